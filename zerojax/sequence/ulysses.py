"""Ulysses attention: all-to-all from sequence slices to head slices and back.

Inside the train step's `shard_map`, each device of the sequence axis (size n) holds
positions [i T/n, (i + 1) T/n) of every row. `attention` trades them, by one
`all_to_all` per tensor, for all T positions of H/n query heads and their KV heads, runs
the given kernel, and trades back. Shapes: B rows, T whole sequence, S = T / n, H query
heads, K key/value heads, Dh head dim.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

# kernel(q [B, T, H/n, Dh], k, v [B, T, K', Dh], segment_ids int32[B, T] | None) -> like q.
Kernel = Callable[..., jax.Array]


def kv_repeats(n_heads: int, n_kv_heads: int, n: int) -> int:
  """How many times each KV head is sent so every device gets whole KV heads for its
  H/n query heads: 1 when n divides K; n/K when K divides n.

  Raises:
    ValueError: n does not divide H, or neither of K and n divides the other.
  """
  if n_heads % n:
    raise ValueError(f"sequence parallelism over {n} devices needs n_heads ({n_heads}) "
                     f"divisible by {n}")
  if n_kv_heads % n == 0:
    return 1
  if n % n_kv_heads:
    raise ValueError(f"sequence parallelism over {n} devices needs n_kv_heads ({n_kv_heads}) "
                     f"divisible by {n}, or a divisor of it")
  return n // n_kv_heads


def _to_heads(x: jax.Array, axis: str) -> jax.Array:
  """[B, S, h, Dh] (this device's positions, all h heads) -> [B, T, h/n, Dh]."""
  return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _to_sequence(x: jax.Array, axis: str) -> jax.Array:
  """[B, T, h/n, Dh] -> [B, S, h, Dh]: `_to_heads` undone."""
  return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
              axis: str, kernel: Kernel) -> jax.Array:
  """Causal attention of a sequence split over mesh axis `axis` (inside `shard_map`).

  Args:
    q: [B, S, H, Dh], this device's slice of the positions, RoPE applied (each position
      rotated by its own angle before the trade).
    k, v: [B, S, K, Dh].
    segment_ids: int32[B, S] of the slice (packed rows), or None.
    axis: the mesh axis the sequence is split over; its size n must divide H, and K
      or n must divide the other (`kv_repeats`).
    kernel: the attention over the whole sequence for a share of the heads.

  Returns:
    [B, S, H, Dh] in q's dtype: this device's positions, every head.
  """
  n = jax.lax.axis_size(axis)
  r = kv_repeats(q.shape[2], k.shape[2], n)
  if r > 1:  # Query head h reads KV head h // G: device i's heads all read head i // r.
    k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
  q, k, v = (_to_heads(x, axis) for x in (q, k, v))
  if segment_ids is not None:
    segment_ids = jax.lax.all_gather(segment_ids, axis, axis=1, tiled=True)
  return _to_sequence(kernel(q, k, v, segment_ids), axis)


def all_to_all_bytes(rows: int, seq_len: int, n: int, n_heads: int, n_kv_heads: int,
                     head_dim: int, itemsize: int, remat: str) -> int:
  """Bytes one device puts into all-to-alls per layer and step (operands; (n - 1) / n of
  them leave the device): q and the output [rows, seq_len / n, H, Dh], k and v with
  their repeats, in the forward pass, the backward pass (their transposes) and, unless
  `remat` is 'none', the forward's recomputation (the traded values are not saved).

  Measured against the compiled step: `tests/test_sequence.py`.
  """
  r = kv_repeats(n_heads, n_kv_heads, n)
  one_pass = rows * (seq_len // n) * head_dim * itemsize * 2 * (n_heads + n_kv_heads * r)
  return one_pass * (2 if remat == "none" else 3)
