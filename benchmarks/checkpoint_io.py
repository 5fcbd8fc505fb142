"""Checkpoint I/O: save and restore time and peak host memory against the state size.

    python benchmarks/checkpoint_io.py                       # configs/1b_bf16.py, ~10 GB of state
    python benchmarks/checkpoint_io.py model.n_layers=2      # the same widths, 2 layers (~3 GB)

The state is the whole `TrainState` of a config (default configs/1b_bf16.py: Llama-3.2-1B
shape, bf16 params, Kahan AdamW with bf16 moments: 8 bytes per parameter), sharded from
birth at ZeRO stage 3 over 8 fake CPU devices, and filled with pseudo-random values of
realistic magnitudes (params ~0.02, mu ~1e-4, nu ~1e-8, Kahan buffers ~1e-6: orbax
compresses, so zeros would flatter it). Each measurement runs in its own process:

- save, async: `Checkpointer.save` (checksums of every leaf, device-to-host copy, then
  orbax writes in a background thread) until it returns ("blocking part"), and until
  `wait()` sees the commit ("start to commit");
- save, blocking (`async_save=False`): the same save done in the caller;
- restore: `Checkpointer.restore(step, plan)` onto the 8-device stage-3 plan it was saved
  from, onto one device at stage 0 (the whole state on one device) and, if memory
  allows, onto another mesh (data=2 x fsdp=4: the state held twice), checksums
  verified, timed as a resume sees it (the first restore in the process, compiling the
  checksum function included).

Peak host memory is the process's RSS, sampled every 5 ms by a thread (psutil), minus
its RSS just before the operation; on CPU the "devices'" memory is host memory, so the
restored state itself counts (ideal ratio to the state size: 0 for a save, 1 for a
restore). The files are just written, so restores read from the page cache where it
holds them. Prints a markdown table and writes benchmarks/results/checkpoint_io.json.
Refuses to start when the machine has less than 2.5 x the state size available.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "checkpoint_io.json")
ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("overrides", nargs="*", help="config overrides, e.g. model.n_layers=2")
ARGS.add_argument("--config", default=os.path.join(ROOT, "configs", "1b_bf16.py"))
ARGS.add_argument("--dir", default="/tmp/zerojax_checkpoint_io", help="checkpoints (removed after)")
ARGS.add_argument("--out", default=OUT)
ARGS.add_argument("--no_restore_elsewhere", action="store_true",
                  help="restore only onto the plan the state was saved from")
ARGS.add_argument("--child", default=None, help=argparse.SUPPRESS)  # One measurement (JSON).


class PeakRSS:
  """The peak RSS of this process while a `with` block runs, sampled by a thread."""

  def __init__(self, every: float = 0.005):
    import psutil
    self._process, self._every = psutil.Process(), every
    self.before = self.peak = 0

  def rss(self) -> int:
    return self._process.memory_info().rss

  def _sample(self) -> None:
    while not self._done.is_set():
      self.peak = max(self.peak, self.rss())
      self._done.wait(self._every)

  def __enter__(self):
    self.before = self.peak = self.rss()
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._done.set()
    self._thread.join()
    self.peak = max(self.peak, self.rss())


def noise(shape, seed: int, scale: float):
  """Pseudo-random values (an integer hash of the position: fast, unlike jax.random on
  2 cores), uniform mantissas over 8 binades around `scale`, either sign: about as
  compressible as trained weights."""
  import jax
  import jax.numpy as jnp
  u32 = jnp.uint32
  h, stride = jnp.full(shape, seed * 0x9E3779B9 % 2**32, u32), 1
  for d in reversed(range(len(shape))):
    h = h + jax.lax.broadcasted_iota(u32, shape, d) * u32(stride)
    stride = stride * shape[d] % 2**32
  for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 1)):  # lowbias32
    h = (h ^ (h >> shift)) * u32(mul)
  mantissa = (h & 0xFFFFFF).astype(jnp.float32) * 2.0**-23 - 1
  return mantissa * scale * jnp.exp2(((h >> 24) & 7).astype(jnp.float32) - 4)


def random_state(plan):
  """A train state of `plan` with random values of realistic magnitudes, sharded from
  birth (one jit with out_shardings: no leaf is ever whole on one device)."""
  import jax
  import jax.numpy as jnp

  import zerojax
  from zerojax.step import state_shardings

  abstract = zerojax.abstract_state(plan)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)]

  def make():
    leaves, treedef = jax.tree.flatten(abstract)
    out = []
    for i, (name, a) in enumerate(zip(paths, leaves)):
      if not (a.ndim and jnp.issubdtype(a.dtype, jnp.floating)):
        out.append(jnp.zeros(a.shape, a.dtype))
        continue
      scale = (1e-6 if "compensation" in name else 1e-4 if "['mu']" in name or
               "['nu']" in name else 0.02)
      x = noise(a.shape, i, scale)
      out.append((x * x if "['nu']" in name else x).astype(a.dtype))
    return jax.tree.unflatten(treedef, out)

  return jax.jit(make, out_shardings=state_shardings(plan))()


def du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def child(spec: dict) -> dict:
  """One measurement, in a process started with spec["devices"] fake CPU devices."""
  import gc
  import resource

  import jax

  from zerojax import checkpoint
  from zerojax.build import build
  from zerojax.checkpoint import checksums
  from zerojax.config import load_config

  overrides = [*spec["overrides"], f"zero.stage={spec['stage']}",
               f"mesh.data={spec['data']}", f"mesh.fsdp={spec['fsdp']}",
               f"train.global_batch_size={spec['devices']}"]
  plan = build(load_config(spec["config"], overrides, num_devices=jax.device_count())).plan
  rss, row = PeakRSS(), {}
  if spec["op"] == "save":
    start = time.perf_counter()
    state = jax.block_until_ready(random_state(plan))
    row["fill_s"] = time.perf_counter() - start
    leaves = jax.tree.leaves(state)
    row["params"] = sum(x.size for x in jax.tree.leaves(state.params))
    row["state_bytes"] = sum(x.nbytes for x in leaves)
    start = time.perf_counter()
    checksums.describe(state)  # Compiles it.
    row["checksum_compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    checksums.describe(state)
    row["checksums_s"] = time.perf_counter() - start
    gc.collect()
    ckpt = checkpoint.Checkpointer(spec["dir"], save_every_steps=0, async_save=spec["async"])
    with rss:
      start = time.perf_counter()
      ckpt.save(0, state, {"benchmark": "checkpoint_io"})  # The random state is at step 0.
      row["returned_s"] = time.perf_counter() - start
      ckpt.wait()
      row["committed_s"] = time.perf_counter() - start
    ckpt.close()
    row["disk_bytes"] = du(os.path.join(spec["dir"], "0"))
  else:
    ckpt = checkpoint.Checkpointer(spec["dir"], save_every_steps=0)
    gc.collect()
    with rss:
      start = time.perf_counter()
      state, _ = ckpt.restore(0, plan)
      jax.block_until_ready(state)
      row["restore_s"] = time.perf_counter() - start
    row["state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state))
    row["after_bytes"] = rss.rss() - rss.before
    ckpt.close()
  row.update(rss_before=rss.before, peak_over_before=rss.peak - rss.before,
             ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
  return row


def run_child(spec: dict) -> dict:
  from zerojax.runtime.device_env import fake_devices_env
  env = fake_devices_env(spec["devices"])
  result = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
  if result.returncode:
    sys.exit(f"{spec['op']} failed:\n{result.stderr[-3000:]}")
  return {**spec, **json.loads(result.stdout.strip().splitlines()[-1])}


def main() -> None:
  args = ARGS.parse_args()
  if args.child:
    print(json.dumps(child(json.loads(args.child))))
    return
  import psutil
  # The state's size from shapes alone, before anything is allocated.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  size = subprocess.run(
      [sys.executable, "-c", "import sys, jax, zerojax\nfrom zerojax.build import build\n"
       "from zerojax.config import load_config\n"
       "p = build(load_config(sys.argv[1], sys.argv[2:], num_devices=1)).plan\n"
       "print(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(zerojax.abstract_state(p))))",
       args.config, *args.overrides, "train.global_batch_size=1"],
      env=env, capture_output=True, text=True, check=True)
  state_bytes = int(size.stdout.split()[-1])
  available = psutil.virtual_memory().available
  if available < 2.5 * state_bytes:
    sys.exit(f"{state_bytes / 1e9:.1f} GB of state needs ~{2.5 * state_bytes / 1e9:.0f} GB "
             f"of memory, {available / 1e9:.1f} GB available: use a smaller model "
             "(e.g. model.n_layers=2)")
  print(f"state {state_bytes / 1e9:.2f} GB, {available / 1e9:.1f} GB available", flush=True)

  load = os.getloadavg()  # The machine may be shared: times are only as good as it is idle.
  base = dict(config=args.config, overrides=args.overrides)
  here = dict(devices=8, data=1, fsdp=8, stage=3)
  rows = []
  for is_async in (True, False):
    shutil.rmtree(args.dir, ignore_errors=True)
    rows.append(run_child({**base, **here, "op": "save", "async": is_async, "dir": args.dir}))
    print(rows[-1], flush=True)
  targets = [here] if args.no_restore_elsewhere else [
      here, dict(devices=1, data=1, fsdp=1, stage=0), dict(devices=8, data=2, fsdp=4, stage=3)]
  for target in targets:
    if target["data"] > 1 and psutil.virtual_memory().available < 3.5 * state_bytes:
      print(f"skipped the restore onto {target}: it holds the state twice (replicated "
            "over data) and there is not enough memory", flush=True)
      continue
    rows.append(run_child({**base, **target, "op": "restore", "dir": args.dir}))
    print(rows[-1], flush=True)
  shutil.rmtree(args.dir, ignore_errors=True)

  gb = 1e9
  lines = ["| operation | devices, mesh, stage | state GB | seconds | GB/s "
           "| peak RSS over before / state |", "| --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    where = f"{r['devices']}, {r['data']}x{r['fsdp']}, {r['stage']}"
    if r["op"] == "save":
      what = "save, async" if r["async"] else "save, blocking"
      secs = (f"{r['committed_s']:.1f} (returns in {r['returned_s']:.1f})" if r["async"]
              else f"{r['committed_s']:.1f}")
      rate = r["state_bytes"] / r["committed_s"] / gb
    else:
      what, secs = "restore", f"{r['restore_s']:.1f}"
      rate = r["state_bytes"] / r["restore_s"] / gb
    lines.append(f"| {what} | {where} | {r['state_bytes'] / gb:.2f} | {secs} | {rate:.2f} | "
                 f"{r['peak_over_before'] / r['state_bytes']:.2f} |")
  table = "\n".join(lines)
  save = rows[0]
  notes = (f"{save['params'] / 1e9:.2f}B params, {save['state_bytes'] / gb:.2f} GB of state, "
           f"{save['disk_bytes'] / gb:.2f} GB on disk; checksums {save['checksums_s']:.1f} s "
           f"(first call compiles: {save['checksum_compile_s']:.1f} s)")
  print(table + "\n" + notes)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(config=os.path.relpath(args.config, ROOT), overrides=args.overrides,
                   cpu_count=os.cpu_count(), memory_bytes=psutil.virtual_memory().total,
                   load_average_before=load, load_average_after=os.getloadavg(),
                   rows=rows, table=table, notes=notes), f, indent=1)


if __name__ == "__main__":
  main()
