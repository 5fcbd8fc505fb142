"""The checkpoint format: what a train state's leaves are called on disk, and migrations.

A leaf is named by its path of keys, whatever the containers: attribute names, dict
keys and sequence indices joined by "/" (`opt_state/inner/0/mu/layers/mlp/up_proj/kernel`).
No Python class name is part of it, and a NamedTuple, a dict or a dataclass with the
same fields give the same names: orbax writes the state as dicts and lists under these
keys, `meta["leaves"]` keys each leaf's shape, dtype and checksum by its name, and a
restore reads the tree orbax wrote (never the current code's classes) and places each
leaf by name. So a renamed class restores as it is. What changes names is a renamed,
added or removed field, or a transform added to an optax chain (the indices after it
shift): such a change bumps `FORMAT` and appends a `Migration` from the format before,
and `tests/fixtures/write_checkpoints.py` writes fixtures of the new format beside the
old ones, which `tests/test_upgrade.py` restores with the code of the day.

| format | zerojax | what changed |
| --- | --- | --- |
| 1 | 0.1.0 | (the first) `meta["leaves"]` keyed by `jax.tree_util.keystr`, no `format` |
| 2 | 0.2.0 | `meta["leaves"]` keyed by names; `meta["format"]` |
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import ml_collections

from zerojax.checkpoint.errors import CheckpointError
from zerojax.config import checks, schema

FORMAT = 2  # What this code writes; every earlier one restores through MIGRATIONS.


def version() -> str:
  """This zerojax's version, as its installed metadata says."""
  return importlib.metadata.version("zerojax")


def name(path: tuple) -> str:
  """A leaf's name: its `jax.tree_util` key path's keys joined by "/"."""
  return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def names(tree: Any) -> dict[str, Any]:
  """{name: leaf} of a pytree, in its leaves' order."""
  return {name(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


class Leaf(NamedTuple):
  """A leaf of a checkpoint, as a format names it."""
  shape: tuple[int, ...]
  dtype: str  # numpy's name: "bfloat16", "float32", "int32", ...
  checksum: int | None  # `checkpoint.checksums` of the bits on disk; None: made by a migration.
  disk: str | None  # The name orbax wrote it under; None: made by a migration as `fill`.
  fill: float = 0


class Saved(NamedTuple):
  """What a checkpoint holds, named as format `format` names it."""
  format: int
  written: int  # The format it was written in.
  version: str  # The zerojax that wrote it.
  leaves: dict[str, Leaf]
  config: dict[str, Any] | None  # Flat ("model.d_model": 32); None: saved without one.


class Migration(NamedTuple):
  """From format `to - 1` to `to`: renames, drops or adds leaves and config keys.

  `leaves` maps the older format's leaves to the newer's: keep each `Leaf` (its `disk`
  name is where it is read from) under its new name, leave a dropped one out, and make
  an added one `Leaf(shape, dtype, None, None, fill)`. Values are never computed: a
  change that needs arithmetic on old values is a new optimizer, not a new format.
  """
  to: int
  what: str  # One line: what changed, for messages.
  leaves: Callable[[dict[str, Leaf]], dict[str, Leaf]]
  config: Callable[[dict[str, Any]], dict[str, Any]] = dict


# `keystr` pieces: .attribute, [index], ['dict key'] (flax's keys are identifiers).
_KEYSTR = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+)\]|\['((?:[^'\\]|\\.)*)'\]")


def _from_keystr(key: str) -> str:
  if not re.fullmatch(f"(?:{_KEYSTR.pattern})*", key):
    raise CheckpointError(f"cannot read the leaf name {key!r} of a format-1 checkpoint")
  return "/".join(a or i or d for a, i, d in _KEYSTR.findall(key))


def _names_for_keystrs(leaves: dict[str, Leaf]) -> dict[str, Leaf]:
  return {_from_keystr(k): x._replace(disk=_from_keystr(x.disk)) for k, x in leaves.items()}


MIGRATIONS: tuple[Migration, ...] = (
    Migration(2, "leaves named by their keys, not by jax key strings", _names_for_keystrs),
)


def read(meta: Mapping[str, Any]) -> Saved:
  """The checkpoint's `meta` as a `Saved` of its own format."""
  fmt = int(meta.get("format", 1))
  leaves = {k: Leaf(tuple(v[0]), v[1], v[2], k) for k, v in meta["leaves"].items()}
  config = checks.flatten(meta["config"])[0] if "config" in meta else None
  return Saved(fmt, fmt, str(meta.get("zerojax_version", "unknown")), leaves, config)


def upgrade(meta: Mapping[str, Any], where: str) -> Saved:
  """The checkpoint `where` (its `meta`) in this code's format, through `MIGRATIONS`.

  Raises:
    CheckpointError: it was written by a newer format than `FORMAT` (one line).
  """
  saved = read(meta)
  if saved.format > FORMAT:
    raise CheckpointError(
        f"{where} was written by zerojax {saved.version} in checkpoint format "
        f"{saved.format}; this zerojax {version()} reads formats up to {FORMAT}: "
        f"upgrade zerojax to {saved.version} or later to restore it")
  for m in MIGRATIONS:
    if m.to > saved.format:
      config = None if saved.config is None else m.config(saved.config)
      saved = saved._replace(format=m.to, leaves=m.leaves(saved.leaves), config=config)
  return saved


