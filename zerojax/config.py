"""Loading, overriding and strictly validating zerojax configs.

A config is a Python file whose `get_config()` starts from the schema in
`configs/base.py` (`base_config()` here) and changes values. Command-line
overrides use ml_collections' `--config.a.b=value` syntax. Every mistake becomes
one `ConfigError` that names the key, where the value came from and the fix,
before any device work starts.

    python -m zerojax.config --config configs/tiny.py --config.zero.stage=2
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib.util
import inspect
import math
import os
import re
import sys
import traceback
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
    "optimizer.schedule": ("constant", "cosine", "linear"), "model.name": ("llama", "mlp_lm"), "model.attention": ("blocked", "dot_product"), "model.remat": ("none", "full", "dots"),
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
def _base_module() -> Any:
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
  return _base_module().get_config()


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], set[str]]:
  """Returns ({dotted leaf path: value}, {dotted group paths}) for a (Config)dict tree."""
  leaves, groups = {}, set()
  for name, value in tree.items():
    path = prefix + name
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      groups.add(path)
      sub_leaves, sub_groups = _flatten(value, path + ".")
      leaves.update(sub_leaves)
      groups |= sub_groups
    else:
      leaves[path] = value
  return leaves, groups


@functools.lru_cache(maxsize=None)
def _schema() -> tuple[dict[str, Any], set[str]]:
  return _flatten(base_config())


def _parent(config: ml_collections.ConfigDict, key: str) -> tuple[ml_collections.ConfigDict, str]:
  """(the ConfigDict holding `key`, the last component of `key`)."""
  path, _, name = key.rpartition(".")
  return (functools.reduce(getattr, path.split("."), config) if path else config), name


def _group_error(key: str, source: str) -> ConfigError:
  return ConfigError("is a group of settings, not a value.", key=key, source=source,
                     fix="set one of " + ", ".join(k for k in _schema()[0] if k.startswith(key + ".")))


def _source_of(source: Source, *keys: str) -> str:
  """Where the value of the first of `keys` that has a recorded origin came from."""
  if isinstance(source, str):
    return source
  return next((source[k] for k in keys if k in source), source.get("", "the config"))


def _closest(key: str, candidates: Sequence[str]) -> list[str]:
  """The valid keys nearest to `key`: by whole dotted path, then by last component (seeed -> seed)."""
  found = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
  by_last: dict[str, list[str]] = {}
  for path in candidates:
    by_last.setdefault(path.rsplit(".", 1)[-1], []).append(path)
  for name in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_last), n=2, cutoff=0.7):
    found += by_last[name]
  return list(dict.fromkeys(found))[:4]


def _unknown_key(key: str, source: str) -> ConfigError:
  leaves, _ = _schema()
  parts = key.split(".")
  names = [".".join(parts[:n]) for n in range(len(parts), 0, -1)] + [parts[-1]]
  hint = next((_ALIASES[n] for n in names if n in _ALIASES), None)
  near = _closest(key, list(leaves))
  problem = "no such key in the schema (configs/base.py)."
  if hint:
    return ConfigError(problem, key=key, source=source, fix=hint)
  if near:
    return ConfigError(problem, key=key, source=source, fix="did you mean " + " or ".join(near) + "?")
  return ConfigError(problem, key=key, source=source, fix="see configs/base.py for every valid key")


def _check_tree(config: ml_collections.ConfigDict, source: Source) -> None:
  """Unknown keys (at any depth), keys that replaced a group with a value, and deleted keys."""
  leaves, groups = _flatten(config)
  schema_leaves, schema_groups = _schema()
  for key in groups:
    if key in schema_leaves:
      raise ConfigError("is a single value in the schema, but was set to a group of keys.", key=key,
                        source=_source_of(source, key), fix=f"assign a value, e.g. {key} = {schema_leaves[key]!r}")
  for key in leaves:
    if key in schema_groups:
      raise _group_error(key, _source_of(source, key))
  # Leaves first so that `c.bfloat16 = ConfigDict({"enabled": True})` is reported as bfloat16.enabled.
  for key in list(leaves) + sorted(groups):
    if key not in schema_leaves and key not in schema_groups:
      raise _unknown_key(key, _source_of(source, key))
  for key in schema_leaves:
    if key not in leaves:
      raise ConfigError("is missing: the config deleted or replaced it.", key=key, source=_source_of(source, key),
                        fix="keep every key from base_config(); change values, do not delete keys")


def _type_name(kind: type) -> str:
  return {bool: "a bool (True/False)", int: "an int", float: "a number", str: "a string"}.get(kind, kind.__name__)


def _check_value(key: str, value: Any, default: Any, source: str) -> None:
  """Type, enum and range checks for one leaf."""
  kind = type(default)
  ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    ok = True
  if not ok:
    fix = f"use {_type_name(kind)}, e.g. {key} = {default!r}"
    if isinstance(value, str) and kind in (int, float):
      fix = "write the number without quotes"
    raise ConfigError(f"must be {_type_name(kind)}, got {type(value).__name__} {value!r}.", key=key,
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


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def resolve_mesh_shape(config: ml_collections.ConfigDict, num_devices: int, *,
                       source: Source = "the config") -> tuple[int, int]:
  """Returns the (data, fsdp) mesh shape for `num_devices`, resolving a -1 to the devices left over.

  Raises:
    ConfigError: both sizes are -1, a -1 cannot take an even share, or the product is not num_devices.
  """
  data, fsdp = config.mesh.data, config.mesh.fsdp
  src = _source_of(source, "mesh.data", "mesh.fsdp")
  if num_devices < 1:
    raise ConfigError(f"there are {num_devices} devices; the mesh needs at least one.", key="mesh", source=src)
  if data == -1 and fsdp == -1:
    raise ConfigError("mesh.data and mesh.fsdp are both -1; at most one may take the devices left over.",
                      key="mesh", source=src, fix="give one of them a size, e.g. --config.mesh.data=1")
  if -1 in (data, fsdp):
    fixed_key, fixed, free_key = ("mesh.data", data, "mesh.fsdp") if fsdp == -1 else ("mesh.fsdp", fsdp, "mesh.data")
    if num_devices % fixed:
      raise ConfigError(f"{fixed_key}={fixed} does not divide the {num_devices} devices evenly, so {free_key}=-1 "
                        "cannot take the rest.", key=fixed_key, source=src,
                        fix=f"{fixed_key} sizes that work with {num_devices} devices: "
                            + ", ".join(map(str, _divisors(num_devices))))
    rest = num_devices // fixed
    return (fixed, rest) if fsdp == -1 else (rest, fixed)
  if data * fsdp != num_devices:
    pairs = ", ".join(f"data={d} fsdp={num_devices // d}" for d in _divisors(num_devices))
    raise ConfigError(f"mesh.data={data} x mesh.fsdp={fsdp} = {data * fsdp} devices, but {num_devices} devices "
                      "are available.", key="mesh.data", source=src,
                      fix=f"set mesh.fsdp=-1 to use the rest, or one of: {pairs}")
  return data, fsdp


def _check_batch(config: ml_collections.ConfigDict, dp: int, what: str, source: Source) -> None:
  gbs, micro = config.train.global_batch_size, config.train.microbatches
  unit = dp * micro
  what = f"{what} x train.microbatches ({micro})" if what else f"train.microbatches ({micro})"
  if gbs % unit:
    lower, upper = gbs // unit * unit, (gbs // unit + 1) * unit
    nearest = " or ".join(str(b) for b in (lower, upper) if b > 0)
    raise ConfigError(f"{gbs} sequences cannot be split evenly over {what} = {unit}.",
                      key="train.global_batch_size", source=_source_of(
                          source, "train.global_batch_size", "train.microbatches", "mesh.data", "mesh.fsdp"),
                      fix=f"use a multiple of {unit}, e.g. train.global_batch_size={nearest}, "
                          "or change train.microbatches")


# Keys that only one model family reads: setting one for the other family is an error,
# not a silently ignored value.
_MODEL_ONLY = {
    "mlp_lm": ("context",),
    "llama": ("n_heads", "n_kv_heads", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
              "rope_high_freq_factor", "rope_original_context", "norm_eps", "tie_embeddings",
              "attention", "attention_block", "loss_chunk"),
}


def _check_model(config: ml_collections.ConfigDict, source: Source) -> None:
  m, base = config.model, _schema()[0]
  for family, keys in _MODEL_ONLY.items():
    if family == m.name:
      continue
    for key in keys:
      if m[key] != base[f"model.{key}"]:
        raise ConfigError(f"is set to {m[key]!r}, but only model.name={family!r} reads it and this "
                          f"model is {m.name!r}.", key=f"model.{key}", source=_source_of(source, f"model.{key}"),
                          fix=f"remove it, or set model.name={family!r}")
  if m.name == "llama":
    where = _source_of(source, "model.n_heads", "model.n_kv_heads", "model.d_model")
    if m.n_heads % m.n_kv_heads:
      raise ConfigError(f"n_kv_heads={m.n_kv_heads} does not divide n_heads={m.n_heads}.",
                        key="model.n_kv_heads", source=where, fix="use a divisor of n_heads")
    if m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2:
      raise ConfigError(f"d_model={m.d_model} must split into n_heads={m.n_heads} heads of even size "
                        "(rotary embeddings rotate pairs).", key="model.d_model", source=where,
                        fix="choose d_model divisible by 2 * n_heads")


def _check_precision(config: ml_collections.ConfigDict, source: Source) -> None:
  """Dtype combinations that cannot work, or silently do nothing."""
  p, o = config.precision, config.optimizer
  where = lambda *keys: _source_of(source, *keys)
  low = {p.param_dtype, p.compute_dtype} - {"float32"}
  if len(low) > 1:
    raise ConfigError(f"param_dtype={p.param_dtype!r} with compute_dtype={p.compute_dtype!r} mixes "
                      "float16 and bfloat16.", key="precision.compute_dtype",
                      source=where("precision.param_dtype", "precision.compute_dtype"),
                      fix="use the same 16-bit format for both (bfloat16 needs no loss scaling)")
  if o.update_rule == "stochastic" and p.param_dtype != "bfloat16":
    raise ConfigError(f"stochastic rounding is implemented for bfloat16 params, not {p.param_dtype}.",
                      key="optimizer.update_rule", source=where("optimizer.update_rule", "precision.param_dtype"),
                      fix="use update_rule 'kahan' (any dtype) or param_dtype 'bfloat16'")
  if o.update_rule in ("kahan", "master") and p.param_dtype == "float32":
    raise ConfigError(f"update_rule {o.update_rule!r} compensates low-precision params, but params are "
                      "float32: it would only spend memory.", key="optimizer.update_rule",
                      source=where("optimizer.update_rule", "precision.param_dtype"),
                      fix="use update_rule 'nearest' with float32 params")
  ls = p.loss_scale
  if "float16" in (p.param_dtype, p.compute_dtype) and ls.min_scale > 2.0 ** ls.initial_power:
    raise ConfigError(f"min_scale={ls.min_scale:g} is above the first scale 2**{ls.initial_power}: the "
                      "first back-off would raise the scale.", key="precision.loss_scale.min_scale",
                      source=where("precision.loss_scale.min_scale", "precision.loss_scale.initial_power"),
                      fix=f"use min_scale <= 2**initial_power = {2.0 ** ls.initial_power:g}")
  # A bf16 second moment cannot decay: nu * b2 rounds back to nu when 1 - b2 < 2^-9.
  if o.name == "adamw" and o.state_dtype == "bfloat16" and 1 - o.b2 < 2 ** -8:
    raise ConfigError(f"b2={o.b2} with bfloat16 optimizer state: each step shrinks nu by {1 - o.b2:.2g}, "
                      "under bfloat16's resolution, so nu never decays.", key="optimizer.b2",
                      source=where("optimizer.b2", "optimizer.state_dtype"),
                      fix="use b2 <= 0.996 (e.g. 0.95) or optimizer.state_dtype='float32'")


def _check_data(config: ml_collections.ConfigDict, source: Source) -> None:
  """The keys each data source needs; the files themselves are checked by zerojax.data.load_tokens."""
  d = config.data
  where = lambda *keys: _source_of(source, *keys, "data.name")
  if d.name == "stdlib":
    if d.path or d.eval_path:
      key = "data.path" if d.path else "data.eval_path"
      raise ConfigError("is set, but data.name='stdlib' reads no file.", key=key, source=where(key),
                        fix="set data.name='tokens' (.bin / .npy ids) or 'text' (.txt / .jsonl), or clear it")
    if config.model.vocab_size < 256:
      raise ConfigError(f"is {config.model.vocab_size}, but data.name='stdlib' has byte tokens (ids 0-255).",
                        key="model.vocab_size", source=where("model.vocab_size"), fix="use model.vocab_size >= 256")
    return
  kinds = "a .bin or .npy file of token ids" if d.name == "tokens" else "a .txt or .jsonl file"
  if not d.path:
    raise ConfigError(f"is empty, but data.name={d.name!r} reads its tokens from a file.", key="data.path",
                      source=where("data.path"), fix=f"set data.path to {kinds}")
  if d.name == "text" and not d.tokenizer:
    raise ConfigError("is empty, but data.name='text' needs a tokenizer.", key="data.tokenizer",
                      source=where("data.tokenizer"), fix="set data.tokenizer to a Hugging Face tokenizer.json")
  if d.name == "text" and not d.text_key:
    raise ConfigError("is empty.", key="data.text_key", source=where("data.text_key"),
                      fix="set it to the JSONL field that holds each document (usually 'text')")


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None,
             source: Source = "the config") -> None:
  """Checks every key, type, value range and combination; raises ConfigError on the first mistake.

  Args:
    config: a config tree with exactly the keys of base_config().
    num_devices: when given, the mesh and the batch are checked against this many devices.
    source: where values came from: one string, or {dotted key: source} with "" as the fallback.
  """
  _check_tree(config, source)
  values, _ = _flatten(config)
  for key, default in _schema()[0].items():
    _check_value(key, values[key], default, _source_of(source, key))
  if config.mesh.data == -1 and config.mesh.fsdp == -1:
    raise ConfigError("mesh.data and mesh.fsdp are both -1; at most one may take the devices left over.",
                      key="mesh", source=_source_of(source, "mesh.data", "mesh.fsdp"), fix="give one of them a size")
  if config.optimizer.warmup_steps > config.train.steps:
    raise ConfigError(f"warmup of {config.optimizer.warmup_steps} steps is longer than train.steps="
                      f"{config.train.steps}.", key="optimizer.warmup_steps",
                      source=_source_of(source, "optimizer.warmup_steps", "train.steps"),
                      fix=f"use optimizer.warmup_steps <= {config.train.steps}")
  _check_precision(config, source)
  _check_model(config, source)
  _check_data(config, source)
  if config.model.name == "mlp_lm" and config.model.context > config.train.seq_len:
    raise ConfigError(f"context {config.model.context} is longer than train.seq_len={config.train.seq_len}.",
                      key="model.context", source=_source_of(source, "model.context", "train.seq_len"),
                      fix=f"use model.context <= {config.train.seq_len}")
  if num_devices is not None:
    data, fsdp = resolve_mesh_shape(config, num_devices, source=source)
    _check_batch(config, data * fsdp, f"the data-parallel size (mesh.data x mesh.fsdp = {data * fsdp})", source)
  else:
    fixed = math.prod(s for s in (config.mesh.data, config.mesh.fsdp) if s > 0)
    _check_batch(config, fixed, f"the fixed mesh sizes ({fixed})" if fixed > 1 else "", source)


def _parse_value(text: str, kind: type, key: str, source: str) -> Any:
  """Parses an override string as the schema field's type, like ml_collections config_flags."""
  text = text.strip()
  try:
    if kind is bool:
      return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
    if kind is int:
      return int(text)
    if kind is float:
      return float(text)
    if kind is str:
      return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    return kind(ast.literal_eval(text))
  except (KeyError, ValueError, SyntaxError, TypeError):
    raise ConfigError(f"cannot parse {text!r} as {_type_name(kind)}.", key=key, source=source,
                      fix="use true or false" if kind is bool else f"give {_type_name(kind)}") from None


