"""Reading what XLA dumped about the compiled train step (`build.compile_step(built,
dump_to=DIR)`): which temporaries are alive at the memory peak.

Library, not test tooling: `python -m zerojax.memory --compile` attributes these
buffers to the planner's components, so a user sees where an estimate and the compiler
differ.
"""

import collections
import contextlib
import glob
import os
import re

import jax
from jax.experimental.compilation_cache import compilation_cache


@contextlib.contextmanager
def compiled_afresh():
  """JAX's persistent compilation cache off for the compiles inside, so XLA dumps them.

  XLA dumps only what it compiles, and the cache's key leaves the dump options out: an
  executable loaded from the cache (`jax_compilation_cache_dir` set, the program
  compiled before) comes with no dump, and the attribution read from it would be empty.
  Not thread-safe: the cache is a process-wide setting.
  """
  if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
    yield
    return
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # JAX decides once whether the cache is used.
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


def itemsize(dtype: str) -> int:
  """Bytes per element of an HLO type name: f32 -> 4, bf16 -> 2, pred -> 1."""
  bits = re.search(r"\d+", dtype)
  return max(1, int(bits.group()) // 8) if bits else 1


def step_files(dump_dir: str) -> str | None:
  """The path prefix of the optimized step's files in an XLA dump (add
  '-buffer-assignment.txt', '-live-range.txt', ...), or None if there is no step."""
  found = glob.glob(os.path.join(dump_dir, "*jit_step*after_optimizations-live-range.txt"))
  return found[0][:-len("-live-range.txt")] if found else None


def live_at_peak(dump_dir: str) -> list[tuple[int, str, str]]:
  """(bytes, shape, HLO value name) of the step's temporaries alive at their peak,
  largest first: the buffer assignment's temporaries, replayed over the live ranges;
  values sharing an (offset, size) slot count once. Empty if the dump has no step."""
  base = step_files(dump_dir)
  if base is None:
    return []
  with open(base + "-buffer-assignment.txt") as f:
    allocations = f.read().split("\nallocation ")
  # The device's temporaries: with activation offload a second preallocated-temp
  # allocation, color 5 (host memory), holds the host buffers.
  temp = next(a for a in allocations if "preallocated-temp:" in a.split("\n")[0]
              and ", color 5," not in a.split("\n")[0])
  with open(base + "-live-range.txt") as f:
    live = {n: (int(a), int(b)) for n, a, b in re.findall(r"^    (\S+\{\S*\}):(\d+)-(\d+)",
                                                         f.read(), re.M)}
  slots = collections.defaultdict(list)  # (offset, size) -> [(start, end, shape, name)]
  for name, size, offset, shape in re.findall(
      r"value: <\d+ (\S+)(?: \(phi\))? @\S+> \(size=(\d+),offset=(\d+)\): (\S+)", temp):
    name = name if "{" in name else name + "{}"
    if name in live:
      slots[(int(offset), int(size))].append((*live[name], shape.split("{")[0], name))
  events = collections.Counter()
  for (_, size), spans in slots.items():
    end = -1
    for start, stop, *_ in sorted(spans):  # A slot's overlapping spans count once.
      start = max(start, end + 1)
      if stop >= start:
        events[start], events[stop + 1], end = events[start] + size, events[stop + 1] - size, stop
  total, peak, when = 0, 0, 0
  for t in sorted(events):
    total += events[t]
    if total > peak:
      peak, when = total, t
  return sorted(((size, *next((sh, n) for a, b, sh, n in spans if a <= when <= b))
                 for (_, size), spans in slots.items()
                 if any(a <= when <= b for a, b, *_ in spans)), reverse=True)
