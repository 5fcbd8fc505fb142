"""Checkpoints written by earlier zerojax versions restore with this one.

The fixtures in tests/fixtures/checkpoints/format_<N>/ were written by the code of
format N (tests/fixtures/write_checkpoints.py; format 1 by zerojax 0.1.0, before the
format had a number). Every one must restore, bit-exactly, on this code; a change to the
state's names without a migration must fail here, in one line naming both versions.
"""

import glob
import importlib.util
import json
import os
import shutil
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

import zerojax.train
from zerojax import build, checkpoint, optim
from zerojax.checkpoint import layout
from zerojax.runtime import exits

from test_train import checkpoint_leaves

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = sorted(glob.glob(os.path.join(HERE, "fixtures", "checkpoints", "format_*", "*")))
_spec = importlib.util.spec_from_file_location(
    "write_checkpoints", os.path.join(HERE, "fixtures", "write_checkpoints.py"))
writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(writer)


def fixture(fmt: int, name: str, tmp_path) -> str:
  """A copy of a fixture's checkpoints directory (a restore may move damaged ones aside)."""
  directory = tmp_path / "checkpoints"
  shutil.copytree(os.path.join(HERE, "fixtures", "checkpoints", f"format_{fmt}", name),
                  directory)
  return str(directory)


def restore(directory: str, config: Any = None):
  """(state, saved config, Saved) of checkpoint 2 in `directory`, on the plan its own
  config builds (8 devices here)."""
  with checkpoint.Checkpointer(directory, save_every_steps=0, async_save=False) as ckpt:
    where = os.path.join(directory, "2")
    saved = layout.upgrade(ckpt.read_meta(2), where)
    config = config or layout.config(saved, where)
    state, _ = ckpt.restore(2, build.build(config).plan, config=config)
  return state, config, saved


def on_disk(directory: str) -> dict[str, np.ndarray]:
  """{name: array} of checkpoint 2's state as orbax wrote it, read without a target."""
  return checkpoint_leaves(os.path.join(directory, "2"))


def test_the_current_format_has_its_fixtures():
  """Whoever bumps `layout.FORMAT` writes its fixtures (the writer's command), and no
  format's fixtures are ever removed."""
  formats = {int(os.path.basename(os.path.dirname(d)).split("_")[1]) for d in FIXTURES}
  assert formats == set(range(1, layout.FORMAT + 1))
  for fmt in formats:
    assert {os.path.basename(d) for d in FIXTURES if f"format_{fmt}" in d} == set(
        writer.FIXTURES), f"format {fmt}"
  assert [m.to for m in layout.MIGRATIONS] == list(range(2, layout.FORMAT + 1))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda d: "/".join(d.split(os.sep)[-2:]))
def test_every_fixture_restores_bit_exactly(path, tmp_path):
  """Restored onto the plan of the config it was saved with (checksums verified), each
  leaf is the array orbax wrote under the name its format gives it."""
  fmt, name = int(path.split(os.sep)[-2].split("_")[1]), os.path.basename(path)
  directory = fixture(fmt, name, tmp_path)
  state, config, saved = restore(directory)
  assert saved.format == layout.FORMAT and int(state.step) == 2
  assert config.zero.stage == int(name[len("stage")])
  disk = on_disk(directory)
  restored = layout.names(state)
  assert restored.keys() == saved.leaves.keys()
  for k, x in restored.items():
    np.testing.assert_array_equal(np.asarray(jax.device_get(x)), disk[saved.leaves[k].disk],
                                  err_msg=k)
  if "release_norm" in name:  # Release's carried norm: the last step's, not 0.
    assert float(restored["opt_state/0/norm"]) > 0


def test_train_py_resumes_a_checkpoint_of_the_first_format(tmp_path, capsys):
  """A zerojax 0.1.0 checkpoint (release, carried norm, stage 3) resumes under train.py
  (this process: `zerojax.train.main`) and trains on from step 2."""
  name = "stage3_adamw_master_release_norm"
  fixture(1, name, tmp_path)
  args = ["--config", "configs/tiny.py", "--workdir", str(tmp_path)]
  args += [f"--config.{o}" for o in writer.SMALL + writer.FIXTURES[name]]
  assert zerojax.train.main([*args, "--config.train.steps=4"]) == exits.DONE
  out = capsys.readouterr().out
  assert f"resumed from {tmp_path}/checkpoints/2" in out and "step      4/4" in out
  with checkpoint.Checkpointer(tmp_path / "checkpoints", save_every_steps=0) as ckpt:
    assert "format" not in ckpt.read_meta(2)  # The fixture's, as 0.1.0 wrote it ...
    assert ckpt.read_meta(4)["format"] == layout.FORMAT  # ... and today's on top.


class RenamedLionState(NamedTuple):
  """`optim.LionState` under another class name, same field."""
  mu: Any


class LionStateWithRenamedField(NamedTuple):
  """`optim.LionState` with its field renamed: a change of the checkpoint format."""
  momentum: Any

  @property
  def mu(self):  # What optim's code reads: it would say `momentum` after a real rename.
    return self.momentum


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_renamed_state_class_restores(fmt, tmp_path, monkeypatch):
  """Class names are not part of the format: a checkpoint restores with the class renamed."""
  monkeypatch.setattr(optim, "LionState", RenamedLionState)
  state, _, _ = restore(fixture(fmt, "stage3_lion_master", tmp_path))
  assert type(state.opt_state.inner[0]) is RenamedLionState


