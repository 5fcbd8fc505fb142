"""The fine-tuning quick start, measured: configs/sft_tiny.py's completion loss and
exact-match accuracy on held-out prompts, step by step.

    python benchmarks/sft_quickstart.py                   # 4.4-10 minutes on 2 shared CPU cores
    python benchmarks/sft_quickstart.py --workdir runs/x  # read a finished run of the config
    python benchmarks/sft_quickstart.py --replot          # redraw the PNG from the saved JSON

Runs `python train.py --config configs/sft_tiny.py --workdir <tmp>` (nothing overridden)
and reads its metrics.jsonl: the train loss (completion tokens of the batch), the held-out
completion loss and the share of the 200 held-out prompts (none of them in the training
file) whose greedy answer is exactly right, EOS included. Writes
benchmarks/results/sft_quickstart.json and .png, prints a markdown table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

from zerojax.testing import markdown_table  # pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
OUT_JSON = os.path.join(RESULTS, "sft_quickstart.json")
OUT_PNG = os.path.join(RESULTS, "sft_quickstart.png")


def curves(workdir: str) -> dict:
  """{'train': [(step, loss)], 'eval': [(step, eval_loss, exact_match)]} of a run."""
  out = {"train": [], "eval": []}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  for r in records:
    if "exact_match" in r:
      out["eval"].append((r["step"], r["eval_loss"], r["exact_match"]))
    elif "loss" in r and "step" in r:
      out["train"].append((r["step"], r["loss"]))
  return out


def plot(r: dict) -> None:
  fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
  loss_ax.plot(*zip(*r["train"]), "o-", ms=3, lw=1.2, label="train (batch completions)")
  steps, losses, accuracy = zip(*r["eval"])
  loss_ax.plot(steps, losses, "s--", ms=6, label="held-out completions")
  loss_ax.set(xlabel="step", ylabel="loss (nats per completion token)", yscale="log")
  loss_ax.legend()
  acc_ax.plot(steps, [100 * a for a in accuracy], "s-", color="tab:green", ms=6)
  for s, a in zip(steps, accuracy):
    acc_ax.annotate(f"{100 * a:.0f}%", (s, 100 * a), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=8)
  acc_ax.set(xlabel="step", ylabel="exact match, 200 held-out prompts (%)", ylim=(0, 105))
  for ax in (loss_ax, acc_ax):
    ax.grid(alpha=0.3)
  fig.suptitle(f"configs/sft_tiny.py: {steps[-1]} steps, {r['wall_s']:.0f} s wall "
               f"(train.py, compile included) on {r['cpu_cores']} CPU cores")
  fig.tight_layout()
  fig.savefig(OUT_PNG, dpi=110)
  plt.close(fig)


def measure(workdir: str, wall_s: float) -> dict:
  """The curves of a run of the config in `workdir`, or of a new run when it is ""."""
  with tempfile.TemporaryDirectory() as tmp:
    if not workdir:
      workdir = tmp
      cmd = [sys.executable, "train.py", "--config", "configs/sft_tiny.py", "--workdir", tmp]
      start = time.perf_counter()
      subprocess.run(cmd, cwd=ROOT, check=True)
      wall_s = time.perf_counter() - start
    return dict(curves(workdir), wall_s=wall_s, cpu_cores=os.cpu_count())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replot", action="store_true", help="redraw from the saved JSON")
  parser.add_argument("--workdir", default="", help="read this finished run instead")
  parser.add_argument("--wall_s", type=float, default=0.0, help="its wall time, with --workdir")
  args = parser.parse_args()
  os.makedirs(RESULTS, exist_ok=True)
  r = json.load(open(OUT_JSON)) if args.replot else measure(args.workdir, args.wall_s)
  with open(OUT_JSON, "w") as f:
    json.dump(r, f, indent=1)
  plot(r)
  rows = [(s, f"{l:.4f}", f"{100 * a:.1f}%") for s, l, a in r["eval"]]
  print(markdown_table(["step", "held-out completion loss", "exact match"], rows))
  print(f"\nwrote {os.path.relpath(OUT_JSON, ROOT)} and {os.path.relpath(OUT_PNG, ROOT)}")


if __name__ == "__main__":
  main()
