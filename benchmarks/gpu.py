"""One-GPU benchmark: MFU, the optimizer update's memory bandwidth, memory vs the planner.

    bash benchmarks/gpu.sh         # one H200: under 8 minutes -> results/gpu.json
    bash benchmarks/gpu.sh --cpu   # tiny shapes on CPU (a smoke test) -> results/gpu_cpu.json
    python benchmarks/gpu.py --cpu --configs 1b --remat full --steps 1   # the test's run

Three measurements, each in its own subprocess (a fresh device: memory peaks are per
measurement, an out-of-memory or a hang costs one row, not the run):

1. **bandwidth**: a jitted, donated update of zerojax's bf16 Kahan AdamW (bf16 moments,
   bf16 compensation buffer, fp32 gradients as the ZeRO step hands them over) on a large
   param tree. Bytes per step = reads of params, grads, mu, nu and the Kahan buffer +
   writes of params, mu, nu and the buffer (20 B/param); achieved bytes/s against the
   device's peak (H200: 4.8 TB/s HBM3e). The same process measures the CPU's reference
   peaks in `--cpu` mode (no datasheet: a bf16 matmul and an elementwise stream).
2. **MFU** of `configs/1b_bf16.py` and `configs/8b_bf16.py` at ZeRO stage 3 with each
   remat policy of `REMATS` (full, by-name ones), built as train.py builds it
   (`zerojax.build.build`), random tokens, `--steps` timed steps after a warm-up. MFU = the model's
   `flops_per_token` x tokens/s / (peak FLOP/s x devices) (`zerojax.run.metrics.peak_flops`:
   H200 989 TFLOP/s dense bf16; in `--cpu` mode the measured matmul rate).
3. **memory** of each of those steps per device: compiled (arguments + outputs - aliased +
   temporaries, and XLA's peak), the device's `peak_bytes_in_use` after the steps (on CPU:
   the process's max RSS, which includes the runtime), and the memory planner's estimate
   (`zerojax.memory.estimate(config, devices).total`). The device's peak and bytes in use
   are also read after each phase (compile, `init_state`, the first step, the timed
   steps: `phases` in the results), so the phase that sets the peak is known. A variant
   whose compiled memory exceeds the device is reported as not fitting without being run.
4. **offload** (`--offload`, default 8b): the same step with `optimizer.offload=host`
   (remat full), so the device peak and step time sit beside the run without it: the
   proof that the device bytes fall by the optimizer state (XLA:CPU cannot show it).
5. **parameter offload** (`--param-offload`, default 8b): the step with gradient release,
   then the same with `zero.param_offload=host` and `optimizer.offload=host` (what
   `configs/8b_1x4090.py` runs): step time and device peak with and without the copies;
   on a GPU once more written behind (`optimizer.release_write_behind`: each layer's
   update goes back during the next layer's trip, 32 host copies in flight).
6. **the whole run** (issue 52), on the parameter-offload row (not written behind): each
   phase of the run compiled (`zerojax.memory.phases`: init, init from HF weights, the
   step, the eval step, a checkpoint's checksums) beside the device's peak read after
   each phase as it runs, in the order init, checksums (a save's and a restore's own
   device work; the 8B's 58 GiB of state is not written: the lent machine's disk is 64
   GiB), the eval step, the first step, the timed steps. The peak only grows, so a
   phase's own peak shows where it exceeds every phase before it: the order is the
   compiled bytes' ascending.

The run stops starting new measurements when `--budget` seconds are spent; results are
written after every measurement, so a run cut short keeps what it measured.
"""

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback

from gpu_report import BANDWIDTH_GOAL, GIB, PLANNER_GOAL, derive, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # This checkout's zerojax, as the children get it (PYTHONPATH).
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CONFIGS = {"1b": "configs/1b_bf16.py", "8b": "configs/8b_bf16.py"}
# Remat policies per config, most promising first after 'full' (zerojax/models/remat.py).
# The 8B's planner bytes on one H200 at 4 sequences: 94.6-96.8 GiB for these four, 120.8
# for 'minimal' (under gpu.sh's 0.95 of 141 GB, 124.9 GiB, narrowly: last).
REMATS = {"1b": ("full", "save_dot_with_context_except_mlp", "save_qkv_proj",
                 "save_dot_except_mlp", "minimal", "save_attention_out"),
          "8b": ("full", "save_dot_with_context_except_mlp", "save_dot_except_mlp",
                 "save_qkv_proj", "minimal")}
