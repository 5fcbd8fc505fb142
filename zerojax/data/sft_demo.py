"""A fine-tuning set made in code, for `configs/sft_tiny.py` and the tests: no download.

`byte_tokenizer()` is a byte-level `tokenizers.Tokenizer` (ids 0-255: one per byte, GPT-2's
byte-to-character table, no merges) with Llama 3's special tokens after them
(`SPECIAL_TOKENS`, ids 256..). `tasks(n, seed)` are small instructions with one right
answer each (add or subtract two numbers, reverse a word, sort its letters), so
exact-match accuracy measures what was learned. `write(folder)` puts a tokenizer.json,
train.jsonl and eval.jsonl of {prompt, completion} lines there, once; `chats` gives the
same tasks as {messages} conversations.
"""

import json
import os

import numpy as np

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def byte_tokenizer():
  """A byte-level tokenizer: 256 byte ids, then `SPECIAL_TOKENS` as special added tokens."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415  optional: the text extra
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  # GPT-2's table maps bytes to printable characters; ids follow the bytes' order.
  table = _byte_chars()
  assert sorted(table.values()) == sorted(alphabet)
  vocab = {table[b]: b for b in range(256)}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
  return tokenizer


def _byte_chars() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character table."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def tasks(n: int, seed: int) -> list[dict[str, str]]:
  """`n` {prompt, completion} pairs drawn from `seed`: sums, differences, reversals, sorts."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    kind = int(rng.integers(4))
    if kind < 2:
      a, b = (int(x) for x in rng.integers(0, 100, size=2))
      op, value = ("+", a + b) if kind == 0 else ("-", a - b)
      out.append({"prompt": f"{a}{op}{b}=", "completion": str(value)})
    else:
      word = "".join(rng.choice(list(_LETTERS), size=int(rng.integers(3, 7))))
      verb, value = ("reverse", word[::-1]) if kind == 2 else ("sort", "".join(sorted(word)))
      out.append({"prompt": f"{verb} {word}:", "completion": value})
  return out


def write(folder: str, train: int = 20000, held_out: int = 200, seed: int = 0) -> dict[str, str]:
  """Writes tokenizer.json, train.jsonl and eval.jsonl into `folder` unless there already.

  The held-out prompts are drawn with another seed and any that also occur in train are
  left out, so exact match on them is not recall.

  Returns:
    {'tokenizer': path, 'train': path, 'eval': path}.
  """
  paths = {k: os.path.join(folder, f) for k, f in
           (("tokenizer", "tokenizer.json"), ("train", "train.jsonl"), ("eval", "eval.jsonl"))}
  if all(os.path.isfile(p) for p in paths.values()):
    return paths
  os.makedirs(folder, exist_ok=True)
  train_set = tasks(train, seed)
  seen = {t["prompt"] for t in train_set}
  eval_set = [t for t in tasks(3 * held_out, seed + 1) if t["prompt"] not in seen][:held_out]
  # Several processes may write at once: each its own temporary files, renamed last (the
  # tokenizer last of all), so a half-written folder is never read.
  tmp = {k: f"{p}.{os.getpid()}.tmp" for k, p in paths.items()}
  for key, rows in (("train", train_set), ("eval", eval_set)):
    with open(tmp[key], "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  byte_tokenizer().save(tmp["tokenizer"])
  for key in ("train", "eval", "tokenizer"):
    os.replace(tmp[key], paths[key])
  return paths


def chats(n: int, seed: int, system: str = "") -> list[dict[str, list[dict[str, str]]]]:
  """`tasks(n, seed)` as conversations: {"messages": [system?, user, assistant]} lines, for
  `data.name='sft'` through a chat template (the built-in Llama 3 one without a
  tokenizer_config.json)."""
  head = [{"role": "system", "content": system}] if system else []
  return [{"messages": head + [{"role": "user", "content": t["prompt"]},
                               {"role": "assistant", "content": t["completion"]}]}
          for t in tasks(n, seed)]
