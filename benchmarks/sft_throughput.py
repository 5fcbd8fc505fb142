"""Step time of packed fine-tuning batches vs pretraining batches, same model and shapes.

    python benchmarks/sft_throughput.py              # ~2 minutes on 2 CPU cores
    python benchmarks/sft_throughput.py --rounds 4

Both steps are built as train.py builds them (`zerojax.build`, one CPU device): configs/
tiny.py (stdlib bytes, `{'tokens'}` batches) and configs/sft_tiny.py (the same model,
optimizer, batch of 16 x 128, vocabulary 264 for both; packed rows with segment ids,
positions and a loss mask: the segment mask in the blocked attention kernel, positions
into RoPE, the mask into the loss). Batches come from each config's own loader. Steps run
interleaved in one process, one step of each at a time, each waited for; a round is
`--steps` steps of both, and the ratio of their times is taken per round: the median is
reported (>= 0.9 is the aim).
Writes benchmarks/results/sft_throughput.json.
"""

import argparse
import json
import os
import statistics
import time

import jax

import zerojax
from zerojax import data
from zerojax.build import build
from zerojax.config import load_config
from zerojax.data import sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "sft_throughput.json")


def setup(name: str, overrides: tuple[str, ...] = (), num_devices: int = 1,
          count: int = 4):
  """[step, state, batches] for configs/<name>.py + `overrides`: the compiled step (as
  train.py builds it) and `count` real batches from the config's own loader (local ones
  too: the numpy arrays, for counting their tokens)."""
  # The same vocabulary for both (sft_tiny's 264: bytes and 5 special tokens).
  c = load_config(os.path.join(ROOT, "configs", f"{name}.py"),
                  ["model.vocab_size=264", *overrides], num_devices=num_devices)
  t = c.train
  built = build(c)
  step = built.train_step.lower(built.abstract_state, built.abstract_batch).compile()
  state = zerojax.init_state(built.plan, built.model.init, built.tx, jax.random.key(0))
  if c.data.name == "sft":
    train, _, _ = sft.load(c.data, c.model.vocab_size, t.seq_len)
    local = [sft.batch_at(train, s, t.global_batch_size, c.seed) for s in range(count)]
  else:
    train, _ = data.load_tokens(c.data, c.model.vocab_size, t.seq_len)
    local = [{"tokens": data.batch_at(train, s, t.global_batch_size, t.seq_len, c.seed)}
             for s in range(count)]
  return [step, state, [data.global_batch(b, built.batch_sharding) for b in local], local]


def interleaved(runs: dict[str, list], rounds: int, steps: int) -> dict[str, list[float]]:
  """Seconds per step of each run, per round: one step of each at a time, each waited
  for, `steps` steps of every run a round (round 0 warms up and is not counted)."""
  times = {name: [] for name in runs}
  for r in range(rounds + 1):
    spent = dict.fromkeys(runs, 0.0)
    for i in range(steps):
      for name, run in runs.items():
        step, state, batches = run[:3]
        start = time.perf_counter()
        state, metrics = step(state, batches[i % len(batches)])
        jax.block_until_ready(metrics)
        spent[name] += time.perf_counter() - start
        run[1] = state
    if r:
      for name in runs:
        times[name].append(spent[name] / steps)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
  args = parser.parse_args()
  runs = {name: setup(name) for name in ("tiny", "sft_tiny")}
  times = interleaved(runs, args.rounds, args.steps)
  ratios = [a / b for a, b in zip(times["tiny"], times["sft_tiny"])]
  result = dict(rounds=args.rounds, steps=args.steps,
                median_step_s={k: statistics.median(v) for k, v in times.items()},
                ratio_per_round=ratios, median_ratio=statistics.median(ratios),
                meaning="tokens/s of packed SFT batches / tokens/s of pretraining batches")
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  with open(OUT, "w") as f:
    json.dump(result, f, indent=1)
  print(f"median step: pretraining {result['median_step_s']['tiny'] * 1e3:.1f} ms, "
        f"packed SFT {result['median_step_s']['sft_tiny'] * 1e3:.1f} ms; SFT / pretraining "
        f"throughput: median {result['median_ratio']:.3f} over {args.rounds} rounds "
        f"(range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
  main()
