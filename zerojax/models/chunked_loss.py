"""Next-token cross-entropy computed over sequence chunks.

A 128K vocabulary's fp32 logits for a whole sequence are large (4096 positions x 128256
x 4 bytes = 2 GiB per sequence), so the head and the loss run under `lax.scan` over
`chunk` positions at a time, each chunk under `jax.checkpoint`: only one chunk's logits
are alive, forward or backward.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def chunked_nll(head: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array,
                chunk: int, weights: jax.Array | None = None) -> jax.Array:
  """Weighted cross-entropy of `targets` under `head(x)`, `chunk` positions at a time.

  Args:
    head: [B, C, D] hidden states -> float32[B, C, V] logits (C <= chunk).
    x: [B, T, D] hidden states (any float dtype).
    targets: int32[B, T].
    chunk: positions per chunk; T is padded up to a multiple (padding weighs 0).
    weights: float[B, T] per-position weights (a loss mask; None = 1).

  Returns:
    The float32 scalar sum over B x T positions of nll x weights, divided by B x T.
  """
  def chunk_nll(x, targets, weights):  # [B, size, D], [B, size], [B, size] -> scalar.
    z = head(x)
    logz = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - picked) * weights)

  return chunked(chunk_nll, x, targets, chunk, weights)


def chunked(chunk_loss: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
            x: jax.Array, targets: jax.Array, chunk: int,
            weights: jax.Array | None = None) -> jax.Array:
  """`chunked_nll` with the chunk's loss given: `chunk_loss(x [B, C, D], targets
  int32[B, C], weights float32[B, C])` -> the float32 sum of its weighted nll (e.g.
  `zerojax.vocab.nll` on a vocabulary-sharded head), each chunk under `jax.checkpoint`;
  the sum over the chunks divided by B x T."""
  B, T, _ = x.shape
  size = min(chunk, T)
  n = -(-T // size)
  pad = n * size - T
  chunks = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)).reshape(
      B, n, size, *a.shape[2:]).swapaxes(0, 1)
  weights = jnp.ones((B, T), jnp.float32) if weights is None else weights.astype(jnp.float32)

  one = jax.checkpoint(chunk_loss)
  total, _ = jax.lax.scan(lambda acc, xs: (acc + one(*xs), None),
                          jnp.zeros((), jnp.float32),
                          (chunks(x), chunks(targets), chunks(weights)))
  return total / (B * T)
