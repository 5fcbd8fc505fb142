"""A stack kept in host memory: written one layer at a time as the forward pass ends each
layer, read back one layer ahead in the backward pass.

A stack is a pytree whose leaves have a leading layers axis. The forward pass writes it
as `lax.scan` stacks a body's outputs: the body returns `outbound(layer_values, host)`,
its values moved to host memory, and the scan's stacked output is a host buffer, one
layer written per trip (the shape XLA's host offloader turns into a host allocation and
one device-to-host copy a layer; JAX's own offloading remat policies emit the same).
`backward_layers` runs the loop over the layers in reverse with layer i's slice on the
device: at trip i it fetches layer i-1's (a dynamic slice of the host buffer, moved to
the device) and carries it, so the copy depends on nothing layer i computes and XLA's
scheduler can keep it in flight while layer i's backward pass runs. The cost is one more
layer's values on the device (the one in use, the one arriving).

A stack the loop also writes (the optimizer state, updated layer by layer in gradient
release's backward loop) is read ahead with `read_ahead`: its read of layer i-1 and the
trip's in-place write of layer i touch other slices and depend on nothing of each other,
and XLA copies a buffer whose in-place write it cannot order after every read of it (the
whole stack, every trip). An optimization barrier on (the read, the stack) orders them:
the write takes the stack out of the barrier, so it comes after the read, while the
read depends only on the stack as the trip got it and can be in flight from the trip's
start.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax.streaming.memory import to_device, to_host

PyTree = Any


def _everywhere(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda _: True, tree)


def outbound(layer: PyTree, host: bool) -> PyTree:
  """One layer's values as a scan body returns them to be stacked: in host memory if
  `host` (every leaf), else as they are."""
  return to_host(layer, _everywhere(layer)) if host else layer


def fetch(stack: PyTree, i: jax.Array, host: bool) -> PyTree:
  """Layer i of a stack (leading axis), moved to the device if the stack is in host
  memory (`host`)."""
  layer = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), stack)
  return to_device(layer, _everywhere(layer)) if host else layer


def forward_layers(body: Callable[[jax.Array, PyTree, PyTree], tuple[PyTree, PyTree]],
                   carry: PyTree, read: Callable[[jax.Array], PyTree], length: int,
                   ahead: bool) -> tuple[PyTree, PyTree]:
  """`carry, y_i = body(i, read(i), carry)` for i = 0, ..., length-1: a `lax.scan`.

  Args:
    body: one layer's step: (layer index int32[], its values as `read` gives them,
      carry) -> (carry, per-layer output, stacked by the scan).
    carry: the loop's state, any pytree.
    read: layer i's values on the device (a slice of a stack, moved there).
    length: the number of layers.
    ahead: read layer i+1 during trip i and carry it, so its copy is in flight while
      layer i computes (a host stack); else each trip reads its own layer.

  Returns:
    (the carry after the last layer, the stacked outputs).
  """
  if not ahead:
    return jax.lax.scan(lambda c, i: body(i, read(i), c), carry, jnp.arange(length))

  def trip(state, i):
    c, layer = state
    # The last trip reads the last layer again (clamped), as `backward_layers` does.
    nxt = read(jnp.minimum(i + 1, length - 1))
    c, y = body(i, layer, c)
    return (c, nxt), y

  (carry, _), ys = jax.lax.scan(trip, (carry, read(0)), jnp.arange(length))
  return carry, ys


def backward_layers(body: Callable[[jax.Array, PyTree, PyTree], PyTree], carry: PyTree,
                    stack: PyTree, length: int, host: bool) -> PyTree:
  """`carry = body(i, stack[i], carry)` for i = length-1, ..., 0: a `fori_loop`.

  Args:
    body: one layer's step: (layer index int32[], layer i of `stack` on the device, carry)
      -> carry.
    carry: the loop's state, any pytree.
    stack: read-only values saved per layer (leading axis `length`).
    length: the number of layers.
    host: whether `stack` is in host memory: then layer i-1 is fetched during trip i
      and carried (read one ahead); else each trip slices its own layer.

  Returns:
    The carry after layer 0.
  """
  if not host:
    return jax.lax.fori_loop(
        0, length, lambda k, c: body(length - 1 - k, fetch(stack, length - 1 - k, False), c),
        carry)

  def trip(k, state):
    c, layer = state
    i = length - 1 - k
    # The last trip fetches layer 0 again (the index is clamped): one layer's copy more
    # than needed, against a second copy of the body's code for a peeled last trip.
    ahead = fetch(stack, jnp.maximum(i - 1, 0), True)
    return body(i, layer, c), ahead

  return jax.lax.fori_loop(0, length, trip, (carry, fetch(stack, length - 1, True)))[0]


def read_ahead(stack: PyTree, read: Callable[[PyTree], PyTree]) -> tuple[PyTree, PyTree]:
  """(`read(stack)`, `stack`), the read ordered before any later in-place write of `stack`.

  For a stack a loop both reads ahead and writes (see the module docstring): write into
  the returned stack, never the one given.
  """
  return jax.lax.optimization_barrier((read(stack), stack))
