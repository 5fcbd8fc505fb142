"""Per-device bytes from XLA's GPU compiler for the shipped configs and the README's 70B
table, beside the planner's (and XLA:CPU's with --cpu): no GPU needed.

    python benchmarks/gpu_targets.py            # ~3 min on 2 cores -> results/gpu_targets.json
    python benchmarks/gpu_targets.py --cpu      # + XLA:CPU's compile of each (~+4 min)
    python benchmarks/gpu_targets.py --rows 70b # only the rows whose label has "70b"
                                                # (replaced in the record, the rest kept)
    python benchmarks/gpu_targets.py --replan   # the planner's columns of every recorded
                                                # row again, nothing compiled (seconds)

Each row is compiled as train.py would compile it on that GPU (`zerojax.gpu`: the XLA
flag profile, cuDNN attention) and judged against the memory XLA's allocator has there
(`zerojax.gpu.targets.budget`). planner/GPU is the calibration docs/design/gpu-targets.md tabulates.
A row whose config offloads (params, optimizer state or saved activations to the host)
also compiles each other phase of its run (`zerojax.memory.phases`: init, init from HF
weights, eval, checksums, generation): `phases` holds each phase's device bytes,
`whole_run` the largest, `peak_phase` its phase, and `fits` judges the whole run.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ADAMW = ("optimizer.name=adamw", "optimizer.b2=0.95")
# (label, config, overrides, target): the README's 70B table (8 x H100), its 8 x A100 40GB
# row (`python -m zerojax.memory.fit --config configs/70b_bf16.py --targets a100_40gb
# --devices 8 --compile` chose it), then each shipped GPU config at its intended hardware.
ROWS = [
    ("70b: Lion + Kahan + release", "70b_8x80gb", (), "h100:8"),
    ("70b: AdamW + Kahan + release + offload", "70b_8x80gb", (*ADAMW, "optimizer.offload=host"),
     "h100:8"),
    ("70b: AdamW + Kahan + release", "70b_8x80gb", ADAMW, "h100:8"),
    ("70b: Lion + Kahan, no release", "70b_8x80gb", ("optimizer.release=False",), "h100:8"),
    ("70b: AdamW + Kahan, no release", "70b_8x80gb", ("optimizer.release=False", *ADAMW),
     "h100:8"),
    ("70b: Lion + stochastic rounding + release", "70b_8x80gb",
     ("optimizer.update_rule=stochastic",), "h100:8"),
    ("70b: Lion + Kahan + release, no XLA flag profile", "70b_8x80gb",
     ("xla.gpu_profile=False",), "h100:8"),
    ("70b: AdamW + Kahan + release x8 microbatches + offload", "70b_bf16",
     ("optimizer.release=True", "optimizer.grad_clip=0", "train.microbatches=8",
      "optimizer.release_accumulation=optimizer", "optimizer.offload=host"), "a100_40gb:8"),
    ("configs/70b_8x80gb.py", "70b_8x80gb", (), "h100:8"),
    ("configs/70b_bf16.py (16, batch 16)", "70b_bf16", ("train.global_batch_size=16",),
     "h100:16"),
    ("configs/70b_bf16.py", "70b_bf16", (), "h100:64"),
    ("configs/8b_bf16.py", "8b_bf16", (), "h100:8"),
    ("configs/1b_bf16.py", "1b_bf16", (), "h200:1"),
    ("configs/125m_quality.py", "125m_quality", (), "h200:1"),
    # The mixtures of experts, their experts split over the 8 devices (mesh.expert=8).
    ("moe: configs/qwen3_30b_a3b_8x80gb.py", "qwen3_30b_a3b_8x80gb", (), "h100:8"),
    ("moe: configs/qwen3_235b_a22b_8xh200.py", "qwen3_235b_a22b_8xh200", (), "h200:8"),
    ("moe: configs/mixtral_8x7b_8x80gb.py", "mixtral_8x7b_8x80gb", (), "h100:8"),
    # The largest model per GPU: the whole model in host memory, a layer at a time.
    ("largest: configs/405b_8xh200.py", "405b_8xh200", (), "h200:8"),
    ("largest: configs/405b_1xh200.py", "405b_1xh200", (), "h200:1"),
    ("largest: configs/70b_1xh100.py", "70b_1xh100", (), "h100:1"),
    ("largest: configs/70b_1x4090.py", "70b_1x4090", (), "rtx4090:1"),
    # Every other shipped GPU config at the target its docstring names.
    *[(f"shipped: configs/{name}.py", name, (), target) for name, target in (
        ("70b_8x4090", "rtx4090:8"), ("70b_8xl40s", "l40s:8"), ("70b_sft_8x80gb", "h100:8"),
        ("70b_256k_8x80gb", "h100:8"), ("8b_4m_8x80gb", "h100:8"),
        ("qwen25_72b_8x80gb", "h100:8"), ("qwen3_32b_4x80gb", "h100:4"),
        ("gemma3_27b_4x80gb", "h100:4"), ("mistral_small_24b_4x80gb", "h100:4"),
        ("8b_1x4090", "rtx4090:1"), ("qwen3_8b_1x4090", "rtx4090:1"),
        ("qwen25_7b_1x4090", "rtx4090:1"), ("mistral_7b_1x4090", "rtx4090:1"),
        ("gemma3_12b_1x4090", "rtx4090:1"))],
]


def planned(config, spec) -> dict:
  """The planner's columns of a row: its estimate for `config` on `spec`, as
  `python -m zerojax.memory --target` makes it."""
  from zerojax import memory
  from zerojax.memory import bus, report as memory_report
  from zerojax.runtime import platform

  budget, fraction = memory_report.target_budget(config, spec.target)
  with platform.targeting():
    e = memory.estimate(config, spec.devices, budget, gpu_memory=spec.target.memory)
  h2d, d2h = bus.totals(bus.traffic(e.setup, e.host))
  return dict(budget=budget, memory_fraction=fraction, planner=e.total,
              planner_host=e.host_total, planner_h2d=h2d, planner_d2h=d2h)


def replan(row: dict) -> dict:
  """`row` with its planner columns made again by today's planner; its config must still
  resolve to the digest it was compiled with (else the compile is stale: --rows)."""
  from zerojax.config import digest, load_config
  from zerojax.gpu import targets

  spec = targets.parse(row["target"])
  config = load_config(os.path.join(ROOT, row["config"]), row["overrides"],
                       num_devices=spec.devices)
  if digest(config) != row["config_digest"]:
    raise SystemExit(f"{row['label']}: its config changed since it was compiled: "
                     f"python benchmarks/gpu_targets.py --rows '{row['label']}'")
  row = dict(row, **planned(config, spec))
  row["planner_over_gpu"] = row["planner"] / row["gpu"]
  return row


def measure(label, name, overrides, target, cpu):
  import jax

  from zerojax import build
  from zerojax.config import digest, load_config
  from zerojax.gpu import compile as gpu_compile, targets
  from zerojax.memory import phases as run_phases
  from zerojax.streaming import schedule

  spec = targets.parse(target)
  config = load_config(os.path.join(ROOT, "configs", f"{name}.py"), list(overrides),
                       num_devices=spec.devices)
  plan = planned(config, spec)
  built = build.build(config, jax.devices()[:spec.devices])
  start = time.perf_counter()
  compiled = gpu_compile.compile_step(built, config, spec)
  out = compiled.memory
  moved = schedule.host_traffic(compiled.hlo)  # The module's host copies a step.
  row = dict(label=label, config=f"configs/{name}.py", overrides=list(overrides),
             config_digest=digest(config), target=str(spec),
             device_kind=spec.target.device_kind, **plan,
             gpu=out["arguments"] + out["temporaries"], gpu_arguments=out["arguments"],
             gpu_temporaries=out["temporaries"], gpu_host=out["host_arguments"],
             gpu_host_temporaries=out["host_temporaries"],
             gpu_h2d=moved[0], gpu_d2h=moved[1], gpu_seconds=time.perf_counter() - start)
  if offloads(config):  # The run's other phases, the step's compile reused (issue 52).
    phased = run_phases.beside_step(config, spec, run_phases.PHASES, built, out)
    row["peak_phase"], row["whole_run"] = run_phases.whole_run(phased)
    row["phases"] = {phase: m["device"] for phase, m in phased.items()}
    row["gpu_seconds"] = time.perf_counter() - start
  row["fits"] = max(row["gpu"], row.get("whole_run", 0)) <= row["budget"]
  row["planner_over_gpu"] = row["planner"] / row["gpu"]
  if cpu:
    mem = build.compiled_memory(built)
    row["cpu"] = mem["arguments"] + mem["temporaries"]
  return row


def offloads(config) -> bool:
  """Whether `config` keeps anything in host memory (its phases are then recorded)."""
  return "host" in (config.zero.param_offload, config.optimizer.offload,
                    config.model.activation_offload)


def table(rows):
  from zerojax.runtime.units import fmt_bytes
  from zerojax.testing import markdown_table

  host = lambda n: f" + {fmt_bytes(n)} host" if n else ""
  cpu = any("cpu" in r for r in rows)
  head = ["row", "target", "planner", "XLA's GPU compiler", "planner / GPU", "whole run",
          "budget", "fits"]
  head += ["XLA:CPU"] if cpu else []
  body = [[r["label"], r["target"], fmt_bytes(r["planner"]) + host(r["planner_host"]),
           fmt_bytes(r["gpu"]) + host(r["gpu_host"]), f"{r['planner_over_gpu']:.3f}",
           f"{fmt_bytes(r['whole_run'])} ({r['peak_phase']})" if "phases" in r else "-",
           fmt_bytes(r["budget"]), "yes" if r["fits"] else "no"]
          + ([fmt_bytes(r["cpu"]) if "cpu" in r else "-"] if cpu else []) for r in rows]
  return markdown_table(head, body)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cpu", action="store_true", help="also compile each row with XLA:CPU")
  ap.add_argument("--rows", default="",
                  help="only rows whose label contains this (or one of these, comma-separated)")
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                "gpu_targets.json"))
  ap.add_argument("--replan", action="store_true",
                  help="only the planner's columns of every recorded row, made again")
  args = ap.parse_args(argv)
  if args.replan:
    with open(args.out) as f:
      record = json.load(f)
    record["rows"] = [replan(r) for r in record["rows"]]
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)
    print(table(record["rows"]))
    return
  rows = [r for r in ROWS if any(x in r[0] for x in args.rows.split(","))]
  from zerojax.gpu import compile as gpu_compile, targets
  from zerojax.runtime.device_env import CPU_MEMORY_FLAGS
  # The most devices any row traces over; with XLA:CPU's memory flags for --cpu's column
  # (they change nothing in the GPU compile).
  devices = max(targets.parse(t).devices for *_, t in rows)
  gpu_compile.prepare(devices)
  os.environ["XLA_FLAGS"] += " " + " ".join(CPU_MEMORY_FLAGS)
  results = []
  for row in rows:
    results.append(measure(*row, args.cpu))
    print(json.dumps(results[-1]), flush=True)
  import jax
  rows_out = results
  if args.rows and os.path.exists(args.out):  # A subset replaces its rows in the record.
    with open(args.out) as f:
      fresh = {r["label"]: r for r in results}
      kept = json.load(f)["rows"]
    for r in kept:  # XLA:CPU's figure (--cpu) kept where the config is the same.
      new = fresh.get(r["label"])
      if new and "cpu" in r and "cpu" not in new and r["config_digest"] == new["config_digest"]:
        new["cpu"] = r["cpu"]
    rows_out = [fresh.pop(r["label"], r) for r in kept] + list(fresh.values())
  with open(args.out, "w") as f:
    json.dump(dict(jax=jax.__version__, rows=rows_out), f, indent=1)
  print(table(results))


if __name__ == "__main__":
  main()
