"""Greedy generation without a KV cache, and exact-match accuracy on fine-tuning examples.

    python -m zerojax.generate --workdir runs/sft --prompt "12+30="
    python -m zerojax.generate --workdir runs/chat --chat --prompt "Reverse 'abc'."

Each new token reruns the model over the whole (fixed-size) buffer: quadratic in the
length, but one compiled program for every prompt and no cache to shard, which is what
checking a small fine-tune needs. Params are whole (replicated) arrays: a model that
fits one device.

    tokens = greedy(model.logits, params, prompts, lengths, steps=8)
    accuracy = exact_match(model.logits, params, held_out, count=200)
"""

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax import data, exits, sft

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


_greedy_jit = jax.jit(greedy, static_argnums=0, static_argnames="steps")


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
  # One jitted decoder per (model, answer length): a lambda made here would compile again
  # at every evaluation of a training run.
  run = functools.partial(_greedy_jit, logits_fn, steps=steps)
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


def encode_prompt(d: Any, tokenizer: Any, prompt: str, as_chat: bool) -> tuple[list[int], set]:
  """A prompt's ids as training saw them (data section `d`) and the ids that end an answer.

  Plain: [BOS] (data.add_bos) + the prompt, ended by the EOS. Chat: one user turn rendered
  with the chat template and its generation prompt, ended by EOS or the template's
  eos_token (Llama 3's <|eot_id|>).
  """
  stops = {data.eos_token_id(tokenizer, d.tokenizer, d.eos_id)}
  if as_chat:
    template = sft._template(d.tokenizer)
    from zerojax import chat  # pylint: disable=import-outside-toplevel
    text = chat.render(template, [{"role": "user", "content": prompt}],
                       add_generation_prompt=True)
    stops.add(tokenizer.token_to_id(template.tokens.get("eos_token", "")))
    return tokenizer.encode(text, add_special_tokens=False).ids, stops - {None}
  head = [sft.bos_token_id(tokenizer, d.tokenizer)] if d.add_bos else []
  return head + tokenizer.encode(prompt, add_special_tokens=False).ids, stops


def main(argv: list[str] | None = None) -> int:
  """`python -m zerojax.generate`: a checkpoint's greedy answer to a prompt; the exit status."""
  from zerojax import checkpoint, export  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(prog="python -m zerojax.generate",
                                   description="Greedy answer of a train.py checkpoint.")
  parser.add_argument("--workdir", required=True, help="train.py's --workdir")
  parser.add_argument("--prompt", required=True)
  parser.add_argument("--chat", action="store_true",
                      help="wrap the prompt in a user turn of the chat template")
  parser.add_argument("--max_new", type=int, default=64, help="tokens to generate at most")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  args = parser.parse_args(argv)
  try:
    config, built, state, _ = export.restore(args.workdir, args.step)
    d = config.data
    if not d.tokenizer:
      raise data.DataError("the run had no tokenizer (data.tokenizer): nothing to decode with",
                           key="data.tokenizer")
    tokenizer = data.load_tokenizer(d.tokenizer, config.model.vocab_size)
    ids, stops = encode_prompt(d, tokenizer, args.prompt, args.chat)
  except (export.HFError, checkpoint.CheckpointError, data.DataError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return exits.BAD_INPUT
  tokens = np.zeros((1, len(ids) + args.max_new), np.int32)
  tokens[0, :len(ids)] = ids
  out = greedy(built.model.logits, jax.device_get(state.params), jnp.asarray(tokens),
               jnp.asarray([len(ids)], jnp.int32), args.max_new)
  answer = np.asarray(out)[0, len(ids):].tolist()
  ends = [i for i, t in enumerate(answer) if t in stops]
  print(tokenizer.decode(answer[:ends[0]] if ends else answer), flush=True)
  return exits.DONE


if __name__ == "__main__":
  sys.exit(main())
