"""Token data: three sources, checked before training, and resumable random batches.

The data room: the token sources here, `sft` (instruction and chat data, masks,
packing), `chat` (chat templates; jinja2, the `text` extra) and `sft_demo` (the embedded
SFT default). It imports no other zerojax room.

`load_tokens(config.data, vocab_size, seq_len)` gives (train, eval) flat token arrays:

- `stdlib` (default): the bytes of Python's own `.py` sources; no download, vocabulary 256.
- `tokens`: memory-mapped token-id files as nanoGPT / Megatron preprocessing writes them,
  `.bin` (raw ids of `data.dtype`, uint16 | uint32) or `.npy` (1-D, any integer dtype).
- `text`: `.txt` (the whole file is one document) or `.jsonl` (a JSON object per line, the
  document under `data.text_key`), encoded with a Hugging Face `tokenizer.json`
  (`pip install zerojax[text]`) and its special tokens (Llama 3's BOS, say), `data.eos_id`
  after each document, packed into one uint32 array in host memory. With `cache_dir` it is
  saved as `tokens-<file>-<hash>.npy` (itself a `tokens` source) and reused.

`data.eval_path` is a held-out file of the same kind; without it the last
`data.eval_fraction` is held out. Bad data raises one `DataError` naming the file and the fix.

Batch windows start at offsets that are a pure function of (seed, step), so resuming at
step k replays an uninterrupted run with no loader state to checkpoint. Each process
gathers only its rows (`process_rows`); `global_batch` makes them one sharded `jax.Array`.

    train, held_out = load_tokens(config.data, config.model.vocab_size, config.train.seq_len)
    rows = process_rows(16)
    local = {"tokens": batch_at(train, step, 16, 128, seed, rows=rows)}
    batch = global_batch(local, NamedSharding(mesh, P(("data", "fsdp"))))
"""

import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

# Directories that are not the stdlib (site-packages) or not representative source:
# tests are huge and full of odd literals, idlelib is an application, and encodings
# is ~1.4 MB of generated codec tables that would otherwise fill the held-out tail
# of a 4 MiB corpus and make the eval loss meaninglessly low.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "encodings",
              "__pycache__"}
_BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Token ids are scanned this many at a time, so checking a 100 GB file needs 64 MiB.
_SCAN_CHUNK = 1 << 24
# Documents handed to the tokenizer at once: enough for its threads, little memory.
_ENCODE_BATCH = 1024
# End-of-sequence tokens of common tokenizers, tried when tokenizer_config.json is absent
# (Llama 3's base models end documents with <|end_of_text|>, GPT-2 with <|endoftext|>).
_EOS_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>")
_CACHE_VERSION = 1  # Bump when the packing changes, so old caches are not reused.
# {path: (inode, size, mtime_ns, config key)} of each token file read_token_file mapped.
_OPENED: dict[str, tuple[int, int, int, str]] = {}


class DataError(ValueError):
  """Bad training data, explained for a person: the file, what is wrong, the fix."""

  def __init__(self, problem: str, *, path: str | None = None, key: str | None = None,
               fix: str | None = None):
    self.problem, self.path, self.key, self.fix = problem, path, key, fix
    head = f"{path} ({key})" if key and path else (path or key or "data")
    super().__init__(f"{head}: {problem}" + (f"\n  fix: {fix}" if fix else ""))


def stdlib_corpus(max_bytes: int = 4 << 20) -> np.ndarray:
  """The standard library's `.py` sources as uint8[n <= max_bytes], one token per byte.

  Files are taken in sorted relative-path order (skipping `_SKIP_DIRS`), joined by a
  newline and cut at `max_bytes`: the same on every run of the same Python version.

  Raises:
    DataError: if the standard library directory holds no `.py` files.
  """
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
    paths += [os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/")
              for f in files if f.endswith(".py")]
  chunks, total = [], 0
  for rel in sorted(paths):
    if total >= max_bytes:
      break
    with open(os.path.join(root, rel), "rb") as f:
      chunk = f.read() + b"\n"
    chunks.append(chunk)
    total += len(chunk)
  if not chunks:
    raise DataError("holds no .py files", path=root,
                    fix="use data.name='tokens' or 'text' with your own data")
  return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def _check_file(path: str, key: str) -> int:
  """The size of `path` in bytes, or a DataError if it is missing, a directory or empty."""
  if os.path.isdir(path):
    raise DataError("is a directory, not a file", path=path, key=key,
                    fix=f"set {key} to a file in it (one file per key; concatenate shards into "
                        "one)")
  if not os.path.isfile(path):
    raise DataError("no such file", path=path, key=key,
                    fix=f"set {key} to an existing file (relative paths start at the working "
                        "directory)")
  size = os.path.getsize(path)
  if size == 0:
    raise DataError("the file is empty", path=path, key=key,
                    fix="regenerate it; the preprocessing that wrote it probably failed")
  return size


