"""Causal grouped-query attention kernels for `zerojax.models.llama`.

`attention_kernel` says which one a config's `attention` means on this backend;
`blocked_attention` is the portable one: a loop over query blocks whose backward pass
recomputes each block's scores (a `custom_vjp`), so no (heads, T, T) array is ever
alive. The other, 'dot_product', is `jax.nn.dot_product_attention` (cuDNN's fused
kernel on a GPU in bf16/fp16), called by the model itself.

Packed sequences: with `segment_ids` a query sees only the keys of its own segment (its
own example), besides the causal rule. Sliding-window (local) attention: with `window` W
> 0 a query at position i sees only keys at i - W < j <= i (Hugging Face's rule: W keys,
itself included); W is static (a layer stack that mixes local and global layers picks
its kernel per layer with `lax.cond`, `zerojax.models.llama`). `scale` multiplies the
scores (None: Dh ** -0.5; Gemma's `query_pre_attn_scalar ** -0.5`).

Shapes: B batch, T sequence, H query heads, K key/value heads, G = H // K, Dh head_dim,
S query positions per block.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zerojax.runtime import platform


class Mask(NamedTuple):
  """What a kernel masks and scales beyond causality, static: `window` (0: none) and
  `scale` (None: Dh ** -0.5); see the module docstring."""
  window: int = 0
  scale: float | None = None


def _in_window(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
  """bool[..., S, T]: key k_pos[t] is within `window` of query q_pos[s] (k_pos <= q_pos
  is the causal rule's, not checked here)."""
  return q_pos[..., :, None] - k_pos[..., None, :] < window


def _attend(q_blk: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array,
            q_seg: jax.Array, k_seg: jax.Array, mask: Mask = Mask()) -> jax.Array:
  """One query block: [B, S, K, G, Dh] queries at positions start.. against all T keys.

  Scores are fp32 [B, K, G, S, T], masked causally, to the window and to the query's
  segment (q_seg int32[B, S], k_seg int32[B, T]; None: one segment, no compare), softmax
  in fp32. Returns [B, S, K, G, Dh] in q's dtype.
  """
  S, T = q_blk.shape[1], k.shape[1]
  # Ties the mask to this block's queries. Computed from constants alone, it would be
  # loop-invariant in the layer scan, and JAX hoists such values out of the loop: the
  # masks of all blocks, made once, a [n, B, K, G, S, T] array alive throughout.
  start, q_blk = jax.lax.optimization_barrier((start, q_blk))
  visible = jnp.arange(T)[None, :] <= (start + jnp.arange(S))[:, None]  # [S, T]
  if mask.window:
    visible &= _in_window(start + jnp.arange(S), jnp.arange(T), mask.window)
  if q_seg is not None:  # [B, 1, 1, S, T]: also the query's own segment.
    visible = (visible & (q_seg[:, :, None] == k_seg[:, None, :]))[:, None, None]
  return _masked_attention(q_blk, k, v, visible, mask.scale)


def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                      scale: float | None = None) -> jax.Array:
  """Queries [B, S, K, G, Dh] against keys and values [B, T, K, Dh] where `visible`
  (bool, broadcast to [B, K, G, S, T]); fp32 scores (times `scale`, None: Dh ** -0.5)
  and softmax. Returns q's shape and dtype."""
  s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  p = jax.nn.softmax(jnp.where(visible, s * scale, -1e30), axis=-1)
  out = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.astype(q.dtype)


def _attend_blocks_fwd(mask, q, k, v, q_seg, k_seg):
  """`_attend` over query blocks q: [n, B, S, K, G, Dh] -> same, q_seg: int32[n, B, S];
  residuals q, k, v and the segment ids. `mask`: a static `Mask`."""
  starts = jnp.arange(q.shape[0]) * q.shape[2]
  out = jax.lax.map(lambda xs: _attend(xs[0], k, v, xs[1], xs[2], k_seg, mask),
                    (q, starts, q_seg))
  return out, (q, k, v, q_seg, k_seg)


def _attend_blocks_bwd(mask, res, ct):
  # The forward kept only q, k, v: each block's scores are recomputed here, and dk, dv
  # summed over blocks in fp32 (a `jax.checkpoint` per block would sum them in the
  # compute dtype, in the transpose of the scan).
  q, k, v, q_seg, k_seg = res
  starts = jnp.arange(q.shape[0]) * q.shape[2]

  def block(acc, xs):
    q_blk, start, seg, ct_blk = xs
    _, vjp = jax.vjp(lambda q, k, v: _attend(q, k, v, start, seg, k_seg, mask), q_blk, k, v)
    dq, dk, dv = vjp(ct_blk)
    return (acc[0] + dk.astype(jnp.float32), acc[1] + dv.astype(jnp.float32)), dq

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  (dk, dv), dq = jax.lax.scan(block, (zeros(k), zeros(v)), (q, starts, q_seg, ct))
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None  # Segment ids: integers.