def apply_override(config: ml_collections.ConfigDict, override: str, origins: dict[str, str] | None = None) -> None:
  """Sets one `a.b=value` override (a `--config.` or `config.` prefix is allowed) on an unlocked config."""
  text = override.strip()
  for prefix in ("--config.", "config."):
    text = text[len(prefix):] if text.startswith(prefix) else text
  key, sep, raw = text.partition("=")
  key = key.strip()
  source = f"override --config.{text}"
  if not sep or not key:
    raise ConfigError(f"override {override!r} is not of the form key=value.", key=key or None,
                      fix="write it as --config.zero.stage=2")
  leaves, groups = _schema()
  if key in groups:
    raise _group_error(key, source)
  if key not in leaves:
    raise _unknown_key(key, source)
  value = _parse_value(raw, type(leaves[key]), key, source)
  parent, name = _parent(config, key)
  try:
    setattr(parent, name, value)
  except TypeError:  # The file stored a wrongly typed value; ml_collections pins that type.
    del parent[name]
    setattr(parent, name, value)
  if origins is not None:
    origins[key] = source


def _describe_failure(exc: BaseException, path: str) -> ConfigError:
  """Turns an exception raised by a config file into a ConfigError naming the file line and key."""
  line, code = getattr(exc, "lineno", None), (getattr(exc, "text", None) or "").strip()
  for frame in traceback.extract_tb(exc.__traceback__):
    if os.path.abspath(frame.filename) == os.path.abspath(path):
      line, code = frame.lineno, (frame.line or "").strip()
  where = f"{path}, line {line}" + (f": {code}" if code else "") if line else path
  inner: Any = exc
  while isinstance(inner, BaseException) and inner.args:  # ml_collections wraps KeyErrors in AttributeErrors.
    inner = inner.args[0]
  message = str(inner)
  field = re.search(r"field '(\w+)'.*?(\S+) is of original type <class '([\w.]+)'>.*?type <class '([\w.]+)'>", message)
  missing = (re.search(r'Key "(\w+)" does not exist and cannot be added', message)
             or re.match(r"'(\w+)'(\nDid you mean|$)", message))
  name = (field or missing).group(1) if field or missing else None
  key = None
  if name:  # Recover the dotted key from `c.zero.stage = ...` on the failing line.
    written = re.search(r"\w+((?:\.\w+)*\." + name + r")\b", code)
    key = written.group(1)[1:] if written else name
  if missing:
    return _unknown_key(key, where)
  if field:
    got, want = field.group(3).rsplit(".", 1)[-1], field.group(4).rsplit(".", 1)[-1]
    if want == "ConfigDict":
      return _group_error(key, where)
    fix = "write the number without quotes" if got == "str" and want in ("int", "float") else (
        f"assign {_type_name({'int': int, 'float': float, 'bool': bool, 'str': str}.get(want, object))}")
    shown = repr(field.group(2)) if got == "str" else field.group(2)
    return ConfigError(f"the file assigns {got} {shown}, but this key takes {want}.",
                       key=key, source=where, fix=fix)
  first = message.splitlines()[0][:300] if message else ""
  return ConfigError(f"running the config file failed: {type(exc).__name__}: {first}", source=where,
                     fix="fix the file so that get_config() runs")