def _watch(tokens: np.memmap, key: str) -> np.memmap:
  """Records a memory-mapped file's identity, size and mtime for `check_unchanged`."""
  st = os.stat(tokens.filename)
  _OPENED[tokens.filename] = (st.st_ino, st.st_size, st.st_mtime_ns, key)
  return tokens


def check_unchanged(tokens: np.ndarray) -> None:
  """Raises DataError if the file under a memory-mapped `tokens` changed since it was opened.

  A file truncated under its memmap kills the process with SIGBUS, no message, when a
  batch touches the lost pages; one rewritten in place feeds other tokens than were
  checked. One `os.stat` per call, before the batch is read: a change that lands during
  the read itself (a fraction of a millisecond per step) can still end in SIGBUS. A file
  replaced by a new one (a rename) or deleted is fine: the map keeps the old file's pages.
  """
  path = getattr(tokens, "filename", None)
  if path not in _OPENED:  # In memory, or not opened by read_token_file.
    return
  inode, size, mtime, key = _OPENED[path]
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return
  if st.st_ino == inode and (st.st_size, st.st_mtime_ns) != (size, mtime):
    what = (f"size {size} -> {st.st_size} bytes" if st.st_size != size else
            "rewritten in place, same size")
    raise DataError(f"changed while training ({what}); training reads it through a memory map, so "
                    "it must stay as it was until the run ends", path=path, key=key,
                    fix=f"write new data to a new file and point {key} at it; the same command "
                        "then resumes from the last checkpoint")


def read_token_file(path: str, dtype: str = "uint16", *, key: str = "data.path") -> np.ndarray:
  """A read-only 1-D memmap of a `.bin` (raw little-endian ids of `dtype`) or `.npy` file.

  Nothing is read until a batch touches it. `key` names the file's config key in errors.

  Raises:
    DataError: missing, empty or unknown file; a size or contents that do not fit the dtype;
      a non-integer or non-flat `.npy`.
  """
  size = _check_file(path, key)
  ext = os.path.splitext(path)[1].lower()
  if ext == ".bin":
    itemsize = np.dtype(_BIN_DTYPES[dtype]).itemsize
    if size % itemsize:
      raise DataError(f"{size} bytes is not a whole number of {dtype} ids ({itemsize} bytes "
                      "each): the file holds another dtype or is truncated", path=path, key=key,
                      fix="set data.dtype to the dtype the file was written with (uint16 | uint32)")
    tokens = np.memmap(path, dtype=_BIN_DTYPES[dtype], mode="r")
    # uint32 ids read as uint16 are all below the vocabulary, so the id scan misses them;
    # their little-endian high halves, though, are zeros at every odd position.
    head = np.asarray(tokens[:1 << 20])
    if dtype == "uint16" and len(head) >= 32 and not head[1::2].any() and head[0::2].any():
      raise DataError("every second uint16 id is 0: this looks like uint32 data", path=path,
                      key=key, fix="set data.dtype='uint32'")
    return _watch(tokens, key)
  if ext == ".npy":
    try:
      tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
      raise DataError(f"not a readable .npy file ({e})", path=path, key=key,
                      fix="write it with np.save(path, ids), ids a 1-D integer array") from None
    if not np.issubdtype(tokens.dtype, np.integer):
      raise DataError(f"holds {tokens.dtype} values, not integer token ids", path=path, key=key,
                      fix="save the ids as integers, e.g. np.save(path, ids.astype(np.uint32))")
    if tokens.ndim != 1:
      raise DataError(f"holds an array of shape {tokens.shape}, not a flat sequence of ids",
                      path=path, key=key, fix="save it flat: np.save(path, ids.reshape(-1))")
    if tokens.size == 0:
      raise DataError("holds no tokens", path=path, key=key, fix="regenerate it")
    return _watch(tokens, key)
  raise DataError(f"has extension {ext or '(none)'!r}; data.name='tokens' reads .bin (raw ids of "
                  "data.dtype) and .npy files", path=path, key=key,
                  fix="convert it, or use data.name='text' for .txt / .jsonl text")


