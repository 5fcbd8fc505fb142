"""The config schema: which keys exist and what each one may hold.

`configs/base.py` defines every key and its default; this module loads it and checks a
config tree against it key by key: unknown keys (with the nearest valid ones and a table
of DeepSpeed / PyTorch names), missing keys, types, enums and ranges. Combinations of
values (mesh vs devices, batch vs mesh, dtype pairs) are checked in `zerojax.config`.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

_BASE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.py")
_DTYPES = ("float32", "bfloat16")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")
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
    "zero_optimization": "the ZeRO stage is zero.stage (0-3)", "zero_stage": "the ZeRO stage is zero.stage (0-3)",
    "zero_optimization.stage3_param_persistence_threshold": "use zero.min_shard_size",
    "train_batch_size": "use train.global_batch_size", "batch_size": "use train.global_batch_size",
    "gradient_accumulation_steps": "use train.microbatches",
    "train_micro_batch_size_per_gpu": "set train.global_batch_size and train.microbatches; the per-device "
                                      "microbatch is global_batch_size / (devices * microbatches)",
    "gradient_clipping": "use optimizer.grad_clip", "max_grad_norm": "use optimizer.grad_clip",
    "lr": "use optimizer.learning_rate", "warmup": "use optimizer.warmup_steps",
    "steps": "use train.steps", "max_steps": "use train.steps", "num_train_steps": "use train.steps",
    "train_steps": "use train.steps", "total_steps": "use train.steps",
}
_ENUMS: dict[str, tuple[Any, ...]] = {
    "precision.param_dtype": _PARAM_DTYPES, "precision.compute_dtype": _PARAM_DTYPES,
    "precision.reduce_dtype": _DTYPES, "precision.accum_dtype": _DTYPES,
    "optimizer.state_dtype": _DTYPES,
    "optimizer.update_rule": ("nearest", "kahan", "stochastic", "master"),
    "zero.stage": (0, 1, 2, 3), "optimizer.name": ("adamw", "lion", "sgd"),
    "optimizer.schedule": ("constant", "cosine", "linear"), "model.name": ("llama", "mlp_lm"), "model.attention": ("auto", "blocked", "dot_product"), "model.remat": ("none", "full", "dots"),
    "data.name": ("stdlib", "tokens", "text"), "data.dtype": ("uint16", "uint32"),
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat": "bfloat16", "fp32": "float32", "f32": "float32",
                  "float": "float32", "single": "float32", "fp16": "float16", "f16": "float16", "half": "float16"}
_ENUM_HINTS = {("optimizer.name", "adam"): "plain Adam is adamw with optimizer.weight_decay=0",
               ("zero.stage", 4): "ZeRO has stages 0-3 (3 shards parameters, gradients and optimizer state)"}
_POS, _NONNEG = (lambda v: v > 0, "> 0"), (lambda v: v >= 0, ">= 0")
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": _NONNEG, "zero.min_shard_size": _NONNEG,
    "mesh.data": (lambda v: v > 0 or v == -1, "a positive size, or -1 for the devices left over"),
    "mesh.fsdp": (lambda v: v > 0 or v == -1, "a positive size, or -1 for the devices left over"),
    "optimizer.learning_rate": _POS, "optimizer.eps": _POS, "optimizer.weight_decay": _NONNEG,
    "optimizer.b1": (lambda v: 0 <= v < 1, "in [0, 1)"), "optimizer.b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optimizer.momentum": (lambda v: 0 <= v < 1, "in [0, 1)"), "optimizer.grad_clip": _NONNEG,
    "optimizer.warmup_steps": _NONNEG, "optimizer.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "train.steps": _POS, "train.global_batch_size": _POS, "train.microbatches": (lambda v: v >= 1, ">= 1"),
    "train.seq_len": _POS, "train.log_every": _POS, "train.eval_every": _NONNEG,
    "train.eval_batches": (lambda v: v >= 1, ">= 1"), "model.vocab_size": _POS, "model.d_model": _POS,
    "model.d_ff": _POS, "model.n_layers": _POS, "model.context": (lambda v: v >= 1, ">= 1"),
    "model.n_heads": _POS, "model.n_kv_heads": _POS, "model.rope_theta": _POS,
    "model.rope_scaling_factor": _NONNEG, "model.rope_low_freq_factor": _POS,
    "model.rope_high_freq_factor": _POS, "model.rope_original_context": _POS, "model.norm_eps": _POS,
    "model.attention_block": _POS, "model.loss_chunk": _POS, "train.peak_flops": _NONNEG,
    "checkpoint.every_steps": _NONNEG, "checkpoint.every_minutes": _NONNEG,
    "checkpoint.keep": _NONNEG, "checkpoint.keep_every": _NONNEG,
    "data.eval_fraction": (lambda v: 0 < v <= 0.5, "in (0, 0.5]"),
    "data.eos_id": (lambda v: v >= -1, "a token id >= 0, or -1 for the tokenizer's end-of-sequence token"),
    "precision.loss_scale.initial_power": (lambda v: 0 <= v <= 40, "in [0, 40]"),
    "precision.loss_scale.window": (lambda v: v >= 1, ">= 1"),
    "precision.loss_scale.hysteresis": (lambda v: v >= 1, ">= 1"),
    "precision.loss_scale.min_scale": _POS, "precision.max_consecutive_skips": _NONNEG,
    "distributed.num_processes": (lambda v: v >= 0, ">= 0 (0 = $ZEROJAX_NUM_PROCESSES or detected)"),
    "distributed.process_id": (lambda v: v >= -1, "an id >= 0, or -1 for $ZEROJAX_PROCESS_ID or detected"),
    "distributed.initialization_timeout": _POS, "distributed.heartbeat_timeout": _POS,
    "distributed.shutdown_timeout": _POS, "distributed.wait_report_every": _POS,
}
Source = str | Mapping[str, str]


class ConfigError(ValueError):
  """A config mistake, explained for a person: the key, where it came from, what is wrong, the fix."""

  def __init__(self, problem: str, *, key: str | None = None, source: str | None = None, fix: str | None = None):
    self.problem, self.key, self.source, self.fix = problem, key, source, fix
    head = f"config key {key}" if key else "config"
    message = f"{head} (from {source}): {problem}" if source else f"{head}: {problem}"
    super().__init__(message + (f"\n  fix: {fix}" if fix else ""))


@functools.lru_cache(maxsize=None)
def base_module() -> Any:
  if not os.path.isfile(_BASE_PATH):
    raise ConfigError(f"the schema file {_BASE_PATH} is missing",
                      fix="run from a zerojax checkout that has configs/base.py")
  spec = importlib.util.spec_from_file_location("_zerojax_configs_base", _BASE_PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def base_config() -> ml_collections.ConfigDict:
  """Returns a fresh, unlocked copy of the schema in configs/base.py (every key, default values).

  Config files anywhere on disk start from this, so `configs/` need not be on sys.path.
  """
  return base_module().get_config()


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
def schema() -> tuple[dict[str, Any], set[str]]:
  return flatten(base_config())


def parent_of(config: ml_collections.ConfigDict, key: str) -> tuple[ml_collections.ConfigDict, str]:
  """(the ConfigDict holding `key`, the last component of `key`)."""
  path, _, name = key.rpartition(".")
  return (functools.reduce(getattr, path.split("."), config) if path else config), name


def group_error(key: str, source: str) -> ConfigError:
  return ConfigError("is a group of settings, not a value.", key=key, source=source,
                     fix="set one of " + ", ".join(k for k in schema()[0] if k.startswith(key + ".")))


def source_of(source: Source, *keys: str) -> str:
  """Where the value of the first of `keys` that has a recorded origin came from."""
  if isinstance(source, str):
    return source
  return next((source[k] for k in keys if k in source), source.get("", "the config"))


def closest(key: str, candidates: Sequence[str]) -> list[str]:
  """The valid keys nearest to `key`: by whole dotted path, then by last component (seeed -> seed)."""
  found = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
  by_last: dict[str, list[str]] = {}
  for path in candidates:
    by_last.setdefault(path.rsplit(".", 1)[-1], []).append(path)
  for name in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_last), n=2, cutoff=0.7):
    found += by_last[name]
  return list(dict.fromkeys(found))[:4]


def unknown_key(key: str, source: str) -> ConfigError:
  leaves, _ = schema()
  parts = key.split(".")
  names = [".".join(parts[:n]) for n in range(len(parts), 0, -1)] + [parts[-1]]
  hint = next((_ALIASES[n] for n in names if n in _ALIASES), None)
  near = closest(key, list(leaves))
  problem = "no such key in the schema (configs/base.py)."
  if hint:
    return ConfigError(problem, key=key, source=source, fix=hint)
  if near:
    return ConfigError(problem, key=key, source=source, fix="did you mean " + " or ".join(near) + "?")
  return ConfigError(problem, key=key, source=source, fix="see configs/base.py for every valid key")


def check_tree(config: ml_collections.ConfigDict, source: Source) -> None:
  """Unknown keys (at any depth), keys that replaced a group with a value, and deleted keys."""
  leaves, groups = flatten(config)
  schema_leaves, schema_groups = schema()
  for key in groups:
    if key in schema_leaves:
      raise ConfigError("is a single value in the schema, but was set to a group of keys.", key=key,
                        source=source_of(source, key), fix=f"assign a value, e.g. {key} = {schema_leaves[key]!r}")
  for key in leaves:
    if key in schema_groups:
      raise group_error(key, source_of(source, key))
  # Leaves first so that `c.bfloat16 = ConfigDict({"enabled": True})` is reported as bfloat16.enabled.
  for key in list(leaves) + sorted(groups):
    if key not in schema_leaves and key not in schema_groups:
      raise unknown_key(key, source_of(source, key))
  for key in schema_leaves:
    if key not in leaves:
      raise ConfigError("is missing: the config deleted or replaced it.", key=key, source=source_of(source, key),
                        fix="keep every key from base_config(); change values, do not delete keys")


def type_name(kind: type) -> str:
  return {bool: "a bool (True/False)", int: "an int", float: "a number", str: "a string"}.get(kind, kind.__name__)


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
  if key in _ENUMS and value not in _ENUMS[key]:
    allowed = ", ".join(map(repr, _ENUMS[key]))
    if key.startswith("precision.") or key == "optimizer.state_dtype":
      canonical = _DTYPE_ALIASES.get(re.sub(r"^(jnp|np|torch|jax\.numpy|numpy)\.", "", value.lower()), value.lower())
      if canonical == "float16" and key == "optimizer.state_dtype":
        raise ConfigError(f"is {value!r}, but float16 moments underflow (Adam's nu holds squared "
                          "gradients).", key=key, source=source,
                          fix="use bfloat16 (the default) or float32")
      if canonical == "float16":
        raise ConfigError(f"is {value!r}, but {_FLOAT16[0]}.", key=key, source=source, fix=_FLOAT16[1])
      if canonical in _DTYPES:
        raise ConfigError(f"{value!r} is not a dtype name here; use one of {allowed}.", key=key, source=source,
                          fix=f"write {key} = {canonical!r}")
    hint = _ENUM_HINTS.get((key, value))
    near = difflib.get_close_matches(str(value), [str(a) for a in _ENUMS[key]], n=1, cutoff=0.5)
    fix = hint or (f"did you mean {near[0]!r}?" if near else f"use one of {allowed}")
    raise ConfigError(f"must be one of {allowed}; got {value!r}.", key=key, source=source, fix=fix)
  if key in _RANGES and not _RANGES[key][0](value):
    raise ConfigError(f"must be {_RANGES[key][1]}, got {value!r}.", key=key, source=source,
                      fix=f"use a value {_RANGES[key][1]} (the default is {default!r})")
