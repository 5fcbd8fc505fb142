"""Checkpoints: exact resume, restore onto other meshes and stages, damage, retention."""

import asyncio
import collections
import errno
import functools
import gc
import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint._src.serialization import serialization

import zerojax
import zerojax.train
from zerojax import checkpoint, optim
from zerojax.checkpoint import checksums, orbax_quirks
from zerojax.models.mlp_lm import MlpLM
from zerojax.run import preemption
from zerojax.runtime import exits
from zerojax.step import state_shardings

from test_train import TINY, checkpoint_files

KEY = jax.random.key(0)


def make_plan(stage, dtype=jnp.bfloat16, devices=None):
  """(model, tx, plan) of the small test LM on `devices` (all by default)."""
  model = MlpLM(vocab_size=64, d_model=64, d_ff=128, n_layers=2, context=4,
                param_dtype=dtype, compute_dtype=dtype)
  if dtype == jnp.bfloat16:
    tx = optim.adamw(1e-3, b2=0.95, update_rule="kahan", state_dtype=jnp.bfloat16)
  else:
    tx = optim.adamw(1e-3)
  plan = zerojax.make_plan(zerojax.make_mesh(1, -1, devices=devices), stage,
                           jax.eval_shape(model.init, KEY), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  return model, tx, plan


@functools.cache
def compiled(stage, dtype=jnp.bfloat16):
  """(plan, train_step, initial state on the host), built once: compiling dominates."""
  model, tx, plan = make_plan(stage, dtype)
  return plan, zerojax.make_train_step(plan, model.loss, tx), jax.device_get(
      zerojax.init_state(plan, model.init, tx, KEY))


def initial_state(stage, dtype=jnp.bfloat16):
  """A fresh sharded initial state (its own buffers: train steps donate them)."""
  plan, _, host = compiled(stage, dtype)
  return jax.device_put(host, state_shardings(plan))


def batch(step):
  return {"tokens": jax.random.randint(jax.random.key(100 + step), (8, 9), 0, 64)}


def host_bytes(state):
  """Every leaf as raw bytes: equal means bit-identical."""
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(state))]


def at_step(state, step):
  """`state` as if `step` steps had been taken (a checkpoint's step is its state's)."""
  return state._replace(step=jax.device_put(np.int32(step), state.step.sharding))


def new_state(stage=3, dtype=jnp.bfloat16, steps=2):
  plan, train_step, _ = compiled(stage, dtype)
  state = initial_state(stage, dtype)
  for i in range(steps):  # Moments and Kahan buffers away from their zero init.
    state, _ = train_step(state, batch(i))
  return plan, state


@pytest.mark.parametrize("stage,dtype", [(1, jnp.bfloat16),
                                         (3, jnp.float32), (3, jnp.bfloat16)])
def test_exact_resume(tmp_path, stage, dtype):
  _, train_step, _ = compiled(stage, dtype)
  state = initial_state(stage, dtype)
  ckpt = checkpoint.Checkpointer(tmp_path, save_every_steps=3)
  straight = []
  for step in range(1, 7):
    state, m = train_step(state, batch(step - 1))
    straight.append(float(m["loss"]))
    if step == 3:
      at_3 = host_bytes(state)  # Before the async save; the next step donates `state`.
    assert ckpt.maybe_save(step, state, {"run": "a"}) == (step in (3, 6))
  ckpt.close()

  # A new process, in effect: a fresh plan and checkpointer. (The step function is
  # reused: compiling it again would give the same program, and take most of the time.)
  plan = make_plan(stage, dtype)[2]
  with checkpoint.Checkpointer(tmp_path, save_every_steps=3) as ckpt:
    state, meta = ckpt.restore(3, plan)
  assert host_bytes(state) == at_3
  assert int(state.step) == 3 and meta["data_position"] == 3 and meta["run"] == "a"
  resumed = straight[:3]
  for step in range(4, 7):
    state, m = train_step(state, batch(step - 1))
    resumed.append(float(m["loss"]))
  assert resumed == straight
  with checkpoint.Checkpointer(tmp_path, save_every_steps=3) as ckpt:
    final, _ = ckpt.restore(6, plan)
  assert host_bytes(state) == host_bytes(final)