# Peak memory bandwidth per device (vendor datasheets, bytes/s); MFU's peak FLOP/s is
# zerojax.run.metrics.PEAK_FLOPS.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
# Tiny shapes for --cpu: the configs' structure (tied embeddings, GQA, RoPE scaling),
# a few hundred thousand params.
CPU_SHAPES = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2",
              "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
              "model.attention_block=64", "model.loss_chunk=64", "train.seq_len=64",
              "train.global_batch_size=2"]
# Sequences per step on one GPU: the configs' 8 x 4096 for 1B; 4 for 8B, whose Kahan
# AdamW state (8 B/param) and fp32 gradients (4 B/param) already take ~96 GB.
GPU_BATCH = {"1b": 8, "8b": 4}


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cpu", action="store_true",
                  help="tiny shapes on CPU (default when no GPU is found)")
  ap.add_argument("--configs", default="1b,8b", help="comma list of " + ", ".join(CONFIGS))
  ap.add_argument("--remat", default="", help="comma list of policies for every config "
                  "(default per config: " + "; ".join(f"{c}: {','.join(r)}"
                                                      for c, r in REMATS.items()) + ")")
  ap.add_argument("--offload", default="8b",
                  help="comma list of configs also run with optimizer.offload=host (remat full)")
  ap.add_argument("--param-offload", default="8b",
                  help="comma list of configs also run with gradient release, without and "
                       "with zero.param_offload=host + optimizer.offload=host (remat full)")
  ap.add_argument("--steps", type=int, default=0, help="timed steps (default GPU 4, CPU 2)")
  ap.add_argument("--batch", type=int, default=0, help="sequences per step (default per config)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="a config override for every MFU run, e.g. model.attention=dot_product")
  ap.add_argument("--budget", type=float, default=0,
                  help="seconds after which no new measurement starts (default GPU 420, CPU 240)")
  ap.add_argument("--no-bandwidth", action="store_true", help="skip the update bandwidth")
  ap.add_argument("--out", default="", help="JSON path (default results/gpu[_cpu].json)")
  ap.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if not args.cpu and not args.child and shutil.which("nvidia-smi") is None:
    print("no nvidia-smi on PATH: running the CPU smoke test (--cpu)", flush=True)
    args.cpu = True
  args.steps = args.steps or (2 if args.cpu else 4)
  args.budget = args.budget or (240 if args.cpu else 420)
  args.out = args.out or os.path.join(RESULTS, "gpu_cpu.json" if args.cpu else "gpu.json")
  return args


# --- Children: one measurement each, a JSON line on stdout -------------------------------


def _device_info():
  import jax

  from zerojax.run import metrics
  d = jax.devices()[0]
  stats = d.memory_stats() or {}
  kind = getattr(d, "device_kind", "")
  return dict(platform=d.platform, device_kind=kind, devices=jax.device_count(),
              jax=jax.__version__, bytes_limit=stats.get("bytes_limit"),
              peak_flops=metrics.peak_flops(d) or None,
              peak_bandwidth=next((v for k, v in PEAK_BANDWIDTH.items() if k in kind), None))


def _memory_now() -> dict:
  """The first device's peak and current bytes in use (None on CPU: no allocator stats)."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return dict(peak=stats.get("peak_bytes_in_use"), in_use=stats.get("bytes_in_use"))


def _time(fn, warmup, iters):
  """Median seconds of `fn()` (each call waited for) after `warmup` calls."""
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def child_bandwidth(cpu: bool) -> dict:
  """The Kahan AdamW update's achieved bandwidth (and, on CPU, reference peaks)."""
  import jax
  import jax.numpy as jnp
  import optax

  from zerojax import optim

  info = _device_info()
  # GPU: 8 leaves of 8192 x 16384 = 1.07e9 params (~21 GB with the state and grads);
  # CPU: 4 x 1024 x 2048 = 8.4e6 params (168 MB moved per update), past the caches.
  leaves, shape = (4, (1024, 2048)) if cpu else (8, (8192, 16384))
  tx = optim.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1, state_dtype=jnp.bfloat16,
                   update_rule="kahan")
  keys = jax.random.split(jax.random.key(0), 2 * leaves)
  params = {f"w{i}": (0.02 * jax.random.normal(keys[i], shape)).astype(jnp.bfloat16)
            for i in range(leaves)}
  grads = {f"w{i}": 1e-3 * jax.random.normal(keys[leaves + i], shape, jnp.float32)
           for i in range(leaves)}
  opt_state = tx.init(params)

  def update(params, opt_state, grads):
    u, new = tx.update(grads, opt_state, params)
    new = jax.tree.map(lambda n, o: n.astype(o.dtype), new, opt_state)  # As step.py.
    return optax.apply_updates(params, u), new

  step = jax.jit(update, donate_argnums=(0, 1))
  compiled = step.lower(params, opt_state, grads).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  state = [params, opt_state]

  def run():
    state[0], state[1] = compiled(state[0], state[1], grads)
    return state

  secs = _time(run, warmup=2, iters=5 if cpu else 20)
  nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))
  # Mirrored state leaves (mu, nu, compensation) are read and written; scalars ignored.
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state[1]) if x.ndim)
  moved = 2 * nbytes(state[0]) + nbytes(grads) + 2 * state_bytes
  n = sum(x.size for x in jax.tree.leaves(state[0]))
  out = dict(info=info, optimizer="zerojax.optim.adamw(state_dtype=bf16, update_rule='kahan')",
             params=n, leaves=leaves, shape=list(shape), seconds=secs, bytes=moved,
             bytes_per_param=moved / n, bytes_per_s=moved / secs,
             xla_bytes_accessed=(cost or {}).get("bytes accessed"))
  if cpu:  # No datasheet: the rates this CPU reaches on a matmul and a stream.
    a = jnp.ones((1024, 1024), jnp.bfloat16)
    matmul = jax.jit(lambda x: x @ x)
    out["measured_matmul_flops"] = 2 * 1024 ** 3 / _time(lambda: matmul(a), 2, 5)
    # In place (donated, as the update is), past the caches: 256 MB read + 256 MB written.
    stream = jax.jit(lambda x: x * 1.0001 + 1.0, donate_argnums=0)
    xs = [jnp.ones((64 * 2 ** 20,), jnp.float32)]

    def scale():
      xs[0] = stream(xs[0])
      return xs[0]

    out["measured_stream_bandwidth"] = 2 * xs[0].nbytes / _time(scale, 2, 5)
  return out


