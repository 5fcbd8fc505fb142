"""One zerojax computation in flight at a time on XLA:CPU: the guard against its deadlock.

On XLA:CPU with several devices (fake CPU devices: the tests', `--fake_devices`), JAX's
asynchronous dispatch lets a loop run ahead of the devices, and jaxlib 0.10.2 deadlocks
once a few dozen computations are queued: a collective's rendezvous waits for a device
whose part of the run is not started, its launch waiting on that device's limit of
computations in flight (32), and after 40 s the process aborts (exit 134). Two train
steps called alternately without blocking abort every time, one step alone at 120 steps;
neither when each dispatch waits for the one before (docs/design/cpu-collectives.md,
"Two executables in flight", with a plain-JAX reproduction).

`guarded(jitted)` bounds that queue: before a guarded function dispatches on XLA:CPU with
more than one device, it waits for every guarded dispatch of another guarded function
still running (no two executables' collectives in flight) and for its own but the last
(`SAME_IN_FLIGHT`: a step's dispatch still overlaps the step before it, a loop of one
step function keeps its asynchrony). The host's work between calls (the next batch,
logging) runs while the devices compute (`benchmarks/cpu_dispatch.py`: the cost). On
GPUs, and while a step is traced for a GPU target (`platform.targeting()`), it only
calls: full asynchrony. `ZEROJAX_CPU_DISPATCH_GUARD=0` in the environment turns it off.
"""

import collections
import functools
import os
import threading
from typing import Any, Callable

import jax

from zerojax.runtime import platform

ENV = "ZEROJAX_CPU_DISPATCH_GUARD"

# One guarded function's dispatches in flight at most, called back to back: 2 lets a call's
# dispatch overlap the call before it (1: each waits for the one before); both far below
# the ~32 that deadlock. Another function's call waits for all of them.
SAME_IN_FLIGHT = 2

_LOCK = threading.RLock()  # An RLock: a guarded function traced inside another's call.
# Each guarded dispatch in flight, oldest first: (its function, outputs that are ready when
# it has run).
_in_flight: collections.deque[tuple[Callable, list[jax.Array]]] = collections.deque()
_several_devices: bool | None = None  # Asked once the first guarded function runs.


def enabled() -> bool:
  """Whether guarded functions wait here: XLA:CPU with more than one device, not while
  tracing for a GPU target, and not turned off by `ZEROJAX_CPU_DISPATCH_GUARD=0`."""
  global _several_devices
  if platform.backend() != "cpu" or os.environ.get(ENV, "1") == "0":
    return False
  if _several_devices is None:
    _several_devices = jax.device_count() > 1
  return _several_devices


def _witnesses(out: Any) -> list[jax.Array]:
  """The fewest, smallest arrays of `out` that together sit on each of its devices.

  XLA:CPU makes every output of a run on a device ready at once, when that device's
  part of the run ends, so one array a device tells that the run is over. Holding only
  small ones (a metric, a counter) keeps no large output alive until the next call (a
  KV cache its caller dropped). On a tie the later output: the metrics after the state,
  which the next step donates. Sizes in elements: `nbytes` is slower to ask.
  """
  arrays = [x for x in jax.tree.leaves(out)
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
  if not arrays:
    return []
  sets = [x.sharding.device_set for x in arrays]
  devices = set().union(*sets)
  order = sorted(range(len(arrays)), key=lambda i: (arrays[i].size // len(sets[i]), -i))
  chosen, covered = [], set()
  for i in order:
    if not sets[i] <= covered:
      chosen.append(arrays[i])
      covered |= sets[i]
      if covered == devices:
        break
  return chosen


def wait_until(in_flight: int = 0, fn: Callable | None = None) -> None:
  """Blocks until at most `in_flight` guarded dispatches are still running, all of them
  `fn`'s (the defaults: until every one has finished on every device it ran on).

  An output deleted since (donated to a function that is not guarded) can no longer be
  waited on; it is skipped.
  """
  with _LOCK:
    while _in_flight and (len(_in_flight) > in_flight
                          or any(owner is not fn for owner, _ in _in_flight)):
      for x in _in_flight.popleft()[1]:
        try:
          if not x.is_deleted():
            x.block_until_ready()
        except RuntimeError:  # Deleted between the check and the wait (another thread).
          pass


class Wrapped:
  """A `jax.jit` function with a check before each use (`_check`: before a call, `lower`,
  `trace` and `eval_shape`); everything else (`clear_cache`, ...) is the function's own,
  so a wrapper never changes what is traced, lowered or compiled. The dispatch guard
  (`Guarded`) and the step's batch check (`zero.BatchChecked`) are its two."""

  def __init__(self, fn: Callable):
    functools.update_wrapper(self, fn, updated=())  # Its name and docstring, not its state.
    self._fn = fn

  def _check(self, args: tuple, kwargs: dict) -> None:
    """Runs before each use of the function; raises to refuse it."""

  def __call__(self, *args, **kwargs):
    self._check(args, kwargs)
    return self._fn(*args, **kwargs)

  def lower(self, *args, **kwargs):
    self._check(args, kwargs)
    return self._fn.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    self._check(args, kwargs)
    return self._fn.trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    self._check(args, kwargs)
    return self._fn.eval_shape(*args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    if name == "_fn":  # Not set yet (a copy being made): no recursion.
      raise AttributeError(name)
    return getattr(self._fn, name)

  def __repr__(self) -> str:
    return f"{type(self).__name__.lower()}({self._fn!r})"


class Guarded(Wrapped):
  """A jitted function that, called on XLA:CPU with several devices (`enabled`), first
  waits for other guarded functions' dispatches and its own past `SAME_IN_FLIGHT` - 1;
  elsewhere it is the jitted function.
  """

  def __call__(self, *args, **kwargs):
    self._check(args, kwargs)
    if not enabled():
      return self._fn(*args, **kwargs)
    # Held from the wait to the record: two threads' calls cannot both pass the wait.
    with _LOCK:
      wait_until(SAME_IN_FLIGHT - 1, self)
      out = self._fn(*args, **kwargs)
      witnesses = _witnesses(out)
      if witnesses:  # None while traced inside another function: its outputs are tracers.
        _in_flight.append((self, witnesses))
    return out


def guarded(fn: Callable) -> Guarded:
  """`fn` (a `jax.jit` function) behind the XLA:CPU dispatch guard (`Guarded`)."""
  return fn if isinstance(fn, Guarded) else Guarded(fn)