def test_restore_onto_other_meshes_and_stages(tmp_path):
  _, state = new_state(stage=3)  # 8 devices, mesh (1, 8).
  saved = host_bytes(state)
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1) as ckpt:
    ckpt.save(2, state)
  for stage, n in [(1, 4), (0, 1)]:
    plan = make_plan(stage, devices=jax.devices()[:n])[2]
    with checkpoint.Checkpointer(tmp_path, save_every_steps=1) as ckpt:
      restored, _ = ckpt.restore_latest(zerojax.abstract_state(plan))
    assert host_bytes(restored) == saved
    for x, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state_shardings(plan))):
      assert x.sharding.is_equivalent_to(s, x.ndim) and len(x.sharding.device_set) == n
    sharded = [not x.sharding.is_fully_replicated for x in jax.tree.leaves(restored)]
    assert any(sharded) == (stage > 0)  # Stage 1: the optimizer state over 4 devices.


def largest_data_file(step_dir) -> tuple[str, int]:
  """(path, end) of the data file the state's OCDBT index points furthest into, and the
  end of the bytes it points at there. Not the largest file on disk: orbax's writes may
  leave bytes that no index entry points at (a 112,934-byte file of which the index used
  53,551), and cutting or garbling only those damages nothing."""
  state = os.path.join(step_dir, "state")
  files = ts.KvStore.open({"driver": "file", "path": state + os.sep}).result()
  ends = collections.Counter()

  def points_at(ref):  # "kind:base:file:offset:length"
    head, offset, length = ref.rsplit(":", 2)
    _, base, name = head.split(":", 2)
    ends[base + name] = max(ends[base + name], int(offset) + int(length))

  def walk(node):
    points_at(node)
    for entry in ts.ocdbt.dump(files, node=node).result().get("entries") or []:
      if "location" in entry:
        walk(entry["location"])
      elif "indirect_value" in entry:
        points_at(entry["indirect_value"])

  walk(ts.ocdbt.dump(files).result()["versions"][-1]["root"]["location"])
  name, end = max(((n, e) for n, e in ends.items() if "/d/" in "/" + n), key=lambda x: x[1])
  return os.path.join(state, name), end


# Files a damaged checkpoint may lack, and the reason the error gives for each damage.
MISSING = {"no_meta": "meta/metadata", "no_metadata": "state/_METADATA",
           "no_manifest": "state/manifest.ocdbt"}
DATA_FILE = r"state/(ocdbt\.process_0/)?d/\w+"
REASONS = {"swapped": "fail their checksums",
           "truncated": r"cannot read the state: file state/d/\w+ is truncated \(\d+ bytes",
           "no_meta": "cannot read its meta: its file meta/metadata is missing",
           "no_metadata": "cannot read the state: its file state/_METADATA is missing",
           "no_manifest": "cannot read the state: its file state/manifest.ocdbt is missing",
           # The largest data file only (an array's chunks): found in the index's pointers.
           "one_truncated": rf"cannot read the state: file {DATA_FILE} is truncated \(\d+ bytes",
           "one_missing": rf"cannot read the state: its file {DATA_FILE} is missing",
           # Random bytes: the index (DATA_LOSS) or an array's chunk (zstd) does not decode.
           "garbage": "cannot read the state: .*does not decode: ",
           "one_garbage": "cannot read the state: .*does not decode: ",
           "bad_json": r"cannot read the state: its file state/_METADATA is not JSON \(",
           "tree": (r"its state is not the tree its meta lists: 1 arrays absent or of another "
                    r"shape or dtype \(first: params/layers/w_in\)")}


def garble(path):
  """Overwrites the file `path` with as many random bytes."""
  size = os.path.getsize(path)
  with open(path, "wb") as f:
    f.write(np.random.default_rng(0).bytes(size))