def test_a_renamed_field_without_a_migration_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
  """Renaming the Lion state's field without a migration: restoring a zerojax 0.1.0
  checkpoint is one `error:` line naming both versions and the leaves that differ, and
  train.py exits 2 (not a pytree traceback)."""
  monkeypatch.setattr(optim, "LionState", LionStateWithRenamedField)
  name = "stage3_lion_master"
  directory = fixture(1, name, tmp_path)
  with pytest.raises(checkpoint.CheckpointError) as e:
    restore(directory)
  line = str(e.value)
  assert "\n" not in line
  assert f"{directory}/2 (zerojax 0.1.0, checkpoint format 1) cannot be restored by zerojax "\
         f"{layout.version()} (format {layout.FORMAT})" in line
  assert "leaves it lacks: 12 (first: opt_state/inner/0/momentum/" in line
  assert "leaves this state lacks: 12 (first: opt_state/inner/0/mu/" in line
  assert "resume with zerojax 0.1.0" in line
  args = ["--config", "configs/tiny.py", "--workdir", str(tmp_path)]
  args += [f"--config.{o}" for o in writer.SMALL + writer.FIXTURES[name]]
  capsys.readouterr()
  assert zerojax.train.main([*args, "--config.train.steps=3"]) == exits.BAD_INPUT
  err = capsys.readouterr().err
  assert f"error: {line}" in err.splitlines() and "Traceback" not in err


def test_a_migration_restores_a_renamed_field(tmp_path, monkeypatch):
  """The same rename with its migration (format FORMAT + 1): both formats' checkpoints
  restore, the renamed leaves holding what orbax wrote under the old name."""
  def rename(leaves):
    return {k.replace("/inner/0/mu/", "/inner/0/momentum/"): x for k, x in leaves.items()}
  monkeypatch.setattr(optim, "LionState", LionStateWithRenamedField)
  monkeypatch.setattr(layout, "FORMAT", layout.FORMAT + 1)
  monkeypatch.setattr(layout, "MIGRATIONS", layout.MIGRATIONS + (
      layout.Migration(layout.FORMAT, "Lion's mu is momentum", rename),))
  for fmt in (1, 2):
    directory = fixture(fmt, "stage3_lion_master", tmp_path / str(fmt))
    state, _, _ = restore(directory)
    disk = on_disk(directory)
    got = layout.names(state)
    for k in (k for k in got if "/momentum/" in k):
      np.testing.assert_array_equal(np.asarray(got[k]), disk[k.replace("momentum", "mu")])


def test_a_migration_may_add_a_leaf(tmp_path, monkeypatch):
  """A field added with its migration: old checkpoints restore with the migration's fill."""
  class LionStateWithCount(NamedTuple):
    mu: Any
    count: Any = None

  scale_by_lion = optim.scale_by_lion

  def with_count(*a, **k):
    tx = scale_by_lion(*a, **k)
    init = lambda params: LionStateWithCount(tx.init(params).mu, jax.numpy.zeros((), "int32"))
    return tx._replace(init=init)

  def add_count(leaves):
    return {**leaves, "opt_state/inner/0/count": layout.Leaf((), "int32", None, None, 7)}
  monkeypatch.setattr(optim, "scale_by_lion", with_count)
  monkeypatch.setattr(layout, "FORMAT", layout.FORMAT + 1)
  monkeypatch.setattr(layout, "MIGRATIONS", layout.MIGRATIONS + (
      layout.Migration(layout.FORMAT, "Lion counts its steps", add_count),))
  state, _, _ = restore(fixture(2, "stage3_lion_master", tmp_path))
  assert int(state.opt_state.inner[0].count) == 7


def test_a_newer_format_or_an_unknown_config_key_is_one_line(tmp_path):
  directory = fixture(2, "stage1_adamw_kahan", tmp_path)
  meta_file = os.path.join(directory, "2", "meta", "metadata")
  with open(meta_file, encoding="utf-8") as f:
    meta = json.load(f)
  newer = {**meta, "format": layout.FORMAT + 1, "zerojax_version": "9.0.0"}
  with open(meta_file, "w", encoding="utf-8") as f:
    json.dump(newer, f)
  config = layout.config(layout.upgrade(meta, directory), directory)
  with pytest.raises(checkpoint.CheckpointError) as e:
    restore(directory, config)
  assert str(e.value) == (
      f"{directory}/2 was written by zerojax 9.0.0 in checkpoint format {layout.FORMAT + 1}; "
      f"this zerojax {layout.version()} reads formats up to {layout.FORMAT}: upgrade zerojax "
      "to 9.0.0 or later to restore it")
  # A key the schema gained since: its default. A key it lost: named, one line.
  meta["config"]["train"].pop("step_timeout")
  meta["config"]["model"]["old_key"] = 1
  saved = layout.upgrade(meta, directory)
  with pytest.raises(checkpoint.CheckpointError, match=r"does not know: model\.old_key; no "):
    layout.config(saved, directory)
  del meta["config"]["model"]["old_key"]
  assert layout.config(layout.upgrade(meta, directory), directory).train.step_timeout == 0.0