def _planner_estimate(config, devices, out):
  """Adds zerojax.memory's per-device estimate to `out` (planner_bytes, or a note why not).

  `zerojax.memory.estimate(config, devices)` is arithmetic on the config (no JAX work):
  its `total` is the per-device peak it predicts (state + the largest phase of the
  step's temporaries), `conventional_per_device` the ZeRO paper's model state.
  """
  try:
    from zerojax import memory
  except ImportError:
    out["planner_note"] = "zerojax.memory does not exist"
    return
  try:
    est = memory.estimate(config, devices, int(out["info"].get("bytes_limit") or 0))
    out["planner_bytes"] = int(est.total)
    out["planner"] = dict(total=int(est.total), state=int(est.state),
                          peak_phase=est.peak_phase, phases=est.phases,
                          components=est.components,
                          conventional_per_device=float(est.conventional_per_device),
                          fits=est.fits if est.device_memory else None)
  except Exception as e:  # pylint: disable=broad-except
    out["planner_note"] = f"zerojax.memory.estimate failed: {type(e).__name__}: {e}"[:300]


def _compiled_phases(config, built, compiled, out) -> None:
  """Adds each phase's compiled device bytes on this device (`zerojax.memory.phases`, the
  step's compile reused) to `out` as compiled_phases, or a note why not."""
  try:
    from zerojax.memory import phases as run_phases
    m = compiled.memory_analysis()
    step = dict(arguments=m.argument_size_in_bytes, temporaries=m.temp_size_in_bytes,
                outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
                host_arguments=m.host_argument_size_in_bytes,
                host_outputs=m.host_output_size_in_bytes)
    got = run_phases.beside_step(config, None, run_phases.PHASES, built, step)
    out["compiled_phases"] = {p: v["device"] for p, v in got.items()}
    out["compiled_peak_phase"] = run_phases.whole_run(got)[0]
  except Exception as e:  # pylint: disable=broad-except  (a row without it still counts)
    out["compiled_phases_note"] = f"{type(e).__name__}: {e}"[:300]


