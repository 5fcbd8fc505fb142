"""What a run reports: throughput, MFU, a progress line or bar, JSONL records.

Only process 0 prints and writes; every other process stays quiet, so a multi-host
run reads like a single-host one.
"""

import json
import os
import sys
import time

import jax

# Dense bf16 peak FLOP/s per device, for the MFU estimate (vendor datasheets). A device
# not listed reports no MFU unless `train.peak_flops` is set.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12,
    "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v4": 275e12,
}


def peak_flops(device: jax.Device, override: float = 0.0) -> float:
  """Peak bf16 FLOP/s of `device` (0.0 if unknown); `override` wins when > 0."""
  if override > 0:
    return override
  kind = getattr(device, "device_kind", "")
  return next((v for k, v in PEAK_FLOPS.items() if k in kind), 0.0)


class Reporter:
  """Prints lines and appends JSON records to `<workdir>/metrics.jsonl` (process 0).

  On a terminal, `start_bar` adds a rich progress bar (loss, tokens/s, MFU, ETA) below
  the printed lines; in a log file there is no bar, the lines say the same.
  """

  def __init__(self, workdir: str = ""):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl") if workdir else ""
    self.bar, self.task = None, None
    if self.enabled and workdir:
      os.makedirs(workdir, exist_ok=True)

  def start_bar(self, total: int) -> None:
    if not (self.enabled and sys.stdout.isatty()):
      return
    from rich import progress  # pylint: disable=g-import-not-at-top
    self.bar = progress.Progress(
        progress.TextColumn("{task.description}"), progress.BarColumn(),
        progress.MofNCompleteColumn(), progress.TimeRemainingColumn(), transient=True)
    self.task = self.bar.add_task("training", total=total)
    self.bar.start()

  def advance(self, step: int, description: str | None = None) -> None:
    if self.bar is not None:
      self.bar.update(self.task, completed=step,
                      **({"description": description} if description else {}))

  def stop_bar(self) -> None:
    if self.bar is not None:
      self.bar.stop()
      self.bar = None

  def __call__(self, text: str | None = None, **record) -> None:
    if not self.enabled:
      return
    if text is not None and self.bar is not None:
      self.bar.console.print(text, highlight=False, markup=False)  # Above the bar.
    elif text is not None:
      print(text, flush=True)
    if self.path and record:
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")


class Throughput:
  """Tokens/s, MFU and ETA between two reports; the clock starts at the first step."""

  def __init__(self, total_steps: int, tokens_per_step: int, flops_per_token: float,
               peak_flops_total: float):
    self.total, self.tokens_per_step = total_steps, tokens_per_step
    self.flops_per_token, self.peak = flops_per_token, peak_flops_total
    self.start = self.tick = time.perf_counter()
    self.steps_since = 0
    self.first_step = None

  def step(self, step: int) -> None:
    if self.first_step is None:
      self.first_step = step
    self.steps_since += 1

  def report(self, step: int) -> dict[str, float]:
    """Rates since the last report (call after the step's metrics are on the host)."""
    now = time.perf_counter()
    rate = self.steps_since * self.tokens_per_step / max(now - self.tick, 1e-9)
    self.tick, self.steps_since = now, 0
    done = step - (self.first_step or step) + 1
    eta = (now - self.start) / max(done, 1) * (self.total - step)
    out = {"tokens_per_s": rate, "eta_s": eta}
    if self.peak and self.flops_per_token:
      out["mfu"] = rate * self.flops_per_token / self.peak
    return out


def progress_line(step: int, total: int, metrics: dict[str, float],
                  rates: dict[str, float]) -> str:
  """One line: step, loss, grad norm, lr, tokens/s, MFU (if known), ETA."""
  eta = rates["eta_s"]
  parts = [f"step {step:6d}/{total}", f"loss {metrics['loss']:.4f}",
           f"grad_norm {metrics['grad_norm']:.3f}"]
  if "learning_rate" in metrics:
    parts.append(f"lr {metrics['learning_rate']:.2e}")
  parts.append(f"tokens/s {rates['tokens_per_s']:,.0f}")
  if "mfu" in rates:
    parts.append(f"mfu {100 * rates['mfu']:.1f}%")
  parts.append(f"eta {int(eta // 60)}m{int(eta % 60):02d}s")
  return "  ".join(parts)

