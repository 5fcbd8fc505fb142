"""The moves between device and host memory, and what a platform and a compiled module
say about host memory.

A move is `jax.device_put(x, jax.memory.Space.Host | Device)` inside a jitted function:
XLA:GPU and TPU lower it to `annotate_device_placement` custom calls (DMA copies once
XLA's host offloader is through); XLA:CPU, whose host and device share one RAM, to
nothing.
"""

import math
import re
from typing import Any

import jax

from zerojax import zero
from zerojax.runtime import xla_dump

PyTree = Any


def memory_kinds(device: Any) -> tuple[str, ...]:
  """The memory kinds `device` can address (none on a platform without memory kinds)."""
  try:
    return tuple(m.kind for m in device.addressable_memories())
  except Exception:  # pylint: disable=broad-except
    return ()


def has_host_memory(device: Any) -> bool:
  """Whether `device` can address host memory of the kind offload uses."""
  return zero.HOST_MEMORY in memory_kinds(device)


def _move(tree: PyTree, mask: PyTree, space: Any) -> PyTree:
  # Only the masked, non-empty leaves move: the others (a step count, the leaves
  # `updates.LayerViews` empties) are device values already, and a move of a device
  # value is not one XLA's offloader expects.
  return jax.tree.map(lambda x, m: jax.device_put(x, space) if m and x.size else x, tree,
                      mask)


def to_device(tree: PyTree, mask: PyTree) -> PyTree:
  """The leaves of `tree` where `mask` is True, moved to device memory."""
  return _move(tree, mask, jax.memory.Space.Device)


def to_host(tree: PyTree, mask: PyTree) -> PyTree:
  """The leaves of `tree` where `mask` is True, moved to host memory."""
  return _move(tree, mask, jax.memory.Space.Host)


def in_host_memory(x: jax.Array) -> bool:
  """Whether `x`, a value inside a jitted function, is in host memory."""
  return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def on_device(x: jax.Array) -> jax.Array:
  """`x` in device memory (moved there if it is a host value), inside a jitted function:
  the one way code that computes on any state leaf (checksums, a stage-3 gather) reads
  an offloaded one."""
  return jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x


def host_parameter_bytes(hlo_text: str) -> int:
  """Bytes of a compiled module's entry parameters laid out in host memory (memory space
  S(5) in its `entry_computation_layout`), per device.

  XLA:CPU has one memory space for its buffers and counts these among the arguments of
  `memory_analysis()` (its host_* fields stay 0); this is how much of them is host memory.
  """
  start = hlo_text.index("entry_computation_layout={")
  params = hlo_text[start:hlo_text.index(")->", start)]
  return sum(xla_dump.itemsize(t) * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in re.findall(r"(\w+)\[([\d,]*)\]\{[^}]*S\(5\)[^}]*\}", params))