def _run_file(spec: str) -> tuple[ml_collections.ConfigDict, str]:
  """Runs `get_config()` (or `get_config(arg)` for `file.py:arg`) from a config file."""
  match = re.match(r"^(.*?\.py):(.*)$", spec)
  path, arg = (match.group(1), match.group(2)) if match and not os.path.isfile(spec) else (spec, None)
  if not os.path.isfile(path):
    folder = os.path.dirname(path) or "."
    near = difflib.get_close_matches(os.path.basename(path), os.listdir(folder), n=3) if os.path.isdir(folder) else []
    raise ConfigError(f"config file {path} does not exist.", source="--config",
                      fix="did you mean " + ", ".join(os.path.join(folder, n) for n in near) + "?" if near
                      else "pass the path of a Python file with get_config(), e.g. --config configs/tiny.py")
  try:
    module_spec = importlib.util.spec_from_file_location("_zerojax_config_file", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
      raise ConfigError("the file has no get_config() function.", source=path,
                        fix="define get_config() that starts from zerojax.config.base_config() and returns it")
    params = inspect.signature(get_config).parameters
    if arg is not None and not params:
      raise ConfigError(f"the file was given the argument {arg!r} (file.py:arg) but get_config() takes none.",
                        source=path, fix=f"drop ':{arg}' or define get_config(arg)")
    config = get_config(arg) if arg is not None else get_config()
  except ConfigError:
    raise
  except Exception as exc:  # Anything the file raises is a config mistake, not a zerojax crash.
    raise _describe_failure(exc, path) from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"get_config() returned {type(config).__name__}, not an ml_collections.ConfigDict.",
                      source=path, fix="start from zerojax.config.base_config() and return it")
  return config, path