def child_mfu(cfg: str, remat: str, cpu: bool, steps: int, batch: int,
              extra: list[str], out: dict, whole_run: bool = False) -> dict:
  """Builds the config at stage 3 with `remat`, compiles, checks the fit, times steps.

  Fills `out` as it goes, so a failure (say, out of memory in the first step) still
  reports the compiled and planned memory. `whole_run`: each phase compiled, and the
  checksums and the eval step run before the first step (module docstring, 6).
  """
  import jax
  import jax.numpy as jnp

  import zerojax
  from zerojax import build
  from zerojax.config import load_config
  from zerojax.gpu import xla_flags

  overrides = ["zero.stage=3", f"model.remat={remat}"] + (CPU_SHAPES if cpu else [])
  batch = batch or (0 if cpu else GPU_BATCH[cfg])
  overrides += ([f"train.global_batch_size={batch}"] if batch else []) + list(extra)
  # train.py's XLA flags on a GPU (zerojax.gpu.xla_flags), set before the backend starts.
  out["xla_profile"] = xla_flags.apply_gpu_profile(
      load_config(os.path.join(ROOT, CONFIGS[cfg]), overrides))
  out["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  info = _device_info()
  config = load_config(os.path.join(ROOT, CONFIGS[cfg]), overrides,
                       num_devices=jax.device_count())
  t = config.train
  out.update(info=info, config=CONFIGS[cfg], remat=remat, stage=3, overrides=overrides,
             batch=t.global_batch_size, seq_len=t.seq_len)
  start = time.perf_counter()
  b = build.build(config)
  out["params"] = sum(x.size for x in jax.tree.leaves(b.plan.params))
  out["flops_per_token"] = b.model.flops_per_token(t.seq_len)
  compiled = b.train_step.lower(b.abstract_state, b.abstract_batch).compile()
  out["compile_s"] = time.perf_counter() - start
  m = compiled.memory_analysis()
  out["compiled"] = dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                         aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
                         peak=getattr(m, "peak_memory_in_bytes", None),
                         host_arguments=m.host_argument_size_in_bytes,
                         host_temporaries=m.host_temp_size_in_bytes)
  out["compiled_bytes"] = (m.argument_size_in_bytes + m.output_size_in_bytes
                           - m.alias_size_in_bytes + m.temp_size_in_bytes)
  _planner_estimate(config, jax.device_count(), out)
  if whole_run:
    _compiled_phases(config, b, compiled, out)
  limit = info["bytes_limit"]
  if limit and out["compiled_bytes"] > limit:
    out["status"] = "does not fit"
    out["error"] = (f"compiled step needs {out['compiled_bytes'] / GIB:.1f} GiB per device, "
                    f"the device has {limit / GIB:.1f} GiB")
    return out

  # The device's peak is read after each phase (it only grows: the phase after which it
  # jumps is the one that set it) beside the bytes in use then (what the phase left).
  phases = out["phases"] = {"compile": _memory_now()}
  state = zerojax.init_state(b.plan, b.model.init, b.tx, jax.random.key(config.seed),
                             b.loss_scaling)
  jax.block_until_ready(state)
  phases["init"] = _memory_now()
  tokens = jax.random.randint(jax.random.key(1), (t.global_batch_size, t.seq_len + 1), 0,
                              config.model.vocab_size, jnp.int32)
  batch_data = {"tokens": jax.device_put(tokens, b.batch_sharding)}
  if whole_run:
    from zerojax.checkpoint import checksums
    checksums.describe(state)  # A save's and a restore's device work.
    phases["checksums"] = _memory_now()
    out["eval_loss"] = float(zerojax.make_eval_step(b.plan, b.model.loss)(state.params,
                                                                          batch_data)["loss"])
    phases["eval step"] = _memory_now()
  state, metrics = compiled(state, batch_data)  # Warm-up (first-run allocations).
  loss0 = float(metrics["loss"])
  jax.block_until_ready(state)
  phases["first step"] = _memory_now()
  start = time.perf_counter()
  for _ in range(steps):  # Dispatched back to back, as train.py does; waited for at the end.
    state, metrics = compiled(state, batch_data)
  jax.block_until_ready((state, metrics))
  secs = (time.perf_counter() - start) / steps
  phases["steps"] = _memory_now()
  tokens_per_s = t.global_batch_size * t.seq_len / secs
  stats = jax.devices()[0].memory_stats() or {}
  out.update(status="ok", steps=steps, step_s=secs, tokens_per_s=tokens_per_s,
             model_flops_per_s=out["flops_per_token"] * tokens_per_s,
             loss_first=loss0, loss_last=float(metrics["loss"]),
             device_peak_bytes=stats.get("peak_bytes_in_use"),
             device_peak_source="memory_stats peak_bytes_in_use")
  if out["device_peak_bytes"] is None:  # CPU: no allocator stats; the whole process.
    out["device_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["device_peak_source"] = "process max RSS (no device memory stats)"
  return out


def run_child(spec: dict) -> None:
  """Entry point of a child: prints `RESULT <json>` (also on failure) and exits."""
  out = {}
  try:
    if spec["kind"] == "bandwidth":
      out = child_bandwidth(spec["cpu"])
    else:
      child_mfu(spec["config"], spec["remat"], spec["cpu"], spec["steps"], spec["batch"],
                spec.get("set", []), out, spec.get("whole_run", False))
  except Exception as e:  # pylint: disable=broad-except
    text = f"{type(e).__name__}: {e}"
    out.update(status="oom" if _is_oom(text) else "error", error=text[:2000],
               traceback=traceback.format_exc()[-3000:])
  print("RESULT " + json.dumps(out), flush=True)


def _is_oom(text: str) -> bool:
  return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory",
                                 "OOM"))


