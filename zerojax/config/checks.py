"""Checks a config against the schema (`zerojax.config.schema`), key by key, for a person.

`zerojax.config.schema` defines every key, its default, choices and range; this module checks a
config tree against it key by key: unknown keys (with the nearest valid ones and a table
of DeepSpeed / PyTorch names), missing keys, types, enums and ranges. Combinations of
values (mesh vs devices, batch vs mesh, dtype pairs) are checked in `zerojax.config`.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from zerojax.config.schema import DTYPES, FIELDS, base_config

_FLOAT16 = ("float16 sums of many gradients overflow (max 65504)",
            "use float32 (the default) or bfloat16 for reductions and accumulation")
# Hand-written names that DeepSpeed / PyTorch users type, mapped to where the
# setting lives here: difflib cannot guess `train_batch_size` -> global_batch_size.
_PRECISION = ("precision settings are under precision.param_dtype / precision.compute_dtype "
              "(float32 | bfloat16 | float16)")
_FP16 = f"{_PRECISION}; float16 turns on dynamic loss scaling, tuned under precision.loss_scale.*"
_ALIASES = {
    "bf16": _PRECISION, "bfloat16": _PRECISION, "amp": _PRECISION, "dtype": _PRECISION,
    "mixed_precision": _PRECISION, "fp16": _FP16, "float16": _FP16,
    "zero_optimization": "the ZeRO stage is zero.stage (0-3)",
    "zero_stage": "the ZeRO stage is zero.stage (0-3)",
    "zero_optimization.stage3_param_persistence_threshold": "use zero.min_shard_size",
    "train_batch_size": "use train.global_batch_size", "batch_size": "use train.global_batch_size",
    "gradient_accumulation_steps": "use train.microbatches",
    "train_micro_batch_size_per_gpu": "set train.global_batch_size and train.microbatches; the "
                                      "per-device microbatch is global_batch_size / (devices * "
                                      "microbatches)",
    "gradient_clipping": "use optimizer.grad_clip", "max_grad_norm": "use optimizer.grad_clip",
    "lr": "use optimizer.learning_rate", "warmup": "use optimizer.warmup_steps",
    "steps": "use train.steps", "max_steps": "use train.steps",
    "num_train_steps": "use train.steps", "train_steps": "use train.steps",
    "total_steps": "use train.steps",
    # Nested DeepSpeed JSON keys (a ds_config.json passed as --config lists these).
    "zero_optimization.stage": "use zero.stage", "steps_per_print": "use train.log_every",
    "fp16.enabled": _FP16, "bf16.enabled": _PRECISION,
    "fp16.initial_scale_power": "use precision.loss_scale.initial_power",
    "fp16.loss_scale_window": "use precision.loss_scale.window",
    "fp16.hysteresis": "use precision.loss_scale.hysteresis",
    "fp16.min_loss_scale": "use precision.loss_scale.min_scale",
    "fp16.loss_scale": "precision.loss_scale.* is always dynamic (DeepSpeed's loss_scale 0)",
    "optimizer.type": "use optimizer.name (adamw | lion | sgd)",
    "betas": "use optimizer.b1, optimizer.b2",
    "eps": "use optimizer.eps", "weight_decay": "use optimizer.weight_decay",
    "scheduler.type": "use optimizer.schedule (constant | cosine | linear)",
    "warmup_num_steps": "use optimizer.warmup_steps", "total_num_steps": "use train.steps",
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat": "bfloat16", "fp32": "float32", "f32": "float32",
                  "float": "float32", "single": "float32", "fp16": "float16", "f16": "float16",
                  "half": "float16"}
_ENUM_HINTS = {
    ("optimizer.name", "adam"): "plain Adam is adamw with optimizer.weight_decay=0",
    ("zero.stage", 4): "ZeRO has stages 0-3 (3 shards parameters, gradients and optimizer state)",
}
Source = str | Mapping[str, str]


class ConfigError(ValueError):
  """A config mistake, explained for a person: the key, its source, what is wrong, the fix."""

  def __init__(self, problem: str, *, key: str | None = None, source: str | None = None,
               fix: str | None = None):
    self.problem, self.key, self.source, self.fix = problem, key, source, fix
    head = f"config key {key}" if key else "config"
    message = f"{head} (from {source}): {problem}" if source else f"{head}: {problem}"
    super().__init__(message + (f"\n  fix: {fix}" if fix else ""))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], set[str]]:
  """Returns ({dotted leaf path: value}, {dotted group paths}) for a (Config)dict tree."""
  leaves, groups = {}, set()
  for name, value in tree.items():
    path = prefix + name
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      groups.add(path)
      sub_leaves, sub_groups = flatten(value, path + ".")
      leaves.update(sub_leaves)
      groups |= sub_groups
    else:
      leaves[path] = value
  return leaves, groups


@functools.lru_cache(maxsize=None)
def flat_schema() -> tuple[dict[str, Any], set[str]]:
  return flatten(base_config())


def parent_of(config: ml_collections.ConfigDict, key: str) -> tuple[ml_collections.ConfigDict, str]:
  """(the ConfigDict holding `key`, the last component of `key`)."""
  path, _, name = key.rpartition(".")
  return (functools.reduce(getattr, path.split("."), config) if path else config), name


def group_error(key: str, source: str) -> ConfigError:
  members = ", ".join(k for k in flat_schema()[0] if k.startswith(key + "."))
  return ConfigError("is a group of settings, not a value.", key=key, source=source,
                     fix=f"set one of {members}")


def source_of(source: Source, *keys: str) -> str:
  """Where the value of the first of `keys` that has a recorded origin came from."""
  if isinstance(source, str):
    return source
  return next((source[k] for k in keys if k in source), source.get("", "the config"))


def closest(key: str, candidates: Sequence[str]) -> list[str]:
  """The valid keys nearest to `key`: by whole dotted path, then by last component.

  The last component finds `seed` for `seeed`, which the whole path is too long to match.
  """
  found = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
  by_last: dict[str, list[str]] = {}
  for path in candidates:
    by_last.setdefault(path.rsplit(".", 1)[-1], []).append(path)
  for name in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_last), n=2, cutoff=0.7):
    found += by_last[name]
  return list(dict.fromkeys(found))[:4]


def alias(key: str, *, groups: bool = True) -> str | None:
  """Where a DeepSpeed / PyTorch name (dotted, at any depth) lives here, from `_ALIASES`.

  Tries the whole key, then (with `groups`) its enclosing groups, then its last part.
  """
  parts = key.split(".")
  names = [".".join(parts[:n]) for n in range(len(parts), 0 if groups else len(parts) - 1, -1)]
  return next((_ALIASES[n] for n in names + [parts[-1]] if n in _ALIASES), None)


def deepspeed_keys(tree: Mapping[str, Any]) -> str:
  """The zerojax keys that correspond to a DeepSpeed JSON config's settings, one per line."""
  leaves, _ = flatten(tree)
  # Not by group: zero_optimization.overlap_comm has nothing to do with zero.stage.
  known = [f"{k} = {json.dumps(v)}: {alias(k, groups=False)}" for k, v in leaves.items()
           if alias(k, groups=False)]
  unknown = [k for k in leaves if not alias(k, groups=False)]
  return "\n    ".join(known + ([f"no zerojax setting: {', '.join(unknown)}"] if unknown else []))


