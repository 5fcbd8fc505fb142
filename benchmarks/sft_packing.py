"""Useful tokens per second of packed vs padded chat fine-tuning rows, under gradient release.

    python benchmarks/sft_packing.py              # ~3 minutes on 2 CPU cores
    python benchmarks/sft_packing.py --seq_len 256     # ~1 minute

One chat JSONL (`zerojax.data.sft_demo.chats`: a system line, a user task, the assistant's
answer; ~60 tokens each through the built-in Llama 3 template and the demo's byte
tokenizer), trained by configs/sft_tiny.py's model at ZeRO stage 3 with gradient release
(`optimizer.release`, per-layer clipping) on 8 fake CPU devices, once with examples
packed several per row (`data.pack=True`) and once one per row, padded (`data.pack=False`).
Both steps are built as train.py builds them and run interleaved in one process
(`sft_throughput.interleaved`). Useful tokens are the rows' example tokens (not
padding); the padding share of each is counted from the same batches. The ratio of
useful tokens per second, packed / padded, is taken per round; the median is reported.
Writes benchmarks/results/sft_packing.json.
"""

import argparse
import json
import os
import statistics
import tempfile

from zerojax.runtime.devices import fake_cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "sft_packing.json")
SYSTEM = "You are a careful assistant. Answer with the result only."


def write_chats(folder: str, n: int) -> dict[str, str]:
  """chats.jsonl (`n` conversations) and the byte tokenizer in `folder`."""
  from zerojax.data import sft_demo
  paths = {"path": os.path.join(folder, "chats.jsonl"),
           "tokenizer": os.path.join(folder, "tokenizer.json")}
  with open(paths["path"], "w", encoding="utf-8") as f:
    f.writelines(json.dumps(c) + "\n" for c in sft_demo.chats(n, seed=0, system=SYSTEM))
  sft_demo.byte_tokenizer().save(paths["tokenizer"])
  return paths


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
  parser.add_argument("--seq_len", type=int, default=1024)
  args = parser.parse_args()
  fake_cpu_devices(8)
  # pylint: disable=import-outside-toplevel  (JAX starts after the device flags)
  import numpy as np
  from sft_throughput import interleaved, setup

  with tempfile.TemporaryDirectory() as folder:
    paths = write_chats(folder, 4000)
    common = ("zero.stage=3", "optimizer.release=True", "optimizer.release_clipping=per_layer",
              f"data.path={paths['path']}", "data.eval_path=", f"train.seq_len={args.seq_len}",
              f"data.tokenizer={paths['tokenizer']}")
    runs = {pack: setup("sft_tiny", (*common, f"data.pack={pack}"), num_devices=8)
            for pack in (True, False)}
  times = interleaved(runs, args.rounds, args.steps)
  # Example tokens (segment id > 0) per batch, and the rows' positions.
  useful = {p: np.mean([(b["segment_ids"] > 0).sum() for b in run[3]]) for p, run in runs.items()}
  trained = {p: np.mean([(b["loss_mask"] > 0).sum() for b in run[3]]) for p, run in runs.items()}
  slots = {p: run[3][0]["segment_ids"].size for p, run in runs.items()}
  rate = {p: [useful[p] / t for t in times[p]] for p in runs}
  ratios = [a / b for a, b in zip(rate[True], rate[False], strict=True)]
  name = {True: "packed", False: "padded"}
  result = dict(
      rounds=args.rounds, steps=args.steps, seq_len=args.seq_len, rows=runs[True][3][0][
          "segment_ids"].shape[0],
      median_step_s={name[p]: statistics.median(times[p]) for p in runs},
      padding_share={name[p]: 1 - useful[p] / slots[p] for p in runs},
      useful_tokens_per_step={name[p]: float(useful[p]) for p in runs},
      trained_tokens_per_step={name[p]: float(trained[p]) for p in runs},
      useful_tokens_per_s={name[p]: statistics.median(rate[p]) for p in runs},
      ratio_per_round=ratios, median_ratio=statistics.median(ratios),
      meaning="useful (non-padding) tokens/s, packed / padded, same chats, release at stage 3")
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  with open(OUT, "w") as f:
    json.dump(result, f, indent=1)
  for p in runs:
    print(f"{name[p]}: {result['median_step_s'][name[p]] * 1e3:.0f} ms a step, padding "
          f"{result['padding_share'][name[p]]:.1%}, {result['useful_tokens_per_s'][name[p]]:.0f} "
          "useful tokens/s")
  print(f"packed / padded useful tokens/s: median {result['median_ratio']:.2f} over "
        f"{args.rounds} rounds (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
  main()