def damage_state(step_dir, damage):
  """Damages the state of the checkpoint `step_dir` as `damage` (a key of REASONS) says."""
  state = os.path.join(step_dir, "state")
  data_files = glob.glob(os.path.join(state, "**", "d", "*"), recursive=True)
  if damage == "truncated":  # Every data file: which ones the arrays still use varies.
    for path in data_files:
      os.truncate(path, os.path.getsize(path) // 2)
  elif damage == "garbage":
    for path in data_files:
      garble(path)
  elif damage == "one_truncated":  # Inside the bytes the index points at.
    path, end = largest_data_file(step_dir)
    os.truncate(path, end // 2)
  elif damage == "one_missing":
    os.remove(largest_data_file(step_dir)[0])
  elif damage == "one_garbage":
    garble(largest_data_file(step_dir)[0])
  elif damage == "bad_json":  # Cut short.
    os.truncate(os.path.join(state, "_METADATA"), 100)
  elif damage == "tree":  # An index that lacks an array the meta lists.
    with open(os.path.join(state, "_METADATA")) as f:
      index = json.load(f)
    del index["tree_metadata"]["('params', 'layers', 'w_in')"]
    with open(os.path.join(state, "_METADATA"), "w") as f:
      json.dump(index, f)
  else:
    os.remove(os.path.join(step_dir, MISSING[damage]))


# Reads still in flight when the first one failed must end before their event loop:
# else each is an "Event loop is closed" that Python reports as unraisable.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", REASONS)
def test_damaged_checkpoint_is_skipped(tmp_path, damage):
  plan, state = new_state(steps=1)
  messages = []
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1, log=messages.append) as ckpt:
    ckpt.save(1, state)
    older = host_bytes(state)
    state, _ = compiled(3)[1](state, batch(5))
    ckpt.save(2, state)
  step_2 = os.path.join(tmp_path, "2")
  if damage == "swapped":  # Intact files of another state: only the checksums see it.
    shutil.rmtree(os.path.join(step_2, "state"))
    shutil.copytree(os.path.join(tmp_path, "1", "state"), os.path.join(step_2, "state"))
  else:
    damage_state(step_2, damage)
  # A save killed before its commit (what SIGKILL mid-save leaves): never a checkpoint.
  shutil.copytree(os.path.join(tmp_path, "1"), os.path.join(tmp_path, "3.orbax-checkpoint-tmp"))

  with checkpoint.Checkpointer(tmp_path, save_every_steps=1, log=messages.append) as ckpt:
    assert ckpt.all_steps() == [1, 2]
    with pytest.raises(checkpoint.DamagedCheckpointError, match=REASONS[damage]) as e:
      ckpt.restore(2, plan)
    assert "\n" not in str(e.value) and "tensorstore_spec" not in str(e.value)
    restored, meta = ckpt.restore_latest(plan)
    assert meta["step"] == 1 and host_bytes(restored) == older
    assert ckpt.all_steps() == [1]
  assert "checkpoint step 2 skipped, damaged" in messages[0]
  assert sorted(os.listdir(tmp_path)) == ["1", "2.damaged"]  # The tmp dir cleaned up.

  shutil.rmtree(os.path.join(tmp_path, "1"))  # Nothing intact left: an error, not a fresh start.
  os.rename(os.path.join(tmp_path, "2.damaged"), os.path.join(tmp_path, "2"))
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1, log=messages.append) as ckpt:
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint"):
      ckpt.restore_latest(plan)


def fail_reads_of(step, error, monkeypatch):
  """Makes orbax's read of each array of checkpoint `step` raise `error`."""
  read = serialization.async_deserialize

  async def failing(sharding, spec, *args, **kwargs):
    if f"{os.sep}{step}{os.sep}state{os.sep}" in str(spec):
      raise error
    return await read(sharding, spec, *args, **kwargs)

  monkeypatch.setattr(serialization, "async_deserialize", failing)


