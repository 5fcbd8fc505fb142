"""Safetensors files: check and index a folder's files, write them tensor by tensor.

A safetensors file is an 8-byte little-endian header length n, then n bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}}, offsets relative to the data
after the header, optional "__metadata__"), then the tensors' raw little-endian bytes.
A Hugging Face folder holds one `model.safetensors`, or `model-0000i-of-0000N` files
named tensor by tensor in `model.safetensors.index.json`.

Reading goes through `safetensors.safe_open` (memory-mapped); this module only checks
the headers first (`read_header`, `tensor_index`). Writing is done here (`write_file`,
`write_folder`): the header is known before any data, so tensors can be produced and
written one at a time and host memory holds one tensor, where
`safetensors.numpy.save_file` needs the whole dict in memory.
"""

import contextlib
import json
import math
import os
import re
import struct
from typing import Callable

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors dtype codes <-> numpy (bfloat16 is ml_dtypes', as jnp.bfloat16 is).
DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
CODES = {v: k for k, v in DTYPES.items()}
# What the writers take: (name, shape, produce), produce() -> the tensor, on every process.
Tensors = list[tuple[str, tuple, Callable[[], np.ndarray]]]


class HFError(ValueError):
  """A Hugging Face folder or file that cannot be imported: names the file and the fix.

  Raised here and by `zerojax.hf` (which re-exports it as `hf.HFError`).
  """

  def __init__(self, problem: str, *, path: str | None = None, fix: str | None = None):
    self.problem, self.path, self.fix = problem, path, fix
    super().__init__(f"{path or 'hugging face import'}: {problem}" +
                     (f"\n  fix: {fix}" if fix else ""))


def read_header(path: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
  """{name: (dtype, shape)} of a safetensors file, its sizes checked.

  The file size is checked against the header's offsets before any data is read: a
  truncated download fails now, with its name, not as a bus error halfway through a
  memory-mapped read.

  Raises:
    HFError: unreadable, malformed or truncated file, or a dtype we do not read.
  """
  damaged = lambda problem: HFError(problem, path=path, fix="download it again")
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      n = int.from_bytes(f.read(8), "little")
      if not 0 < n <= size - 8:
        raise damaged(f"not a safetensors file (header length {n}, file {size} bytes)")
      header = json.loads(f.read(n))
    entries = {k: (e["dtype"], tuple(e["shape"]), e["data_offsets"])
               for k, e in header.items() if k != "__metadata__"}
  except HFError:
    raise
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise damaged(f"cannot read the safetensors header: {e!r}") from None
  out, data_end = {}, 0
  for name, (code, shape, (begin, end)) in entries.items():
    if code not in DTYPES:
      raise HFError(f"tensor {name} has dtype {code!r}; zerojax reads {sorted(DTYPES)}", path=path)
    if end - begin != math.prod(shape) * DTYPES[code].itemsize:
      raise damaged(f"tensor {name}: header offsets {begin}..{end} do not fit {code}{list(shape)}")
    out[name], data_end = (DTYPES[code], shape), max(data_end, end)
  if 8 + n + data_end > size:
    raise damaged(f"truncated: its header needs {8 + n + data_end} bytes, the file has {size}")
  return out


def tensor_index(folder: str) -> dict[str, tuple[str, np.dtype, tuple[int, ...]]]:
  """{HF tensor name: (file, dtype, shape)} over the folder's safetensors files.

  Files: those of `model.safetensors.index.json` if present, else `model.safetensors`,
  else every `*.safetensors` file. Every header is read and checked (`read_header`).

  Raises:
    HFError: no safetensors files, a file the index names that is missing, a tensor
      the index places in a file that lacks it, a tensor in two files.
  """
  index_path = os.path.join(folder, INDEX)
  weight_map = None
  if os.path.isfile(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise HFError(f"cannot read its weight_map: {e!r}", path=index_path) from None
    files = sorted(set(weight_map.values()))
  elif os.path.isfile(os.path.join(folder, SINGLE)):
    files = [SINGLE]
  else:
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
  if not files:
    raise HFError(f"no safetensors files ({SINGLE} or {INDEX})", path=folder,
                  fix="download the weights in safetensors format")
  out = {}
  for name in files:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      raise HFError(f"missing: {INDEX} names it", path=path, fix="download it")
    for tensor, (dtype, shape) in read_header(path).items():
      if tensor in out:
        raise HFError(f"tensor {tensor} is in {out[tensor][0]} too", path=path)
      out[tensor] = (path, dtype, shape)
  for tensor, name in (weight_map or {}).items():
    if out.get(tensor, (None,))[0] != os.path.join(folder, name):
      raise HFError(f"missing tensor {tensor} ({INDEX} places it here)",
                    path=os.path.join(folder, name), fix="download the file again")
  return out


def write_file(path: str, tensors: Tensors, dtype: np.dtype, write: bool) -> None:
  """Writes one safetensors file, one tensor in host memory at a time.

  The header (names, dtypes, shapes, offsets) is known before any data, so it is
  written first and the tensors streamed after it, in header order. Each tensor's
  `produce()` runs on every process (it may be a collective); only the process with
  `write` touches the file, via `<path>.tmp` renamed at the end (a failed export
  leaves no file that looks whole). Bytes are written in the host's order:
  little-endian, as safetensors wants, on x86 and Arm.
  """
  header, offset = {"__metadata__": {"format": "pt"}}, 0  # "pt": what transformers expects.
  for name, shape, _ in tensors:
    size = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # The data starts 8-byte aligned, as safetensors pads it.
  with open(path + ".tmp", "wb") if write else contextlib.nullcontext() as f:
    if f:
      f.write(struct.pack("<Q", len(blob)) + blob)
    for name, shape, produce in tensors:
      x = np.ascontiguousarray(produce(), dtype=dtype)
      assert x.shape == tuple(shape), (name, x.shape, shape)
      if f:
        f.write(x.reshape(-1).view(np.uint8).data)  # No bytes copy of the tensor.
  if write:
    os.replace(path + ".tmp", path)


def write_folder(folder: str, tensors: Tensors, dtype: np.dtype, max_shard_size: int,
                 write: bool) -> list[str]:
  """Writes `tensors` as a Hugging Face folder's weights; returns the file names, in order.

  The tensors, in their order, are packed greedily into files of at most
  `max_shard_size` bytes (one larger tensor gets a file of its own), as
  `save_pretrained` does: `model.safetensors` if one file, else
  `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`. Weights of an
  earlier export in `folder` are removed first: they would be read instead of (an
  index) or with these. `write` as in `write_file`: every process calls this.
  """
  groups, size = [[]], 0
  for t in tensors:
    nbytes = math.prod(t[1]) * dtype.itemsize
    if groups[-1] and size + nbytes > max_shard_size:
      groups, size = groups + [[]], 0
    groups[-1].append(t)
    size += nbytes
  n = len(groups)
  names = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
  if write:
    os.makedirs(folder, exist_ok=True)
    for stale in os.listdir(folder):
      if stale in (SINGLE, INDEX) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", stale):
        os.remove(os.path.join(folder, stale))
  for name, group in zip(names, groups):
    write_file(os.path.join(folder, name), group, dtype, write)
  if write and n > 1:
    total = sum(math.prod(t[1]) for g in groups for t in g) * dtype.itemsize
    with open(os.path.join(folder, INDEX), "w") as f:
      weight_map = {t[0]: name for name, g in zip(names, groups) for t in g}
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names
