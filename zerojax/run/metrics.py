"""What a run reports: throughput, MFU, a progress line or bar, JSONL records, and the
same scalars to TensorBoard (`<workdir>/tb`, tensorboardX) and Weights & Biases.

Only process 0 prints and writes; every other process stays quiet, so a multi-host
run reads like a single-host one.
"""

import json
import netrc
import os
import re
import secrets
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections
from rich import console as rich_console, progress, progress_bar, table

# Dense bf16 peak FLOP/s per device, for the MFU estimate (vendor datasheets). A device
# not listed reports no MFU unless `train.peak_flops` is set.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12,
    "RTX 4090": 165.2e12,  # bf16 with fp32 accumulation (Ada whitepaper; 330 with fp16's).
    "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v4": 275e12,
}


def peak_flops(device: jax.Device, override: float = 0.0) -> float:
  """Peak bf16 FLOP/s of `device` (0.0 if unknown); `override` wins when > 0."""
  if override > 0:
    return override
  kind = getattr(device, "device_kind", "")
  return next((v for k, v in PEAK_FLOPS.items() if k in kind), 0.0)


# Record keys (metrics.jsonl) -> the writers' tags; other keys stay in the JSONL only.
SCALARS = {
    "loss": "train/loss", "grad_norm": "train/grad_norm", "learning_rate": "train/learning_rate",
    "update_norm": "train/update_norm",
    "eval_loss": "eval/loss", "exact_match": "eval/exact_match",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    "loss_scale": "precision/loss_scale", "skipped": "precision/skipped",
    "consecutive_skips": "precision/consecutive_skips",
    "compiled_memory": "memory/compiled_bytes_per_device",
    "peak_bytes_in_use": "memory/peak_bytes_in_use", "bytes_in_use": "memory/bytes_in_use",
}


class Writer(NamedTuple):
  """A metrics sink: `scalars(step, {tag: value})`, `close(failed)` (the run ended by
  an error: W&B marks it failed)."""
  scalars: Callable[[int, dict[str, float]], Any]
  close: Callable[[bool], Any]


def device_memory() -> dict[str, int]:
  """This process's first device's bytes in use and peak (GPU, TPU); {} where unknown (CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}


def config_text(config: ml_collections.ConfigDict) -> str:
  """The config as Markdown (an indented block, shown as written by TensorBoard's text tab)."""
  return "\n".join("    " + line for line in config.to_json_best_effort(indent=2).splitlines())


def _summary_writer() -> type:
  """tensorboardX's SummaryWriter, imported without torch.

  tensorboardX imports torch when it is installed (to accept its tensors; we log floats):
  1-2 s and hundreds of MB at every run's start where torch is there (the hf-check
  extra, most ML environments). Hidden for the import unless something loaded it already.
  """
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError, which it handles.
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415  optional: only a run that logs to TensorBoard
  finally:
    if hide:
      del sys.modules["torch"]
  return SummaryWriter


def tensorboard(logdir: str, config: ml_collections.ConfigDict, start: int) -> Writer:
  """Event files in `logdir`; a resumed run (start > 0) writes a new file from start + 1.

  `purge_step` marks the new file so TensorBoard drops what older files hold at steps
  after `start` (logged by a run killed after its last checkpoint): no step twice.
  """
  SummaryWriter = _summary_writer()
  # The file is named by the second it was opened in; the start step keeps two runs
  # opened in one second apart (else the second would overwrite the first's file).
  writer = SummaryWriter(logdir, purge_step=start + 1 if start else None,
                         filename_suffix=f".from{start}")
  writer.add_text("config", config_text(config), start)

  def scalars(step: int, values: dict[str, float]) -> None:
    for tag, value in values.items():
      writer.add_scalar(tag, value, step)
    writer.flush()  # Readable while the run goes on, and after a kill.

  return Writer(scalars, lambda failed: writer.close())


def _wandb_reachable() -> bool:
  """Whether the W&B server answers and an API key is set: online can work."""
  url = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
  host = url.hostname or "api.wandb.ai"
  try:
    key = os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators(host)
  except (OSError, netrc.NetrcParseError):
    key = None
  if not key:
    return False
  try:
    socket.create_connection((host, url.port or 443), timeout=3).close()
    return True
  except OSError:
    return False


def wandb_run(workdir: str, config: ml_collections.ConfigDict, log: Callable[[str], Any]
              ) -> Writer:
  """A W&B run; its id is kept in `<workdir>/wandb_run_id`, so a resumed run appends to it.

  Mode auto: $WANDB_MODE if set, else online when the server answers and a key is set,
  else offline (files under `<workdir>/wandb`; `wandb sync` uploads them later).
  """
  import wandb  # noqa: PLC0415  optional: the wandb extra
  w = config.logging.wandb
  mode = w.mode
  if mode == "auto":
    mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_reachable() else "offline")
  run_id, id_file = None, os.path.join(workdir, "wandb_run_id") if workdir else ""
  if id_file and os.path.exists(id_file):
    with open(id_file) as f:
      run_id = f.read().strip()
  run_id = run_id or secrets.token_hex(6)  # W&B's id alphabet: [a-z0-9].
  if id_file:
    with open(id_file, "w") as f:
      f.write(run_id + "\n")
  run = wandb.init(project=w.project, entity=w.entity or None, name=w.name or None, id=run_id,
                   resume="allow", dir=workdir or None, config=config.to_dict(), mode=mode,
                   settings=wandb.Settings(quiet=True))  # Our own line says where it went.
  log(f"wandb: run {run_id} ({mode})" + (
      f"; upload later with: wandb sync {run.dir.removesuffix('/files')}"
      if mode == "offline" else ""))
  return Writer(lambda step, values: run.log(values, step=step),
                lambda failed: run.finish(exit_code=1 if failed else 0))