_attend_blocks = jax.custom_vjp(lambda *args: _attend_blocks_fwd(*args)[0], nondiff_argnums=(0,))
_attend_blocks.defvjp(_attend_blocks_fwd, _attend_blocks_bwd)


def cudnn_head_dim(compute_capability: tuple[int, int] | None) -> int:
  """The widest heads cuDNN's fused attention takes on a GPU of `compute_capability` (jax's
  check): 256 from Hopper (9.0) on, 128 before (an RTX 4090 is 8.9) and when not known."""
  return 256 if compute_capability is not None and compute_capability >= (9, 0) else 128


def attention_kernel(attention: str, dtype: Any, backend: str | None = None,
                     head_dim: int | None = None,
                     compute_capability: tuple[int, int] | None = None) -> str:
  """The kernel 'auto' means: cuDNN's fused attention on a GPU in bf16/fp16 with heads it
  takes there (`cudnn_head_dim`; a head_dim of None: not known, taken as fitting) (2-4x
  the blocked loop's MFU on an H200, benchmarks/README.md), else the blocked loop (XLA's
  dot_product materialises the T x T scores). Other names pass through.

  `backend` None: the traced step's (`platform.backend()`), and then the GPU's
  `platform.compute_capability()` unless `compute_capability` is given.
  """
  if attention != "auto":
    return attention
  gpu = (backend or platform.backend()) == "gpu"
  if compute_capability is None and backend is None:
    compute_capability = platform.compute_capability()
  fits = head_dim is None or head_dim <= cudnn_head_dim(compute_capability)
  low = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
  return "dot_product" if gpu and low and fits else "blocked"


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          segment_ids: jax.Array | None = None, mask: Mask = Mask()
                          ) -> jax.Array:
  """Causal grouped-query attention by `jax.nn.dot_product_attention`: cuDNN's fused
  kernel on a GPU in bf16/fp16, else XLA's (which materialises the scores). Shapes as
  `blocked_attention`'s. A window is its `local_window_size` (W - 1 keys before the
  query, none after): cuDNN's own sliding-window mask, a mask over the scores in XLA's.

  Packed rows: the segment mask as jax.nn.dot_product_attention takes it, which cuDNN
  turns into a [B, 1, T, T] bias (the whole scores' size, in the compute dtype).
  """
  # jax 0.10's implementation=None always means XLA (whole scores): ask for cuDNN.
  cudnn = platform.backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
  same = (None if segment_ids is None else
          (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None])
  return jax.nn.dot_product_attention(
      q, k, v, mask=same, is_causal=True,
      scale=q.shape[-1] ** -0.5 if mask.scale is None else mask.scale,
      local_window_size=(mask.window - 1, 0) if mask.window else None,
      implementation="cudnn" if cudnn else "xla")


