"""KV-cached generation vs the uncached reference: the same model, prompts and new tokens.

    python benchmarks/generate_speed.py              # ~1 minute on 2 CPU cores (50 s measured)
    python benchmarks/generate_speed.py --rounds 5 --batch 8

configs/tiny.py's Llama (as train.py builds it: bf16 params and compute, random init: the
speed does not depend on the weights) on one CPU device; `--batch` prompts of 16 tokens,
`--new` (256) greedy tokens each. Uncached: `generate.greedy` (the model rerun over the
whole prompt + new-token buffer per token); cached: `generate.generate` (a prefill, then
one token per row and step against the KV cache, in one program). Both are compiled
before timing; then each round times one call of each, waited for, and the ratio of
their times is taken per round: the median is reported (the issue asks for >= 10x).
Writes benchmarks/results/generate_speed.json.
"""

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

from zerojax import generate, models
from zerojax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "generate_speed.json")
PROMPT = 16


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--new", type=int, default=256)
  args = p.parse_args()
  config = load_config(os.path.join(ROOT, "configs", "tiny.py"), [], num_devices=1)
  model = models.from_config(config)
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, config.model.vocab_size, (args.batch, PROMPT)).astype(np.int32)
  buffer = np.zeros((args.batch, PROMPT + args.new), np.int32)
  buffer[:, :PROMPT] = prompts
  lengths = np.full(args.batch, PROMPT, np.int32)

  def uncached():
    out = generate.greedy_jit(model.logits, params, buffer, lengths, steps=args.new)
    return np.asarray(out)[:, PROMPT:]

  def cached():
    return generate.generate(model, params, list(prompts), args.new).tokens

  runs = {"uncached": uncached, "cached": cached}
  said = {name: run() for name, run in runs.items()}  # Compiles.
  times = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name, run in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  ratios = [u / c for u, c in zip(times["uncached"], times["cached"])]
  tokens = args.batch * args.new
  result = dict(
      model="configs/tiny.py", batch=args.batch, prompt=PROMPT, new_tokens=args.new,
      devices=jax.device_count(), backend=jax.default_backend(), rounds=args.rounds,
      seconds=times, tokens_per_s={k: tokens / statistics.median(v) for k, v in times.items()},
      ratio_per_round=ratios, ratio=statistics.median(ratios),
      same_tokens=float(np.mean(said["cached"] == said["uncached"])))
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  with open(OUT, "w") as f:
    json.dump(result, f, indent=2)
  print("| path | s per call (median) | new tokens/s |\n| --- | --- | --- |")
  for name in runs:
    print(f"| {name} | {statistics.median(times[name]):.3f} | "
          f"{result['tokens_per_s'][name]:.0f} |")
  print(f"cached / uncached speed: {result['ratio']:.1f}x (rounds: "
        f"{', '.join(f'{r:.1f}' for r in ratios)}); same tokens: {result['same_tokens']:.1%} "
        f"(bf16, random init: argmax near-ties may differ); wrote {OUT}")


if __name__ == "__main__":
  main()