def check_ids(tokens: np.ndarray, vocab_size: int, *, path: str, key: str | None = None) -> None:
  """Checks that every id is in [0, vocab_size), reading `_SCAN_CHUNK` ids at a time.

  Raises:
    DataError: naming the largest id found and the first position of an id out of range.
  """
  info = np.iinfo(tokens.dtype)
  if info.min >= 0 and info.max < vocab_size:  # The dtype cannot hold a bad id (uint16, 65536+).
    return
  first, largest = None, -1
  for start in range(0, len(tokens), _SCAN_CHUNK):
    chunk = np.asarray(tokens[start:start + _SCAN_CHUNK])
    if info.min < 0 and chunk.min() < 0:
      at = start + int(np.argmax(chunk < 0))
      raise DataError(f"token id {int(tokens[at])} at position {at} is negative", path=path,
                      key=key, fix="write ids as unsigned integers from the tokenizer")
    largest = max(largest, int(chunk.max()))
    if first is None and largest >= vocab_size:
      first = start + int(np.argmax(chunk >= vocab_size))
  if first is not None:
    fix = f"use model.vocab_size >= {largest + 1} (the tokenizer's vocabulary)"
    if tokens.dtype == np.uint32 and os.path.splitext(path)[1] == ".bin" and largest >= 1 << 16:
      # Two uint16 ids read as one uint32 make an id this large: the dtype is the likelier fault.
      fix = f"set data.dtype='uint16' if the file was written as uint16; else {fix}"
    raise DataError(f"token ids reach {largest}, but model.vocab_size is {vocab_size} (first id "
                    f"out of range at position {first})", path=path, key=key, fix=fix)


def load_tokenizer(path: str, vocab_size: int) -> Any:
  """Loads a Hugging Face `tokenizer.json` whose vocabulary fits the model's.

  Raises:
    DataError: `tokenizers` is not installed, or the file is missing, unreadable or has
      more ids than `vocab_size`.
  """
  try:
    from tokenizers import Tokenizer  # noqa: PLC0415  optional: the text extra
  except ImportError:
    raise DataError("data.name='text' needs the `tokenizers` package, which is not installed",
                    path=path, key="data.tokenizer", fix="pip install 'zerojax[text]'") from None
  _check_file(path, "data.tokenizer")
  try:
    tokenizer = Tokenizer.from_file(path)
  except Exception as e:  # The Rust side raises a bare Exception for every kind of failure.
    raise DataError(f"not a Hugging Face tokenizer.json ({e})", path=path, key="data.tokenizer",
                    fix="pass the tokenizer.json that tokenizers' save() or save_pretrained() "
                        "writes") from None
  n = tokenizer.get_vocab_size(with_added_tokens=True)
  if n > vocab_size:
    raise DataError(f"the tokenizer has {n} ids, more than model.vocab_size={vocab_size}",
                    path=path, key="data.tokenizer",
                    fix=f"use model.vocab_size >= {n} (often rounded up to a multiple of 128)")
  return tokenizer


def eos_token_id(tokenizer: Any, path: str, eos_id: int = -1) -> int:
  """The id put after every document: `eos_id`, or for -1 the tokenizer's own.

  The tokenizer's own is `eos_token` of a `tokenizer_config.json` next to `path` (how
  transformers records it), else the first of `_EOS_TOKENS` the vocabulary has.

  Raises:
    DataError: `eos_id` is beyond the tokenizer, or -1 and no end token is found.
  """
  n = tokenizer.get_vocab_size(with_added_tokens=True)
  if eos_id >= 0:
    if eos_id >= n:
      raise DataError(f"data.eos_id={eos_id} is not an id of this tokenizer ({n} ids)",
                      path=path, key="data.tokenizer",
                      fix=f"use an id below {n}, or -1 for the tokenizer's own")
    return eos_id
  return special_token_id(tokenizer, path, "eos_token", _EOS_TOKENS, "end-of-sequence",
                          "set data.eos_id to the id that separates documents")


