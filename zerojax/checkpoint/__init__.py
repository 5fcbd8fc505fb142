"""Checkpoints of the whole train state, on orbax's `CheckpointManager`.

The checkpoint room: the checkpointer here, `layout` (the on-disk format and its
migrations), `damage` (what a failed read says about the files), `checksums` (a leaf's
checksum, computed on the devices), `orbax_quirks` and `errors`. It imports the train
state (`zerojax.step`), the plan and the config.

One checkpoint is a step directory holding `state` (the `TrainState`: params, optimizer
state with its Kahan / master buffers, step, rng, loss scale) and `meta` (JSON: the step,
the data position, the zerojax version, whatever the caller adds, e.g. the resolved
config, and a checksum, shape and dtype per state leaf).

- **Saves are async and atomic.** orbax writes `<step>.orbax-checkpoint-tmp*` and renames
  it to `<step>` only after every file is written, so a crash or kill mid-save leaves
  an uncommitted temporary directory that is never listed as a checkpoint (and is
  removed by the next `Checkpointer`); the previous checkpoint is untouched.
- **Damage is detected, never loaded.** A missing or truncated file fails the read; a
  flipped byte in a compressed chunk does not (orbax has no checksums: measured), so
  every restore recomputes each leaf's checksum on the devices and compares it with
  the one taken at save time. `restore_latest` skips a damaged checkpoint with a
  message, moves it aside (`<step>.damaged`) and restores the one before.
- **Only damage moves a checkpoint aside.** A failed read is damage only when the files
  show it (`damage.find`: a missing or truncated file, bytes that do not decode, a tree
  that is not the meta's); out of memory, an I/O error of a flaky mount or a bug of ours
  is `RestoreError`, naming the cause and the checkpoint, and nothing on disk changes.
- **Restore anywhere.** The state is read straight onto the shardings of any plan
  (`zerojax.abstract_state(plan)`): another mesh, device count or ZeRO stage.
- **Restore after an upgrade.** Leaves are named by their keys, never by class names,
  and a checkpoint of an earlier format restores through `layout.MIGRATIONS`; one that
  cannot be restored is one line naming both zerojax versions and what differs. One of
  this zerojax restored onto another train state (another optimizer, another model) is
  one line naming the fields and leaves that differ and how to restore it.
- **A failed save is an error, at once.** orbax writes in a background thread and
  raises its error only at the next save; `maybe_save` (called every step) checks the
  thread and raises `SaveError`, naming the cause (disk full, permission) and the last
  good checkpoint. orbax's own log of the failure (a traceback per thread) is kept off
  stderr while a `Checkpointer` is open: the `SaveError` says it in one line.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from zerojax import step as step_lib, zero
from zerojax.checkpoint import checksums, damage, layout, orbax_quirks
from zerojax.checkpoint.errors import (
  CheckpointError,
  DamagedCheckpointError,
  RestoreError,
  SaveError,
)
from zerojax.config.checks import flatten

__all__ = ["Checkpointer", "CheckpointError", "DamagedCheckpointError", "RestoreError",
           "SaveError", "check_compatible", "layout"]

_policies = ocp.checkpoint_managers
# How long `close` waits for orbax's write threads (a failed save's siblings) to end.
_LOOPS_TIMEOUT_S = 60
# Config keys a checkpoint must agree on: the model's shape and function, and what
# decides the optimizer state's structure. Keys that only change how the same model is
# computed (remat, attention kernel, block sizes) may change between runs.
_COMPUTE_ONLY = ("model.remat", "model.attention", "model.attention_block",
                 "model.loss_chunk", "model.mlp_chunk", "model.activation_offload")
_STATE_KEYS = ("precision.param_dtype", "optimizer.name", "optimizer.state_dtype",
               "optimizer.update_rule")


def check_compatible(meta: Mapping[str, Any], config: Any) -> None:
  """Raises `CheckpointError` if `config` describes another model than the checkpoint.

  Compared: every `model.*` key but those that only change how the model is computed,
  the param dtype, and the optimizer keys that shape its state. `meta` is the
  checkpoint's (its "config" the config it was saved with, in the format it was saved
  in: a key added to the schema since has its default); `config` a ConfigDict or
  nested dict. The error names every differing key with both values.
  """
  saved = layout.upgrade(meta, f"checkpoint step {meta.get('step')}")
  if saved.config is None:
    return  # Saved without a config (a library user's checkpoint): nothing to check.
  # Through JSON, as the saved one went: tuples become lists, and so on.
  wanted = json.loads(json.dumps(flatten(config)[0], default=str))
  keys = sorted(k for k in saved.config.keys() | wanted.keys()
                if (k.startswith("model.") and k not in _COMPUTE_ONLY) or k in _STATE_KEYS)
  no = "<absent>"
  had = {k: layout.saved_value(saved, k, no) for k in keys}
  diffs = [f"{k}: checkpoint {had[k]!r}, config {wanted.get(k, no)!r}"
           for k in keys if had[k] != wanted.get(k, no)]
  if diffs:
    raise CheckpointError(
        f"the config contradicts the checkpoint of step {meta.get('step')}:\n  " +
        "\n  ".join(diffs) + "\nuse the checkpoint's values, or start in a new workdir")


def _not_damaged(where: str, doing: str, cause: str) -> RestoreError:
  return RestoreError(f"checkpoint {where}: cannot {doing}: {cause}; its files show no "
                      "damage, so it is left as it is: rerun once the cause is fixed")


def _read(where: str, what: str, read: Callable[[], Any]) -> Any:
  """`read()`; if it fails on any process, the same error on every one.

  `DamagedCheckpointError` if a process finds damage in the files (`damage.find`), whatever
  failed on the others (a read that failed beside a damaged file, orbax's barrier);
  else `RestoreError`. Processes read their own shards, so only some may fail; they
  must agree, or some would go on to the checksums (collective) and wait forever.
  """
  try:
    value, error = read(), None
  except Exception as e:  # pylint: disable=broad-except  (classified by the files)
    value, error = None, e
  found = damage.find(where, error) if error else None
  outcome = 2 if found else 1 if error else 0  # Damaged, failed, read: the worst wins.
  if jax.process_count() > 1:
    outcome = int(multihost_utils.process_allgather(np.array(outcome)).max())
  if outcome == 2:
    raise DamagedCheckpointError(f"{where}: cannot read {what}: "
                                 f"{found or 'another process found it damaged'}") from error
  if outcome == 1:
    raise _not_damaged(where, f"read {what}", damage.failure(error, where) if error else
                       "it failed on another process") from error
  return value


class _SinceLastSave(_policies.SaveDecisionPolicy):
  """Save once `seconds` have passed since the last checkpoint or the start of the run.

  orbax's `ContinuousCheckpointingPolicy` makes the time decision on the primary host
  and shares it (every host must save the same steps); it measures from the last
  checkpoint, which after a restart is the one restored: measure from now instead.
  """

  def __init__(self, seconds: float):
    self._inner = _policies.ContinuousCheckpointingPolicy(minimum_interval_secs=seconds)
    self._start = datetime.datetime.now(tz=datetime.timezone.utc)

  def should_save(self, step, previous_steps, *, context) -> bool:
    last = max([self._start] + [p.time for p in previous_steps[-1:]])
    since = [types.SimpleNamespace(step=-1, time=last, metrics=None)]
    return self._inner.should_save(step, since, context=context)


def _filled(leaf: layout.Leaf, sharding: Any) -> jax.Array:
  """A leaf a migration added: `leaf.fill` everywhere, on `sharding`."""
  value = np.full(leaf.shape, leaf.fill, jnp.dtype(leaf.dtype))
  return jax.make_array_from_callback(leaf.shape, sharding, lambda index: value[index])


class Checkpointer:
  """Saves and restores `TrainState`s in `directory`, one subdirectory per step.

  Args:
    directory: where the step directories go (created if missing).
    save_every_steps: `maybe_save` saves at multiples of this; 0: never by step.
    save_every_minutes: ... and once this many minutes have passed since the last
      checkpoint (or the start); 0: never by time.
    keep: keep the newest `keep` checkpoints; 0: keep all.
    keep_every: also keep every checkpoint whose step is a multiple of this, forever.
    async_save: write in a background thread; `save` returns once the state is
      copied to host memory, so the next step may donate its buffers. A failed write
      raises `SaveError` at the next `maybe_save`, `save`, `wait` or `close`.
    log: where messages (skipped checkpoints) go; the module's logger by default.
  """

  def __init__(self, directory: str | os.PathLike, *, save_every_steps: int,
               save_every_minutes: float = 0, keep: int = 3, keep_every: int = 0,
               async_save: bool = True, log: Callable[[str], Any] | None = None):
    self.directory = os.path.abspath(os.fspath(directory))
    self._log = log or logging.getLogger(__name__).warning
    # A preemption sync point (multi-host, jax's coordination service) saves too.
    save = [_policies.PreemptionCheckpointingPolicy()]
    if save_every_steps:
      save.append(_policies.FixedIntervalPolicy(save_every_steps))
    if save_every_minutes:
      save.append(_SinceLastSave(60 * save_every_minutes))
    keep_policy = [_policies.LatestN(keep or None)]
    if keep_every:
      keep_policy.append(_policies.EveryNSteps(keep_every))
    self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        save_decision_policy=_policies.AnySavePolicy(save),
        preservation_policy=_policies.AnyPreservationPolicy(keep_policy),
        enable_async_checkpointing=async_save, create=True,
        cleanup_tmp_directories=True))  # What a killed save left behind.
    # orbax removes those in a background thread that dies with a traceback if the
    # process exits first (say, on a data error right after this); it takes one listing.
    getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
    self._closed, self._failed = False, False
    orbax_quirks.let_tasks_end()
    orbax_quirks.no_replica_parallel_on_cpu(jax.default_backend())
    # orbax logs a failed write from each of its threads, traceback and all; `SaveError`
    # says it in one line.
    self._quiet = orbax_quirks.OrbaxErrors()
    logging.getLogger("absl").addFilter(self._quiet)

  def all_steps(self) -> list[int]:
    """The steps of the committed checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed checkpoint's step (unverified), or None."""
    return self._manager.latest_step()

  def maybe_save(self, step: int, state: step_lib.TrainState,
                 meta: Mapping[str, Any] | None = None) -> bool:
    """Saves if `step` is due (steps, minutes or preemption); returns whether it did.

    Cheap when not due, so call it every step: it also raises `SaveError` as soon as a
    save in the background has failed.
    """
    self._check()
    return self.save(step, state, meta, force=False)

  def save(self, step: int, state: step_lib.TrainState,
           meta: Mapping[str, Any] | None = None, *, force: bool = True) -> bool:
    """Starts saving `state` as checkpoint `step`; returns False if not due or saved.

    Args:
      step: the checkpoint's number: the steps taken (`state.step`).
      state: the train state, sharded as it is.
      meta: JSON-serializable extras, e.g. `{"config": config.to_dict()}`.
      force: save even if `step` is not due.

    Raises:
      SaveError: this save or an earlier one in the background failed.
      ValueError: `step` is not `state.step` (a checkpoint would be misnamed).
    """
    if step in self._manager.all_steps():
      return False  # E.g. a stop signal right after a periodic save of the same step.
    if not force and not self._manager.should_save(step):
      return False
    if step != int(state.step):  # Waits for the step; saving would, too.
      raise ValueError(f"checkpoint {step} would hold the state of step {int(state.step)}")
    meta = {**(meta or {}), "step": int(step), "data_position": int(step),
            "zerojax_version": layout.version(), "format": layout.FORMAT,
            "leaves": checksums.describe(state, name=layout.name)}
    self.wait()  # orbax would, first thing; an earlier failure is that save's.
    try:
      return self._manager.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # pylint: disable=broad-except  (the synchronous part)
      raise self._save_error(step, e) from e

  def wait(self) -> None:
    """Blocks until the saves in flight are committed; `SaveError` if one failed."""
    thread = self._finalize_thread()
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(thread.step() if thread else None, e) from e

  def _finalize_thread(self) -> Any:
    """orbax's background thread of the newest save (None: none, or another orbax)."""
    return getattr(getattr(self._manager, "_finalize_thread", None), "get", lambda: None)()

  def _check(self) -> None:
    """`SaveError` if the newest save has failed; never waits."""
    thread = self._finalize_thread()
    if thread is not None and not thread.is_alive() and thread.exception is not None:
      self.wait()  # Returns at once: raises the thread's error.

  def _save_error(self, step: int | None, error: BaseException) -> SaveError:
    self._failed = True
    good = [s for s in self._committed() if s != step]
    where = self._path(step) if step is not None else self.directory
    last = self._path(max(good)) if good else "none"
    return SaveError(f"checkpoint {where} could not be written: "
                     f"{orbax_quirks.cause(error, where)}; the last good checkpoint is {last}")

  def _committed(self) -> list[int]:
    """The committed steps on disk: orbax's list has already dropped the steps a failed
    save would have removed, and its failed step."""
    return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def read_meta(self, step: int) -> dict:
    """Checkpoint `step`'s JSON meta (no array is read)."""
    where = self._path(step)
    meta = _read(where, "its meta", lambda: self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
    if not isinstance(meta, dict) or not isinstance(meta.get("leaves"), dict):
      raise DamagedCheckpointError(f"{where}: cannot read its meta: it lists no leaves")
    return meta

  def check_config(self, config: Any) -> None:
    """`check_compatible` with the newest readable meta: fails fast, before compiling."""
    for step in reversed(self.all_steps()):
      try:
        meta = self.read_meta(step)
      except DamagedCheckpointError:
        continue  # `restore_latest` reports it.
      return check_compatible(meta, config)

  def restore(self, step: int, target: zero.ZeroPlan | step_lib.TrainState, *,
              config: Any = None) -> tuple[step_lib.TrainState, dict]:
    """Reads checkpoint `step` straight onto the shardings of `target`, verified.

    The checkpoint may be of any format up to `layout.FORMAT`: its leaves are found by
    name (through `layout.MIGRATIONS` from an older format), read onto the target's
    shardings from the tree orbax wrote, and placed into the target's structure.

    Args:
      step: which checkpoint.
      target: a `ZeroPlan` (any mesh, device count or stage) or its abstract state
        (`zerojax.abstract_state(plan)`).
      config: if given, first `check_compatible` with the checkpoint's config.

    Returns:
      (state, meta), every leaf bit-identical to what was saved.

    Raises:
      CheckpointError: the config or the target's leaves do not match the checkpoint
        (one line naming the leaves that differ and the fix; both zerojax versions if
        another wrote it), before any array is read; nothing is moved.
      DamagedCheckpointError: missing, truncated or undecodable files, a state tree
        that is not the meta's, or failed checksums.
      RestoreError: anything else failed (out of memory, an I/O error, a bug): the
        checkpoint may well be intact.
    """
    try:
      return self._restore(step, target, config)
    except (CheckpointError, RestoreError):
      raise
    except Exception as e:  # pylint: disable=broad-except  (the checksums' OOM, a bug)
      where = self._path(step)
      raise _not_damaged(where, "restore it", damage.failure(e, where)) from e

  def _restore(self, step: int, target: zero.ZeroPlan | step_lib.TrainState,
               config: Any) -> tuple[step_lib.TrainState, dict]:
    if isinstance(target, zero.ZeroPlan):
      target = step_lib.abstract_state(target)
    where, meta = self._path(step), self.read_meta(step)
    if config is not None:
      check_compatible(meta, config)
    saved, wanted = layout.upgrade(meta, where), layout.names(target)
    if error := layout.mismatch(saved, wanted, where):
      raise CheckpointError(error)  # Before reading any data: a changed state is not damage.
    reads = {saved.leaves[k].disk: x for k, x in wanted.items() if saved.leaves[k].disk}
    written = _read(where, "the state", lambda: ocp.StandardCheckpointHandler().metadata(
        epath.Path(where) / "state").tree)
    disk, on_disk = {x.disk: x for x in saved.leaves.values() if x.disk}, layout.names(written)
    odd = [k for k in reads if k not in on_disk or (tuple(on_disk[k].shape), str(
        on_disk[k].dtype)) != (tuple(disk[k].shape), disk[k].dtype)]
    if odd:  # Both written by the same save: one of them is not what was written.
      raise DamagedCheckpointError(
          f"{where}: its state is not the tree its meta lists: {len(odd)} arrays absent or "
          f"of another shape or dtype (first: {odd[0]})")
    ask = jax.tree_util.tree_map_with_path(lambda path, _: (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if (x := reads.get(layout.name(path))) is not None else ocp.PLACEHOLDER), written)
    got = _read(where, "the state", lambda: layout.names(self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(ask))).state))
    got = {k: x for k, x in got.items() if k in reads}  # Without the skipped leaves.
    sums = checksums.describe(got, name=lambda path: path[0].key)
    bad = [k for k, (_, _, c) in sums.items() if c != disk[k].checksum]
    if bad:
      raise DamagedCheckpointError(
          f"{where}: {len(bad)} arrays fail their checksums (files damaged after "
          f"saving): {', '.join(bad[:5])}")
    leaves = [got[saved.leaves[k].disk] if saved.leaves[k].disk else
              _filled(saved.leaves[k], x.sharding) for k, x in wanted.items()]
    return jax.tree.unflatten(jax.tree.structure(target), leaves), meta

  def restore_latest(self, target: zero.ZeroPlan | step_lib.TrainState, *,
                     config: Any = None) -> tuple[step_lib.TrainState, dict] | None:
    """Restores the newest checkpoint that reads back intact; None if there is none.

    A damaged checkpoint is reported through `log`, moved aside to `<step>.damaged`
    (kept for inspection, out of the way of the steps to come) and the next older one
    is tried. Any other failure stops here, with nothing moved.

    Raises:
      CheckpointError: the config or target does not match (see `restore`), or
        checkpoints exist and none of them is intact.
      RestoreError: a restore failed for another reason than damage (see `restore`).
    """
    damaged = []
    for step in reversed(self.all_steps()):
      try:
        restored = self.restore(step, target, config=config)
      except DamagedCheckpointError as e:
        self._log(f"checkpoint step {step} skipped, damaged: {e}")
        damaged.append(step)
        continue
      self._set_aside(damaged)
      return restored
    if damaged:
      raise CheckpointError(f"no intact checkpoint in {self.directory}: steps "
                            f"{sorted(damaged)} are all damaged (see the messages above)")
    return None

  def _set_aside(self, steps: list[int]) -> None:
    if not steps:
      return
    if jax.process_index() == 0:
      for step in steps:
        aside = self._path(step) + ".damaged"
        while os.path.exists(aside):
          aside += "_"
        os.rename(self._path(step), aside)
        self._log(f"moved damaged checkpoint {self._path(step)} to {aside}")
    multihost_utils.sync_global_devices("zerojax.checkpoint.set_aside")
    self._manager.reload()

  def close(self) -> None:
    """Waits for the saves in flight, then releases the manager's threads (once).

    Raises:
      SaveError: a save failed and no `SaveError` has said so yet.
    """
    if self._closed:
      return
    self._closed, reported, errors = True, self._failed, []
    for end in (self.wait, self._manager.close):  # The second even if the first fails.
      try:
        end()
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
    # After a failed save orbax's other writes may still be running, and log their
    # tracebacks when they fail: the filter goes once they have all ended.
    if orbax_quirks.loops_ended(_LOOPS_TIMEOUT_S):
      logging.getLogger("absl").removeFilter(self._quiet)
    if errors and not reported:
      if isinstance(errors[0], SaveError):
        raise errors[0]
      raise self._save_error(None, errors[0]) from errors[0]

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
