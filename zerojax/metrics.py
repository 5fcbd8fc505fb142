"""What a run reports: throughput, MFU, a progress line or bar, JSONL records.

Only process 0 prints and writes; every other process stays quiet, so a multi-host
run reads like a single-host one.
"""

import json
import os
import re
import sys
import time

import jax
from rich import console as rich_console, progress, progress_bar, table

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
  the printed lines, laid out to the terminal's width by `bar_layout`; in a log file
  there is no bar, the lines say the same.
  """

  def __init__(self, workdir: str = ""):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl") if workdir else ""
    self.bar, self.task = None, None
    if self.enabled and workdir:
      os.makedirs(workdir, exist_ok=True)

  def start_bar(self, total: int, console: rich_console.Console | None = None) -> None:
    """Shows the bar on a terminal (or on `console`, given one) until `stop_bar`."""
    if not (self.enabled and (console or sys.stdout.isatty())):
      return
    self.bar = progress.Progress(transient=True, console=console)
    self.bar.columns = (_BarColumn(lambda: self.bar.console.width),)
    self.task = self.bar.add_task("training", total=total, values={})
    self.bar.start()

  def advance(self, step: int, values: dict[str, float] | None = None) -> None:
    """Moves the bar to `step`; `values` (metrics and rates) replace the numbers shown."""
    if self.bar is not None:
      self.bar.update(self.task, completed=step, **({"values": values} if values else {}))

  def stop_bar(self) -> None:
    if self.bar is not None:
      self.bar.stop()
      self.bar = None

  def __call__(self, text: str | None = None, **record) -> None:
    if not self.enabled:
      return
    if text is not None and self.bar is not None:
      self.bar.console.print(wrap_fields(text, self.bar.console.width), highlight=False,
                             markup=False)  # Above the bar.
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


def fmt_duration(seconds: float) -> str:
  """'12m34s' under an hour, '20h34m' under a day, then '3d04h': short at any length."""
  s = max(int(seconds), 0)
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  if s < 86400:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _fields(values: dict[str, float]) -> list[tuple[str, str]]:
  """(key, text) of each number in `values` that a progress line shows, in its order."""
  formats = [("loss", lambda v: f"loss {v:.4f}"), ("grad_norm", lambda v: f"grad_norm {v:.3f}"),
             ("learning_rate", lambda v: f"lr {v:.2e}"),
             ("tokens_per_s", lambda v: f"tokens/s {v:,.0f}"),
             ("mfu", lambda v: f"mfu {100 * v:.1f}%"),
             ("eta_s", lambda v: f"eta {fmt_duration(v)}")]
  return [(k, f(values[k])) for k, f in formats if k in values]


def progress_line(step: int, total: int, metrics: dict[str, float],
                  rates: dict[str, float]) -> str:
  """One line: step, loss, grad norm, lr, tokens/s, MFU (if known), ETA."""
  return "  ".join([f"step {step:6d}/{total}"]
                   + [text for _, text in _fields({**metrics, **rates})])


def wrap_fields(text: str, width: int) -> str:
  """A one-line `text` wrapped to `width` between its fields, never inside one.

  Fields are what a progress line joins with two spaces before a name ("loss 2.1234",
  "eta 3d04h"); a terminal or rich would wrap between a name and its number.
  """
  if "\n" in text or len(text) <= width:
    return text
  lines = [""]
  for field in re.split(r"(?<=\S)  (?=[a-z])", text):
    if lines[-1].strip() and len(lines[-1]) + 2 + len(field) > width:
      lines.append("  ")  # A continuation, indented under the first line.
    lines[-1] += ("  " if lines[-1].strip() else "") + field
  return "\n".join(lines)


# When the bar's line is wider than the terminal, the bar shrinks, then goes, then these
# numbers go in this order; the step, loss and ETA always stay.
DROP_ORDER = ("learning_rate", "grad_norm", "mfu", "tokens_per_s")
MIN_BAR, MAX_BAR = 10, 40  # Narrower than MIN_BAR, a bar says too little to be worth its room.


def bar_layout(step: int, total: int, values: dict[str, float],
               width: int) -> tuple[str, int, str]:
  """The bar's line at `width` columns: (text left of the bar, bar width (0: none), text right).

  With the bar and two-space gaps the line is at most `width` wide, unless the step, loss
  and ETA alone are wider (then they are all it holds).
  """
  left, fields = f"step {step}/{total}", _fields(values)
  right = lambda: "  ".join(text for _, text in fields)  # noqa: E731
  for key in DROP_ORDER:
    if len(left) + 2 + len(right()) <= width:
      break
    fields = [f for f in fields if f[0] != key]
  if len(left) + 2 + len(right()) > width:
    left = f"{step}/{total}"  # The last room there is to make.
  room = width - len(left) - (4 + len(right()) if fields else 2)
  return left, min(room, MAX_BAR) if room >= MIN_BAR else 0, right()


class _BarColumn(progress.ProgressColumn):
  """The whole bar as one column, laid out by `bar_layout` for the console's width."""

  def __init__(self, width):
    super().__init__()
    self.width = width  # A function: the terminal may be resized while training.

  def render(self, task: progress.Task) -> table.Table:
    left, bar, right = bar_layout(int(task.completed), int(task.total), task.fields["values"],
                                  self.width())
    cells = [left] + (["  ", progress_bar.ProgressBar(task.total, task.completed, width=bar)]
                      if bar else []) + (["  " + right] if right else [])
    grid = table.Table.grid()  # One row, no padding: the widths are bar_layout's.
    for _ in cells:
      grid.add_column(no_wrap=True)
    grid.add_row(*cells)
    return grid
