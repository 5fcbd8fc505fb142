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
  return _host_bytes(_entry_layout(hlo_text)[0])


def host_output_bytes(hlo_text: str) -> int:
  """Bytes of a compiled module's results laid out in host memory (S(5)), per device:
  `host_parameter_bytes`' twin for the outputs, which XLA:CPU counts among its outputs."""
  return _host_bytes(_entry_layout(hlo_text)[1])


def _entry_layout(hlo_text: str) -> tuple[str, str]:
  """The entry computation layout's (parameters, results) text."""
  start = hlo_text.index("entry_computation_layout={")
  split, depth = hlo_text.index(")->", start), 0
  for end in range(start + len("entry_computation_layout="), len(hlo_text)):
    depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
    if depth == 0:
      break
  return hlo_text[start:split], hlo_text[split:end]


def _host_bytes(layout: str) -> int:
  return sum(xla_dump.itemsize(t) * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in re.findall(r"(\w+)\[([\d,]*)\]\{[^}]*S\(5\)[^}]*\}", layout))


# Host leaves moved to or from the device by their own program are grouped up to the
# largest one's bytes, or this many for small models (fewer programs to compile).
GROUP_BYTES = 64 << 20


def host_groups(leaves: list[int], sizes: list[int]) -> list[list[int]]:
  """The host leaves `leaves` (indices into `sizes`, their bytes) packed into groups of at
  most the largest one's bytes or `GROUP_BYTES` (first fit, largest first): the programs
  that make or read them one group at a time (`step.init_state`, the checkpoint's
  checksums) keep the device to one large leaf's bytes, with as few programs as that
  allows."""
  groups: list[tuple[int, list[int]]] = []
  cap = max([GROUP_BYTES] + [sizes[i] for i in leaves])
  for i in sorted(leaves, key=lambda i: -sizes[i]):
    at = next((k for k, (used, _) in enumerate(groups) if used + sizes[i] <= cap), None)
    if at is None:
      groups.append((sizes[i], [i]))
    else:
      groups[at] = (groups[at][0] + sizes[i], groups[at][1] + [i])
  return [sorted(g) for _, g in groups]


def nbytes(x) -> int:
  """An array's or a `jax.ShapeDtypeStruct`'s bytes."""
  return math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize
