"""The hang watchdog: a process that stops making progress ends the run, saying where.

A process that is alive but stuck (in a filesystem read, on a wedged device, in a loop
that never ends, or in a collective waiting on one that is) keeps its peer-watch link and
JAX's heartbeat alive, so nothing else notices and the job burns its reservation. Here
the training loop marks its progress (`mark`: each step, evaluation, save), and a thread
checks that the last mark is younger than the timeout. When it is not, the process
prints its phase and every thread's Python stack (`faulthandler`), tells the other
processes (`peers.report_hang`), and exits with `exits.HUNG`; the others exit with the
same status, so a job runner restarts from the last checkpoint. PyTorch's NCCL watchdog
(a collective timeout, a stack dump, an abort) is the model.

The timeout is `train.step_timeout` seconds, or with 0 (the default) `FACTOR` x the
median of the first `MEASURED` step intervals, at least `MIN_TIMEOUT`; nothing is
watched before that is known. A phase marked `watched=False` (the first checkpoint
save, whose start-up can be slow) is not timed until the next mark. The step is compiled
before the loop starts, so the first step is not a compile.
"""

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence

from zerojax.run import peers
from zerojax.runtime import exits

FACTOR = 10.0
MEASURED = 5
MIN_TIMEOUT = 300.0
_STALL_ENV = "ZEROJAX_TEST_STALL"  # "process:step" or "process:path": `test_stall`.


def derived_timeout(intervals: Sequence[float], floor: float = MIN_TIMEOUT) -> float:
  """train.step_timeout=0's timeout: `FACTOR` x the median of the first `MEASURED` step
  intervals (seconds), at least `floor`: an evaluation or a save between steps takes longer
  than a step and is no hang."""
  if len(intervals) < MEASURED:
    raise ValueError(f"{len(intervals)} step intervals: the timeout needs {MEASURED}")
  return max(floor, FACTOR * statistics.median(intervals[:MEASURED]))


class Watchdog:
  """Marks of progress and the thread that checks them (one per process).

  Args:
    timeout: seconds without a mark that count as a hang; 0: derived from the first
      step intervals (`derived_timeout`).
    process_id: this process's index, for the messages.
    floor: the derived timeout's least value (a test's is shorter).
  """

  def __init__(self, timeout: float, process_id: int = 0, *, floor: float = MIN_TIMEOUT):
    self.timeout = timeout or None
    self.process_id = process_id
    self.floor = floor
    self.phase, self.since, self.watched = "start", time.monotonic(), False
    self._steps: list[float] = []
    self._lock = threading.Lock()
    self._stop = threading.Event()
    threading.Thread(target=self._check, daemon=True, name="zerojax-watchdog").start()

  def mark(self, phase: str, *, watched: bool = True, step: bool = False) -> None:
    """Progress: the process enters `phase` now. `step`: a training step (its interval
    counts toward the derived timeout)."""
    now = time.monotonic()
    with self._lock:
      if step and self.phase.startswith("step") and len(self._steps) < MEASURED:
        self._steps.append(now - self.since)
        if self.timeout is None and len(self._steps) == MEASURED:
          self.timeout = derived_timeout(self._steps, self.floor)
      self.phase, self.since, self.watched = phase, now, watched

  def close(self) -> None:
    self._stop.set()

  def _check(self) -> None:
    while not self._stop.wait(1.0):
      with self._lock:
        waited = time.monotonic() - self.since
        hung = self.watched and self.timeout is not None and waited > self.timeout
        phase, timeout = self.phase, self.timeout
      if hung:
        self._fire(phase, waited, timeout)

  def _fire(self, phase: str, waited: float, timeout: float) -> None:
    """Prints the phase and every thread's stack, tells the others, exits `HUNG`."""
    print(f"error: process {self.process_id} made no progress for {waited:.0f} s in {phase} "
          f"(train.step_timeout: {timeout:.0f} s); every thread's stack:", file=sys.stderr,
          flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    peers.report_hang(f"process {self.process_id}: {phase}")
    peers.leave(f"error: process {self.process_id} is hung ({phase}): the run stops; the "
                "last committed checkpoint resumes", exits.HUNG)


def test_stall(process_id: int, step: int) -> None:
  """For the hang tests only: blocks this thread forever at `step` when the environment
  names this process and step (`ZEROJAX_TEST_STALL=process:step`), or at the first step
  at which a file exists (`process:/path`: the test says when, not a step count)."""
  who, _, when = os.environ.get(_STALL_ENV, "").partition(":")
  if who != str(process_id):
    return
  if (int(when) == step) if when.isdigit() else os.path.exists(when):
    threading.Event().wait()