def drop_partial_record(path: str) -> None:
  """Cuts a last line without its newline from the JSONL file `path`: the record of a
  run killed while writing it (never complete), which the next run's first record would
  otherwise extend into a line that does not parse. Complete records are untouched."""
  try:
    with open(path, "rb+") as f:
      data = f.read()
      if data and not data.endswith(b"\n"):
        f.truncate(data.rfind(b"\n") + 1)
  except FileNotFoundError:
    return


class Reporter:
  """Prints lines and appends JSON records to `<workdir>/metrics.jsonl` (process 0).

  On a terminal, `start_bar` adds a rich progress bar (loss, tokens/s, MFU, ETA) below
  the printed lines, laid out to the terminal's width by `bar_layout`; in a log file
  there is no bar, the lines say the same.
  """

  def __init__(self, workdir: str = ""):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl") if workdir else ""
    self.workdir = workdir
    self.bar, self.task = None, None
    self.writers: list[Writer] = []
    if self.enabled and workdir:
      os.makedirs(workdir, exist_ok=True)
      drop_partial_record(self.path)

  def open_writers(self, config: ml_collections.ConfigDict, start: int) -> None:
    """TensorBoard (with a workdir) and W&B (with a project) from step `start` on."""
    if not self.enabled:
      return
    if self.workdir and config.logging.tensorboard:
      self.writers.append(tensorboard(os.path.join(self.workdir, "tb"), config, start))
    if config.logging.wandb.project:
      self.writers.append(wandb_run(self.workdir, config, self))

  def close(self, failed: bool = False) -> None:
    """Closes the writers; `failed`: the run ended by an error. Then a writer that cannot
    flush (the disk that failed the checkpoint is full) is a note on stdout, not a
    traceback over the run's own error line and exit status."""
    for writer in self.writers:
      try:
        writer.close(failed)
      except OSError as e:
        if not failed:
          raise
        print(f"note: a metrics writer could not finish: {e}", flush=True)
    self.writers = []

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
      # One write call a record (the header is over 8 KiB, which a buffered file writes
      # in pieces): a SIGKILL then leaves at most the record's own tail unwritten.
      fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
      try:
        os.write(fd, (json.dumps(record) + "\n").encode())
      finally:
        os.close(fd)
    values = {scalar_name(k): float(v) for k, v in record.items() if scalar_name(k)}
    if "step" in record and values:
      for writer in self.writers:
        writer.scalars(record["step"], values)


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


def scalar_name(key: str) -> str | None:
  """A metric's name in TensorBoard and W&B: `SCALARS`'s, 'moe/...' for the routers'
  (`models.llama.router_metrics`), None for what is only in metrics.jsonl."""
  if key in SCALARS:
    return SCALARS[key]
  if key.startswith(("router_", "expert_load/")):
    return "moe/" + key.removeprefix("router_")
  return None


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