# Failures of a read of intact files: what the error says is the cause, nothing more. The
# last is a short read as TensorStore words a truncated file: the files say otherwise.
NOT_DAMAGE = {
    "io_error": (OSError(errno.EIO, "Input/output error"), "OSError: Input/output error"),
    "out_of_memory": (MemoryError(), "MemoryError"),
    "short_read": (ValueError('OUT_OF_RANGE: Error reading "params.embed/0.0" in OCDBT database: '
                              "Requested byte range [0, 49438) is not valid for value of size "
                              "24719"), "ValueError: OUT_OF_RANGE: Error reading"),
}


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("failure", NOT_DAMAGE)
def test_a_failed_read_of_an_intact_checkpoint_moves_nothing(tmp_path, monkeypatch, failure):
  """A flaky mount or a full host memory is no damage: restore_latest stops with one line
  naming the cause and the checkpoint, touches no file, and the checkpoint resumes once
  the read works again."""
  error, says = NOT_DAMAGE[failure]
  plan, state = new_state(steps=1)
  messages = []
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1, log=messages.append) as ckpt:
    ckpt.save(1, state)
    state, _ = compiled(3)[1](state, batch(5))
    newest = host_bytes(state)
    ckpt.save(2, state)
  before = checkpoint_files(tmp_path)
  fail_reads_of(2, error, monkeypatch)
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1, log=messages.append) as ckpt:
    with pytest.raises(checkpoint.RestoreError) as e:
      ckpt.restore_latest(plan)
  assert str(e.value).startswith(f"checkpoint {tmp_path}/2: cannot read the state: {says}")
  assert str(e.value).endswith("; its files show no damage, so it is left as it is: rerun "
                               "once the cause is fixed")
  assert "\n" not in str(e.value) and "tensorstore_spec" not in str(e.value)
  assert messages == [] and checkpoint_files(tmp_path) == before  # Nothing moved or written.
  monkeypatch.undo()  # The mount is back.
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1, log=messages.append) as ckpt:
    restored, meta = ckpt.restore_latest(plan)
  assert meta["step"] == 2 and host_bytes(restored) == newest and messages == []


def test_train_exits_8_when_a_restore_fails_and_moves_nothing(tmp_path, monkeypatch, capsys):
  """train.py in this process, tiny shapes: checkpoints 1 and 2, then a rerun whose reads
  of checkpoint 2 fail with an I/O error: one line, exits.RESTORE_FAILED, and no file of
  the workdir touched but the rerun's metrics lines."""
  args = ["--config", TINY, "--config.model.d_model=32", "--config.model.n_layers=1",
          "--config.model.n_heads=2", "--config.model.n_kv_heads=1", "--config.model.d_ff=64",
          "--config.model.attention_block=16", "--config.model.loss_chunk=16",
          "--config.train.seq_len=16", "--config.train.global_batch_size=8",
          "--config.train.steps=2", "--config.train.eval_every=0",
          "--config.optimizer.warmup_steps=1", "--config.checkpoint.every_steps=1",
          f"--config.workdir={tmp_path}"]
  assert zerojax.train.main(args) == exits.DONE
  before = checkpoint_files(tmp_path)
  del before["metrics.jsonl"]  # The rerun's own lines (its setup) go there.
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  fail_reads_of(2, OSError(errno.EIO, "Input/output error"), monkeypatch)
  capsys.readouterr()
  assert zerojax.train.main(args) == exits.RESTORE_FAILED
  err = capsys.readouterr().err
  assert err.splitlines()[-1] == (
      f"error: checkpoint {tmp_path}/checkpoints/2: cannot read the state: OSError: "
      "Input/output error; its files show no damage, so it is left as it is: rerun once the "
      "cause is fixed"), err[-3000:]
  assert "Traceback" not in err and "damaged" not in err
  after = checkpoint_files(tmp_path)
  del after["metrics.jsonl"]
  assert after == before  # The checkpoints and config.json.


