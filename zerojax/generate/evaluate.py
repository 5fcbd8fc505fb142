"""Exact-match accuracy on fine-tuning examples (train.py's `train.eval_exact_match`).

    accuracy = exact_match(model, state.params, held_out, count=200, plan=built.plan)
"""

import functools
from typing import Any

import numpy as np

from zerojax import zero
from zerojax.data import sft
from zerojax.generate import decode, reference


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


def exact_match(model: Any, params: Any, examples: sft.Examples, count: int,
                batch_size: int = 64, *, plan: zero.ZeroPlan | None = None,
                gather: str = "auto") -> float:
  """The share of the first `count` examples whose answer greedy decoding reproduces
  exactly, token for token, its stop token included.

  Args:
    model: a model with a KV-cached pass (`LlamaLM`), decoded by `decode.generate` on
      params as `plan` lays them out; or any `logits(params, tokens)` function, decoded
      by the uncached `reference.greedy` on whole params.
    params: the params (laid out by `plan`, or whole).
    examples: SFT examples (`sft.Examples`).
    count: examples to score (the first ones).
    batch_size: prompts decoded at once; every batch is padded to this size (one
      compilation).
    plan: the params' ZeRO plan (cached decoding); None: whole params.
    gather: for `decode.generate`.
  """
  pairs = prompts_and_answers(examples, count)
  steps = max(len(a) for _, a in pairs)
  right = 0
  for start in range(0, len(pairs), batch_size):
    chunk = pairs[start:start + batch_size]
    chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # One shape for every call.
    said = (_uncached(model, params, [p for p, _ in chunk], steps) if callable(model) else
            decode.generate(model, params, [p for p, _ in chunk], steps, plan=plan,
                            gather=gather).tokens)
    right += sum(np.array_equal(said[b, :len(a)], a) for b, (_, a) in enumerate(chunk)
                 if start + b < len(pairs))
  return right / len(pairs)


def _uncached(logits_fn: Any, params: Any, prompts: list, steps: int) -> np.ndarray:
  """int32[B, steps]: `reference.greedy`'s new tokens after each prompt."""
  width = max(len(p) for p in prompts) + steps
  tokens = np.zeros((len(prompts), width), np.int32)
  lengths = np.array([len(p) for p in prompts], np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  # One jitted decoder per (model, answer length): a lambda made here would compile again
  # at every evaluation of a training run.
  run = functools.partial(reference.greedy_jit, logits_fn, steps=steps)
  out = np.asarray(run(params, tokens, lengths))
  return np.stack([out[b, n:n + steps] for b, n in enumerate(lengths)])
