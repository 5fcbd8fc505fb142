"""Training quality with gradient release: the same token budget, 3 seeds, held-out loss.

Four arms of the same run (mlp_lm, or the Llama with `--model llama`, on the stdlib
bytes, bf16 params, Kahan AdamW with bf16 moments, stage 3 on 8 fake CPU devices, no
clipping), built by `zerojax.build` from the config as train.py builds them:

- `accumulate`: the normal step, gradient accumulation over `--microbatches`;
- `release_accumulate`: gradient release with optimizer accumulation over as many;
- `plain` / `release`: one microbatch, the normal step / gradient release.

Each arm trains `--steps` steps of `--batch` sequences per seed and reports the mean
loss over `--eval_batches` held-out batches at the end; the table gives the ratio of
release to normal per seed (mean, min, max). Writes benchmarks/results/release_quality.json.

  python benchmarks/release_quality.py [--steps 150 --seeds 0 1 2]
"""

import argparse
import json
import os
import time

from zerojax.runtime.devices import fake_cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"plain": (False, 1), "release": (True, 1), "accumulate": (False, None),
        "release_accumulate": (True, None)}
PAIRS = (("release", "plain"), ("release_accumulate", "accumulate"))


def overrides(args, release: bool, microbatches: int) -> list[str]:
  return [
      f"model.name={args.model}", f"model.n_layers={args.layers}", "model.d_model=128",
      "model.d_ff=384", f"train.seq_len={args.seq_len}", f"train.steps={args.steps}",
      f"train.global_batch_size={args.batch}", f"train.microbatches={microbatches}",
      "optimizer.grad_clip=0", f"optimizer.warmup_steps={args.steps // 10}",
      f"optimizer.learning_rate={args.learning_rate}",
      f"optimizer.state_dtype={args.state_dtype}",
      f"optimizer.release={release}",
      f"optimizer.release_accumulation={'optimizer' if release and microbatches > 1 else 'none'}"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="mlp_lm", choices=("mlp_lm", "llama"))
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--microbatches", type=int, default=4)
  parser.add_argument("--seq_len", type=int, default=64)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--eval_batches", type=int, default=8)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--learning_rate", type=float, default=3e-3)
  parser.add_argument("--state_dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
  parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                    "release_quality.json"))
  args = parser.parse_args()
  fake_cpu_devices(8, memory_flags=False)
  # pylint: disable=import-outside-toplevel  (JAX starts after the device flags)
  import numpy as np
  from arms import run_seed

  from zerojax import config as zc, data
  from zerojax.build import build
  from zerojax.testing import markdown_table

  base = os.path.join(ROOT, "configs", "base.py")
  finals: dict[str, list[float]] = {}
  start = time.perf_counter()
  for arm in args.arms:
    release, micro = ARMS[arm]
    micro = micro or args.microbatches
    config = zc.load_config(base, overrides(args, release, micro), num_devices=8)
    built = build(config)
    tokens, held_out = data.load_tokens(config.data, config.model.vocab_size, args.seq_len)
    for seed in args.seeds:
      run = run_seed(built, config, seed, tokens, held_out, eval_batches=args.eval_batches)
      assert not run["skipped"], (arm, seed)
      finals.setdefault(arm, []).append(run["final"])
      print(f"{arm:20s} seed {seed}: held-out loss {run['final']:.4f}", flush=True)

  rows = []
  for ours, theirs in [p for p in PAIRS if set(p) <= set(finals)]:
    ratio = np.array(finals[ours]) / np.array(finals[theirs])
    rows.append([ours, theirs, " ".join(f"{x:.4f}" for x in finals[ours]),
                 " ".join(f"{x:.4f}" for x in finals[theirs]),
                 f"{ratio.mean():.4f}", f"{ratio.min():.4f}-{ratio.max():.4f}"])
  print(markdown_table(["arm", "against", "held-out loss (seeds)", "against (seeds)",
                        "ratio mean", "ratio min-max"], rows))
  result = dict(args=vars(args), held_out_loss=finals,
                seconds=round(time.perf_counter() - start, 1))
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
