"""Fine-tuning data (`data.name = 'sft'`): instruction JSONL, loss masks, packing, batches.

Each line of a `.jsonl` file is one example, either

- `{"prompt": ..., "completion": ...}`: [BOS] prompt completion [EOS] (`data.add_bos`,
  `data.add_eos`), prompt and completion tokenized apart so the boundary is exact; or
- `{"messages": [{"role": ..., "content": ...}, ...]}`: rendered with the model's chat
  template (`zerojax.data.chat`: the `tokenizer_config.json` beside `data.tokenizer`, else Llama
  3's), which writes its own special tokens. One example per conversation, or several
  where the template renders an earlier turn otherwise once later messages follow
  (`chat.assistant_examples`: each such turn as the template renders it at that turn).

The loss is on the completion / the assistant turns only (their end-of-turn token
included), or with `data.train_on = 'all'` on every token but the first. Lines that
cannot be used (not JSON, fields missing or empty, an unknown role, no assistant turn, a
template that refuses the conversation, too long for `train.seq_len` under
`data.too_long = 'drop'`) are skipped, counted by reason and reported with the first
line of each; a file with nothing usable left is a `DataError` (train.py: exit 2).

Batches are rows of `seq_len + 1` tokens. With `data.pack`, examples follow one another in
a row (first fit in the epoch's order), each with its own segment id and positions
restarting at 0, so the model's attention and RoPE treat each as if alone; without it a
row is one example and padding. The order is a permutation per (seed, epoch) and the
rows run on across epochs, so the batch of step s is a pure function of (seed, s):
resuming needs no loader state. Each process materializes only its rows.

    train, held_out, lines = load(config.data, config.model.vocab_size, config.train.seq_len)
    local = batch_at(train, step, 16, seed, rows=data.process_rows(16))
    # {'tokens': int32[b, T + 1], 'segment_ids', 'positions': int32[b, T],
    #  'loss_mask': float32[b, T]}
"""

import collections
import dataclasses
import json
import os
from typing import Any

import numpy as np

from zerojax.data import DataError, _check_file, eos_token_id, load_tokenizer, special_token_id

# Beginning-of-sequence tokens of common tokenizers, tried when tokenizer_config.json
# names none (Llama 3, Llama 2 / Mistral, Gemma, GPT-NeoX-style).
_BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


@dataclasses.dataclass
class Examples:
  """Tokenized examples, concatenated.

  Attributes:
    ids: int32[total] token ids of every example, one after another.
    mask: bool[total], True where a token is trained as a target (never an example's
      first token, which nothing in the example predicts).
    starts, lengths: int64[n], where each example lies in `ids`.
    row_len: tokens per row, train.seq_len + 1.
    pack: several examples per row.
    name: the file, for messages.
    lines: int64[n], the file's line of each example (a conversation can give several),
      so a held-out split keeps a conversation's examples together; None: one a line.
  """
  ids: np.ndarray
  mask: np.ndarray
  starts: np.ndarray
  lengths: np.ndarray
  row_len: int
  pack: bool
  name: str = ""
  lines: np.ndarray | None = None
  # Caches: {(seed, epoch): rows} of recent epochs, {(seed, epoch): row count} of all.
  _epochs: dict = dataclasses.field(default_factory=dict, repr=False)
  _counts: dict = dataclasses.field(default_factory=dict, repr=False)

  def __len__(self) -> int:
    return len(self.lengths)

  def subset(self, index: np.ndarray) -> "Examples":
    """The examples `index` (in that order), a copy."""
    parts = [np.arange(s, s + n) for s, n in zip(self.starts[index], self.lengths[index])]
    at = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    lengths = self.lengths[index]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return Examples(self.ids[at], self.mask[at], starts, lengths, self.row_len, self.pack,
                    self.name, None if self.lines is None else self.lines[index])