def test_flipped_bytes_are_caught_or_harmless(tmp_path):
  """orbax reads many flipped bytes in a data file as other values, without an error."""
  plan, state = new_state()
  saved = host_bytes(state)
  with checkpoint.Checkpointer(tmp_path / "good", save_every_steps=1) as ckpt:
    ckpt.save(2, state)
  outcomes = []
  for i in range(1, 12):
    shutil.copytree(tmp_path / "good", tmp_path / "bad", dirs_exist_ok=True)
    # The largest file on disk, bytes the index points at or not: a flip anywhere.
    path = max(glob.glob(os.path.join(tmp_path, "bad", "2", "state", "**", "d", "*"),
                         recursive=True), key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    data[len(data) * i // 12] ^= 0xFF
    open(path, "wb").write(data)
    with checkpoint.Checkpointer(tmp_path / "bad", save_every_steps=1) as ckpt:
      try:
        restored, _ = ckpt.restore(2, plan)
        assert host_bytes(restored) == saved  # Else: silently loaded wrong values.
        outcomes.append("harmless")
      except checkpoint.DamagedCheckpointError as e:
        outcomes.append("checksum" if "checksums" in str(e) else "unreadable")
  assert "checksum" in outcomes, outcomes  # What orbax alone would have loaded.


def test_keep_last_and_every(tmp_path):
  _, state = new_state(steps=0)
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1, keep=2, keep_every=4) as ckpt:
    for step in range(1, 10):
      assert ckpt.maybe_save(step, at_step(state, step))
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 9]
  assert sorted(os.listdir(tmp_path), key=int) == ["4", "8", "9"]


def test_save_every_minutes(tmp_path):
  _, state = new_state(steps=0)
  # Every 2 s: the test must not stall that long between calls, even on a busy machine.
  with checkpoint.Checkpointer(tmp_path, save_every_steps=0, save_every_minutes=2 / 60,
                               async_save=False) as ckpt:
    assert not ckpt.maybe_save(1, at_step(state, 1))
    time.sleep(2.1)
    assert ckpt.maybe_save(2, at_step(state, 2))
    assert not ckpt.maybe_save(3, at_step(state, 3))
    assert not ckpt.save(2, at_step(state, 2))  # Already saved (a stop signal right after it).
    assert ckpt.save(3, at_step(state, 3))


def test_a_checkpoint_holds_the_state_of_its_own_step(tmp_path):
  _, state = new_state(steps=2)
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1) as ckpt:
    with pytest.raises(ValueError, match="checkpoint 3 would hold the state of step 2"):
      ckpt.save(3, state)
  assert os.listdir(tmp_path) == []


def fill(disk) -> None:
  """Writes a file as large as the free space of `disk`."""
  with open(os.path.join(disk, "filler"), "wb", buffering=0) as f:
    try:
      while True:
        f.write(b"\0" * 65536)
    except OSError as e:
      assert e.errno == errno.ENOSPC, e


def test_the_writes_beside_a_failed_one_leave_no_unretrieved_exception(caplog):
  """orbax gathers its writes; when the first fails, the others fail too (the disk is as
  full for them). One failing in the very loop iteration that stops the loop once was
  logged by asyncio as "Task exception was never retrieved" (train.py's stderr)."""

  async def write(turns):
    for _ in range(turns):
      await asyncio.sleep(0)
    raise OSError(errno.ENOSPC, f"write {turns}")

  async def save(writes):
    await asyncio.gather(*map(write, range(writes)))

  for last in range(6):  # One of these is the iteration that stops the loop.
    with pytest.raises(OSError, match="write 0"):
      orbax_quirks._run_to_the_end(save(last + 1))
  # A task's unretrieved exception is logged when it is collected: one full collection
  # finds every round's (one a round cost 4.6 s of CPU in a CI worker's heap).
  gc.collect()
  assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text[-3000:]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_save_is_one_save_error_at_the_next_step(tmp_path, caplog, async_save):
  """A real tmpfs, filled up after the first checkpoint: the second save fails."""
  if os.geteuid() != 0:
    pytest.skip("mounting a small tmpfs (the full disk) needs root")
  _, state = new_state(steps=1)
  disk = tmp_path / "disk"
  disk.mkdir()
  mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                         capture_output=True, text=True)
  if mount.returncode:
    pytest.skip(f"cannot mount a tmpfs: {mount.stderr.strip()}")
  try:
    ckpt = checkpoint.Checkpointer(disk, save_every_steps=100, async_save=async_save)
    assert ckpt.save(1, state)
    ckpt.wait()
    fill(disk)
    state, _ = compiled(3)[1](state, batch(1))
    with pytest.raises(checkpoint.SaveError) as e:
      ckpt.save(2, state)  # Synchronous: fails here.
      deadline = time.monotonic() + 60
      while time.monotonic() < deadline:  # Async: at the first step after it failed.
        ckpt.maybe_save(3, at_step(state, 3))
        time.sleep(0.01)
    assert str(e.value) == (f"checkpoint {disk}/2 could not be written: No space left on "
                            f"device; the last good checkpoint is {disk}/1")
    ckpt.close()  # Reported once: no second error.
    assert sorted(os.listdir(disk)) == ["1", "2.orbax-checkpoint-tmp", "filler"]
  finally:
    subprocess.run(["umount", str(disk)], check=True)
  # orbax's own error records (a traceback from each of its threads) are dropped.
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-3000:]