def load_config(path: str, overrides: Sequence[str] = (), *,
                num_devices: int | None = None) -> ml_collections.ConfigDict:
  """Loads a config file, applies `--config.a.b=value` overrides, validates, and returns it locked.

  Args:
    path: a Python file with get_config(); `file.py:arg` passes `arg` to get_config(arg).
    overrides: strings like "zero.stage=2" or "--config.zero.stage=2", applied in order.
    num_devices: when given, the mesh and batch are checked against this many devices.

  Raises:
    ConfigError: naming the key, its source (file or override) and the fix.
  """
  config, file_source = _run_file(path)
  _check_tree(config, file_source)
  schema_leaves, _ = _schema()
  for key, default in schema_leaves.items():  # A replaced group may hold ints in float fields; unify.
    parent, name = _parent(config, key)
    if type(default) is float and type(parent[name]) is int:
      parent[name] = float(parent[name])
  origins = {"": file_source}
  for override in overrides:
    apply_override(config, override, origins)
  validate(config, num_devices=num_devices, source=origins)
  config.lock()  # Later typos in Python code (config.zero.stag) fail instead of adding keys.
  return config


def parse_argv(argv: Sequence[str], *, default: str | None = None) -> tuple[str, list[str], list[str]]:
  """Splits CLI args into (config path, overrides, remaining args).

  Understands `--config PATH`, `--config=PATH`, `--config.a.b=v` and `--config.a.b v`; stops at `--`.

  Raises:
    ConfigError: no --config (and no default), two of them, or an override without a value.
  """
  path, overrides, rest = None, [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg == "--":
      rest += args[i:]
      break
    if arg == "--config" or arg.startswith("--config=") or arg.startswith("--config."):
      name, sep, value = arg.partition("=")
      if not sep:
        if i + 1 >= len(args) or args[i + 1].startswith("--"):
          raise ConfigError(f"{name} has no value.", key=name[len("--config."):] or None, source="the command line",
                            fix=f"write {name}=VALUE" if name != "--config" else "write --config path/to/config.py")
        value = args[i + 1]
        i += 1
      if name == "--config":
        if path is not None:
          raise ConfigError(f"--config was given twice ({path} and {value}).", source="the command line",
                            fix="pass one config file; change single values with --config.a.b=value")
        path = value
      else:
        overrides.append(f"{name[len('--config.'):]}={value}")
    else:
      rest.append(arg)
    i += 1
  if path is None:
    if default is None:
      raise ConfigError("no config file given.", source="the command line",
                        fix="pass --config path/to/config.py, e.g. --config configs/tiny.py")
    path = default
  return path, overrides, rest


def exit_on_config_error(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Decorates a CLI entry point: a ConfigError prints `error: <message>` to stderr and exits with 2."""

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    try:
      return fn(*args, **kwargs)
    except ConfigError as exc:
      print(f"error: {exc}", file=sys.stderr)
      sys.exit(2)

  return wrapper


@exit_on_config_error
def main(argv: Sequence[str] | None = None) -> int:
  """Prints the resolved config: python -m zerojax.config --config F [--config.a.b=v ...] [--num_devices N]."""
  path, overrides, rest = parse_argv(sys.argv[1:] if argv is None else argv, default="")
  parser = argparse.ArgumentParser(prog="python -m zerojax.config", description=main.__doc__)
  parser.add_argument("--num_devices", type=int, help="check the mesh and batch against this many devices")
  args = parser.parse_args(rest)  # --help, and unknown arguments exit here (status 2).
  if not path:
    raise ConfigError("no config file given.", source="the command line", fix="pass --config configs/tiny.py")
  config = load_config(path, overrides, num_devices=args.num_devices)
  print(config, end="")
  if args.num_devices is not None:
    print(f"# mesh (data, fsdp) on {args.num_devices} devices: {resolve_mesh_shape(config, args.num_devices)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
