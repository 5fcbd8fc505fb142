"""Checkpoints of the whole train state, on orbax's `CheckpointManager`.

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
- **Restore anywhere.** The state is read straight onto the shardings of any plan
  (`zerojax.abstract_state(plan)`): another mesh, device count or ZeRO stage.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import logging
import math
import os
import signal
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from zerojax import step as step_lib
from zerojax import zero
from zerojax.config_schema import flatten

_policies = ocp.checkpoint_managers
# Config keys a checkpoint must agree on: the model's shape and function, and what
# decides the optimizer state's structure. Keys that only change how the same model is
# computed (remat, attention kernel, block sizes) may change between runs.
_COMPUTE_ONLY = ("model.remat", "model.attention", "model.attention_block",
                 "model.loss_chunk")
_STATE_KEYS = ("precision.param_dtype", "optimizer.name", "optimizer.state_dtype",
               "optimizer.update_rule")


class CheckpointError(ValueError):
  """A checkpoint that cannot be used: incompatible with the run, or unreadable."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint whose files are missing, unreadable or fail their checksums."""


def check_compatible(meta: Mapping[str, Any], config: Any) -> None:
  """Raises `CheckpointError` if `config` describes another model than the checkpoint.

  Compared: every `model.*` key but those that only change how the model is computed,
  the param dtype, and the optimizer keys that shape its state. `meta["config"]` is
  the config the checkpoint was saved with; `config` a ConfigDict or nested dict. The
  error names every differing key with both values.
  """
  if "config" not in meta:
    return  # Saved without a config (a library user's checkpoint): nothing to check.
  # Through JSON, as the saved one went: tuples become lists, and so on.
  saved, wanted = flatten(meta["config"])[0], json.loads(json.dumps(flatten(config)[0], default=str))
  keys = sorted(k for k in saved.keys() | wanted.keys()
                if (k.startswith("model.") and k not in _COMPUTE_ONLY) or k in _STATE_KEYS)
  no = "<absent>"
  diffs = [f"{k}: checkpoint {saved.get(k, no)!r}, config {wanted.get(k, no)!r}"
           for k in keys if saved.get(k, no) != wanted.get(k, no)]
  if diffs:
    raise CheckpointError(
        f"the config contradicts the checkpoint of step {meta.get('step')}:\n  " +
        "\n  ".join(diffs) + "\nuse the checkpoint's values, or start in a new workdir")


_K = 2654435761  # Odd: the weights `index * _K + 1` of any two positions differ.


def _bits(x: jax.Array) -> jax.Array:
  """`x` as unsigned integers of its own width (8-byte dtypes: two uint32 per element,
  along the last axis); bool stays bool."""
  if x.dtype == jnp.bool_:
    return x
  if x.dtype.itemsize >= 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(*x.shape[:-1], -1)
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _block_checksum(block: jax.Array, shape: tuple[int, ...], offsets: list) -> jax.Array:
  """sum(bits * (global flat index * _K + 1)) mod 2**32 over `block` (ndim >= 1), the
  part of an array of `shape` that starts at `offsets`; each element's bits are one
  uint32 word (two for 8-byte dtypes, the second at index + 1).

  Summed in two stages with a barrier between: groups of <= 32 words along the last
  axis (XLA:CPU fuses the weighting into such a reduction), then the rest. In one
  reduction XLA:CPU materializes the whole weighted uint32 product: 2x a bf16 state's
  bytes on top of the state (measured).
  """
  w = 2 if block.dtype.itemsize == 8 else 1
  cols = block.shape[-1] * w
  group = max(g for g in range(1, 33) if cols % g == 0)
  bits = _bits(block).reshape(*block.shape[:-1], cols // group, group).astype(jnp.uint32)
  u32 = functools.partial(jnp.asarray, dtype=jnp.uint32)
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.uint32, bits.shape)
  index, stride = u32(offsets[-1]) * u32(w) + iota(bits.ndim - 2) * u32(group) + iota(
      bits.ndim - 1), w  # Of the last axis, in words; then the others, mod 2**32.
  for d in reversed(range(block.ndim - 1)):
    stride = stride * shape[d + 1] % 2**32
    index = index + (u32(offsets[d]) + iota(d)) * u32(stride)
  groups = jnp.sum(bits * (index * u32(_K) + u32(1)), axis=-1, dtype=jnp.uint32)
  return jnp.sum(jax.lax.optimization_barrier(groups), dtype=jnp.uint32)