# --- Parent: schedule, budget, tables --------------------------------------------------


def child_env(cpu: bool, xla: tuple[str, ...] = ()) -> dict:
  from zerojax.runtime.device_env import fake_devices_env
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
  if xla:  # A variant's own XLA flags, beside the user's (train.py's profile adds its own).
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *xla]).strip()
  # One CPU device. XLA:CPU's default scheduler: the memory-optimizing one
  # (zerojax.runtime.device_env.CPU_MEMORY_FLAGS) doubles the compile time of these tiny shapes.
  return fake_devices_env(1, base=env) if cpu else env


def spawn(spec: dict, timeout: float, cpu: bool) -> dict:
  """Runs one measurement in a subprocess; its RESULT, or a status saying what went wrong."""
  start = time.perf_counter()
  try:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                       capture_output=True, text=True, timeout=timeout,
                       env=child_env(cpu, tuple(spec.get("xla_flags", ()))),
                       cwd=ROOT, check=False)
  except subprocess.TimeoutExpired as e:
    tail = (e.stderr or b"")[-1500:]
    return dict(status="timeout", error=f"no result within {timeout:.0f} s",
                stderr=tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
                wall_s=time.perf_counter() - start)
  lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
  if lines:
    out = json.loads(lines[-1][len("RESULT "):])
  else:  # Killed (e.g. by the OOM killer) or crashed before it could report.
    out = dict(status="oom" if _is_oom(p.stderr) else "crashed",
               error=f"exit status {p.returncode}", stderr=p.stderr[-1500:])
  out["wall_s"] = time.perf_counter() - start
  return out


def _interrupt(*_):
  raise KeyboardInterrupt