class _Skip(Exception):
  """One line that cannot be used: `reason` counts it, `detail` is shown for the first."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(reason)
    self.reason, self.detail = reason, detail


def bos_token_id(tokenizer: Any, path: str) -> int:
  """The tokenizer's BOS: tokenizer_config.json's `bos_token`, else one of `_BOS_TOKENS`.

  Raises:
    DataError: no BOS token is found.
  """
  return special_token_id(tokenizer, path, "bos_token", _BOS_TOKENS, "beginning-of-sequence",
                          "set data.add_bos=False")


def _prompt_completion(record: dict, tokenizer: Any, bos: int | None, eos: int | None
                       ) -> tuple[list[int], list[bool]]:
  for field in ("prompt", "completion"):
    if not isinstance(record.get(field), str):
      raise _Skip(f"no string field {field!r}")
  if not record["completion"].strip():
    raise _Skip("an empty completion")
  head = [bos] if bos is not None else []
  head += tokenizer.encode(record["prompt"], add_special_tokens=False).ids
  tail = tokenizer.encode(record["completion"], add_special_tokens=False).ids
  tail += [eos] if eos is not None else []
  return head + tail, [False] * len(head) + [True] * len(tail)


def _conversation(record: dict, tokenizer: Any, template: Any
                  ) -> list[tuple[list[int], list[bool]]]:
  from zerojax.data import chat  # noqa: PLC0415  optional: jinja2 (the text extra)
  messages = record["messages"]
  if not isinstance(messages, list) or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
      for m in messages):
    raise _Skip("'messages' is not a list of {role, content} strings")
  unknown = sorted({m["role"] for m in messages} - set(chat.ROLES))
  if unknown:
    raise _Skip("an unknown role", f"{unknown[0]!r}; known: {', '.join(chat.ROLES)}")
  if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
    raise _Skip("no assistant turn with content")
  try:
    pieces = chat.assistant_examples(template, messages)
  except chat.RenderError as e:
    raise _Skip("the chat template failed", str(e)) from None
  except chat.TemplateError as e:  # A property of the template, not of this line.
    raise DataError(str(e), key="data.tokenizer", fix="use a template whose generation "
                    "prompt is the beginning of the assistant's turn") from None
  out = []
  for text, spans in pieces:
    encoding = tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([start for start, _ in encoding.offsets] or [0])
    mask = np.zeros(len(encoding.ids), bool)
    for start, end in spans:
      mask |= (starts >= start) & (starts < end)
    out.append((encoding.ids, mask.tolist()))
  return out


def _fit(example: list[int], mask: list[bool], d: Any, row_len: int
         ) -> tuple[list[int], list[bool], bool]:
  """An example's tokens and mask under `data.train_on` and `data.too_long`, and whether it
  was truncated to `row_len` tokens.

  Raises:
    _Skip: too long to keep, or fewer than 2 tokens.
  """
  if d.train_on == "all":
    mask = [True] * len(mask)
  mask = [False] + list(mask[1:])  # Nothing in the example predicts its first token.
  cut = len(example) > row_len
  if cut:
    if d.too_long == "drop" or not any(mask[:row_len]):
      raise _Skip(f"longer than train.seq_len + 1 = {row_len} tokens",
                  f"{len(example)} tokens" + ("" if d.too_long == "drop" else
                                              ", nothing trained in the first part"))
    example, mask = example[:row_len], mask[:row_len]
  if len(example) < 2:
    raise _Skip("fewer than 2 tokens")
  return example, mask, cut


def turn_end_ids(tokenizer: Any, tokenizer_path: str) -> set[int]:
  """The ids that end an assistant's answer under the chat template beside the tokenizer
  (`_template`): its `eos_token`, and the special token its turns end with
  (`chat.turn_end`: Gemma 3's `<end_of_turn>`, which is not its EOS; ChatML's
  `<|im_end|>`; Llama 3's `<|eot_id|>`). What generation stops at and export writes.

  Raises:
    DataError: jinja2 is missing, or the template does not parse.
  """
  from zerojax.data import chat  # noqa: PLC0415  optional: jinja2 (the text extra)
  template = _template(tokenizer_path)
  ids = {tokenizer.token_to_id(template.tokens.get("eos_token") or "")}
  end = tokenizer.encode(chat.turn_end(template), add_special_tokens=False).ids
  if end and end[0] in tokenizer.get_added_tokens_decoder():  # A special token, not text.
    ids.add(end[0])
  return ids - {None}


def _template(tokenizer_path: str) -> Any:
  """`chat.load_template`, its problems as DataErrors (jinja2 missing, a bad template)."""
  try:
    from zerojax.data import chat  # noqa: PLC0415  optional: jinja2 (the text extra)
  except ImportError:
    raise DataError("chat data needs the `jinja2` package, which is not installed",
                    path=tokenizer_path, key="data.tokenizer",
                    fix="pip install 'zerojax[text]'") from None
  try:
    return chat.load_template(tokenizer_path)
  except chat.TemplateError as e:
    raise DataError(str(e), path=tokenizer_path, key="data.tokenizer",
                    fix="fix its tokenizer_config.json, or remove its chat_template to use "
                        "Llama 3's") from None


def read_examples(path: str, key: str, d: Any, tokenizer: Any, seq_len: int
                  ) -> tuple[Examples, str]:
  """The usable examples of a JSONL file and a line saying what was kept and skipped.

  Args:
    path: the .jsonl file; key: its config key (for messages).
    d: the config's data section (add_bos, add_eos, train_on, too_long, pack, eos_id,
      tokenizer).
    tokenizer: a `tokenizers.Tokenizer`.
    seq_len: train.seq_len; rows hold seq_len + 1 tokens.

  Raises:
    DataError: the file is missing, empty, not .jsonl, not UTF-8, its chat template is
      unusable, or no line is usable (the message counts each reason).
  """
  _check_file(path, key)
  if os.path.splitext(path)[1].lower() != ".jsonl":
    raise DataError("data.name='sft' reads .jsonl files (one JSON object per line)", path=path,
                    key=key, fix="write one {prompt, completion} or {messages} object per line")
  # BOS / EOS only for prompt/completion lines, looked up at the first: a chat file through a
  # tokenizer without a BOS (Qwen's) needs none, its template writes its own tokens.
  ends, template, row_len = None, None, seq_len + 1
  # reason -> [(line, detail)] per line, or per example of a split conversation.
  skips: dict[str, list] = collections.defaultdict(list)
  ids, masks, numbers, truncated, split = [], [], [], 0, 0
  try:
    with open(path, encoding="utf-8") as f:
      lines = list(enumerate(f, 1))
  except UnicodeDecodeError as e:
    raise DataError(f"is not UTF-8 text ({e})", path=path, key=key,
                    fix="re-encode it as UTF-8") from None
  for number, line in lines:
    if not line.strip():
      continue
    try:
      try:
        record = json.loads(line)
      except ValueError as e:
        raise _Skip("not JSON", str(e)) from None
      if not isinstance(record, dict):
        raise _Skip("not a JSON object")
      if "messages" in record:
        template = template or _template(d.tokenizer)
        pieces = _conversation(record, tokenizer, template)
        split += len(pieces) > 1
      elif "prompt" in record or "completion" in record:
        ends = ends or ((bos_token_id(tokenizer, d.tokenizer) if d.add_bos else None),
                        (eos_token_id(tokenizer, d.tokenizer, d.eos_id) if d.add_eos else None))
        pieces = [_prompt_completion(record, tokenizer, *ends)]
      else:
        raise _Skip("neither 'messages' nor 'prompt' and 'completion'",
                    f"found: {', '.join(map(repr, record)) or 'nothing'}")
    except _Skip as skip:
      skips[skip.reason].append((number, skip.detail))
      continue
    for example, mask in pieces:  # A split conversation's examples are kept or skipped apart.
      try:
        example, mask, cut = _fit(example, mask, d, row_len)
      except _Skip as skip:
        skips[skip.reason].append((number, skip.detail))
        continue
      truncated += cut
      ids.append(np.asarray(example, np.int32))
      masks.append(np.asarray(mask, bool))
      numbers.append(number)
  skipped = "; ".join(
      f"{len(at)} {reason} (first: line {at[0][0]}{': ' + at[0][1] if at[0][1] else ''})"
      for reason, at in sorted(skips.items(), key=lambda kv: -len(kv[1])))
  if not ids:
    raise DataError(f"no usable example: {skipped or 'no lines'}", path=path, key=key,
                    fix="see the reasons above; each line must be one {prompt, completion} or "
                        "{messages} object")
  lengths = np.array([len(x) for x in ids], np.int64)
  examples = Examples(np.concatenate(ids), np.concatenate(masks),
                      np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
                      lengths, row_len, d.pack, path, np.asarray(numbers, np.int64))
  line = (f"{path}: {len(ids)} examples, {int(lengths.sum())} tokens, "
          f"{int(examples.mask.sum())} trained"
          + (f", {split} conversations split where the chat template renders an earlier "
             "turn otherwise once later messages follow" if split else "")
          + (f", {truncated} truncated to {row_len} tokens" if truncated else "")
          + (f"; skipped {sum(map(len, skips.values()))}: {skipped}" if skips else ""))
  return examples, line


def pack_rows(lengths: np.ndarray, order: np.ndarray, row_len: int, pack: bool
              ) -> list[np.ndarray]:
  """Example indices per row: `order` cut into runs that fit `row_len` (first fit in
  order: a row is closed when the next example does not fit), or one example per row."""
  if not pack:
    return [order[i:i + 1] for i in range(len(order))]
  rows, start, used = [], 0, 0
  for i, n in enumerate(lengths[order]):
    if used + n > row_len:
      rows.append(order[start:i])
      start, used = i, 0
    used += n
  rows.append(order[start:])
  return rows


def epoch_rows(examples: Examples, seed: int, epoch: int) -> list[np.ndarray]:
  """The rows of epoch `epoch`: a permutation drawn from (seed, epoch), packed (cached)."""
  key = (seed, epoch)
  if key not in examples._epochs:
    if len(examples._epochs) > 4:  # A step reads one or two epochs; older ones go.
      examples._epochs.clear()
    order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    rows = pack_rows(examples.lengths, order, examples.row_len, examples.pack)
    examples._epochs[key] = rows
    examples._counts[key] = len(rows)
  return examples._epochs[key]


def rows_at(examples: Examples, first: int, count: int, seed: int) -> list[np.ndarray]:
  """Rows first..first+count-1 of the stream epoch 0, epoch 1, ... (example indices each).

  Epochs before the one holding `first` are counted, not kept: a resumed run packs each
  earlier epoch once (its row count is cached), then reads on from there.
  """
  out, epoch, at = [], 0, 0  # `at`: the stream position of this epoch's first row.
  while len(out) < count:
    n = examples._counts.get((seed, epoch))
    if n is None or first + len(out) < at + n:
      rows = epoch_rows(examples, seed, epoch)
      n, lo = len(rows), first + len(out) - at
      out += rows[lo:lo + count - len(out)] if lo < n else []
    at, epoch = at + n, epoch + 1
  return out


def batch_at(examples: Examples, step: int, batch_size: int, seed: int,
             rows: slice | None = None) -> dict[str, np.ndarray]:
  """The batch of step `step`: global rows step * batch_size onwards of the row stream.

  The trained tokens' weights are scaled so that they average 1 over the global batch's
  B x T positions: the model's mean over positions (and the train step's mean over
  devices and microbatches) is then the mean over the global batch's trained tokens.

  Args:
    examples: from `read_examples`.
    step: the optimizer step; batch_size: rows in the global batch; seed: the data seed.
    rows: this process's rows (`data.process_rows(batch_size)`); None = all.

  Returns:
    {'tokens': int32[b, T + 1], 'segment_ids': int32[b, T] (1, 2, ... per example of a
    row, 0 for padding), 'positions': int32[b, T] (from 0 in each example),
    'loss_mask': float32[b, T] (the weight of predicting tokens[:, 1:])}, b the rows read.
  """
  chosen = rows_at(examples, step * batch_size, batch_size, seed)
  trained = sum(int(examples.mask[_span(examples, r)].sum()) for r in chosen)
  scale = batch_size * (examples.row_len - 1) / max(trained, 1)
  chosen = chosen if rows is None else chosen[rows]
  L = examples.row_len
  tokens = np.zeros((len(chosen), L), np.int32)
  segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
  mask = np.zeros((len(chosen), L), np.float32)
  for r, row in enumerate(chosen):
    at = _span(examples, row)
    n = len(at)
    tokens[r, :n], mask[r, :n] = examples.ids[at], examples.mask[at] * scale
    lengths = examples.lengths[row]
    segments[r, :n] = np.repeat(np.arange(1, len(row) + 1), lengths)
    positions[r, :n] = np.arange(n) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  return {"tokens": tokens, "segment_ids": segments[:, :-1], "positions": positions[:, :-1],
          "loss_mask": mask[:, 1:]}


def _span(examples: Examples, row: np.ndarray) -> np.ndarray:
  """Indices into `examples.ids` of the examples of `row`, one after another."""
  return np.concatenate([np.arange(s, s + n) for s, n in
                         zip(examples.starts[row], examples.lengths[row])])


def batch_shapes(batch_size: int, seq_len: int) -> dict[str, tuple[tuple[int, ...], Any]]:
  """{key: (shape, dtype)} of a global batch (for compiling the step from abstract inputs)."""
  return {"tokens": ((batch_size, seq_len + 1), np.int32),
          "segment_ids": ((batch_size, seq_len), np.int32),
          "positions": ((batch_size, seq_len), np.int32),
          "loss_mask": ((batch_size, seq_len), np.float32)}


def load(d: Any, vocab_size: int, seq_len: int) -> tuple[Examples, Examples, list[str]]:
  """The (train, held-out) examples of the config's data section, and report lines.

  Held out: `data.eval_path`, else the last `data.eval_fraction` of `data.path`'s examples.

  Raises:
    DataError: a bad file, tokenizer or template, or no usable example in a split.
  """
  tokenizer = load_tokenizer(d.tokenizer, vocab_size)
  train, line = read_examples(d.path, "data.path", d, tokenizer, seq_len)
  lines = [line]
  if d.eval_path:
    held_out, line = read_examples(d.eval_path, "data.eval_path", d, tokenizer, seq_len)
    lines.append(line)
  else:
    k = int(len(train) * d.eval_fraction)
    cut = len(train) - k
    while 0 < k < len(train) and 0 < cut and train.lines[cut] == train.lines[cut - 1]:
      cut -= 1  # A split conversation's examples are held out together: they share turns.
    k = len(train) - cut
    if not 0 < k < len(train):
      raise DataError(f"{len(train)} usable examples leave {k} for evaluation at "
                      f"data.eval_fraction={d.eval_fraction}", path=d.path, key="data.path",
                      fix="use more examples, a larger data.eval_fraction or a data.eval_path")
    train, held_out = (train.subset(np.arange(cut)),
                       train.subset(np.arange(cut, len(train))))
    lines.append(f"held out: the last {k} examples (data.eval_fraction={d.eval_fraction})")
  kind = "packed" if d.pack else "one example per row, padded"
  lines.append(f"rows of {seq_len + 1} tokens, {kind}; loss on "
               + ("every token" if d.train_on == "all" else "completions / assistant turns"))
  return train, held_out, lines
