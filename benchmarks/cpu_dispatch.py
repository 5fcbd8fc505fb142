"""The XLA:CPU dispatch guard (zerojax.runtime.dispatch): aborts without it, its cost with it.

Issue 51's loop: two zerojax train steps (stage 3 and stage 2 of one linen CNN) called
alternately without blocking on 8 fake CPU devices. On jaxlib 0.10.2 it aborts (exit
134, a collective's rendezvous timing out) unless the queue of dispatches is bounded,
which the guard does (docs/design/cpu-collectives.md, "Two executables in flight").

    python benchmarks/cpu_dispatch.py                 # 20 + 5 guarded runs under load, ~4 min
    python benchmarks/cpu_dispatch.py --unguarded 3   # and 3 + 1 without the guard (~20 s each)
    python benchmarks/cpu_dispatch.py --child alternate --steps 60   # one loop, this process

Each run is a child process (an abort must not end the benchmark) with a timeout: `--runs`
of the alternated loop (`--steps` each), then `--alone` of the stage-3 step alone for 4 x
`--steps` steps (the guard lets one function's calls run two in flight). With `--load`
(the default) two busy processes keep both of this machine's cores loaded meanwhile.
Then, unloaded, the guard's cost, in ms a step: loops of 24 dispatches (below the 32
computations a device admits in flight: the unguarded loops do not abort) of the stage-3
step alone (unguarded, guarded, guarded one at a time) and of the two alternated
(unguarded, guarded), interleaved, the median of each. The results go to
`benchmarks/results/cpu_dispatch.json`; the table, to benchmarks/README.md.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Without the guard a hung collective aborts after this many seconds instead of XLA's 40:
# a run that deadlocks ends in ~15 s. Guarded runs keep XLA's timeouts.
TERMINATE_S = 10
TIMEOUT_FLAGS = (f"--xla_cpu_collective_call_terminate_timeout_seconds={TERMINATE_S}",
                 "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5")


def _steps_and_states(stages: tuple[int, ...]):
  """One linen CNN's train step and state at each of `stages`, on 8 fake CPU devices, and a
  batch (32 16x16 images)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import zerojax

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), (2, 2))
      x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
      return nn.Dense(10)(x.reshape(x.shape[0], -1))

  model, tx = CNN(), optax.adamw(1e-3)
  init_fn = lambda key: model.init(key, jnp.zeros((1, 16, 16, 1)))["params"]

  def loss_fn(params, batch, rng):
    del rng
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  mesh = zerojax.make_mesh(data=2, fsdp=4)
  shapes = jax.eval_shape(init_fn, jax.random.key(0))
  steps, states = [], []
  for stage in stages:
    # min_shard_size=64: the CNN's kernels are sharded (stage 3 gathers them: all-gathers
    # and reduce-scatters in every step).
    plan = zerojax.make_plan(mesh, stage=stage, params=shapes, tx=tx, min_shard_size=64)
    steps.append(zerojax.make_train_step(plan, loss_fn, tx))
    states.append(zerojax.init_state(plan, init_fn, tx, jax.random.key(0)))
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(32, 16, 16, 1)).astype(np.float32),
           "y": rng.integers(0, 10, 32).astype(np.int32)}
  return steps, states, batch


