"""What the metrics writers cost: opening each, and each logged step (every scalar).

    python benchmarks/metrics_writers.py     # a few seconds; needs the wandb extra for W&B

TensorBoard (tensorboardX, flushed at every logged step so a killed run keeps its
points) and W&B in offline mode, each alone, through `metrics.Reporter` as train.py
uses it, the JSONL turned off; 200 logged steps of every scalar in `metrics.SCALARS`.
"""

import importlib.util
import tempfile
import time

from zerojax.config import base_config
from zerojax.run import metrics


def measure(tensorboard: bool, wandb: bool, steps: int = 200) -> dict[str, float]:
  """Seconds to open and close, and per logged step."""
  c = base_config()
  c.logging.tensorboard = tensorboard
  if wandb:
    c.logging.wandb.project, c.logging.wandb.mode = "zerojax-bench", "offline"
  report = metrics.Reporter(tempfile.mkdtemp())
  report.path = ""  # The writers alone.
  record = {k: 1.0 for k in metrics.SCALARS}
  start = time.perf_counter()
  report.open_writers(c, 0)
  opened = time.perf_counter()
  for step in range(1, steps + 1):
    report(step=step, **record)
  logged = time.perf_counter()
  report.close()
  return {"open_s": opened - start, "per_step_ms": (logged - opened) / steps * 1e3,
          "close_s": time.perf_counter() - logged}


def main() -> None:
  rows = [("tensorboard", measure(True, False))]
  if importlib.util.find_spec("wandb"):
    rows.append(("wandb (offline)", measure(False, True)))
  print(f"| writer | open s | ms per logged step ({len(metrics.SCALARS)} scalars) | close s |")
  print("| --- | --- | --- | --- |")
  for name, r in rows:
    print(f"| {name} | {r['open_s']:.3f} | {r['per_step_ms']:.2f} | {r['close_s']:.3f} |")


if __name__ == "__main__":
  main()
