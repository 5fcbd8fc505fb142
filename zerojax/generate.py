"""Greedy generation without a KV cache, and exact-match accuracy on fine-tuning examples.

Each new token reruns the model over the whole (fixed-size) buffer: quadratic in the
length, but one compiled program for every prompt and no cache to shard, which is what
checking a small fine-tune needs. Params are whole (replicated) arrays: a model that
fits one device.

    tokens = greedy(model.logits, params, prompts, lengths, steps=8)
    accuracy = exact_match(model.logits, params, held_out, count=200)
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax import sft

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


def prompts_and_answers(examples: sft.Examples, count: int
                        ) -> list[tuple[np.ndarray, np.ndarray]]:
  """(prompt, answer) of the first `count` examples: the tokens before the first trained
  token, and the first run of trained tokens (a completion with its EOS, or the first
  assistant turn with its end-of-turn token)."""
  out = []
  for i in range(min(count, len(examples))):
    ids = examples.ids[examples.starts[i]:examples.starts[i] + examples.lengths[i]]
    mask = examples.mask[examples.starts[i]:examples.starts[i] + examples.lengths[i]]
    first = int(np.argmax(mask))
    end = first + (int(np.argmin(mask[first:])) if not mask[first:].all() else len(ids) - first)
    out.append((ids[:first], ids[first:end]))
  return out


def exact_match(logits_fn: LogitsFn, params: Any, examples: sft.Examples, count: int,
                batch_size: int = 64) -> float:
  """The share of the first `count` examples whose answer greedy decoding reproduces
  exactly, token for token, its stop token included.

  Prompts are decoded `batch_size` at a time in one buffer size (one compilation).
  """
  pairs = prompts_and_answers(examples, count)
  steps = max(len(a) for _, a in pairs)
  width = max(len(p) for p, _ in pairs) + steps
  run = jax.jit(lambda params, t, n: greedy(logits_fn, params, t, n, steps))
  right = 0
  for start in range(0, len(pairs), batch_size):
    chunk = pairs[start:start + batch_size]
    chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # One shape for every call.
    tokens = np.zeros((batch_size, width), np.int32)
    lengths = np.array([len(p) for p, _ in chunk], np.int32)
    for b, (p, _) in enumerate(chunk):
      tokens[b, :len(p)] = p
    out = np.asarray(run(params, tokens, lengths))
    right += sum(np.array_equal(out[b, n:n + len(a)], a)
                 for b, ((_, a), n) in enumerate(zip(chunk, lengths))
                 if start + b < len(pairs))
  return right / len(pairs)