def child(mode: str, steps: int, repeats: int) -> None:
  """In this process: 'alternate' (stage 3 and stage 2, `steps` each, no blocking) and
  'alone' (stage 3 only) print `done` and the last loss; 'timing' prints, as JSON, ms a
  step over `repeats` loops of each kind: the stage-3 step alone (`steps` steps) unguarded,
  guarded, and guarded one dispatch in flight; the two alternated (`steps` // 2 each, 2 x
  that many dispatches a loop) unguarded and guarded."""
  import warnings

  from zerojax.runtime import devices, dispatch
  # Guarded, XLA's own timeouts, as a user's run has them.
  unguarded = os.environ.get(dispatch.ENV) == "0" and mode != "timing"
  devices.fake_cpu_devices(8, *(TIMEOUT_FLAGS if unguarded else ()))
  import jax

  warnings.simplefilter("ignore")  # Stage 3 gathers the CNN whole: it says so.
  fns, states, batch = _steps_and_states((3,) if mode == "alone" else (3, 2))
  for i, fn in enumerate(fns):  # Compiled and run once before the loop.
    states[i], metrics = fn(states[i], batch)
  jax.block_until_ready((states, metrics))
  if mode != "timing":
    for _ in range(steps):
      for i, fn in enumerate(fns):
        states[i], metrics = fn(states[i], batch)
    print(f"done: {steps} steps of each, loss {float(metrics['loss']):.4f}", flush=True)
    return
  # (functions, calls of each a loop, guarded: dispatch.SAME_IN_FLIGHT, None: unguarded)
  kinds = {"alone, unguarded": ((0,), steps, None),
           "alone, guarded": ((0,), steps, dispatch.SAME_IN_FLIGHT),
           "alone, guarded, 1 in flight": ((0,), steps, 1),
           "alternated, unguarded": ((0, 1), steps // 2, None),
           "alternated, guarded": ((0, 1), steps // 2, dispatch.SAME_IN_FLIGHT)}
  times = {kind: [] for kind in kinds}
  for r in range(len(kinds) * repeats):
    kind = list(kinds)[r % len(kinds)]
    which, calls, in_flight = kinds[kind]
    os.environ[dispatch.ENV] = "0" if in_flight is None else "1"
    dispatch.SAME_IN_FLIGHT = in_flight or 1
    start = time.perf_counter()
    for _ in range(calls):
      for i in which:
        states[i], metrics = fns[i](states[i], batch)
    jax.block_until_ready((states, metrics))
    times[kind].append(1e3 * (time.perf_counter() - start) / (calls * len(which)))
  print(json.dumps(times), flush=True)


def run_child(args: list[str], guarded: bool, timeout: float) -> tuple[int, str, float]:
  """(exit status, last output line, seconds) of one child; -9 on a timeout."""
  env = dict(os.environ, ZEROJAX_CPU_DISPATCH_GUARD="1" if guarded else "0")
  start = time.perf_counter()
  try:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args], env=env,
                       capture_output=True, text=True, timeout=timeout, check=False)
    code, text = p.returncode, (p.stdout + p.stderr).strip()
  except subprocess.TimeoutExpired:
    code, text = -9, "timeout"
  lines = [l for l in text.splitlines() if l.startswith(("done", "{", "F", "timeout"))]
  last = lines[-1] if lines else text[-160:]
  return code, last if last.startswith("{") else last[:160], time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--child", choices=("alternate", "alone", "timing"))
  parser.add_argument("--steps", type=int, default=60, help="steps of each function a run")
  parser.add_argument("--runs", type=int, default=20, help="guarded runs")
  parser.add_argument("--unguarded", type=int, default=0, help="runs without the guard")
  parser.add_argument("--alone", type=int, default=5,
                      help="guarded runs of the stage-3 step alone, 4 x --steps steps")
  parser.add_argument("--no-load", dest="load", action="store_false")
  parser.add_argument("--repeats", type=int, default=5, help="timed loops of each kind")
  parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                    "cpu_dispatch.json"))
  args = parser.parse_args()
  if args.child:
    child(args.child, args.steps, args.repeats)
    return

  # One compile for every run: JAX's compilation cache (the same executables, read back).
  cache = tempfile.mkdtemp(prefix="cpu_dispatch_cache_")
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  load = []
  if args.load:  # Two busy processes: both cores loaded, as another engineer's tests do.
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2)]
  results = {"steps": args.steps, "load": args.load, "guarded": [], "unguarded": [],
             "alone": [], "alone, unguarded": []}
  runs = (("unguarded", args.unguarded), ("guarded", args.runs), ("alone", args.alone),
          ("alone, unguarded", min(args.unguarded, 1)))
  try:
    for kind, count in runs:
      mode, steps = ("alone", 4 * args.steps) if kind.startswith("alone") else (
          "alternate", args.steps)
      for r in range(count):
        code, line, seconds = run_child([mode, "--steps", str(steps)],
                                        not kind.endswith("unguarded"), timeout=180)
        results[kind].append({"exit": code, "seconds": round(seconds, 1), "last": line})
        print(f"{kind} run {r + 1}/{count}: exit {code} in {seconds:.0f} s: {line}", flush=True)
  finally:
    for p in load:
      p.kill()
      p.wait()
  code, line, _ = run_child(["timing", "--steps", "24", "--repeats", str(args.repeats)],
                            True, timeout=300)
  if code == 0:
    times = json.loads(line)
    results["ms_a_step"] = {k: statistics.median(v) for k, v in times.items()}
    results["ms_a_step_all"] = times
  for kind, _ in runs:
    if results[kind]:
      ok = sum(r["exit"] == 0 for r in results[kind])
      print(f"{kind}: {ok} of {len(results[kind])} runs done, "
            f"{len(results[kind]) - ok} aborted or hung")
  for kind, ms in results.get("ms_a_step", {"timing": line}).items():
    print(f"{kind}: {ms} ms a step (median of {args.repeats} loops)")
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
  main()