def _leaf_checksum(x: jax.Array, sharding: Any = None) -> jax.Array:
  """A uint32 checksum of the bits of `x` that does not depend on its sharding.

  Each element's bits are weighted by an odd multiple of its global position and
  summed mod 2**32: exact integer arithmetic in any reduction order, so every mesh
  and stage gets the same number, and a moved block changes it as a flipped bit does.
  With a `NamedSharding` that divides `x` evenly, each device sums its own block (one
  device per replica group counts it) and the blocks' sums are added up.
  """
  shape = x.shape or (1,)
  if not isinstance(sharding, jax.sharding.NamedSharding) or not x.shape:
    return _block_checksum(x.reshape(shape), shape, [0] * len(shape))
  mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  axes = [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in spec]
  if any(n % math.prod(mesh.shape[a] for a in ax) for n, ax in zip(shape, axes)):
    return _block_checksum(x, shape, [0] * len(shape))  # Uneven: GSPMD, more memory.

  def local(block):
    offsets = []
    for n, ax in zip(block.shape, axes):
      position = jnp.uint32(0)
      for a in ax:
        position = (position * jnp.uint32(mesh.shape[a]) +
                    jax.lax.axis_index(a).astype(jnp.uint32))
      offsets.append(position * jnp.uint32(n))
    counts = jnp.bool_(True)  # The first of each group of replicas.
    for a in set(mesh.axis_names) - {a for ax in axes for a in ax}:
      counts &= jax.lax.axis_index(a) == 0
    total = jnp.where(counts, _block_checksum(block, shape, offsets), jnp.uint32(0))
    return jax.lax.psum(total, tuple(mesh.axis_names))

  return jax.shard_map(local, mesh=mesh, in_specs=P(*spec), out_specs=P(), check_vma=False)(x)


@functools.lru_cache(maxsize=8)
def _checksums(treedef: Any, shardings: tuple) -> Callable:
  """One jitted function: the leaves of a tree of `treedef` -> their checksums."""
  return jax.jit(lambda leaves: [_leaf_checksum(x, s) for x, s in zip(leaves, shardings)])


def _describe(state: Any) -> dict[str, list]:
  """{leaf path: [shape, dtype, checksum]} of a (sharded) state."""
  leaves, treedef = jax.tree.flatten(state)
  sums = jax.device_get(_checksums(treedef, tuple(getattr(x, "sharding", None)
                                                  for x in leaves))(leaves))
  return {jax.tree_util.keystr(path): [list(x.shape), str(x.dtype), int(s)]
          for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(state), sums,
                                  strict=True)}