def token_text(value: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  value = value.get("content") if isinstance(value, dict) else value
  return value if isinstance(value, str) else None


def special_token_id(tokenizer: Any, path: str, name: str, candidates: tuple[str, ...],
                     what: str, fix: str) -> int:
  """The id of `name` ('eos_token', 'bos_token') of the `tokenizer_config.json` next to
  `path`, else of the first of `candidates` the vocabulary has; else a DataError."""
  names = []
  config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
  if os.path.isfile(config_path):
    try:
      with open(config_path, encoding="utf-8") as f:
        names.append(token_text(json.load(f).get(name)))
    except (ValueError, OSError, AttributeError):
      pass  # A damaged side file only loses the hint; the list below still applies.
  for token in names + list(candidates):
    if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
      return tokenizer.token_to_id(token)
  raise DataError(f"the tokenizer has no {what} token zerojax knows (tokenizer_config.json's "
                  f"{name}, or one of {', '.join(candidates)})", path=path,
                  key="data.tokenizer", fix=fix)


def _documents(path: str, key: str, text_key: str) -> Iterator[str]:
  """The documents of a .txt (the whole file) or .jsonl (one object per line) file."""
  ext = os.path.splitext(path)[1].lower()
  if ext not in (".txt", ".jsonl"):
    raise DataError(f"has extension {ext or '(none)'!r}; data.name='text' reads .txt (one "
                    "document) and .jsonl (one JSON object per line)", path=path, key=key,
                    fix="convert it, or use data.name='tokens' for .bin / .npy token ids")
  try:
    # newline="": keep \r\n as written, the text is the data.
    with open(path, encoding="utf-8", newline="") as f:
      if ext == ".txt":
        yield f.read()
        return
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue  # Blank lines (a trailing newline, say) are not documents.
        try:
          record = json.loads(line)
        except ValueError as e:
          raise DataError(f"line {number} is not JSON ({e})", path=path, key=key,
                          fix="write one JSON object per line (JSON Lines)") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
          found = (", ".join(map(repr, record)) if isinstance(record, dict)
                   else type(record).__name__)
          raise DataError(f"line {number} has no string field {text_key!r} (found: "
                          f"{found or 'nothing'})", path=path, key=key,
                          fix="set data.text_key to the field that holds the text")
        yield record[text_key]
  except UnicodeDecodeError as e:
    raise DataError(f"is not UTF-8 text ({e})", path=path, key=key,
                    fix="re-encode it as UTF-8") from None


def tokenize_file(path: str, tokenizer: Any, eos_id: int, text_key: str = "text", *,
                  key: str = "data.path", cache_dir: str = "") -> np.ndarray:
  """Encodes a .txt or .jsonl file with `tokenizer` and packs it: doc, eos, doc, eos, ...

  With `cache_dir` the ids are saved there as .npy and reused while the file (path, size,
  mtime), the tokenizer, `text_key` and `eos_id` are unchanged.

  Returns:
    uint32[n], or a read-only memmap of the cached copy.

  Raises:
    DataError: a bad file or JSONL line (see `_documents`), or no text at all.
  """
  _check_file(path, key)
  stat = os.stat(path)
  cache = ""
  if cache_dir:
    digest = hashlib.sha256(json.dumps(
        [_CACHE_VERSION, os.path.abspath(path), stat.st_size, stat.st_mtime_ns, text_key, eos_id,
         tokenizer.to_str()]).encode()).hexdigest()[:16]
    cache = os.path.join(cache_dir, f"tokens-{os.path.basename(path)}-{digest}.npy")
    if os.path.isfile(cache):
      return np.load(cache, mmap_mode="r")
  pieces, batch = [], []

  def flush():  # One array per batch of documents: per-document arrays cost ~100 B each.
    ids = [i for e in tokenizer.encode_batch(batch) if e.ids for i in e.ids + [eos_id]]
    pieces.append(np.asarray(ids, np.uint32))
    batch.clear()

  for document in _documents(path, key, text_key):
    batch.append(document)
    if len(batch) == _ENCODE_BATCH:
      flush()
  flush()
  tokens = np.concatenate(pieces)
  if not len(tokens):
    raise DataError("holds no text to train on", path=path, key=key,
                    fix="check the file's contents")
  if cache:
    os.makedirs(cache_dir, exist_ok=True)
    # Every process (on every host) may write at once: each to its own unique temporary
    # file, then an atomic rename, so a reader never sees half a cache.
    with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".tmp", delete=False) as f:
      np.save(f, tokens)
    os.replace(f.name, cache)
  return tokens


