"""Greedy generation without a KV cache: the reference the cached decoder is tested against.

Each new token reruns the model over the whole (fixed-size) buffer: quadratic in the
length, but any model's `logits` will do and there is nothing to shard. Params are
whole (replicated) arrays.

    tokens = greedy(model.logits, params, prompts, lengths, steps=8)
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax.runtime import dispatch

LogitsFn = Callable[[Any, jax.Array], jax.Array]  # (params, int32[B, L]) -> f32[B, L, V]


def greedy(logits_fn: LogitsFn, params: Any, tokens: jax.Array, lengths: jax.Array,
           steps: int) -> jax.Array:
  """Appends `steps` greedy tokens to each prompt.

  Args:
    logits_fn: the model's next-token logits.
    params: whole params.
    tokens: int32[B, L], prompt b in tokens[b, :lengths[b]], the rest any id (causal
      attention never lets a prompt see what follows it); L >= max(lengths) + steps.
    lengths: int32[B], each prompt's length (>= 1).
    steps: tokens to generate.

  Returns:
    int32[B, L]: the prompts followed by their `steps` generated tokens.
  """
  rows = jnp.arange(tokens.shape[0])

  def body(i, tokens):
    last = lengths + i - 1  # The position that predicts the next token.
    z = logits_fn(params, tokens)[rows, last]  # [B, V]
    return tokens.at[rows, last + 1].set(jnp.argmax(z, axis=-1).astype(tokens.dtype))

  return jax.lax.fori_loop(0, steps, body, tokens)


# Guarded: it runs on the training mesh's params during a run's evaluation.
greedy_jit = dispatch.guarded(jax.jit(greedy, static_argnums=0, static_argnames="steps"))
