"""ZeRO train step benchmarks: step time, per-device state bytes, collectives, with goals.

    python benchmarks/zero_step.py            # ~6 minutes on 2 shared CPU cores
    python benchmarks/zero_step.py --quick    # fewer timed steps, 8 devices only, ~3.5 minutes
    python benchmarks/zero_step.py --replot   # tables and PNG again from the saved JSON

Runs stages 0-3 and a plain jax+optax data-parallel step on 8 fake CPU devices (and
compiles them, without running, on 64 in a subprocess), prints one markdown table per
measurement, with the goal beside each measured number, writes every number to
benchmarks/results/zero_step.json and plots them in benchmarks/results/zero_step.png.
Memory and communication are measured for every precision recipe in `RECIPES` (one code
path: the recipe sets the param dtype and the optimizer). benchmarks/README.md says
what each column means.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--quick", action="store_true",
                  help="fewer timed rounds and steps; no 64-device compile")
ARGS.add_argument("--replot", action="store_true",
                  help="print the tables and redraw the PNG from the saved JSON")
ARGS.add_argument("--devices", type=int, default=8, help=argparse.SUPPRESS)
ARGS.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
args = ARGS.parse_args()

# pylint: disable=wrong-import-position
from zerojax.runtime.devices import fake_cpu_devices

# Before JAX starts a backend. A device count inherited from the parent (by the
# 64-device child) is replaced; any other flag is kept.
fake_cpu_devices(args.devices, memory_flags=False)

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax import optim
from zerojax.models.mlp_lm import MlpLM
from zerojax.testing import hlo, markdown_table

F32, BF16 = jnp.float32, jnp.bfloat16
# ~0.1-0.25 s per step on 8 fake devices sharing 2 cores.
model = lambda dtype: MlpLM(vocab_size=256, d_model=128, d_ff=512, n_layers=4,
                            param_dtype=dtype, compute_dtype=dtype)
MODEL = model(BF16)
BATCH, SEQ = max(16, args.devices), 128  # At least one sequence per device.


class Recipe(NamedTuple):
  """A precision recipe: the param dtype, the optimizer, and its bytes per param.

  `param_bytes` (p) and `opt_bytes` (K) are what the ZeRO formula is computed from:
  bytes per parameter of the params and of the whole optimizer state.
  """
  param_dtype: Any
  tx: Callable[[], optax.GradientTransformation]
  param_bytes: int
  opt_bytes: int


# Both moments in bf16 (K = 4), declared: zerojax refuses optax's own adamw on bf16
# params, whose moments would follow the params' dtype undeclared (b2 = 0.999 never
# decays in bf16). The hand-written baseline runs the same transform.
TIMED = "bf16 nearest, bf16 state (timed)"
RECIPES = {
    TIMED: Recipe(BF16, lambda: optim.adamw(1e-3, b2=0.95, state_dtype=BF16), 2, 4),
    "fp32 (AdamW, fp32 state)": Recipe(
        F32, lambda: optim.adamw(1e-3, b2=0.95), 4, 8),
    "bf16 + fp32 master, fp32 state (DeepSpeed bf16)": Recipe(
        BF16, lambda: optim.adamw(1e-3, b2=0.95, state_dtype=F32, update_rule="master"),
        2, 12),
    "bf16 + Kahan, bf16 state": Recipe(
        BF16, lambda: optim.adamw(1e-3, b2=0.95, state_dtype=BF16, update_rule="kahan"),
        2, 6),
    "Lion + Kahan, bf16 state": Recipe(
        BF16, lambda: optim.lion(1e-4, state_dtype=BF16, update_rule="kahan"), 2, 4),
}
STAGES = ("baseline", 0, 1, 2, 3)
ROOT = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(ROOT, "results", "zero_step.json")
PNG = os.path.join(ROOT, "results", "zero_step.png")
SCALARS = 64  # Reductions of at most this many elements are norms and losses, not grads.
# Goals (issue 7): model state / formula 1.00 +- 0.03; collective bytes / ideal <= 1.05;
# stage 0 step time on 1 device / plain jax+optax <= 1.05.
MEMORY_GOAL, COMM_GOAL, TIME_GOAL = 0.03, 1.05, 1.05
# Param all-gathers the ideal allows per stage: stages 1-2 gather the updated params
# once, stage 3 gathers them for the forward and again for the backward pass.
IDEAL_GATHERS = {"baseline": 0, 0: 0, 1: 1, 2: 1, 3: 2}


def zero_formula(stage, psi: int, r: Recipe, n: int) -> float:
  """The ZeRO paper's per-device model state: params p and optimizer state K bytes per
  param, Psi params, N shards. Gradients are not state here (fp32 temporaries)."""
  p, k = r.param_bytes * psi, r.opt_bytes * psi
  return {"baseline": p + k, 0: p + k, 1: p + k / n, 2: p + k / n, 3: (p + k) / n}[stage]


def compile_step(mesh, stage, r: Recipe):
  """Compiles one step from abstract inputs; nothing is allocated.

  Returns (compiled, partitioned HLO, rng bytes in the arguments, a function making a
  real state and batch to run it on).
  """
  mdl, tx = model(r.param_dtype), r.tx()
  tokens = lambda spec: {"tokens": jax.ShapeDtypeStruct(
      (BATCH, SEQ + 1), jnp.int32, sharding=NamedSharding(mesh, spec))}
  shapes = jax.eval_shape(mdl.init, jax.random.key(0))
  if stage == "baseline":  # Plain GSPMD data parallelism, params and Adam replicated.
    def step(state, batch):
      params, opt_state = state
      loss, grads = jax.value_and_grad(mdl.loss)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=replicated),
                         (shapes, jax.eval_shape(tx.init, shapes)))
    batch = tokens(P(("data", "fsdp")))
    step = jax.jit(step, in_shardings=(replicated, batch["tokens"].sharding),
                   out_shardings=(replicated, replicated), donate_argnums=(0,))
    init = jax.jit(lambda k: (lambda p: (p, tx.init(p)))(mdl.init(k)),
                   out_shardings=replicated)
    rng_bytes = 0
  else:
    plan = zerojax.make_plan(mesh, stage, shapes, tx, logical_axes=mdl.logical_axes(),
                             min_shard_size=0)  # Every divisible leaf is sharded.
    state, batch = zerojax.abstract_state(plan), tokens(plan.batch_spec)
    step = zerojax.make_train_step(plan, mdl.loss, tx)
    init = lambda k: zerojax.init_state(plan, mdl.init, tx, k)
    rng_bytes = 8

  def real():
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, mdl.vocab_size)
    return init(jax.random.key(0)), {
        "tokens": jax.device_put(ids, batch["tokens"].sharding)}
  return *hlo.compile_partitioned(step.lower(state, batch)), rng_bytes, real


def wire_bytes(op: str, operand_bytes: float, group: int) -> float:
  """Bytes one device sends for a collective under ring algorithms (operand bytes in)."""
  share = (group - 1) / group
  return {"all-reduce": 2 * operand_bytes * share, "reduce-scatter": operand_bytes * share,
          "all-gather": operand_bytes * (group - 1), "all-to-all": operand_bytes * share,
          "collective-permute": operand_bytes}.get(op, operand_bytes)


def comm_row(hlo_text: str, psi: int, stage, r: Recipe, n: int) -> dict:
  """Operand bytes per device and step by kind and dtype; totals against the ideal.

  An all-reduce's or reduce-scatter's operand is the whole local gradient, an
  all-gather's the local shard. Gradient reductions: all-reduce and reduce-scatter
  operands of more than SCALARS elements. **ideal** = 4 Psi (one fp32 reduction of
  every gradient) + g * p * Psi / N (g = IDEAL_GATHERS[stage] all-gathers of the
  params, p bytes each, operand = one device's shard); **total** = every collective's
  operand bytes. The wire columns convert both to ring-algorithm bytes sent.
  """
  gathers, share = IDEAL_GATHERS[stage], (n - 1) / n
  row = dict(by_kind={}, grad_f32_bytes=0, grad_other_bytes=0, gather_bytes=0,
             other_bytes=0, size1_ops=0, grad_ideal_bytes=4 * psi,
             gather_ideal_bytes=gathers * r.param_bytes * psi / n, wire_bytes=0.0,
             ideal_wire_bytes=(4 * psi * (2 if stage in ("baseline", 0) else 1)
                               + gathers * r.param_bytes * psi) * share)
  for c in hlo.collectives(hlo_text):
    if c.group_size == 1:  # Groups of one device (a size-1 mesh axis): no traffic.
      row["size1_ops"] += 1
      continue
    for dt in {dt for dt, _ in c.operands}:  # A combined op runs once per dtype.
      row["by_kind"].setdefault(f"{c.op} {dt}", dict(runs=0, bytes=0))["runs"] += c.trips
    for dt, shape in c.operands:
      size = hlo.nbytes(((dt, shape),)) * c.trips
      row["by_kind"][f"{c.op} {dt}"]["bytes"] += size
      row["wire_bytes"] += wire_bytes(c.op, size, c.group_size or n)
      if c.op in ("all-reduce", "reduce-scatter") and math.prod(shape) > SCALARS:
        row["grad_f32_bytes" if dt == "f32" else "grad_other_bytes"] += size
      elif c.op == "all-gather":
        row["gather_bytes"] += size
      else:
        row["other_bytes"] += size
  row["ideal_bytes"] = row["grad_ideal_bytes"] + row["gather_ideal_bytes"]
  row["total_bytes"] = sum(v["bytes"] for v in row["by_kind"].values())
  row["grad_ratio"] = row["grad_f32_bytes"] / row["grad_ideal_bytes"]
  row["ratio"] = row["total_bytes"] / row["ideal_bytes"]
  row["wire_ratio"] = (row["wire_bytes"] / row["ideal_wire_bytes"]  # 0 on one device.
                       if row["ideal_wire_bytes"] else None)
  return row


def compile_all(devices, recipes=tuple(RECIPES), stages=(0, 1, 2, 3), timed_stages=STAGES):
  """Compiled steps, memory rows and collective rows on a (1, len(devices)) mesh.

  Every recipe is compiled at `stages`; the timed recipe at `timed_stages` (with the
  baseline). Returns ({(devices, stage): timed step}, memory rows, collective rows).
  """
  mesh, n = zerojax.make_mesh(1, len(devices), devices=devices), len(devices)
  psi = sum(x.size for x in jax.tree.leaves(jax.eval_shape(MODEL.init, jax.random.key(0))))
  steps, mem, comm = {}, [], []
  for name in recipes:
    r = RECIPES[name]
    for stage in timed_stages if name == TIMED else stages:
      compiled, text, rng_bytes, real = compile_step(mesh, stage, r)
      stage_name = f"stage {stage}" if stage != "baseline" else stage
      a = compiled.memory_analysis()
      state = a.argument_size_in_bytes - BATCH * (SEQ + 1) * 4 // n - rng_bytes
      formula = zero_formula(stage, psi, r, n)
      common = dict(recipe=name, name=stage_name, stage=stage, devices=n, params=psi)
      mem.append(dict(common, state_bytes=state, formula_bytes=formula,
                      ratio=state / formula, param_bytes=r.param_bytes,
                      opt_bytes=r.opt_bytes, output_bytes=a.output_size_in_bytes,
                      temp_bytes=a.temp_size_in_bytes))
      comm.append(dict(common, run=comm_row(compiled.as_text(), psi, stage, r, n),
                       partitioned=comm_row(text, psi, stage, r, n)))
      if name == TIMED:
        steps[(n, stage)] = dict(fn=compiled, real=real)
      del compiled
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
      ratio = statistics.median(ratios)
      goal = TIME_GOAL if (n, stage) == (1, 0) else None
      rows.append(dict(name=f"stage {stage}", devices=n, rounds=rounds, steps=per_round,
                       baseline_s=statistics.median(base),
                       zerojax_s=statistics.median(zero), ratio=ratio,
                       ratio_min=min(ratios), ratio_max=max(ratios), goal=goal,
                       met=None if goal is None else ratio <= goal))
  return rows


def table(title, headers, rows):
  print(f"\n#### {title}\n\n" + markdown_table(headers, rows))


def mb(b):
  return f"{b / 1e6:.3f}" if b >= 1e4 or b == 0 else f"{b:.0f} B"


def verdict(ok):
  return "—" if ok is None else ("met" if ok else "**missed**")


def report(res):
  """Prints every table of a result dict (as saved in the JSON)."""
  timing, mem, comm = res["step_time"], res["memory"], res["comm"]
  table("Overhead: step time, zerojax / plain jax+optax data parallel",
        ["devices", "step", "baseline ms", "zerojax ms", "ratio (median)", "ratio range",
         "goal", "met"],
        [(r["devices"], r["name"], f"{r['baseline_s'] * 1e3:.1f}",
          f"{r['zerojax_s'] * 1e3:.1f}", f"{r['ratio']:.2f}",
          f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
          f"≤ {r['goal']:.2f}" if r.get("goal") else "—", verdict(r.get("met")))
         for r in timing])

  stages = ["stage 0", "stage 1", "stage 2", "stage 3"]
  by = {(r["devices"], r["recipe"], r["name"]): r for r in mem}
  rows = []
  for n in sorted({r["devices"] for r in mem}):
    for name in RECIPES:
      cells = [by.get((n, name, s)) for s in stages]
      if not any(cells):
        continue
      r0 = next(c for c in cells if c)
      ok = all(abs(c["ratio"] - 1) <= MEMORY_GOAL for c in cells if c)
      rows.append([n, name, f"{r0['param_bytes']} + {r0['opt_bytes']}"]
                  + [f"{c['ratio']:.4f}" if c else "—" for c in cells]
                  + [f"1.00 ± {MEMORY_GOAL:.2f}", verdict(ok)])
  table("Memory: compiled per-device model state / ZeRO formula",
        ["devices", "recipe", "bytes/param (params + optimizer)", *stages, "goal", "met"],
        rows)
  table(f"Memory of the timed recipe ({TIMED}) and the plain step, MB per device",
        ["devices", "step", "state", "formula", "state / formula", "output", "temp"],
        [(r["devices"], r["name"], mb(r["state_bytes"]), mb(r["formula_bytes"]),
          f"{r['ratio']:.4f}", mb(r["output_bytes"]), mb(r["temp_bytes"]))
         for r in mem if r["recipe"] == TIMED])

  ok = lambda c: c["ratio"] <= COMM_GOAL
  table(f"Communication per step and device, as partitioned ({TIMED}; MB of operands)",
        ["devices", "step", "grad reductions", "param all-gathers", "other",
         "total", "ideal", "total / ideal", "goal", "met", "wire (ring) / ideal wire"],
        [(r["devices"], r["name"], mb(c["grad_f32_bytes"] + c["grad_other_bytes"])
          + ("" if not c["grad_other_bytes"] else f" ({mb(c['grad_other_bytes'])} not f32)"),
          mb(c["gather_bytes"]), mb(c["other_bytes"]), mb(c["total_bytes"]),
          mb(c["ideal_bytes"]), f"{c['ratio']:.3f}", f"≤ {COMM_GOAL:.2f}",
          verdict(ok(c)) if r["stage"] != "baseline" else "—",
          "—" if c["wire_ratio"] is None else f"{c['wire_ratio']:.3f}")
         for r in comm if r["recipe"] == TIMED for c in [r["partitioned"]]])
  byc = {(r["devices"], r["recipe"], r["name"]): r["partitioned"] for r in comm}
  rows = []
  for n in sorted({r["devices"] for r in comm}):
    for name in RECIPES:
      cells = [byc.get((n, name, s)) for s in stages]
      if any(cells):
        rows.append([n, name] + [f"{c['ratio']:.3f}" if c else "—" for c in cells]
                    + [f"≤ {COMM_GOAL:.2f}", verdict(all(ok(c) for c in cells if c))])
  table("Communication: total / ideal per recipe (operand bytes, as partitioned)",
        ["devices", "recipe", *stages, "goal", "met"], rows)
  for which, title in (("partitioned", "as partitioned (the program's dtypes)"),
                       ("run", "as XLA:CPU runs them (compiled.as_text())")):
    table(f"Collectives per step, {title}; {TIMED}",
          ["devices", "step", "operand MB per device (runs)", "f32 grad reductions",
           "ideal (4 B/param)", "ratio", "non-f32 grad reductions", "size-1 groups"],
          [(r["devices"], r["name"], "; ".join(
              f"{k}: {mb(v['bytes'])} ({v['runs']})"
              for k, v in sorted(c["by_kind"].items())),
            mb(c["grad_f32_bytes"]), mb(c["grad_ideal_bytes"]), f"{c['grad_ratio']:.2f}",
            mb(c["grad_other_bytes"]), c["size1_ops"])
           for r in comm if r["recipe"] == TIMED for c in [r[which]]])


def plot(res):
  """zero_step.png: the three ratios against their goals."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.lines import Line2D
  fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
  names = list(RECIPES)
  devices = sorted({r["devices"] for r in res["memory"]})
  markers = dict(zip(devices, "os^"))
  slots = len(names) * len(devices)
  for ax, key in ((axes[0], "memory"), (axes[1], "comm")):
    for i, (n, name) in enumerate((n, name) for n in devices for name in names):
      pts = [(r["stage"], r["ratio"] if key == "memory" else r["partitioned"]["ratio"])
             for r in res[key] if r["devices"] == n and r["recipe"] == name
             and r["stage"] != "baseline"]
      ax.plot([s + 0.6 * (i / (slots - 1) - 0.5) for s, _ in pts], [v for _, v in pts],
              markers[n], color=f"C{names.index(name)}", ms=6, ls="none")
    ax.set_xticks(range(4), [f"stage {s}" for s in range(4)])
    ax.axhline(1.0, color="grey", lw=0.8)
  axes[0].axhspan(1 - MEMORY_GOAL, 1 + MEMORY_GOAL, color="green", alpha=0.12)
  axes[0].set(ylim=(0.95, 1.05), ylabel="compiled model state / ZeRO formula",
              title=f"memory per device (goal 1.00 ± {MEMORY_GOAL}: green band)")
  axes[1].axhspan(0.0, COMM_GOAL, color="green", alpha=0.12)
  axes[1].set(ylim=(0.9, 1.1), ylabel="collective operand bytes / ideal (as partitioned)",
              title=f"communication per step (goal ≤ {COMM_GOAL}: green)")
  ax = axes[2]
  for n, marker in ((8, "o"), (1, "s")):
    rows = [r for r in res["step_time"] if r["devices"] == n]
    ax.errorbar([int(r["name"][-1]) + (0.15 if n == 1 else 0) for r in rows],
                [r["ratio"] for r in rows],
                yerr=[[r["ratio"] - r["ratio_min"] for r in rows],
                      [r["ratio_max"] - r["ratio"] for r in rows]],
                fmt=marker, color="k" if n == 8 else "C3", capsize=3,
                label=f"{n} device{'s' * (n > 1)}: median, range over rounds")
  ax.plot([-0.2, 0.4], [TIME_GOAL] * 2, color="green", lw=2,
          label=f"goal: stage 0, 1 device ≤ {TIME_GOAL}")
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_xticks(range(4), [f"stage {s}" for s in range(4)])
  ax.set(ylabel="step time / plain jax+optax", title="overhead vs a hand-written step")
  ax.legend(fontsize=8, loc="upper right")
  handles = ([Line2D([], [], color=f"C{i}", marker="o", ls="none", label=name)
              for i, name in enumerate(names)]
             + [Line2D([], [], color="grey", marker=markers[n], ls="none",
                       label=f"{n} devices") for n in devices])
  fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0.12, 1, 1))
  fig.savefig(PNG, dpi=110)
  print(f"wrote {os.path.relpath(PNG)}")


