"""One run per workdir: `<workdir>/lock`, held with `flock` and naming its owner.

Two runs in one workdir would each rotate the other's checkpoints away (and a second
`Checkpointer` removes the first one's save in flight as a leftover), so a second run
refuses to start. The lock is an `fcntl.flock` on the file, which the OS releases when
its process ends in any way (kill -9 included): a lock file that nobody holds is stale,
and the next run takes it over with a note. The file says who holds it (host, pid,
start time, command), for the message. In a multi-host run only process 0 takes it
(the workdir is shared), and every process stops if it cannot.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class WorkdirInUse(Exception):
  """Another run holds the workdir's lock."""


def _owner(f: Any) -> dict:
  f.seek(0)
  try:
    owner = json.loads(f.read() or "{}")
  except ValueError:  # Written by something else, or cut short.
    return {}
  return owner if isinstance(owner, dict) else {}


def _describe(owner: dict) -> str:
  return (f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')} since "
          f"{owner.get('since', '?')} ({owner.get('command', 'another run')})")


def _acquire(path: str, log: Callable[[str], Any]) -> Any:
  """Opens and flocks `path` (created if missing); returns the open file."""
  while True:
    f = open(path, "a+")  # pylint: disable=consider-using-with  (held until release)
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      owner = _owner(f)
      f.close()
      raise WorkdirInUse(
          f"workdir {os.path.dirname(path)} is in use by {_describe(owner)}; wait for it "
          f"or use another --workdir") from None
    try:  # Its previous owner may have removed it between our open and flock.
      if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
        break
    except FileNotFoundError:
      pass
    f.close()
  if previous := _owner(f):
    log(f"note: took over {path} from {_describe(previous)}: that run has ended")
  f.truncate(0)
  f.write(json.dumps({
      "host": socket.gethostname(), "pid": os.getpid(),
      "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "command": "a run of " + os.path.basename(sys.argv[0] or "python")}))
  f.flush()
  return f


@contextlib.contextmanager
def lock(workdir: str, log: Callable[[str], Any] = print) -> Iterator[None]:
  """Holds `<workdir>/lock` (created, with the workdir, if missing) inside the block.

  Raises:
    WorkdirInUse: another live run holds it (on every process of a multi-host run).
  """
  path, held, error = os.path.join(os.path.abspath(workdir), "lock"), None, None
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
      held = _acquire(path, log)
    except WorkdirInUse as e:
      error = e
  if jax.process_count() > 1:  # All stop, or none.
    if not multihost_utils.process_allgather(np.array(error is None)).all() and not error:
      error = WorkdirInUse(f"workdir {workdir} is in use by another run (process 0 says which)")
  if error:
    raise error
  try:
    yield
  finally:
    if held is not None:  # Removed while held: the next run finds no stale owner.
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
      held.close()
