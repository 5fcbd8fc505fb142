"""Whether a checkpoint that failed to read is damaged: what its files show, not the error.

A read fails for two kinds of reasons. The checkpoint is damaged: a file is missing,
shorter than its index says, or holds bytes that do not decode. Or the read failed and
the files are fine: out of host memory, an I/O error of a flaky network mount, a bug.
The exception does not tell them apart (TensorStore raises `ValueError` for a truncated
file and for a bug in a spec alike, orbax wraps both in a bare `Exception`), and only
damage may move a checkpoint aside: anything else moved aside loses the training since
the one before it. So `find` looks at the files themselves:

- every file a restore needs exists (a missing one is `FileNotFoundError` from `stat`,
  not `os.path.exists`, which says False on any error, a stale NFS handle included);
- the JSON files parse;
- the state's OCDBT index decodes, and every data file it points to holds the bytes it
  points at (a truncated or missing data file; reads the index, not the data);
- only then the error itself: TensorStore found a value's bytes that do not decode
  (`DATA_LOSS`, a codec's complaint) with no OS error beside it. It read those bytes
  without an I/O error, so they are what the file holds.

Whatever else failed, or a check that itself fails (the mount still flaky), is not
damage: `find` says None and the checkpoint stays as it is.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

import tensorstore as ts

from zerojax.checkpoint import orbax_quirks

# Files no restore can do without (OCDBT layout). orbax calls a missing `_METADATA` a
# "pytree structure error", and a missing manifest a missing array: name the file.
NEEDED = ("meta/metadata", "state/_METADATA", "state/manifest.ocdbt")
# The JSON files a restore reads; `state/array_metadatas/process_*` too.
_JSON = ("meta/metadata", "state/_METADATA", "state/_sharding")
# TensorStore's messages start with the status code's name.
_STATUS = re.compile(r"([A-Z_]+): ")
# Bytes read without an I/O error that do not decode: a codec's or TensorStore's words.
_UNDECODABLE = re.compile(r"decod|decompress|Truncated \S+ stream|Invalid JSON", re.I)


def find(where: str, error: BaseException) -> str | None:
  """The damage of checkpoint `where` that its files show, in one line; None if they
  show none (`error`, the failed read, is then another failure: see the module)."""
  if not os.path.isdir(where):
    return None  # Gone (removed by someone, an unmounted disk): nothing to move aside.
  try:
    return _files(where) or _ocdbt(where) or _undecodable(error, where)
  except Exception:  # pylint: disable=broad-except  (a check that fails shows no damage)
    return None


def failure(error: BaseException, where: str) -> str:
  """One line on a failure that is not damage: the exception's name and cause."""
  chain = orbax_quirks.chain(error)
  root = next((e for e in chain if isinstance(e, (OSError, MemoryError)) or _tensorstore(e)),
              error)  # orbax's bare `Exception` around TensorStore's says nothing itself.
  text, kind = orbax_quirks.cause(root, where), type(root).__name__
  return text if text.startswith(kind) else f"{kind}: {text}"


def _missing(path: str) -> bool:
  """Whether `path` does not exist; another error of `stat` (EIO, ESTALE) is raised."""
  try:
    os.stat(path)
  except FileNotFoundError:
    return True
  return False


def _files(where: str) -> str | None:
  """A needed file missing, or a JSON file that does not parse."""
  for name in NEEDED:
    if _missing(os.path.join(where, name)):
      return f"its file {name} is missing"
  jsons = [*_JSON, *(os.path.relpath(p, where) for p in sorted(
      glob.glob(os.path.join(where, "state", "array_metadatas", "*"))))]
  for name in jsons:
    path = os.path.join(where, name)
    if _missing(path):
      continue  # Not needed (`_sharding`: the target gives the shardings).
    with open(path, "rb") as f:
      text = f.read()
    try:
      json.loads(text)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError.
      return f"its file {name} is not JSON ({len(text)} bytes: {e})"
  return None


def _ocdbt(where: str) -> str | None:
  """A file of the state's OCDBT index that does not decode, or a file it points to that
  is missing or shorter than the bytes it points at."""
  state = os.path.join(where, "state")
  files = ts.KvStore.open({"driver": "file", "path": state + os.sep}).result()
  seen: dict[str, int] = {}

  def dump(name: str, node: str | None = None) -> dict[str, Any]:
    try:
      return ts.ocdbt.dump(files, **({"node": node} if node else {})).result()
    except ValueError as e:
      if _undecodable_here(e):
        raise _Damage(f"its file state/{name} does not decode: {_short(e, where)}") from e
      raise

  def points_at(ref: str) -> str:
    """Checks the file of `ref` ("kind:base:file:offset:length") holds its bytes."""
    head, offset, length = ref.rsplit(":", 2)
    _, base, name = head.split(":", 2)
    name, end = base + name, int(offset) + int(length)
    if name not in seen:
      path = os.path.join(state, name)
      seen[name] = -1 if _missing(path) else os.path.getsize(path)
    if seen[name] < 0:
      raise _Damage(f"its file state/{name} is missing")
    if seen[name] < end:
      raise _Damage(f"file state/{name} is truncated ({seen[name]} bytes of at least {end})")
    return name

  def walk(node: str) -> None:
    for entry in dump(points_at(node), node).get("entries") or []:
      if "location" in entry:  # An inner node's child.
        walk(entry["location"])
      elif "indirect_value" in entry:  # Else inline: in the node itself.
        points_at(entry["indirect_value"])

  try:
    versions = dump("manifest.ocdbt").get("versions") or [{}]
    if root := (versions[-1].get("root") or {}).get("location"):
      walk(root)
  except _Damage as e:
    return str(e)
  return None


class _Damage(Exception):
  """A damage `_ocdbt` found (internal: ends the walk)."""


def _tensorstore(error: BaseException) -> str | None:
  """TensorStore's status code of `error` ("DATA_LOSS"), None if not TensorStore's."""
  m = _STATUS.match(str(error))
  return m[1] if m else None


def _undecodable_here(error: BaseException) -> bool:
  """Whether `error` is TensorStore saying bytes it read without an OS error do not
  decode (an OS error beside it says the read itself failed)."""
  status, text = _tensorstore(error), str(error)
  if not status or orbax_quirks.os_error(text) is not None:
    return False
  return status == "DATA_LOSS" or (status in ("FAILED_PRECONDITION", "INVALID_ARGUMENT")
                                   and _UNDECODABLE.search(text) is not None)


def _undecodable(error: BaseException, where: str) -> str | None:
  """The value `error` says does not decode (TensorStore read its bytes, without an OS
  error, and they are not what was written); None if it says no such thing."""
  for e in orbax_quirks.chain(error):
    if isinstance(e, (OSError, MemoryError)):
      return None  # The read itself failed.
    if _undecodable_here(e):
      return f"its data does not decode: {_short(e, where)}"
  return None


def _short(error: BaseException, where: str) -> str:
  """TensorStore's message in one line, paths relative to the checkpoint."""
  return orbax_quirks.cause(error, where).replace(where + os.sep, "")
