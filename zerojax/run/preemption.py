"""Preemption: SIGTERM / SIGINT as a request to save and stop between steps.

A job scheduler's preemption notice (SIGTERM), or Ctrl-C, must not kill a step halfway:
the trainer asks `StopSignal` after every step and, once it says stop, saves and exits
with `exits.STOPPED`.
"""

from __future__ import annotations

import signal

import jax
from jax.experimental import multihost_utils


class StopSignal:
  """SIGTERM / SIGINT (preemption) as a request to save and stop between steps.

  `stop(step)`, called every step, is True once a signal has arrived (a second one
  stops at once, the default way). With several processes jax's coordination service
  owns SIGTERM: True once all reach its preemption sync point, so that they all stop
  (and save: a collective) at the same step.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.received: signal.Signals | None = None
    self._previous = {}
    if jax.process_count() == 1:
      self._previous = {s: signal.signal(s, self._handle) for s in signals}

  def _handle(self, signum, frame) -> None:
    del frame
    if self.received is not None:
      self.close()
      signal.raise_signal(signum)
    self.received = signal.Signals(signum)

  def __call__(self, step: int) -> bool:
    if self.received is not None:
      return True
    if jax.process_count() > 1:
      try:
        return multihost_utils.reached_preemption_sync_point(step)
      except RuntimeError:  # The preemption service is off.
        return False
    return False

  def close(self) -> None:
    """Puts the previous signal handlers back."""
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}
