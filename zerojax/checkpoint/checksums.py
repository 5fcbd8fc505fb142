"""Checksums of a train state that do not depend on its sharding.

orbax stores no checksums, and reads many flipped bytes in a data file as other values
without an error (measured: 43 of 69 trials), so `zerojax.checkpoint` stores one per
leaf at save time (`describe`) and compares on restore. Each element's bits are
weighted by an odd multiple of its global position and summed mod 2**32: exact integer
arithmetic, so every mesh, device count and stage gets the same number.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax import streaming, zero
from zerojax.runtime import dispatch

_K = 2654435761  # Odd: the weights `index * _K + 1` of any two positions differ.


def _bits(x: jax.Array) -> jax.Array:
  """`x` as unsigned integers of its own width (8-byte dtypes: two uint32 per element,
  along the last axis); bool stays bool."""
  if x.dtype == jnp.bool_:
    return x
  if x.dtype.itemsize >= 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(*x.shape[:-1], -1)
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _block_checksum(block: jax.Array, shape: tuple[int, ...], offsets: list) -> jax.Array:
  """sum(bits * (global flat index * _K + 1)) mod 2**32 over `block` (ndim >= 1), the
  part of an array of `shape` that starts at `offsets`; each element's bits are one
  uint32 word (two for 8-byte dtypes, the second at index + 1).

  Summed in two stages with a barrier between: groups of <= 32 words along the last
  axis (XLA:CPU fuses the weighting into such a reduction), then the rest. In one
  reduction XLA:CPU materializes the whole weighted uint32 product: 2x a bf16 state's
  bytes on top of the state (measured).
  """
  w = 2 if block.dtype.itemsize == 8 else 1
  cols = block.shape[-1] * w
  group = max(g for g in range(1, 33) if cols % g == 0)
  bits = _bits(block).reshape(*block.shape[:-1], cols // group, group).astype(jnp.uint32)
  u32 = functools.partial(jnp.asarray, dtype=jnp.uint32)
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.uint32, bits.shape)
  index, stride = u32(offsets[-1]) * u32(w) + iota(bits.ndim - 2) * u32(group) + iota(
      bits.ndim - 1), w  # Of the last axis, in words; then the others, mod 2**32.
  for d in reversed(range(block.ndim - 1)):
    stride = stride * shape[d + 1] % 2**32
    index = index + (u32(offsets[d]) + iota(d)) * u32(stride)
  groups = jnp.sum(bits * (index * u32(_K) + u32(1)), axis=-1, dtype=jnp.uint32)
  return jnp.sum(jax.lax.optimization_barrier(groups), dtype=jnp.uint32)


def _leaf_checksum(x: jax.Array, sharding: Any = None) -> jax.Array:
  """A uint32 checksum of the bits of `x` that does not depend on its sharding.

  Each element's bits are weighted by an odd multiple of its global position and
  summed mod 2**32: exact integer arithmetic in any reduction order, so every mesh
  and stage gets the same number, and a moved block changes it as a flipped bit does.
  With a `NamedSharding` that divides `x` evenly, each device sums its own block (one
  device per replica group counts it) and the blocks' sums are added up.
  """
  if streaming.in_host_memory(x) and x.ndim > 1 and (
      sharding is None or len(sharding.device_set) == 1):
    return _by_layer(x)
  x = streaming.on_device(x)  # Host memory is moved, never computed on.
  shape = x.shape or (1,)
  if not isinstance(sharding, jax.sharding.NamedSharding) or not x.shape:
    return _block_checksum(x.reshape(shape), shape, [0] * len(shape))
  mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  axes = [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in spec]
  if any(n % math.prod(mesh.shape[a] for a in ax) for n, ax in zip(shape, axes)):
    return _block_checksum(x, shape, [0] * len(shape))  # Uneven: GSPMD, more memory.

  def local(block):
    offsets = []
    for n, ax in zip(block.shape, axes):
      position = jnp.uint32(0)
      for a in ax:
        position = (position * jnp.uint32(mesh.shape[a]) +
                    jax.lax.axis_index(a).astype(jnp.uint32))
      offsets.append(position * jnp.uint32(n))
    counts = jnp.bool_(True)  # The first of each group of replicas.
    for a in set(mesh.axis_names) - {a for ax in axes for a in ax}:
      counts &= jax.lax.axis_index(a) == 0
    total = jnp.where(counts, _block_checksum(block, shape, offsets), jnp.uint32(0))
    return jax.lax.psum(total, tuple(mesh.axis_names))

  return jax.shard_map(local, mesh=mesh, in_specs=P(*spec), out_specs=P(), check_vma=False)(x)


def _by_layer(x: jax.Array) -> jax.Array:
  """A host stack's checksum on one device, its leading slices moved over one at a time
  (the sum is exact mod 2**32 in any order: the whole block's checksum). Moved whole, a
  stack of the 70B on one RTX 4090 is 35 GiB of device memory."""
  def layer(i, total):
    row = streaming.on_device(jax.lax.dynamic_slice_in_dim(x, i, 1))
    return total + _block_checksum(row, x.shape, [i] + [0] * (x.ndim - 1))
  return jax.lax.fori_loop(0, x.shape[0], layer, jnp.uint32(0))


@functools.lru_cache(maxsize=8)
def jitted(treedef: Any, shardings: tuple) -> Callable:
  """One jitted function: the leaves of a tree of `treedef` -> their checksums."""
  return dispatch.guarded(jax.jit(
      lambda leaves: [_leaf_checksum(x, s) for x, s in zip(leaves, shardings)]))


def programs(leaves: list) -> list[list[int]]:
  """The leaves each checksum program reads, by index: the device leaves together, each
  group of host leaves alone (`streaming.host_groups`). One program for all moved every
  host leaf to the device at once: 57.39 GiB on the 8B whose step compiles to 13.91
  (docs/design/gpu-targets.md); on one device a stack is read a layer at a time."""
  host = [i for i, x in enumerate(leaves) if _in_host(x)]
  device = [i for i in range(len(leaves)) if i not in set(host)]
  sizes = [streaming.memory.nbytes(x) for x in leaves]
  return [g for g in [device, *streaming.host_groups(host, sizes)] if g]


def _in_host(x) -> bool:
  kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
  return kind == zero.HOST_MEMORY


def describe(state: Any, name: Callable[[tuple], str] = jax.tree_util.keystr
             ) -> dict[str, list]:
  """{name(leaf path): [shape, dtype, checksum]} of a (sharded) state."""
  leaves = jax.tree.leaves(state)
  sums = [None] * len(leaves)
  for group in programs(leaves):
    part = [leaves[i] for i in group]
    got = jitted(jax.tree.structure(part), tuple(getattr(x, "sharding", None)
                                                  for x in part))(part)
    for i, s in zip(group, jax.device_get(got)):
      sums[i] = s
  return {name(path): [list(x.shape), str(x.dtype), int(s)]
          for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(state), sums,
                                  strict=True)}