def main(argv=None):
  args = parse_args(argv)
  if args.child:
    run_child(json.loads(args.child))
    return 0
  # gpu.sh's `timeout` sends SIGTERM: raise instead, so subprocess.run kills the running
  # child (results so far are on disk) rather than leaving it holding the GPU.
  signal.signal(signal.SIGTERM, _interrupt)
  start = time.perf_counter()
  left = lambda: args.budget - (time.perf_counter() - start)
  if not args.cpu:  # Which XLA flag forms this XLA knows, asked once for every child.
    from zerojax.gpu import xla_flags
    xla_flags.known_flags(xla_flags.forms(xla_flags.gpu_profile(1)), environ=os.environ)
  res = dict(cpu=args.cpu, budget_s=args.budget, steps=args.steps, mfu=[], bandwidth=None,
             goals=dict(bandwidth=f">= {BANDWIDTH_GOAL:.0%} of peak (proposed here)",
                        planner=f"compiled within {PLANNER_GOAL:.0%} of the estimate "
                                "(proposed here)"),
             xla_flags=os.environ.get("XLA_FLAGS", ""))

  def save():
    res["wall_s"] = time.perf_counter() - start
    derive(res)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1)

  # Per-measurement time caps (seconds): the 8B compile alone takes about a minute.
  cap = {"bandwidth": 90, "1b": 150, "8b": 200} if not args.cpu else {
      "bandwidth": 90, "1b": 120, "8b": 120}
  if not args.no_bandwidth:
    print("bandwidth ...", flush=True)
    res["bandwidth"] = spawn(dict(kind="bandwidth", cpu=args.cpu),
                             min(cap["bandwidth"], max(left(), 10)), args.cpu)
    print(f"  {res['bandwidth'].get('status', 'ok')} in {res['bandwidth']['wall_s']:.0f} s",
          flush=True)
    save()
  configs = [c for c in args.configs.split(",") if c]
  remats = {c: [r for r in args.remat.split(",") if r] or REMATS[c] for c in configs}
  # Most informative first: each config's policies in turn, smallest config first (a
  # budget spent early cuts the least promising); after the second round, offload and
  # (GPU) the largest config without train.py's XLA flags, what they are worth.
  # (config, remat, label, config overrides, XLA flags) a measurement.
  rounds = [[(c, remats[c][i], "", (), ()) for c in configs if i < len(remats[c])]
            for i in range(max(len(r) for r in remats.values()))]
  variants = [(c, remats[c][0], "offload", ("optimizer.offload=host",), ())
              for c in args.offload.split(",") if c in configs]
  release = ("optimizer.release=True", "optimizer.grad_clip=0")
  for c in (c for c in args.param_offload.split(",") if c in configs):
    offloads = (*release, "zero.param_offload=host", "optimizer.offload=host")
    variants += [(c, remats[c][0], "release", release, ()),
                 (c, remats[c][0], "release + param and optimizer offload", offloads, ())]
    # Written behind, the compiled schedule puts the copies under the matmuls (the 8B on
    # one 4090: 28% -> 59% of their time, docs/design/offload-and-streaming.md): whether
    # the step gets faster is this row.
    variants += [] if args.cpu else [
        (c, remats[c][0], "release + param and optimizer offload, written behind",
         (*offloads, "optimizer.release_write_behind=True"), ())]
  variants += [] if args.cpu else [(configs[-1], remats[configs[-1]][0], "no XLA profile",
                                    ("xla.gpu_profile=False",), ())]
  order = rounds[0] + (rounds[1] if len(rounds) > 1 else []) + variants + [
      x for r in rounds[2:] for x in r]
  for cfg, remat, label, extra, xla in order:
    name = f"{cfg}/{remat}" + (f" + {label}" if label else "")
    if left() < min(30, cap[cfg] / 2):
      res["mfu"].append(dict(name=name, config=CONFIGS[cfg], remat=remat, status="skipped",
                             error=f"time budget of {args.budget:.0f} s spent"))
      continue
    print(f"{name} ...", flush=True)
    r = spawn(dict(kind="mfu", config=cfg, remat=remat, cpu=args.cpu, steps=args.steps,
                   batch=args.batch, set=args.set + list(extra), xla_flags=list(xla),
                   whole_run=label == "release + param and optimizer offload"),
              min(cap[cfg], left()), args.cpu)
    r.setdefault("config", CONFIGS[cfg])
    r["remat"] = remat + (f" + {label}" if label else "")
    r["name"] = name
    res["mfu"].append(r)
    print(f"  {r.get('status')} in {r['wall_s']:.0f} s"
          + (f": {r['tokens_per_s']:,.0f} tokens/s" if r.get("tokens_per_s") else
             f": {str(r.get('error', ''))[:200]}"), flush=True)
    save()
  save()
  print()
  print(report(res))
  print(f"\nwrote {os.path.relpath(args.out, ROOT)} in {time.perf_counter() - start:.0f} s")
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except KeyboardInterrupt:
    print("gpu.py: stopped (SIGTERM or Ctrl-C); the results measured so far are saved",
          file=sys.stderr)
    sys.exit(124)