def split(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval): views of `tokens[:n - k]` and `tokens[n - k:]`, k = int(n * eval_fraction)."""
  if not 0 < eval_fraction < 1:
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
  cut = len(tokens) - int(len(tokens) * eval_fraction)
  return tokens[:cut], tokens[cut:]


def load_tokens(config_data: Any, vocab_size: int, seq_len: int, *,
                cache_dir: str = "") -> tuple[np.ndarray, np.ndarray]:
  """The (train, eval) flat token arrays of source `config_data.name`, fully checked.

  Args:
    config_data: the config's `data` section.
    vocab_size: the model's vocabulary; every id must be below it.
    seq_len: tokens per example; each split needs at least seq_len + 1.
    cache_dir: where the `text` source keeps its tokenized copy; "" = no cache.

  Raises:
    DataError: naming the file and the fix, for any problem in the data.
  """
  d = config_data

  def read(path: str, key: str) -> np.ndarray:
    if d.name == "tokens":
      tokens = read_token_file(path, d.dtype, key=key)
      check_ids(tokens, vocab_size, path=path, key=key)
      return tokens
    # Ids of a tokenizer that fits the vocabulary fit it too: no scan needed.
    return tokenize_file(path, tokenizer, eos, d.text_key, key=key, cache_dir=cache_dir)

  if d.name == "stdlib":
    tokens, where = stdlib_corpus(), "the stdlib corpus"
    check_ids(tokens, vocab_size, path=where)
    train, held_out = split(tokens, d.eval_fraction)
    train_where = eval_where = where
  elif d.name in ("tokens", "text"):
    if d.name == "text":
      tokenizer = load_tokenizer(d.tokenizer, vocab_size)
      eos = eos_token_id(tokenizer, d.tokenizer, d.eos_id)
    train, train_where = read(d.path, "data.path"), d.path
    if d.eval_path:
      held_out, eval_where = read(d.eval_path, "data.eval_path"), d.eval_path
    else:
      train, held_out = split(train, d.eval_fraction)
      eval_where = f"{d.path} (its last data.eval_fraction={d.eval_fraction})"
  else:
    raise DataError(f"unknown data.name {d.name!r}", fix="use stdlib, tokens or text")
  splits = ((train, train_where, "train"), (held_out, eval_where, "held-out"))
  for tokens, where, split_name in splits:
    if len(tokens) < seq_len + 1:
      more = "" if d.eval_path or split_name == "train" else ", or a larger data.eval_fraction"
      raise DataError(f"the {split_name} split has {len(tokens)} tokens, fewer than "
                      f"train.seq_len + 1 = {seq_len + 1}", path=where,
                      fix=f"use more data or a shorter train.seq_len{more}")
  return train, held_out


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int,
             rows: slice | None = None) -> np.ndarray:
  """The batch of step `step`: random windows of `seq_len + 1` consecutive tokens.

  The start offsets depend only on (seed, step), never on earlier calls, so a run
  resumed at step k sees the same batches as one that never stopped.

  Args:
    tokens: [n] token ids (a memmap is fine: only the windows are read), n >= seq_len + 1.
    step: the optimizer step the batch is for.
    batch_size: windows in the global batch.
    seq_len: tokens per example; each window has one more, the last position's target.
    seed: the data seed.
    rows: if given (`process_rows(batch_size)`), only these rows are read: the same
      values as `batch_at(...)[rows]`.

  Returns:
    int32[batch_size or rows, seq_len + 1].

  Raises:
    ValueError: if the tokens are fewer than seq_len + 1.
    DataError: the memory-mapped file changed since it was opened (`check_unchanged`).
  """
  check_unchanged(tokens)
  n = len(tokens)
  if n < seq_len + 1:
    raise ValueError(f"the token source has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                     "use a shorter train.seq_len or more data")
  rng = np.random.default_rng([seed, step])
  # Every process draws all the offsets, so its rows do not depend on the process count.
  starts = rng.integers(0, n - seq_len, size=batch_size)
  if rows is not None:
    starts = starts[rows]
  return np.asarray(tokens)[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def rows_for(batch_size: int, process_index: int, process_count: int) -> slice:
  """The contiguous block of global-batch rows that process `process_index` feeds.

  Raises:
    ValueError: if the batch does not split evenly over the processes.
  """
  if batch_size % process_count:
    raise ValueError(f"a global batch of {batch_size} cannot be split over {process_count} "
                     "processes")
  per = batch_size // process_count
  return slice(process_index * per, (process_index + 1) * per)


def process_rows(batch_size: int) -> slice:
  """This process's rows of a global batch of `batch_size`: `rows_for` on this process.

  The mesh orders devices by process, so process i's devices hold the i-th contiguous
  block of rows; this is the block `jax.make_array_from_process_local_data` expects.
  """
  return rows_for(batch_size, jax.process_index(), jax.process_count())


def global_batch(local: Any, sharding: jax.sharding.Sharding) -> Any:
  """Assembles each process's rows into global `jax.Array`s with `sharding`.

  Args:
    local: a pytree of numpy arrays, this process's rows (`batch_at(..., rows=process_rows(B))`);
      on one process, the whole batch.
    sharding: the batch sharding, splitting the leading dimension over the data axes.
  """
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)