def _first(keys: list[str]) -> str:
  return f"{len(keys)} (first: {keys[0]})" if len(keys) > 1 else keys[0]


def _leaves(keys: list[str], most: int = 3) -> str:
  """'2 leaves (a, b)', '5 leaves (a, b, c and 2 more)'."""
  shown = ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")
  return f"{len(keys)} {'leaf' if len(keys) == 1 else 'leaves'} ({shown})"


# A train state's top-level fields, as messages name them.
_FIELDS = {"params": "the params", "opt_state": "the optimizer state"}


def mismatch(saved: Saved, wanted: Mapping[str, Any], where: str) -> str | None:
  """One line on how `saved` differs from the leaves `wanted` ({name: array or
  ShapeDtypeStruct}), and the fix; None if it has every leaf.

  Written by another zerojax, the line names both versions: no migration maps the
  leaves. Written by this one, the target is another train state than the saved one
  (`_other_state`).
  """
  lacks = [k for k in wanted if k not in saved.leaves]
  extra = [k for k in saved.leaves if k not in wanted]
  other = [f"{k}: checkpoint {list(saved.leaves[k].shape)} {saved.leaves[k].dtype}, here "
           f"{list(x.shape)} {x.dtype}" for k, x in wanted.items() if k in saved.leaves and (
               saved.leaves[k].shape, saved.leaves[k].dtype) != (tuple(x.shape), str(x.dtype))]
  if not (lacks or extra or other):
    return None
  if saved.version == version():
    return _other_state(where, lacks, extra, other)
  parts = ([f"leaves it lacks: {_first(lacks)}"] if lacks else []) + (
      [f"leaves this state lacks: {_first(extra)}"] if extra else []) + (
      [f"leaves of another shape or dtype: {_first(other)}"] if other else [])
  return (f"{where} (zerojax {saved.version}, checkpoint format {saved.written}) cannot be "
          f"restored by zerojax {version()} (format {FORMAT}): {'; '.join(parts)}; no "
          f"migration maps them: resume with zerojax {saved.version}")


def _other_state(where: str, lacks: list[str], extra: list[str], other: list[str]) -> str:
  """`mismatch`'s line for a checkpoint of this zerojax: which fields of the train state
  differ (the params: another model or param dtype; the optimizer state: another
  optimizer), their leaves, and how a library user restores it (the config-level check,
  `check_compatible`, runs first where there is a config: train.py)."""
  field = lambda k: k.split("/", 1)[0]  # noqa: E731
  fields = sorted({field(k.split(":", 1)[0]) for k in lacks + extra + other},
                  key=lambda f: (f not in _FIELDS, f))
  parts = []
  for f in fields:
    only_saved, only_here, reshaped = ([k for k in keys if field(k) == f]
                                       for keys in (extra, lacks, other))
    pieces = ([f"{_leaves(only_saved)} only in the checkpoint"] if only_saved else []) + (
        [f"{_leaves(only_here)} only in the target"] if only_here else []) + (
        [f"leaves of another shape or dtype: {_leaves(reshaped, 2)}"] if reshaped else [])
    parts.append(f"{_FIELDS.get(f, f)} differ{'' if f == 'params' else 's'}: "
                 + ", ".join(pieces))
  if fields == ["opt_state"]:
    fix = ("it was saved with another optimizer (or chain of optax transforms): restore it "
           "into a plan made with that one (make_plan(mesh, stage, params, tx)); to go on "
           "with another, start the new optimizer's state from the restored params: "
           "zerojax.init_state(plan, init_fn, tx, rng, params=state.params)")
  else:
    fix = ("restore it into a plan made from the model (param tree, shapes and dtype) and "
           "the optimizer it was saved with")
  return (f"{where} holds another train state than the target (both zerojax {version()}): "
          f"{'; '.join(parts)}; {fix}")


def config(saved: Saved, where: str) -> ml_collections.ConfigDict:
  """The config the checkpoint was saved with, every key of this code's schema set: its
  values over the defaults (a key added since it was written has its default).

  Raises:
    CheckpointError: it was saved without a config, or with keys this schema lacks.
  """
  if saved.config is None:
    raise CheckpointError(f"{where} was saved without a config")
  unknown = sorted(k for k in saved.config if k not in schema.FIELDS)
  if unknown:
    raise CheckpointError(
        f"{where} (zerojax {saved.version}, checkpoint format {saved.written}) has config keys "
        f"zerojax {version()} does not know: {', '.join(unknown[:5])}; no migration maps them")
  c = schema.base_config()
  for key, value in saved.config.items():
    parent, leaf = checks.parent_of(c, key)
    parent[leaf] = tuple(value) if isinstance(parent[leaf], tuple) else value
  return c


def saved_value(saved: Saved, key: str, absent: Any) -> Any:
  """The checkpoint's value of config `key`: a key added since has its schema default."""
  if key in saved.config:
    return saved.config[key]
  return schema.FIELDS[key].default if key in schema.FIELDS else absent