def test_incompatible_config_is_an_error(tmp_path):
  config = {"model": {"name": "mlp_lm", "d_model": 64, "vocab_size": 64, "remat": "full"},
            "precision": {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}}
  other = {"model": {"name": "mlp_lm", "d_model": 128, "vocab_size": 64, "remat": "none"},
           "precision": {"param_dtype": "float32", "compute_dtype": "float32"}}
  same_model = {"model": {**config["model"], "remat": "dots"},
                "precision": {"param_dtype": "bfloat16", "compute_dtype": "float32"}}
  plan, state = new_state(steps=1)
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1) as ckpt:
    ckpt.save(1, state, {"config": config})
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1) as ckpt:
    with pytest.raises(checkpoint.CheckpointError, match="d_model"):
      ckpt.check_config(other)  # Cheap: before compiling anything.
    with pytest.raises(checkpoint.CheckpointError) as e:
      ckpt.restore_latest(plan, config=other)
    assert not isinstance(e.value, checkpoint.DamagedCheckpointError)
    assert "model.d_model: checkpoint 64, config 128" in str(e.value)
    assert "precision.param_dtype: checkpoint 'bfloat16', config 'float32'" in str(e.value)
    assert "remat" not in str(e.value) and "compute_dtype" not in str(e.value)
    ckpt.restore_latest(plan, config=same_model)  # Compute-only keys may change.
    fp32_plan = make_plan(3, jnp.float32)[2]  # The same model in fp32: other leaves.
    with pytest.raises(checkpoint.CheckpointError, match="leaves of another shape or dtype"):
      ckpt.restore_latest(fp32_plan)
  assert os.listdir(tmp_path) == ["1"]  # Nothing moved aside.


def test_restoring_with_another_optimizer_names_the_leaves_and_the_fix(tmp_path):
  """A library user's checkpoint of an AdamW state restored into an SGD-with-momentum plan:
  one line naming the optimizer state's leaves on either side and the fix (not a version
  compared with itself, not a train.py hint); nothing is read or moved. The fix it names
  works: restored with AdamW, the params start the SGD state."""
  init = lambda key: {"w": jax.random.normal(key, (32, 16)), "b": jnp.zeros((16,))}
  mesh, shapes = zerojax.make_mesh(1, 8), jax.eval_shape(init, KEY)
  adamw, sgd = optax.adamw(1e-3), optax.sgd(0.1, momentum=0.9)
  plan = zerojax.make_plan(mesh, 2, shapes, adamw, min_shard_size=0)
  sgd_plan = zerojax.make_plan(mesh, 2, shapes, sgd, min_shard_size=0)
  with checkpoint.Checkpointer(tmp_path, save_every_steps=0) as ckpt:
    ckpt.save(0, zerojax.init_state(plan, init, adamw, KEY))
  with checkpoint.Checkpointer(tmp_path, save_every_steps=0) as ckpt:
    with pytest.raises(checkpoint.CheckpointError) as e:
      ckpt.restore_latest(sgd_plan)
    assert not isinstance(e.value, checkpoint.DamagedCheckpointError)
    assert str(e.value) == (
        f"{tmp_path}/0 holds another train state than the target (both zerojax "
        f"{checkpoint.layout.version()}): the optimizer state differs: 5 leaves "
        "(opt_state/0/count, opt_state/0/mu/b, opt_state/0/mu/w and 2 more) only in the "
        "checkpoint, 2 leaves (opt_state/0/trace/b, opt_state/0/trace/w) only in the target; "
        "it was saved with another optimizer (or chain of optax transforms): restore it into "
        "a plan made with that one (make_plan(mesh, stage, params, tx)); to go on with "
        "another, start the new optimizer's state from the restored params: "
        "zerojax.init_state(plan, init_fn, tx, rng, params=state.params)")
    assert os.listdir(tmp_path) == ["0"]  # Nothing moved aside.
    state, _ = ckpt.restore(0, plan)
  want = jax.device_get(state.params)
  moved = zerojax.init_state(sgd_plan, init, sgd, KEY, params=state.params)
  assert jax.tree.map(np.array_equal, jax.device_get(moved.params), want) == {"w": True, "b": True}


