"""ZeRO train step benchmarks: step time, per-device state bytes, collectives.

    python benchmarks/zero_step.py            # ~2 minutes on 2 CPU cores
    python benchmarks/zero_step.py --quick    # fewer timed steps, ~1 minute

Runs stages 0-3 and a plain jax+optax data-parallel step on 8 fake CPU devices (and
compiles them, without running, on 64 in a subprocess), prints one markdown table per
measurement and writes every number to benchmarks/results/zero_step.json.
benchmarks/README.md says what each column means.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--quick", action="store_true", help="fewer timed rounds and steps")
ARGS.add_argument("--devices", type=int, default=8, help=argparse.SUPPRESS)
ARGS.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
args = ARGS.parse_args()

# Fake devices must be requested before jax is imported. A device count inherited from
# the parent (by the 64-device child) is replaced; any other flag is kept.
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
os.environ["XLA_FLAGS"] = " ".join(
    _flags + [f"--xla_force_host_platform_device_count={args.devices}"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax import hlo
from zerojax.models.mlp_lm import MlpLM

# ~0.1-0.25 s per step on 8 fake devices sharing 2 cores.
MODEL = MlpLM(vocab_size=256, d_model=128, d_ff=512, n_layers=4,
              param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
BATCH, SEQ = max(16, args.devices), 128  # At least one sequence per device.
TX = optax.adamw(1e-3)
STAGES = ("baseline", 0, 1, 2, 3)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "zero_step.json")
SCALARS = 64  # Reductions of at most this many elements are norms and losses, not grads.


def tree_bytes(tree) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def compile_step(mesh, stage):
  """Compiles one step from abstract inputs; nothing is allocated.

  Returns (compiled, partitioned HLO, ZeRO-formula bytes of the state, rng bytes in
  the arguments, a function making a real state and batch to run it on).
  """
  tokens = lambda spec: {"tokens": jax.ShapeDtypeStruct(
      (BATCH, SEQ + 1), jnp.int32, sharding=NamedSharding(mesh, spec))}
  shapes = jax.eval_shape(MODEL.init, jax.random.key(0))
  if stage == "baseline":  # Plain GSPMD data parallelism, params and Adam replicated.
    def step(state, batch):
      params, opt_state = state
      loss, grads = jax.value_and_grad(MODEL.loss)(params, batch)
      updates, opt_state = TX.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=replicated),
                         (shapes, jax.eval_shape(TX.init, shapes)))
    batch = tokens(P(("data", "fsdp")))
    step = jax.jit(step, in_shardings=(replicated, batch["tokens"].sharding),
                   out_shardings=(replicated, replicated), donate_argnums=(0,))
    init = jax.jit(lambda k: (lambda p: (p, TX.init(p)))(MODEL.init(k)),
                   out_shardings=replicated)
    formula, rng_bytes = tree_bytes(state), 0
  else:
    plan = zerojax.make_plan(mesh, stage, shapes, TX, logical_axes=MODEL.logical_axes(),
                             min_shard_size=0)  # Every divisible leaf is sharded.
    state, batch = zerojax.abstract_state(plan), tokens(plan.batch_spec)
    step = zerojax.make_train_step(plan, MODEL.loss, TX)
    init = lambda k: zerojax.init_state(plan, MODEL.init, TX, k)
    p, o, n = tree_bytes(plan.params), tree_bytes(plan.opt_state), plan.num_shards
    formula, rng_bytes = [p + o, p + o / n, p + o / n, (p + o) / n][stage], 8

  def real():
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, MODEL.vocab_size)
    return init(jax.random.key(0)), {
        "tokens": jax.device_put(ids, batch["tokens"].sharding)}
  return *hlo.compile_partitioned(step.lower(state, batch)), formula, rng_bytes, real


def comm_row(hlo_text: str, num_params: int) -> dict:
  """Operand bytes per device and step by kind and dtype; gradient reductions vs ideal.

  An all-reduce's or reduce-scatter's operand is the whole local gradient, an
  all-gather's the local shard. Gradient reductions: all-reduce and reduce-scatter
  operands of more than SCALARS elements; ideal: one fp32 reduction of every
  gradient, 4 bytes x params.
  """
  row = dict(by_kind={}, grad_f32_bytes=0, grad_other_bytes=0, size1_ops=0,
             grad_ideal_bytes=4 * num_params)
  for c in hlo.collectives(hlo_text):
    if c.group_size == 1:  # Groups of one device (a size-1 mesh axis): no traffic.
      row["size1_ops"] += 1
      continue
    for dt in {dt for dt, _ in c.operands}:  # A combined op runs once per dtype.
      row["by_kind"].setdefault(f"{c.op} {dt}", dict(runs=0, bytes=0))["runs"] += c.trips
    for dt, shape in c.operands:
      size = hlo.nbytes(((dt, shape),)) * c.trips
      row["by_kind"][f"{c.op} {dt}"]["bytes"] += size
      if c.op in ("all-reduce", "reduce-scatter") and math.prod(shape) > SCALARS:
        row["grad_f32_bytes" if dt == "f32" else "grad_other_bytes"] += size
  row["grad_ratio"] = row["grad_f32_bytes"] / row["grad_ideal_bytes"]
  return row


def compile_all(devices, stages=STAGES):
  """Compiled steps, memory rows and collective rows on a (1, len(devices)) mesh."""
  mesh, n = zerojax.make_mesh(1, len(devices), devices=devices), len(devices)
  num_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(MODEL.init,
                                                                   jax.random.key(0))))
  steps, mem, comm = {}, [], []
  for stage in stages:
    compiled, hlo, formula, rng_bytes, real = compile_step(mesh, stage)
    name = f"stage {stage}" if stage != "baseline" else stage
    a = compiled.memory_analysis()
    state = a.argument_size_in_bytes - BATCH * (SEQ + 1) * 4 // n - rng_bytes
    mem.append(dict(name=name, devices=n, state_bytes=state, formula_bytes=formula,
                    ratio=state / formula, output_bytes=a.output_size_in_bytes,
                    temp_bytes=a.temp_size_in_bytes))
    comm.append(dict(name=name, devices=n, run=comm_row(compiled.as_text(), num_params),
                     partitioned=comm_row(hlo, num_params)))
    steps[(n, stage)] = dict(fn=compiled, real=real)
  return steps, mem, comm


def time_all(steps, rounds, per_round):
  """Interleaved rounds: each round times every step, baseline first, `per_round` times.

  The machine is noisy, so each stage is divided by the baseline of its own round and
  the reported ratio is the median over rounds.
  """
  def run(r, count):
    times = []
    for _ in range(count):
      start = time.perf_counter()
      r["state"], out = r["fn"](r["state"], r["batch"])
      jax.block_until_ready((r["state"], out))
      times.append(time.perf_counter() - start)
    return statistics.median(times)

  for r in steps.values():
    r["state"], r["batch"] = r["real"]()
    run(r, 2)  # Warm-up: the first runs pay for allocation and thread start.
  secs = {k: [] for k in steps}
  for _ in range(rounds):
    for k, r in steps.items():
      secs[k].append(run(r, per_round))
  rows = []
  for (n, stage), zero in secs.items():
    base = secs[(n, "baseline")]
    if stage != "baseline":
      ratios = [z / b for z, b in zip(zero, base)]
      rows.append(dict(name=f"stage {stage}", devices=n, rounds=rounds, steps=per_round,
                       baseline_s=statistics.median(base),
                       zerojax_s=statistics.median(zero), ratio=statistics.median(ratios),
                       ratio_min=min(ratios), ratio_max=max(ratios)))
  return rows


def table(title, headers, rows):
  print(f"\n### {title}\n\n| " + " | ".join(headers) + " |\n|" + " --- |" * len(headers))
  for r in rows:
    print("| " + " | ".join(str(c) for c in r) + " |")


def mb(b):
  return f"{b / 1e6:.3f}" if b >= 1e4 or b == 0 else f"{b} B"


def main():
  if args.compile_only:  # The 64-device child: compile, report on stdout, exit.
    _, mem, comm = compile_all(jax.devices())
    print(json.dumps(dict(memory=mem, comm=comm)))
    return
  start = time.time()
  steps, mem, comm = compile_all(jax.devices())
  steps |= compile_all(jax.devices()[:1], ("baseline", 0))[0]  # 1 device: no sharding.
  timing = time_all(steps, rounds=3 if args.quick else 9, per_round=2 if args.quick else 5)
  del steps  # Frees the 8-device states before the 64-device child compiles.
  child = subprocess.run([sys.executable, __file__, "--devices", "64", "--compile-only"],
                         capture_output=True, text=True, check=False)
  if child.returncode == 0:
    big = json.loads(child.stdout.strip().splitlines()[-1])
    mem, comm = mem + big["memory"], comm + big["comm"]
  else:
    print(f"64-device compile failed (exit {child.returncode}):\n{child.stderr[-3000:]}")

  table("Step time: zerojax / plain jax+optax data parallel",
        ["devices", "step", "baseline ms", "zerojax ms", "ratio (median)", "ratio range"],
        [(r["devices"], r["name"], f"{r['baseline_s'] * 1e3:.1f}",
          f"{r['zerojax_s'] * 1e3:.1f}", f"{r['ratio']:.2f}",
          f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}") for r in timing])
  table("Per-device bytes (MB): model state vs the ZeRO formula",
        ["devices", "step", "state", "formula", "state / formula", "output", "temp"],
        [(r["devices"], r["name"], mb(r["state_bytes"]), mb(r["formula_bytes"]),
          f"{r['ratio']:.4f}", mb(r["output_bytes"]), mb(r["temp_bytes"])) for r in mem])
  for which, title in (("partitioned", "as partitioned (the program's dtypes)"),
                       ("run", "as XLA:CPU runs them (compiled.as_text())")):
    table(f"Collectives per step, {title}",
          ["devices", "step", "operand MB per device (runs)", "f32 grad reductions",
           "ideal (4 B/param)", "ratio", "non-f32 grad reductions", "size-1 groups"],
          [(r["devices"], r["name"], "; ".join(
              f"{k}: {mb(v['bytes'])} ({v['runs']})"
              for k, v in sorted(c["by_kind"].items())),
            mb(c["grad_f32_bytes"]), mb(c["grad_ideal_bytes"]), f"{c['grad_ratio']:.2f}",
            mb(c["grad_other_bytes"]), c["size1_ops"]) for r in comm for c in [r[which]]])

  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  with open(OUT, "w") as f:
    json.dump(dict(model=repr(MODEL), batch=BATCH, seq=SEQ, optimizer="optax.adamw(1e-3)",
                   quick=args.quick, jax=jax.__version__, seconds=time.time() - start,
                   step_time=timing, memory=mem, comm=comm), f, indent=1)
  print(f"\nwrote {OUT} in {time.time() - start:.0f} s")


if __name__ == "__main__":
  main()