def causal_attention(kernel: str, block: int, q: jax.Array, k: jax.Array, v: jax.Array,
                     segment_ids: jax.Array | None = None, mask: Mask = Mask()) -> jax.Array:
  """The `attention_kernel` named `kernel` ('blocked' with query blocks of `block`, or
  'dot_product') on [B, T, H, Dh] queries and [B, T, K, Dh] keys and values."""
  if kernel == "dot_product":
    return dot_product_attention(q, k, v, segment_ids, mask)
  return blocked_attention(q, k, v, block, segment_ids, mask)


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int,
                      segment_ids: jax.Array | None = None, mask: Mask = Mask()
                      ) -> jax.Array:
  """Causal grouped-query attention, one block of queries at a time.

  A loop over query blocks; each block's scores against all T keys are recomputed in
  the backward pass instead of saved, so at most one block's (B, H, block, T) fp32
  scores are alive, never (B, H, T, T). T need not be a multiple of `block` (the
  queries are padded, the padding dropped).

  Args:
    q: [B, T, H, Dh]; query head h reads key/value head h // G (HF's `repeat_kv`).
    k, v: [B, T, K, Dh].
    block: query positions per block.
    segment_ids: int32[B, T]: position i sees position j <= i only if their ids are
      equal (packed examples); None = one segment.
    mask: the window and the scale (`Mask`).

  Returns:
    [B, T, H, Dh] in q's dtype.
  """
  B, T, H, Dh = q.shape
  K = k.shape[2]
  size = min(block, T)
  n = -(-T // size)
  q = q.reshape(B, T, K, H // K, Dh)
  q = jnp.pad(q, ((0, 0), (0, n * size - T), (0, 0), (0, 0), (0, 0)))
  q = q.reshape(B, n, size, K, H // K, Dh).swapaxes(0, 1)  # [n, B, size, K, G, Dh]
  q_seg = None  # Unpacked: no segment compare at all.
  if segment_ids is not None:
    q_seg = jnp.pad(segment_ids, ((0, 0), (0, n * size - T)))
    q_seg = q_seg.reshape(B, n, size).swapaxes(0, 1)  # [n, B, size]
  out = _attend_blocks(mask, q, k, v, q_seg, segment_ids)
  return out.swapaxes(0, 1).reshape(B, n * size, H, Dh)[:, :T]


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                     mask: Mask = Mask()) -> jax.Array:
  """Causal grouped-query attention of new queries against a KV cache (decoding).

  Query t of row b sees the cache slots 0..positions[b, t]: the cache holds each token
  at its own position, so slots past a row's current position (its padding, or what a
  longer prompt of the batch left there) are never read. No backward pass: inference.

  Args:
    q: [B, T, H, Dh], the new tokens' queries (T = a prompt, or 1 per decode step).
    k, v: [B, S, K, Dh], the cache with the new tokens already written.
    positions: int32[B, T], each query's position.
    mask: the window (a slot more than W - 1 before the query is not read) and scale.

  Returns:
    [B, T, H, Dh] in q's dtype.
  """
  B, T, H, Dh = q.shape
  K = k.shape[2]
  slots = jnp.arange(k.shape[1])
  visible = slots <= positions[..., None]  # [B, T, S]
  if mask.window:
    visible &= _in_window(positions, slots, mask.window)
  out = _masked_attention(q.reshape(B, T, K, H // K, Dh), k, v, visible[:, None, None],
                          mask.scale)
  return out.reshape(B, T, H, Dh)



# A local layer's KV cache is a ring of R slots (R = its window, or fewer positions):
# the token at position p lives in slot p mod R, and `held` records which position each
# slot holds (-1: none), so the cache of a 128K-token generation keeps 1024 positions on
# Gemma 3's local layers instead of 128K.


def ring_sources(held: jax.Array, positions: jax.Array, valid: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """Which new token each ring slot takes after new tokens at `positions`.

  Slot r takes the newest valid position p = r (mod R), if this call brings it; a slot
  keeps what it holds otherwise. A gather, not a scatter: a prompt longer than the ring
  maps several tokens to one slot, and only the newest may land there.

  Args:
    held: int32[B, R], the position in each slot before the call (-1: empty).
    positions: int32[B, T], the new tokens' positions, consecutive in each row.
    valid: bool[B, T], a prefix of each row: the tokens to keep (a prefill's padding
      after a row's prompt must not evict its last tokens).

  Returns:
    (int32[B, R] the index in T each slot takes, -1 to keep; int32[B, R] the new `held`).
  """
  R = held.shape[1]
  newest = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)  # [B, 1]
  at = newest - jnp.mod(newest - jnp.arange(R), R)  # Newest position of each slot's class.
  take = (at >= positions[:, :1]) & (newest >= 0)
  return jnp.where(take, at - positions[:, :1], -1), jnp.where(take, at, held)


def ring_write(ring: jax.Array, new: jax.Array, sources: jax.Array) -> jax.Array:
  """The ring [B, R, K, Dh] with slot r replaced by new[:, sources[:, r]] where >= 0."""
  taken = jnp.take_along_axis(new, jnp.maximum(sources, 0)[..., None, None], axis=1)
  return jnp.where((sources >= 0)[..., None, None], taken.astype(ring.dtype), ring)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, ring_k: jax.Array,
                   ring_v: jax.Array, held: jax.Array, positions: jax.Array,
                   mask: Mask) -> jax.Array:
  """Sliding-window attention of new queries against a ring cache and the new tokens.

  The keys are the ring's (at the positions it held before this call) and the new
  tokens' own, so a prompt longer than the ring attends within its window exactly as
  the uncached model does.

  Args:
    q: [B, T, H, Dh]; k, v: [B, T, K, Dh], the new tokens' (rotated) keys and values.
    ring_k, ring_v: [B, R, K, Dh], the ring before the new tokens are written.
    held: int32[B, R], each slot's position (-1: empty); positions: int32[B, T].
    mask: the window (required) and the score scale.

  Returns:
    [B, T, H, Dh] in q's dtype.
  """
  B, T, H, Dh = q.shape
  K = k.shape[2]
  keys = jnp.concatenate([ring_k, k.astype(ring_k.dtype)], axis=1)
  values = jnp.concatenate([ring_v, v.astype(ring_v.dtype)], axis=1)
  key_pos = jnp.concatenate([held, positions], axis=1)[:, None, :]  # [B, 1, R + T]
  visible = ((key_pos >= 0) & (key_pos <= positions[..., None])
             & _in_window(positions, key_pos[:, 0], mask.window))
  out = _masked_attention(q.reshape(B, T, K, H // K, Dh), keys, values, visible[:, None, None],
                          mask.scale)
  return out.reshape(B, T, H, Dh)
