"""Choosing the next token: greedy, or sampled with temperature, top-k and top-p.

The settings are traced values (`Sampling` of scalars), so one compiled decoder serves
every setting. The filters are Hugging Face's, in its order: the logits divided by the
temperature, then the top k kept, then the smallest set of those whose probabilities
sum to at least top_p. Tokens tied with the last one kept are kept too.

Randomness is a pure function of (seed, row, step): row b's token at step i draws from
`fold_in(fold_in(key(seed), b), i)`, so a prompt's tokens depend on its seed and place
in the batch, not on how the batch is split over devices.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampling(NamedTuple):
  """How the next token is chosen.

  Attributes:
    temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens; 0 = all.
    top_p: keep the most likely tokens whose probabilities sum to >= top_p, in (0, 1].
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0


def check(s: Sampling) -> None:
  """ValueError for settings outside their ranges (the CLI's `error:` line)."""
  for ok, what in [(s.temperature >= 0, f"temperature {s.temperature} must be >= 0"),
                   (s.top_k >= 0, f"top_k {s.top_k} must be >= 0 (0: no limit)"),
                   (0 < s.top_p <= 1, f"top_p {s.top_p} must be in (0, 1]")]:
    if not ok:
      raise ValueError(what)


def as_arrays(s: Sampling) -> Sampling:
  """The settings as the decoder's traced scalars (f32, int32, f32)."""
  return Sampling(jnp.float32(s.temperature), jnp.int32(s.top_k), jnp.float32(s.top_p))


def filter_logits(logits: jax.Array, s: Sampling) -> jax.Array:
  """float32[B, V] logits -> the tempered logits with filtered-out tokens at -inf."""
  z = logits / jnp.maximum(s.temperature, 1e-6)
  vocab = z.shape[-1]
  ranked = -jnp.sort(-z, axis=-1)  # Descending.
  k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
  in_k = jnp.arange(vocab) < k
  p = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf), axis=-1)
  # A ranked token is kept while the mass before it is below top_p: the first always is.
  kept = in_k & (jnp.cumsum(p, axis=-1) - p < s.top_p)
  last = jnp.take_along_axis(ranked, jnp.sum(kept, axis=-1, keepdims=True) - 1, axis=-1)
  return jnp.where(z >= last, z, -jnp.inf)


def next_token(logits: jax.Array, s: Sampling, key: jax.Array, rows: jax.Array,
               step: jax.Array) -> jax.Array:
  """The next token of each row.

  Args:
    logits: float32[B, V].
    s: `Sampling` of traced scalars (`as_arrays`).
    key: the run's key (from its seed).
    rows: int32[B], each row's index in the whole batch.
    step: int32 scalar, the generated token's index.

  Returns:
    int32[B].
  """
  def sampled(z):
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(rows)
    return jax.vmap(jax.random.categorical)(keys, filter_logits(z, s)).astype(jnp.int32)

  greedy = lambda z: jnp.argmax(z, axis=-1).astype(jnp.int32)
  # A branch, not both and a select: greedy decoding skips the sort over the vocabulary.
  return jax.lax.cond(s.temperature > 0, sampled, greedy, logits)