def test_stop_signal():
  stop = preemption.StopSignal()
  try:
    assert not stop(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop(2) and stop.received == signal.SIGTERM
  finally:
    stop.close()
  assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def reference_checksum(x: np.ndarray) -> int:
  """The checksum's definition, in numpy: sum(bits * (flat index * K + 1)) mod 2**32,
  one uint32 word per element (two for 8-byte dtypes)."""
  words = (x.astype(np.uint8) if x.dtype == bool else
           x.view(np.uint32) if x.itemsize >= 4 else x.view(f"uint{8 * x.itemsize}"))
  words = words.reshape(-1).astype(np.uint64)
  weight = (np.arange(words.size, dtype=np.uint64) * 2654435761 + 1) % 2**32
  return int((words * weight).sum() % 2**32)  # uint64 wraps mod 2**64: exact mod 2**32.


@pytest.mark.parametrize("spec", [(), ("fsdp",), (None, "fsdp"), (("data", "fsdp"),),
                                  ("data", "fsdp")])
def test_checksums_follow_the_definition_on_any_sharding(spec):
  """Each device sums its own block (one per group of replicas): the same number as
  the whole array's, for sharded, replicated and partly replicated leaves."""
  mesh = zerojax.make_mesh(2, 4)
  rng = np.random.default_rng(0)
  arrays = {"bf16": rng.normal(size=(16, 48, 40)).astype(jnp.bfloat16),
            "f32": rng.normal(size=(16, 24)).astype(np.float32),
            "f16, prime last dim": rng.normal(size=(8, 13)).astype(np.float16),
            "int scalar": np.array(7, np.int32), "bool": rng.normal(size=(8, 8)) > 0,
            "rng": np.array([3, 4], np.uint32)}
  tree = {}
  for name, x in arrays.items():
    fits = len(spec) <= x.ndim and all(
        n % np.prod([mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax or ())])
        == 0 for n, ax in zip(x.shape, spec))
    tree[name] = jax.device_put(x, NamedSharding(mesh, P(*spec) if fits else P()))
  got = checksums.describe(tree)
  assert {k: v[2] for k, v in got.items()} == {
      f"['{name}']": reference_checksum(x) for name, x in arrays.items()}


def test_checksums_need_little_memory():
  """Measured before: XLA:CPU materialized the weighted uint32 product of a one-shot
  sum, twice a bf16 leaf's bytes (20 GB more for a 1B-param Kahan AdamW state)."""
  mesh = zerojax.make_mesh(1, 8)
  leaf = jax.ShapeDtypeStruct((16, 1024, 1024), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P(None, "fsdp")))
  jitted = checksums.jitted
  memory = jitted(jax.tree.structure([leaf]), (leaf.sharding,)).lower(
      [leaf]).compile().memory_analysis()
  assert memory.temp_size_in_bytes < 0.1 * memory.argument_size_in_bytes
