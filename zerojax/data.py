"""Token data: a corpus every Python installation carries, and resumable random batches.

The corpus is the bytes of the Python standard library's own `.py` sources, so the
quick start and the tests need no download. Batches are random windows whose start
offsets are a pure function of (seed, step): resuming at step k replays exactly the
batches an uninterrupted run saw, with no data-loader state to checkpoint.

On several hosts each process builds only its own rows of the global batch
(`process_rows`) and `global_batch` stitches them into one sharded `jax.Array`.

    tokens = stdlib_corpus()
    train, held_out = split(tokens, 0.05)
    rows = process_rows(16)
    local = {"tokens": batch_at(train, step, 16, 128, seed)[rows]}
    batch = global_batch(local, NamedSharding(mesh, P(("data", "fsdp"))))
"""

import os
import sysconfig
from typing import Any

import jax
import numpy as np

# Directories that are not the stdlib (site-packages) or not representative source:
# tests are huge and full of odd literals, idlelib is an application, and encodings
# is ~1.4 MB of generated codec tables that would otherwise fill the held-out tail
# of a 4 MiB corpus and make the eval loss meaninglessly low.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "encodings",
              "__pycache__"}


def stdlib_corpus(max_bytes: int = 4 << 20) -> np.ndarray:
  """The Python standard library's `.py` sources as bytes.

  Files are taken in sorted relative-path order (skipping site-packages, test/tests
  directories, idlelib and the generated codec tables of encodings), joined by a newline and cut at `max_bytes`, so the result
  is the same on every run of the same Python version. Nothing is cached on disk.

  Args:
    max_bytes: at most this many bytes are returned.

  Returns:
    uint8[n] with n <= max_bytes: the text, one token per byte (vocabulary 256).

  Raises:
    ValueError: if the standard library directory holds no `.py` files.
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
    raise ValueError(f"no .py files found under the standard library directory {root}")
  return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def split(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """Splits off the last `eval_fraction` of the tokens as held-out data.

  Args:
    tokens: [n] token ids.
    eval_fraction: share held out, in (0, 1).

  Returns:
    (train, eval): views of `tokens[:n - k]` and `tokens[n - k:]`, k = int(n * eval_fraction).
  """
  if not 0 < eval_fraction < 1:
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
  cut = len(tokens) - int(len(tokens) * eval_fraction)
  return tokens[:cut], tokens[cut:]


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int,
             seed: int) -> np.ndarray:
  """The batch of step `step`: random windows of `seq_len + 1` consecutive tokens.

  The start offsets depend only on (seed, step), never on earlier calls, so a run
  resumed at step k sees the same batches as one that never stopped.

  Args:
    tokens: [n] token ids, n >= seq_len + 1.
    step: the optimizer step the batch is for.
    batch_size: windows in the batch (the global batch; slice with `process_rows`).
    seq_len: tokens per example the model reads; each window has one more, the target
      of the last position.
    seed: the data seed.

  Returns:
    int32[batch_size, seq_len + 1].

  Raises:
    ValueError: if the tokens are fewer than seq_len + 1.
  """
  n = len(tokens)
  if n < seq_len + 1:
    raise ValueError(f"the token source has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                     "use a shorter train.seq_len or more data")
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, n - seq_len, size=batch_size)
  return np.asarray(tokens)[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def process_rows(batch_size: int) -> slice:
  """The rows of the global batch that this process feeds.

  The mesh orders devices by process, so process i's devices hold the i-th contiguous
  block of rows; this is the block `jax.make_array_from_process_local_data` expects.

  Args:
    batch_size: the global batch size, divisible by the number of processes.

  Returns:
    A slice of the leading (example) dimension.
  """
  count, index = jax.process_count(), jax.process_index()
  if batch_size % count:
    raise ValueError(f"a global batch of {batch_size} cannot be split over {count} processes")
  per = batch_size // count
  return slice(index * per, (index + 1) * per)


def global_batch(local: Any, sharding: jax.sharding.Sharding) -> Any:
  """Assembles each process's rows into global, sharded arrays.

  Args:
    local: a pytree of numpy arrays, this process's rows (`batch[process_rows(B)]`);
      on one process, the whole batch.
    sharding: the batch sharding, splitting the leading dimension over the data axes.

  Returns:
    The same pytree of `jax.Array`s with the global leading dimension.
  """
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)
