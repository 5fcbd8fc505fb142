"""The README's quick start, measured: train configs/tiny.py, compare with unigram baselines.

    python benchmarks/quickstart.py                  # ~2.5-4 minutes on 2 CPU cores
    python benchmarks/quickstart.py --replot         # redraw the PNG from the saved JSON

Runs `python train.py --config configs/tiny.py --workdir <tmp>` as a subprocess (the
default config, nothing overridden), reads `<tmp>/metrics.jsonl`, and sets the held-out
loss next to two byte-unigram baselines of the same held-out split
(`zerojax.data.load_tokens`):

- **unigram cross-entropy**: the held-out bytes scored by the train split's byte
  frequencies (add-one smoothed over the 256-byte vocabulary), in nats: the loss of the
  best model that ignores context, fitted on the training data;
- **held-out entropy**: the held-out split's own byte entropy, the floor of any unigram
  model, even one fitted on the held-out data.

Prints a markdown table, writes benchmarks/results/quickstart.json and the curve
benchmarks/results/quickstart.png (train and eval loss vs step, the baselines as lines).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

from zerojax.testing import markdown_table  # pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CONFIG = os.path.join("configs", "tiny.py")
OUT_JSON = os.path.join(RESULTS, "quickstart.json")
OUT_PNG = os.path.join(RESULTS, "quickstart.png")


def train(workdir: str) -> float:
  """Runs the quick-start command in `workdir`; returns its wall time in seconds."""
  cmd = [sys.executable, "train.py", "--config", CONFIG, "--workdir", workdir]
  print("$", " ".join(cmd[1:]), flush=True)
  start = time.perf_counter()
  subprocess.run(cmd, cwd=ROOT, check=True)
  return time.perf_counter() - start


def read_metrics(workdir: str) -> dict:
  """Train-loss points, eval-loss points and the final summary of metrics.jsonl."""
  train_pts, eval_pts, final, header = [], [], {}, {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if "final_eval_loss" in r:
        final = r
      elif "eval_loss" in r:
        eval_pts.append((r["step"], r["eval_loss"]))
      elif "loss" in r:
        train_pts.append((r["step"], r["loss"], r.get("tokens_per_s")))
      elif "params" in r:
        header = r
  return dict(train=train_pts, eval=eval_pts, final=final, params=header.get("params"),
              devices=header.get("devices"))


def unigram_baselines(workdir: str) -> dict:
  """Byte-unigram cross-entropy (train model) and entropy of the held-out split, nats."""
  sys.path.insert(0, ROOT)
  from zerojax import data
  from zerojax.config import load_config
  c = load_config(os.path.join(ROOT, CONFIG), [], num_devices=1)
  train_tokens, eval_tokens = data.load_tokens(c.data, c.model.vocab_size, c.train.seq_len,
                                               cache_dir=workdir)
  v = c.model.vocab_size
  q = np.bincount(np.asarray(train_tokens), minlength=v) + 1.0  # Add-one: no log(0).
  q /= q.sum()
  p = np.bincount(np.asarray(eval_tokens), minlength=v) / len(eval_tokens)
  seen = p > 0
  return dict(unigram_cross_entropy=float(-(p[seen] * np.log(q[seen])).sum()),
              eval_entropy=float(-(p[seen] * np.log(p[seen])).sum()),
              uniform=float(np.log(v)), train_tokens=len(train_tokens),
              eval_tokens=len(eval_tokens))


def plot(r: dict) -> None:
  fig, ax = plt.subplots(figsize=(8, 5))
  steps, losses = zip(*[(s, l) for s, l, _ in r["train"]])
  ax.plot(steps, losses, "o-", color="tab:blue", ms=3, lw=1.5, label="train loss (batch)")
  e_steps, e_losses = zip(*r["eval"])
  ax.plot(e_steps, e_losses, "s--", color="tab:orange", ms=7, lw=1, label="held-out loss")
  lines = [("uniform", "uniform over 256 bytes (ln 256)", "grey", ":"),
           ("unigram_cross_entropy", "unigram, train-split byte frequencies", "tab:red", "--"),
           ("eval_entropy", "unigram floor: held-out byte entropy", "tab:purple", "-.")]
  last = max(steps)
  for key, label, color, style in lines:
    ax.axhline(r[key], color=color, ls=style, lw=1.2, label=f"{label}: {r[key]:.3f}")
  ax.annotate(f"{r['final_eval_loss']:.3f} = {r['ratio']:.2f} x unigram",
              (e_steps[-1], e_losses[-1]), textcoords="offset points", xytext=(0, -18),
              ha="right", color="tab:orange")
  ax.set(xlabel="step", ylabel="loss (nats per byte)", xlim=(-10, last + 10),
         ylim=(0, max(r["uniform"], max(losses)) + 0.6),
         title=f"Quick start (configs/tiny.py): {last} steps in {r['wall_s']:.0f} s wall "
               f"on {r['cpu_cores']} CPU cores")
  ax.grid(alpha=0.3)
  ax.legend(loc="upper right", bbox_to_anchor=(1, 0.87), fontsize=9, framealpha=0.95)
  fig.tight_layout()
  fig.savefig(OUT_PNG, dpi=110)
  plt.close(fig)


def table(r: dict) -> str:
  ratio = r["final_eval_loss"] / r["unigram_cross_entropy"]
  rows = [("wall time (train.py, compile included)", f"{r['wall_s']:.1f} s"),
          ("steps x tokens per step", f"{max(s for s, _, _ in r['train'])} x 2048"),
          ("final train loss (last batch)", f"{r['final_train_loss']:.4f}"),
          ("final held-out loss", f"{r['final_eval_loss']:.4f}"),
          ("unigram cross-entropy (train frequencies)", f"{r['unigram_cross_entropy']:.4f}"),
          ("held-out byte entropy (unigram floor)", f"{r['eval_entropy']:.4f}"),
          ("held-out loss / unigram cross-entropy", f"{ratio:.3f}")]
  return markdown_table(["quantity", "value"], rows)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replot", action="store_true", help="redraw from the saved JSON")
  args = parser.parse_args()
  os.makedirs(RESULTS, exist_ok=True)
  if args.replot:
    with open(OUT_JSON) as f:
      r = json.load(f)
  else:
    with tempfile.TemporaryDirectory() as workdir:
      wall = train(workdir)
      r = read_metrics(workdir)
      r.update(unigram_baselines(workdir))
    r.update(wall_s=wall, cpu_cores=os.cpu_count(), final_train_loss=r["final"]["final_train_loss"],
             final_eval_loss=r["final"]["final_eval_loss"],
             ratio=r["final"]["final_eval_loss"] / r["unigram_cross_entropy"])
    with open(OUT_JSON, "w") as f:
      json.dump(r, f, indent=1)
  plot(r)
  print(table(r))
  print(f"\nwrote {os.path.relpath(OUT_JSON, ROOT)} and {os.path.relpath(OUT_PNG, ROOT)}")


if __name__ == "__main__":
  main()