def main():
  if args.replot:
    with open(OUT) as f:
      res = json.load(f)
    report(res)
    plot(res)
    return
  if args.compile_only:  # The 64-device child: compile, report on stdout, exit.
    _, mem, comm = compile_all(jax.devices())
    print(json.dumps(dict(memory=mem, comm=comm)))
    return
  start = time.time()
  steps, mem, comm = compile_all(jax.devices())
  print(f"compiled {len(mem)} steps on {jax.device_count()} devices in "
        f"{time.time() - start:.0f} s", flush=True)
  steps |= compile_all(jax.devices()[:1], (TIMED,), timed_stages=("baseline", 0))[0]
  timing = time_all(steps, rounds=3 if args.quick else 9, per_round=2 if args.quick else 5)
  del steps  # Frees the 8-device states before the 64-device child compiles.
  if not args.quick:
    child = subprocess.run([sys.executable, __file__, "--devices", "64", "--compile-only"],
                           capture_output=True, text=True, check=False)
    if child.returncode == 0:
      big = json.loads(child.stdout.strip().splitlines()[-1])
      mem, comm = mem + big["memory"], comm + big["comm"]
    else:
      print(f"64-device compile failed (exit {child.returncode}):\n{child.stderr[-3000:]}")

  res = dict(model=repr(MODEL), batch=BATCH, seq=SEQ, recipes={
      k: dict(param_dtype=jnp.dtype(r.param_dtype).name, param_bytes=r.param_bytes,
              opt_bytes=r.opt_bytes) for k, r in RECIPES.items()},
             goals=dict(memory=f"1.00 ± {MEMORY_GOAL}", comm=f"≤ {COMM_GOAL}",
                        step_time=f"stage 0, 1 device ≤ {TIME_GOAL}"),
             quick=args.quick, jax=jax.__version__, load_avg=os.getloadavg(),
             seconds=time.time() - start, step_time=timing, memory=mem, comm=comm)
  report(res)
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  with open(OUT, "w") as f:
    json.dump(res, f, indent=1)
  plot(res)
  print(f"\nwrote {OUT} in {time.time() - start:.0f} s")


if __name__ == "__main__":
  main()
