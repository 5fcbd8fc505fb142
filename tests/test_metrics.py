"""The progress bar at a terminal's width: its numbers stay whole, the bar gives way first."""

import io
import json

import pytest
from rich.console import Console

from zerojax.run import metrics

# A long run's numbers at their widest: a million steps, days left, millions of tokens/s.
VALUES = {"loss": 11.7654, "grad_norm": 123.456, "learning_rate": 1.23e-05,
          "tokens_per_s": 1234567.0, "mfu": 0.412, "eta_s": 3 * 86400 + 4 * 3600 + 5 * 60}
NUMBERS = {"loss": "loss 11.7654", "grad_norm": "grad_norm 123.456",
           "learning_rate": "lr 1.23e-05", "tokens_per_s": "tokens/s 1,234,567",
           "mfu": "mfu 41.2%", "eta_s": "eta 3d04h"}


def render_bar(width: int, step: int, total: int, values: dict[str, float]) -> str:
  """The Reporter's live bar, as rich draws it on a terminal `width` columns wide."""
  report = metrics.Reporter()
  report.start_bar(total, console=Console(file=io.StringIO(), width=width, force_terminal=True))
  try:
    report.advance(step, values)
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(
        report.bar.make_tasks_table(report.bar.tasks))
  finally:
    report.stop_bar()
  return out.getvalue()


@pytest.mark.parametrize("width, shown, bar", [
    (200, list(NUMBERS), True),  # Everything, and a bar.
    (80, ["loss", "tokens_per_s", "mfu", "eta_s"], False),  # The bar went, then lr, grad_norm.
    # tokens/s does not fit even without the bar, so the room left is the bar's.
    (60, ["loss", "eta_s"], True),
    (40, ["loss", "eta_s"], False),  # Even the "step" label goes before a number is cut.
])
def test_bar_keeps_its_numbers_whole_at_any_width(width, shown, bar):
  text = render_bar(width, 123456, 1_000_000, VALUES)
  lines = text.rstrip("\n").split("\n")
  assert len(lines) == 1 and len(lines[0]) <= width, text
  line = lines[0]
  assert "123456/1000000" in line and "…" not in line, line
  for key, number in NUMBERS.items():
    assert (number in line) == (key in shown), (key, line)
  assert ("━" in line) == bar, line


@pytest.mark.parametrize("width, bar", [(120, True), (80, False)])
def test_bar_of_a_short_run(width, bar):
  """Small numbers: at 120 columns all of them and a bar; at 80 all but lr, no bar."""
  assert "step 0/600" in render_bar(width, 0, 600, {})  # Before the first report.
  line = render_bar(width, 300, 600, {"loss": 5.5, "grad_norm": 1.0, "learning_rate": 3e-3,
                                     "tokens_per_s": 2048.0, "eta_s": 754.0}).rstrip("\n")
  assert len(line) <= width and ("━" in line) == bar, line
  for number in ("step 300/600", "loss 5.5000", "grad_norm 1.000", "tokens/s 2,048",
                 "eta 12m34s"):
    assert number in line, line
  assert ("lr 3.00e-03" in line) == bar, line


def test_durations_stay_short():
  assert [metrics.fmt_duration(s) for s in (0, 754, 3600 * 20 + 34 * 60 + 5, 86400 * 12 + 3600)] \
      == ["0m00s", "12m34s", "20h34m", "12d01h"]
  # The log line carries every number, whatever the width.
  line = metrics.progress_line(123456, 1_000_000, VALUES, {"tokens_per_s": 1234567.0})
  assert all(number in line for number in NUMBERS.values()), line


@pytest.mark.parametrize("width", [80, 60])
def test_lines_above_the_bar_wrap_between_numbers(width):
  """A log line wider than the terminal breaks between fields: each 'name number' whole."""
  line = metrics.progress_line(123456, 1_000_000, VALUES, {})
  assert len(line) > width
  wrapped = metrics.wrap_fields(line, width).split("\n")
  assert len(wrapped) > 1 and all(len(w) <= width for w in wrapped), wrapped
  for number in ["step 123456/1000000", *NUMBERS.values()]:
    assert sum(number in w for w in wrapped) == 1, (number, wrapped)
  line = "step      3  eval_loss 2.5000"
  assert metrics.wrap_fields(line, width) == line


def test_a_record_cut_by_a_kill_is_dropped_and_the_next_run_appends_whole_lines(tmp_path):
  """A run SIGKILLed while writing its header leaves half a record without its newline
  (seen in test_faults' kill -9 loop: the next run's record then continued that line)."""
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.5}\n{"devices": 8, "mes')
  report = metrics.Reporter(str(tmp_path))
  report(step=2, loss=2.25)
  assert [json.loads(line) for line in path.read_text().splitlines()] == [
      {"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
  metrics.Reporter(str(tmp_path))  # Whole lines: nothing to cut.
  assert path.read_text().count("\n") == 2

