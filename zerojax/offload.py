"""Optimizer-state offload: moments and Kahan / master buffers live in host memory.

With `make_plan(..., offload=True)` (config `optimizer.offload='host'`) the optimizer
state's param-shaped leaves have `memory_kind='pinned_host'` shardings
(`ZeroPlan.opt_shardings`): between steps, and through the forward and backward
passes, they take no device memory. The update brings them to the device, updates
them there and sends them back (`streamed`). Run one layer at a time
(`updates.update_by_layer`, and gradient release's per-layer update), only one layer's
state is on the device at once; the whole-tree update (optimizers that are not
leafwise) brings the whole state over for the update.

Every computation runs on device values: a host value is only sliced (layer i of a
stack) and moved. XLA:GPU and TPU turn the moves into DMA copies (`jax.device_put` to
a memory space lowers to `annotate_device_placement` custom calls there); XLA:CPU
keeps host and device in the same RAM and lowers them to nothing, so on CPU an
offloaded step computes exactly what the normal step computes.
"""

import math
import re
from collections.abc import Callable
from typing import Any

import jax

from zerojax import xla_dump, zero

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


def on_device(x: jax.Array) -> jax.Array:
  """`x` in device memory (moved there if it is a host value), inside a jitted function:
  the one way code that computes on any state leaf (checksums) reads an offloaded one."""
  if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
    return jax.device_put(x, jax.memory.Space.Device)
  return x


def streamed(update: Callable, plan: zero.ZeroPlan) -> Callable:
  """`update(grads, opt_state, params, **kw)` with the offloaded state moved around it.

  The state `update` is given (the whole tree, or one layer's slices of it as
  `updates.LayerViews` cuts them: the same tree structure) comes to the device first;
  the new state goes back to host memory. Without offload, `update` itself.

  Returns:
    A function of the same arguments returning (new params, new optimizer state with
    the offloaded leaves in host memory, sum of squared updates).
  """
  if not plan.offload:
    return update
  mask = plan.opt_offloaded

  def run(grads, opt_state, params, **kwargs):
    new_params, new_state, squares = update(grads, to_device(opt_state, mask), params,
                                            **kwargs)
    return new_params, to_host(new_state, mask), squares

  return run


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

