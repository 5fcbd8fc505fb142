"""A mixture of experts' train step beside the dense model of the same active width.

Issue 54's yardstick, two parts:

1. This machine's CPU, 8 fake devices, one process, the variants interleaved a step at a
   time (each waited for) and the median of each round's tokens/s reported with its
   ratio to the dense model's in the same round: `configs/qwen3_moe_tiny.py` at d_model
   256, 4 layers, 256-token sequences, 16 a step, 8 experts of width 256, 2 a token, at
   `mesh.expert=8` (dropless, and at a capacity factor) and at `mesh.expert=1`, beside
   `configs/qwen3_tiny.py` with `d_ff=512` (the same model FLOPs a token).
2. With `--target` (the `gpu-compile` extra, no GPU): a MoE recipe at `--layers` layers
   compiled by XLA's GPU compiler, its matmul FLOPs a device counted in the compiled
   module (each loop body times its trip count; an expert's tile loop, whose trip count
   is the tiles its routed rows occupy, at a balanced router's: ceil(N k ep / E /
   `moe.tile_rows`) tiles, in the loop over the E / ep experts a device) against the
   model's (6 x active params x tokens + attention), its bytes, and the dispatch's
   buffers as the planner counts them (`memory.activations.expert_dispatch_bytes`).

    python benchmarks/moe_step.py                      # part 1, ~4 minutes on 2 cores
    python benchmarks/moe_step.py --target h100:8      # part 2, the 30B-A3B at 4 layers
    python benchmarks/moe_step.py --target h100:8 --config configs/qwen3_30b_a3b_8x80gb.py \\
        --config.model.expert_capacity_factor=0

Writes benchmarks/results/moe_step.json (each part its own entry, with the command and
the commit).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "moe_step.json")
SHAPE = ["model.d_model=256", "model.n_layers=4", "train.seq_len=256",
         "train.global_batch_size=16", "model.attention_block=128", "model.loss_chunk=128"]
MOE = ["model.expert_d_ff=256"]
CPU_VARIANTS = {  # name -> (config, overrides)
    "dense, d_ff=512": ("qwen3_tiny.py", ["model.d_ff=512"]),
    "MoE, mesh.expert=8, dropless": ("qwen3_moe_tiny.py", [*MOE, "mesh.expert=8", "mesh.fsdp=1"]),
    "MoE, mesh.expert=8, capacity 1.5": ("qwen3_moe_tiny.py", [
        *MOE, "mesh.expert=8", "mesh.fsdp=1", "model.expert_capacity_factor=1.5"]),
    "MoE, mesh.expert=1": ("qwen3_moe_tiny.py", MOE),
}


def revision() -> str:
  return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True,
                        capture_output=True).stdout.strip()


def save(key: str, record: dict) -> None:
  results = {}
  if os.path.exists(OUT):
    with open(OUT) as f:
      results = json.load(f)
  results[key] = dict(record, command="python benchmarks/moe_step.py " + " ".join(sys.argv[1:]),
                      commit=revision())
  with open(OUT, "w") as f:
    json.dump(results, f, indent=1, sort_keys=True)
    f.write("\n")


def cpu_part(rounds: int, steps: int) -> dict:
  # pylint: disable=import-outside-toplevel  (the fake devices come before JAX starts)
  from zerojax.runtime.devices import fake_cpu_devices
  fake_cpu_devices(8, memory_flags=False)
  import jax
  import numpy as np

  import zerojax
  from zerojax import build
  from zerojax.config import load_config

  runs = {}
  for name, (path, overrides) in CPU_VARIANTS.items():
    config = load_config(os.path.join(ROOT, "configs", path), [*SHAPE, *overrides],
                         num_devices=8)
    built = build.build(config)
    state = zerojax.init_state(built.plan, built.model.init, built.tx, jax.random.key(0))
    t = config.train
    rng = np.random.default_rng(0)
    batches = [jax.device_put({"tokens": rng.integers(
        0, config.model.vocab_size, (t.global_batch_size, t.seq_len + 1)).astype(np.int32)},
        built.batch_sharding) for _ in range(steps)]
    for b in batches[:2]:  # Compile and warm up.
      state, metrics = built.train_step(state, b)
    jax.block_until_ready(state)
    runs[name] = dict(step=built.train_step, state=state, batches=batches,
                      tokens=t.global_batch_size * t.seq_len,
                      flops=built.model.flops_per_token(t.seq_len), rates=[])
  for _ in range(rounds):
    for run in runs.values():
      start = time.perf_counter()
      state = run["state"]
      for b in run["batches"]:
        state, metrics = run["step"](state, b)
        jax.block_until_ready(state)
      run["state"] = state
      run["rates"].append(run["tokens"] * steps / (time.perf_counter() - start))
      run["dropped"] = float(metrics.get("router_dropped_tokens", 0.0))
  dense = runs["dense, d_ff=512"]["rates"]
  rows = []
  for name, run in runs.items():
    rows.append(dict(variant=name, tokens_per_s=statistics.median(run["rates"]),
                     vs_dense=statistics.median(r / d for r, d in zip(run["rates"], dense)),
                     model_flops_per_token=run["flops"], last_dropped=run.get("dropped", 0.0)))
  return dict(rounds=rounds, steps=steps, shape=SHAPE, rows=rows)


def gpu_part(target: str, config_path: str, overrides: list[str], layers: int) -> dict:
  # pylint: disable=import-outside-toplevel  (the GPU target's flags come before JAX starts)
  from zerojax.gpu import compile as gpu_compile, targets
  spec = targets.parse(target, None)
  targets.without_driver()
  gpu_compile.prepare(spec.devices)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import peer_step  # The compiled module's FLOP count, shared with the peer benchmark.

  from zerojax import build, memory
  from zerojax.config import digest, load_config
  from zerojax.memory import activations
  from zerojax.models import moe

  config = load_config(config_path, [*overrides, f"model.n_layers={layers}"],
                       num_devices=spec.devices)
  m, t = config.model, config.train
  built = build.build(config)
  tokens = t.global_batch_size * t.seq_len // spec.devices  # A device's, a step.
  local = m.n_experts // config.mesh.expert
  received = config.mesh.expert * moe.exchange_slots(
      tokens * m.experts_per_token, config.mesh.expert, m.expert_capacity_factor)
  balanced = tokens * m.experts_per_token // local  # Each local expert's rows, balanced.
  trips = math.ceil(balanced / moe.tile_rows(received, local))  # An expert's tile loop.
  out = gpu_compile.compile_step(built, config, spec)
  flops = peer_step.hlo_flops(out.hlo, unknown_trips=trips)
  model = built.model.flops_per_token(t.seq_len) * tokens
  run_spec = memory.RunSpec.from_config(config, spec.devices)
  return dict(target=target, config=os.path.relpath(config_path, ROOT), overrides=overrides,
              layers=layers, digest=digest(config),
              tile_trips=trips, hlo_flops=flops, model_flops=model, ratio=flops / model,
              arguments=out.memory["arguments"], temporaries=out.memory["temporaries"],
              dispatch_bytes=activations.expert_dispatch_bytes(run_spec, tokens))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="", help="part 2: compile for this GPU target")
  parser.add_argument("--config", default=os.path.join(ROOT, "configs",
                                                       "qwen3_30b_a3b_8x80gb.py"))
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=2, help="steps a variant a round")
  args, overrides = parser.parse_known_args()
  overrides = [o.removeprefix("--config.") for o in overrides]
  if args.target:
    r = gpu_part(args.target, args.config, overrides, args.layers)
    save(" ".join([os.path.relpath(args.config, ROOT), *overrides, args.target]), r)
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    print(f"{r['config']} {' '.join(overrides)} at {r['layers']} layers on {r['target']}, "
          f"XLA's GPU compiler: {r['hlo_flops'] / 1e12:.2f} TFLOP a device a step (an "
          f"expert's tile loop at {r['tile_trips']} tiles) / model {r['model_flops'] / 1e12:.2f} = "
          f"{r['ratio']:.3f}; arguments {gib(r['arguments'])}, temporaries "
          f"{gib(r['temporaries'])}; dispatch buffers (planner) {gib(r['dispatch_bytes'])}")
    return
  r = cpu_part(args.rounds, args.steps)
  save("cpu", r)
  print("| variant | tokens/s (median) | / dense (median of rounds) | dropped (last step) |")
  print("| --- | --- | --- | --- |")
  for row in r["rows"]:
    print(f"| {row['variant']} | {row['tokens_per_s']:,.0f} | {row['vs_dense']:.2f} | "
          f"{row['last_dropped']:.0f} |")


if __name__ == "__main__":
  main()