def _read(where: str, what: str, read: Callable[[], Any]) -> Any:
  """`read()`; if it fails on any process, `DamagedCheckpointError` on every one.

  Processes read their own shards, so only some may fail; they must agree, or some
  would go on to the checksums (collective) and wait for the others forever.
  """
  try:
    value, error = read(), None
  except Exception as e:  # pylint: disable=broad-except  (any failure = unreadable)
    value, error = None, e
  ok = error is None
  if jax.process_count() > 1:
    ok = bool(multihost_utils.process_allgather(np.array(ok)).all())
  if not ok:
    cause = str(error).splitlines()[0] if error else "failed on another process"
    raise DamagedCheckpointError(f"{where}: cannot read {what}: {cause}") from error
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
      copied to host memory, so the next step may donate its buffers.
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
    self._closed = False

  def all_steps(self) -> list[int]:
    """The steps of the committed checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed checkpoint's step (unverified), or None."""
    return self._manager.latest_step()

  def maybe_save(self, step: int, state: step_lib.TrainState,
                 meta: Mapping[str, Any] | None = None) -> bool:
    """Saves if `step` is due (steps, minutes or preemption); returns whether it did."""
    return self.save(step, state, meta, force=False)

  def save(self, step: int, state: step_lib.TrainState,
           meta: Mapping[str, Any] | None = None, *, force: bool = True) -> bool:
    """Starts saving `state` as checkpoint `step`; returns False if not due or saved.

    Args:
      step: the checkpoint's number: the steps taken (`state.step`).
      state: the train state, sharded as it is.
      meta: JSON-serializable extras, e.g. `{"config": config.to_dict()}`.
      force: save even if `step` is not due.
    """
    if step in self._manager.all_steps():
      return False  # E.g. a stop signal right after a periodic save of the same step.
    if not force and not self._manager.should_save(step):
      return False
    meta = {**(meta or {}), "step": int(step), "data_position": int(step),
            "zerojax_version": importlib.metadata.version("zerojax"), "leaves": _describe(state)}
    return self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def wait(self) -> None:
    """Blocks until the saves in flight are committed."""
    self._manager.wait_until_finished()

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def read_meta(self, step: int) -> dict:
    """Checkpoint `step`'s JSON meta (no array is read)."""
    meta = _read(self._path(step), "its meta", lambda: self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
    _read(self._path(step), "its meta", lambda: dict(meta["leaves"]))
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

    Args:
      step: which checkpoint.
      target: a `ZeroPlan` (any mesh, device count or stage) or its abstract state
        (`zerojax.abstract_state(plan)`).
      config: if given, first `check_compatible` with the checkpoint's config.

    Returns:
      (state, meta), every leaf bit-identical to what was saved.

    Raises:
      CheckpointError: the config or the target's leaves do not match the checkpoint.
      DamagedCheckpointError: unreadable files or failed checksums.
    """
    if isinstance(target, zero.ZeroPlan):
      target = step_lib.abstract_state(target)
    where, meta = self._path(step), self.read_meta(step)
    saved = meta["leaves"]
    if config is not None:
      check_compatible(meta, config)
    # Before reading any data: a changed model or optimizer is not damage.
    wanted = {jax.tree_util.keystr(p): [list(x.shape), str(x.dtype)]
              for p, x in jax.tree_util.tree_leaves_with_path(target)}
    had = {k: v[:2] for k, v in saved.items()}
    differ = [f"{k}: checkpoint {had.get(k, '<absent>')}, target {wanted.get(k, '<absent>')}"
              for k in sorted(had.keys() | wanted.keys()) if had.get(k) != wanted.get(k)]
    if differ:
      raise CheckpointError(f"{where} holds another state than the target:\n  " +
                            "\n  ".join(differ[:10]))
    state = _read(where, "the state", lambda: self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state)
    got = _describe(state)
    bad = [k for k in saved if got[k][2] != saved[k][2]]
    if bad:
      raise DamagedCheckpointError(
          f"{where}: {len(bad)} arrays fail their checksums (files damaged after "
          f"saving): {', '.join(bad[:5])}")
    return state, meta

  def restore_latest(self, target: zero.ZeroPlan | step_lib.TrainState, *,
                     config: Any = None) -> tuple[step_lib.TrainState, dict] | None:
    """Restores the newest checkpoint that reads back intact; None if there is none.

    A damaged checkpoint is reported through `log`, moved aside to `<step>.damaged`
    (kept for inspection, out of the way of the steps to come) and the next older one
    is tried.

    Raises:
      CheckpointError: the config or target does not match (see `restore`), or
        checkpoints exist and none of them is intact.
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
    """Waits for the saves in flight, then releases the manager's threads (once)."""
    if not self._closed:
      self._closed = True
      self._manager.wait_until_finished()
      self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class StopSignal:
  """SIGTERM / SIGINT (preemption) as a request to save and stop between steps.

  `stop(step)`, called every step, is True once a signal has arrived (a second one
  stops at once, the default way). With several processes jax's coordination service
  owns SIGTERM: True once all reach its preemption sync point, so that they all stop
  (and save: a collective) at the same step.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.received: signal.Signals | None = None
    self._previous = {}
    if jax.process_count() == 1:
      self._previous = {s: signal.signal(s, self._handle) for s in signals}

  def _handle(self, signum, frame) -> None:
    del frame
    if self.received is not None:
      self.close()
      signal.raise_signal(signum)
    self.received = signal.Signals(signum)

  def __call__(self, step: int) -> bool:
    if self.received is not None:
      return True
    if jax.process_count() > 1:
      try:
        return multihost_utils.reached_preemption_sync_point(step)
      except RuntimeError:  # The preemption service is off.
        return False
    return False

  def close(self) -> None:
    """Puts the previous signal handlers back."""
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}