def unknown_key(key: str, source: str) -> ConfigError:
  leaves, _ = flat_schema()
  hint = alias(key)
  near = closest(key, list(leaves))
  problem = "no such key in the schema (zerojax/config/schema.py)."
  if hint:
    return ConfigError(problem, key=key, source=source, fix=hint)
  if near:
    return ConfigError(problem, key=key, source=source,
                       fix="did you mean " + " or ".join(near) + "?")
  return ConfigError(problem, key=key, source=source,
                     fix="python -m zerojax.config --keys lists every valid key")


def check_tree(config: ml_collections.ConfigDict, source: Source) -> None:
  """Unknown keys (at any depth), keys that replaced a group with a value, and deleted keys."""
  leaves, groups = flatten(config)
  schema_leaves, schema_groups = flat_schema()
  for key in groups:
    if key in schema_leaves:
      raise ConfigError("is a single value in the schema, but was set to a group of keys.", key=key,
                        source=source_of(source, key),
                        fix=f"assign a value, e.g. {key} = {schema_leaves[key]!r}")
  for key in leaves:
    if key in schema_groups:
      raise group_error(key, source_of(source, key))
  # Leaves first so that `c.bfloat16 = ConfigDict({"enabled": True})` is reported as
  # bfloat16.enabled.
  for key in list(leaves) + sorted(groups):
    if key not in schema_leaves and key not in schema_groups:
      raise unknown_key(key, source_of(source, key))
  for key in schema_leaves:
    if key not in leaves:
      raise ConfigError("is missing: the config deleted or replaced it.", key=key,
                        source=source_of(source, key),
                        fix="keep every key from base_config(); change values, do not delete keys")


def type_name(kind: type) -> str:
  names = {bool: "a bool (True/False)", int: "an int", float: "a number", str: "a string"}
  return names.get(kind, kind.__name__)


def check_value(key: str, value: Any, default: Any, source: str) -> None:
  """Type, enum and range checks for one leaf."""
  kind = type(default)
  ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    ok = True
  if not ok:
    fix = f"use {type_name(kind)}, e.g. {key} = {default!r}"
    if isinstance(value, str) and kind in (int, float):
      fix = "write the number without quotes"
    raise ConfigError(f"must be {type_name(kind)}, got {type(value).__name__} {value!r}.", key=key,
                      source=source, fix=fix)
  if kind is float and not math.isfinite(value):
    raise ConfigError(f"must be a finite number, got {value!r}.", key=key, source=source)
  field = FIELDS[key]
  if field.choices and value not in field.choices:
    allowed = ", ".join(map(repr, field.choices))
    if key.startswith("precision.") or key == "optimizer.state_dtype":
      bare = re.sub(r"^(jnp|np|torch|jax\.numpy|numpy)\.", "", value.lower())
      canonical = _DTYPE_ALIASES.get(bare, value.lower())
      if canonical == "float16" and key == "optimizer.state_dtype":
        raise ConfigError(f"is {value!r}, but float16 moments underflow (Adam's nu holds squared "
                          "gradients).", key=key, source=source,
                          fix="use bfloat16 (the default) or float32")
      if canonical == "float16":
        raise ConfigError(f"is {value!r}, but {_FLOAT16[0]}.", key=key, source=source,
                          fix=_FLOAT16[1])
      if canonical in DTYPES:
        raise ConfigError(f"{value!r} is not a dtype name here; use one of {allowed}.", key=key,
                          source=source, fix=f"write {key} = {canonical!r}")
    hint = _ENUM_HINTS.get((key, value))
    near = difflib.get_close_matches(str(value), [str(a) for a in field.choices], n=1, cutoff=0.5)
    fix = hint or (f"did you mean {near[0]!r}?" if near else f"use one of {allowed}")
    raise ConfigError(f"must be one of {allowed}; got {value!r}.", key=key, source=source, fix=fix)
  if field.range and not field.range.test(value):
    raise ConfigError(f"must be {field.range.text}, got {value!r}.", key=key, source=source,
                      fix=f"use a value {field.range.text} (the default is {default!r})")
