"""What orbax and TensorStore need around them: short causes, quiet logs, whole loops.

orbax reports a failed read or write as TensorStore's message (with its whole spec as
JSON) or a chain of exceptions, logs each failed write's traceback from its own thread,
and closes its event loop with sibling writes still running. `zerojax.checkpoint` turns
the first into one line (`cause`), filters the second while a `Checkpointer` is open
(`OrbaxErrors`), and runs orbax's coroutines to their end (`let_tasks_end`); on XLA:CPU
it saves replicated arrays from one replica (`no_replica_parallel_on_cpu`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src import asyncio_utils as orbax_asyncio

# TensorStore ends its messages with annotations such as its whole spec as JSON
# (kilobytes): [tensorstore_spec='{...}'], [os_error_code='28'].
_ANNOTATIONS = re.compile(r"\s*\[[a-z_]+(\[\d+\])?='.*$", re.S)
_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
_TRUNCATED = re.compile(r'local file "([^"]+)": Requested byte range \[\d+, (\d+)\) '
                        r"is not valid for value of size (\d+)")


def chain(error: BaseException) -> list[BaseException]:
  """`error` and the exceptions it was raised from or while handling, outermost first."""
  errors = [error]
  while (e := errors[-1].__cause__ or errors[-1].__context__) and e not in errors:
    errors.append(e)
  return errors


def os_error(text: str) -> int | None:
  """The errno TensorStore's message `text` annotates, if any."""
  m = _OS_ERROR.search(text)
  return int(m[1]) if m else None


def cause(error: BaseException, where: str) -> str:
  """Why orbax or TensorStore failed, in one short line (paths relative to `where`)."""
  for e in chain(error):
    if isinstance(e, OSError) and e.strerror:
      return e.strerror + (f": {e.filename}" if e.filename else "")
  text = str(error).strip() or type(error).__name__
  if m := _TRUNCATED.search(text):
    name = os.path.relpath(m[1], where) if m[1].startswith(where + os.sep) else m[1]
    return f"file {name} is truncated ({m[3]} bytes of at least {m[2]})"
  if (code := os_error(text)) is not None:
    return os.strerror(code)
  return _ANNOTATIONS.sub("", text.splitlines()[0])


# orbax's event loops still running: one per save thread (`_run_to_the_end` counts them),
# so `Checkpointer.close` can wait until nothing of a failed save is left to report.
_loops = threading.Condition()
_loops_running = 0


def _run_to_the_end(coro: Any) -> Any:
  """orbax's `asyncio_utils._run_sync_via_new_loop`, but the loop is closed only once
  every task on it has ended, and their exceptions have been retrieved.

  When one read of a restore (or one write of a save) fails, orbax closes its loop with
  the others still in flight; each then prints "RuntimeError: Event loop is closed"
  (TensorStore's callback) or "Exception ignored in <coroutine>" long after the error
  was handled. The other writes fail too (the disk is as full for them), and a task
  whose exception nobody asked for is logged as "Task exception was never retrieved"
  when it is collected: `asyncio.gather` would ask, but its callback can still be queued
  when the loop stops. The first exception is raised; the others are the same failure.
  """
  global _loops_running
  tasks = []

  def task_factory(loop, task_coro, **kwargs):
    tasks.append(asyncio.Task(task_coro, loop=loop, **kwargs))
    return tasks[-1]

  loop = asyncio.new_event_loop()
  loop.set_task_factory(task_factory)
  with _loops:
    _loops_running += 1
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coro)
  finally:
    try:
      while pending := asyncio.all_tasks(loop):
        loop.run_until_complete(asyncio.wait(pending))
      for task in tasks:
        if not task.cancelled():
          task.exception()  # Marks it retrieved.
    finally:
      asyncio.set_event_loop(None)
      loop.close()
      with _loops:
        _loops_running -= 1
        _loops.notify_all()


def loops_ended(seconds: float) -> bool:
  """Waits up to `seconds` for orbax's event loops to end; whether they all did."""
  with _loops:
    return _loops.wait_for(lambda: _loops_running == 0, timeout=seconds)


def let_tasks_end() -> None:
  """Makes orbax run its coroutines (reads, and writes in its background threads) with
  `_run_to_the_end`, for good: a loop whose tasks all ended is all orbax expects."""
  if hasattr(orbax_asyncio, "_run_sync_via_new_loop"):  # Else another orbax: its own way.
    orbax_asyncio._run_sync_via_new_loop = _run_to_the_end  # pylint: disable=protected-access


@functools.cache  # Once a process: the registry keeps it.
def no_replica_parallel_on_cpu(backend: str) -> None:
  """On XLA:CPU, orbax saves each replicated array whole from one replica, not a slice
  from each (its `use_replica_parallel`, on by default unless JAX_PLATFORMS names a GPU).

  Every CPU device is host memory, so slicing a replicated array across its replicas
  parallelizes no transfer; it only compiles a slice program per leaf shape (32 at the
  tiny run's first save: a cold 20-step run 7.0 -> 6.0 s of CPU, a cached one 5.1 ->
  4.7). The bytes written are the same. A GPU keeps orbax's choice (its replicas' copies
  to host run over their own links). Process-wide: orbax's handler registry is global.
  """
  if backend != "cpu":
    return
  absl = logging.getLogger("absl")  # orbax warns of the override on stderr: expected here.
  level = absl.level
  absl.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
  finally:
    absl.setLevel(level)


class OrbaxErrors(logging.Filter):
  """Drops orbax's error records (it logs through absl's logger)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname
