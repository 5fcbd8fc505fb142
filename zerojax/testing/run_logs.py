"""Reading back what the metrics writers wrote, with readers other than the writers.

`tensorboard_scalars`: every scalar event of a log directory, through the `tensorboard`
package's own EventAccumulator: what TensorBoard shows, or, without its purging, all
that the files hold (a step written twice, twice). `wandb_history`: the history rows of
W&B's offline run files (`run-<id>.wandb`: LevelDB's log format around W&B's `Record`
protobufs).
"""

import glob
import json
import os
import struct

_BLOCK = 32768  # LevelDB log blocks; a record's pieces never cross one.
_HEADER = 7  # crc32c (4), length (2), type (1).
_FULL, _FIRST, _LAST = 1, 2, 4


def tensorboard_scalars(logdir: str, purge: bool = True) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} over every event file in `logdir`: as TensorBoard shows
  them, or with `purge=False` all that the files hold (a step written twice, twice)."""
  from tensorboard.backend.event_processing import event_accumulator  # noqa: PLC0415  optional: the test extra
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},
      purge_orphaned_data=purge)
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(logdir: str) -> dict[int, str]:
  """{step: text} of the `config` text summaries."""
  from tensorboard.backend.event_processing import event_accumulator  # noqa: PLC0415  optional: the test extra
  acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.TENSORS: 0},
                                           purge_orphaned_data=False)
  acc.Reload()
  return {e.step: e.tensor_proto.string_val[0].decode()
          for e in acc.Tensors("config/text_summary")}


def _records(data: bytes, start: int):
  """The payloads of a LevelDB log (`data` from offset `start`), pieces joined."""
  pos, pieces = start, []
  while pos + _HEADER <= len(data):
    if _BLOCK - pos % _BLOCK < _HEADER:  # The block's tail is padding.
      pos += _BLOCK - pos % _BLOCK
      continue
    length, kind = struct.unpack_from("<HB", data, pos + 4)
    if length == 0 and kind == 0:  # Zeroed space: the end of what was written.
      break
    pieces.append(data[pos + _HEADER:pos + _HEADER + length])
    pos += _HEADER + length
    if kind in (_FULL, _LAST):
      yield b"".join(pieces)
      pieces = []
    elif kind == _FIRST:
      pieces = pieces[-1:]


def _started(path: str) -> tuple[str, int]:
  """A run file's start: `offline-run-<time>-<id>[-n]`, -n for a second start that second."""
  name = os.path.basename(os.path.dirname(path)).split("-")
  return name[2], int(name[4]) if len(name) > 4 else 0


def wandb_exit_codes(wandb_dir: str) -> list[tuple[str, int]]:
  """[(run id, exit code)] of every offline run under `wandb_dir` that finished, oldest
  first (W&B shows a nonzero code as a failed run)."""
  from wandb.proto import wandb_internal_pb2  # noqa: PLC0415  optional: the wandb extra
  codes = []
  for path in sorted(glob.glob(os.path.join(wandb_dir, "offline-run-*", "run-*.wandb")),
                     key=_started):
    with open(path, "rb") as f:
      data = f.read()
    for payload in _records(data, 7):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(payload)
      if record.WhichOneof("record_type") == "exit":
        codes.append((os.path.basename(path)[len("run-"):-len(".wandb")],
                      record.exit.exit_code))
  return codes


def wandb_history(wandb_dir: str) -> list[tuple[str, int, dict[str, float]]]:
  """[(run id, step, {key: value})] of every offline run under `wandb_dir`, oldest first."""
  from wandb.proto import wandb_internal_pb2  # noqa: PLC0415  optional: the wandb extra
  rows = []
  for path in sorted(glob.glob(os.path.join(wandb_dir, "offline-run-*", "run-*.wandb")),
                     key=_started):
    run_id = os.path.basename(path)[len("run-"):-len(".wandb")]
    with open(path, "rb") as f:
      data = f.read()
    assert data[:4] == b":W&B", path  # W&B's 7-byte file header, then the log.
    for payload in _records(data, 7):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(payload)
      if record.WhichOneof("record_type") == "history":
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                 for i in record.history.item}
        rows.append((run_id, int(items.pop("_step")),
                     {k: v for k, v in items.items() if not k.startswith("_")}))
  return rows
