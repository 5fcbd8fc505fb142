"""Validating a config: every key's type and range, then the rules between keys.

A value can be valid alone and wrong with another: a batch the mesh cannot split, a
float16 / bfloat16 mix, a key of the other model family, a workdir that is a file. Each
is a `ConfigError` naming the key, where its value came from and the fix, before any
device work starts. `zerojax.config.load_config` calls `validate`; the mesh arithmetic
is `zerojax.mesh.resolve_shape`'s.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os

import ml_collections

from zerojax.config.checks import (
  ConfigError,
  Source,
  check_tree,
  check_value,
  flat_schema,
  flatten,
  parent_of,
  source_of,
)
from zerojax.mesh import MeshShapeError, resolve_shape


def resolve_mesh_shape(config: ml_collections.ConfigDict, num_devices: int, *,
                       source: Source = "the config") -> tuple[int, int, int]:
  """Returns the (data, expert, fsdp) mesh shape for `num_devices`, a -1 taking the devices
  left over.

  The arithmetic and its messages are `zerojax.mesh.resolve_shape`'s, in the config's key
  names.

  Raises:
    ConfigError: two sizes are -1, a -1 cannot take an even share, or the product is not
      num_devices.
  """
  keys = ("mesh.data", "mesh.expert", "mesh.fsdp")
  try:
    return resolve_shape((config.mesh.data, config.mesh.expert, config.mesh.fsdp), num_devices,
                         names=keys)
  except MeshShapeError as e:
    raise ConfigError(e.problem, key=e.key or "mesh", source=source_of(source, *keys),
                      fix=e.fix) from None


def _check_batch(config: ml_collections.ConfigDict, dp: int, what: str, source: Source) -> None:
  gbs, micro = config.train.global_batch_size, config.train.microbatches
  unit = dp * micro
  what = f"{what} x train.microbatches ({micro})" if what else f"train.microbatches ({micro})"
  if gbs % unit:
    lower, upper = gbs // unit * unit, (gbs // unit + 1) * unit
    nearest = " or ".join(str(b) for b in (lower, upper) if b > 0)
    where = source_of(source, "train.global_batch_size", "train.microbatches", "mesh.data",
                      "mesh.fsdp")
    raise ConfigError(f"{gbs} sequences cannot be split evenly over {what} = {unit}.",
                      key="train.global_batch_size", source=where,
                      fix=f"use a multiple of {unit}, e.g. train.global_batch_size={nearest}, "
                          "or change train.microbatches")


# Keys that only one model family reads: setting one for the other family is an error,
# not a silently ignored value.
_MODEL_ONLY = {
    "mlp_lm": ("context",),
    "llama": ("n_heads", "n_kv_heads", "rope_theta", "rope_scaling_factor",
              "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context",
              "norm_eps", "tie_embeddings", "attention", "attention_block", "loss_chunk",
              "activation_offload", "mlp_chunk", "family", "head_size", "qkv_bias", "qk_norm",
              "norm_offset", "scale_embeddings", "hidden_act", "post_norms",
              "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
              "rope_local_theta", "rope_scaling_type", "n_experts", "experts_per_token",
              "expert_d_ff", "norm_topk_prob", "router_aux_loss_coef", "router_z_loss_coef",
              "expert_capacity_factor"),
}


def _check_model(config: ml_collections.ConfigDict, source: Source) -> None:
  m, base = config.model, flat_schema()[0]
  for family, keys in _MODEL_ONLY.items():
    if family == m.name:
      continue
    for key in keys:
      if m[key] != base[f"model.{key}"]:
        raise ConfigError(f"is set to {m[key]!r}, but only model.name={family!r} reads it and "
                          f"this model is {m.name!r}.", key=f"model.{key}",
                          source=source_of(source, f"model.{key}"),
                          fix=f"remove it, or set model.name={family!r}")
  # mlp_lm.REMAT_POLICIES' keys (not imported: validation runs without JAX).
  if m.name == "mlp_lm" and m.remat not in ("none", "full", "dots"):
    raise ConfigError(f"is {m.remat!r}, a by-name policy of the Llama block; mlp_lm has "
                      "none, full and dots.", key="model.remat",
                      source=source_of(source, "model.remat"), fix="use model.remat='dots'")
  if m.name == "llama":
    where = source_of(source, "model.n_heads", "model.n_kv_heads", "model.d_model")
    if m.n_heads % m.n_kv_heads:
      raise ConfigError(f"n_kv_heads={m.n_kv_heads} does not divide n_heads={m.n_heads}.",
                        key="model.n_kv_heads", source=where, fix="use a divisor of n_heads")
    if m.head_size % 2:
      raise ConfigError(f"head_size={m.head_size} must be even (rotary embeddings rotate "
                        "pairs).", key="model.head_size", source=source_of(
                            source, "model.head_size"), fix="choose an even head_size")
    if m.n_experts and not (0 < m.experts_per_token <= m.n_experts and m.expert_d_ff > 0):
      raise ConfigError(f"n_experts={m.n_experts} needs experts_per_token in 1..{m.n_experts} "
                        f"and expert_d_ff > 0 (they are {m.experts_per_token}, {m.expert_d_ff}).",
                        key="model.experts_per_token", source=source_of(
                            source, "model.n_experts", "model.experts_per_token",
                            "model.expert_d_ff"),
                        fix="set model.experts_per_token and model.expert_d_ff (HF: "
                            "num_experts_per_tok, moe_intermediate_size)")
    for bad, key, why in [(m.mlp_chunk, "model.mlp_chunk", "the tiled MLP"),
                          (config.mesh.sequence_parallel, "mesh.sequence_parallel",
                           "sequence parallelism")]:
      if m.n_experts and bad:
        raise ConfigError(f"{why} with experts (model.n_experts={m.n_experts}) is not built: "
                          "the router's losses would count each tile or slice on its own.",
                          key=key, source=source_of(source, key), fix=f"unset {key}")
    _check_experts(config, source)
    if not m.head_size and (m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2):
      raise ConfigError(f"d_model={m.d_model} must split into n_heads={m.n_heads} heads of even "
                        "size (rotary embeddings rotate pairs).", key="model.d_model",
                        source=where, fix="choose d_model divisible by 2 * n_heads, or set "
                        "model.head_size")


def _check_experts(config: ml_collections.ConfigDict, source: Source) -> None:
  """mesh.expert (expert parallelism) against the model's experts."""
  m, ep = config.model, config.mesh.expert
  if ep == 1:
    return
  where = source_of(source, "mesh.expert", "model.n_experts")
  if not m.n_experts:
    raise ConfigError(f"is {ep}, and the model has no experts (model.n_experts=0): the axis "
                      "would only be one more ZeRO axis.", key="mesh.expert", source=where,
                      fix="use mesh.expert=1 (and mesh.fsdp for the devices)")
  if ep > 0 and m.n_experts % ep:
    divisors = [d for d in range(1, m.n_experts + 1) if m.n_experts % d == 0]
    raise ConfigError(f"={ep} does not divide model.n_experts={m.n_experts}: each device "
                      "holds the same number of experts.", key="mesh.expert", source=where,
                      fix=f"use one of {divisors}")


def _check_precision(config: ml_collections.ConfigDict, source: Source) -> None:
  """Dtype combinations that cannot work, or silently do nothing."""
  p, o = config.precision, config.optimizer
  where = lambda *keys: source_of(source, *keys)
  low = {p.param_dtype, p.compute_dtype} - {"float32"}
  if len(low) > 1:
    raise ConfigError(f"param_dtype={p.param_dtype!r} with compute_dtype={p.compute_dtype!r} mixes "
                      "float16 and bfloat16.", key="precision.compute_dtype",
                      source=where("precision.param_dtype", "precision.compute_dtype"),
                      fix="use the same 16-bit format for both (bfloat16 needs no loss scaling)")
  if o.update_rule == "stochastic" and p.param_dtype != "bfloat16":
    raise ConfigError("stochastic rounding is implemented for bfloat16 params, not "
                      f"{p.param_dtype}.", key="optimizer.update_rule",
                      source=where("optimizer.update_rule", "precision.param_dtype"),
                      fix="use update_rule 'kahan' (any dtype) or param_dtype 'bfloat16'")
  if o.update_rule in ("kahan", "master") and p.param_dtype == "float32":
    raise ConfigError(f"update_rule {o.update_rule!r} compensates low-precision params, but "
                      "params are float32: it would only spend memory.",
                      key="optimizer.update_rule",
                      source=where("optimizer.update_rule", "precision.param_dtype"),
                      fix="use update_rule 'nearest' with float32 params")
  ls = p.loss_scale
  if "float16" in (p.param_dtype, p.compute_dtype) and ls.min_scale > 2.0 ** ls.initial_power:
    raise ConfigError(f"min_scale={ls.min_scale:g} is above the first scale "
                      f"2**{ls.initial_power}: the first back-off would raise the scale.",
                      key="precision.loss_scale.min_scale",
                      source=where("precision.loss_scale.min_scale",
                                   "precision.loss_scale.initial_power"),
                      fix=f"use min_scale <= 2**initial_power = {2.0 ** ls.initial_power:g}")
  # A bf16 second moment cannot decay: nu * b2 rounds back to nu when 1 - b2 < 2^-9.
  if o.name == "adamw" and o.state_dtype == "bfloat16" and 1 - o.b2 < 2 ** -8:
    raise ConfigError(f"b2={o.b2} with bfloat16 optimizer state: each step shrinks nu by "
                      f"{1 - o.b2:.2g}, under bfloat16's resolution, so nu never decays.",
                      key="optimizer.b2",
                      source=where("optimizer.b2", "optimizer.state_dtype"),
                      fix="use b2 <= 0.996 (e.g. 0.95) or optimizer.state_dtype='float32'")


def _check_data(config: ml_collections.ConfigDict, source: Source) -> None:
  """The keys each data source needs; `zerojax.data.load_tokens` checks the files themselves."""
  d = config.data
  where = lambda *keys: source_of(source, *keys, "data.name")
  if config.train.eval_exact_match and d.name != "sft":
    raise ConfigError(f"is {config.train.eval_exact_match}, but only data.name='sft' has prompts "
                      "with answers.", key="train.eval_exact_match",
                      source=where("train.eval_exact_match"), fix="set it to 0")
  if d.name != "sft":
    base = flat_schema()[0]
    for key in ("train_on", "add_bos", "add_eos", "pack", "too_long"):
      if d[key] != base[f"data.{key}"]:
        raise ConfigError(f"is set to {d[key]!r}, but only data.name='sft' reads it.",
                          key=f"data.{key}", source=where(f"data.{key}"),
                          fix="remove it, or set data.name='sft'")
  if d.name == "stdlib":
    if d.path or d.eval_path:
      key = "data.path" if d.path else "data.eval_path"
      raise ConfigError("is set, but data.name='stdlib' reads no file.", key=key,
                        source=where(key), fix="set data.name='tokens' (.bin / .npy ids) or "
                                               "'text' (.txt / .jsonl), or clear it")
    if config.model.vocab_size < 256:
      raise ConfigError(f"is {config.model.vocab_size}, but data.name='stdlib' has byte tokens "
                        "(ids 0-255).", key="model.vocab_size", source=where("model.vocab_size"),
                        fix="use model.vocab_size >= 256")
    return
  kinds = {"tokens": "a .bin or .npy file of token ids", "text": "a .txt or .jsonl file",
           "sft": "a .jsonl file of {prompt, completion} or {messages} lines"}[d.name]
  if not d.path:
    raise ConfigError(f"is empty, but data.name={d.name!r} reads its tokens from a file.",
                      key="data.path", source=where("data.path"), fix=f"set data.path to {kinds}")
  if d.name in ("text", "sft") and not d.tokenizer:
    raise ConfigError(f"is empty, but data.name={d.name!r} needs a tokenizer.",
                      key="data.tokenizer", source=where("data.tokenizer"),
                      fix="set data.tokenizer to a Hugging Face tokenizer.json")
  if d.name == "sft" and config.model.name != "llama":
    # Packed rows need the model to keep examples apart (segment ids, positions).
    raise ConfigError(f"is {config.model.name!r}, but data.name='sft' needs a model that reads "
                      "segment ids, positions and a loss mask.", key="model.name",
                      source=where("model.name"), fix="use model.name='llama'")
  if d.name == "text" and not d.text_key:
    raise ConfigError("is empty.", key="data.text_key", source=where("data.text_key"),
                      fix="set it to the JSONL field that holds each document (usually 'text')")


def _check_workdir(config: ml_collections.ConfigDict, source: Source) -> None:
  """The workdir must be a directory or creatable as one; it is made later, by the run."""
  if not config.workdir:
    return
  existing = os.path.abspath(config.workdir)
  while not os.path.exists(existing):  # The nearest part of the path that exists.
    existing = os.path.dirname(existing)
  where = source_of(source, "workdir")
  if not os.path.isdir(existing):
    inside = ("" if existing == os.path.abspath(config.workdir)
              else f", and {config.workdir} would be inside it")
    raise ConfigError(f"{existing} is a file, not a directory{inside}.", key="workdir",
                      source=where, fix="name a directory for the run's checkpoints, metrics and "
                                        "config (it is created if missing)")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"the directory {existing} is not writable by this user.", key="workdir",
                      source=where, fix="name a directory you can write to")


def _importable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ValueError:  # In sys.modules as None: imports of it are blocked.
    return False


def _check_logging(config: ml_collections.ConfigDict, source: Source) -> None:
  """W&B is an extra: asking for it without the package is a mistake caught before any work."""
  w = config.logging.wandb
  if w.project and not _importable("wandb"):
    raise ConfigError(f"is {w.project!r}, but the wandb package is not installed.",
                      key="logging.wandb.project",
                      source=source_of(source, "logging.wandb.project"),
                      fix='pip install -e ".[wandb]" (or pip install "zerojax[wandb]"), or '
                          "leave logging.wandb.project empty")
  for key in ("entity", "name"):
    if w[key] and not w.project:
      where = source_of(source, f"logging.wandb.{key}")
      raise ConfigError(f"is {w[key]!r}, but logging.wandb.project is empty: W&B is off.",
                        key=f"logging.wandb.{key}", source=where,
                        fix="set --config.logging.wandb.project=NAME too")


def _override(value: object) -> str:
  """A value as an override writes it: strings quoted, the rest as Python prints them."""
  return repr(value) if isinstance(value, str) else f"{value}"


def _fixes(config: ml_collections.ConfigDict, num_devices: int | None,
           alternatives: list[dict[str, object]], why: str = "") -> str:
  """The `alternatives` (each {dotted key: value}) with which the config validates,
  written as overrides ("set a=1 and b='x' (why), or c=0"): a suggested fix is never
  itself an error. `why` explains the first alternative."""
  working = []
  for i, changes in enumerate(alternatives):
    candidate = copy.deepcopy(config)
    for key, value in changes.items():
      parent, name = parent_of(candidate, key)
      parent[name] = value
    try:
      validate(candidate, num_devices=num_devices, check_fixes=False)
    except ConfigError:
      continue
    working.append(" and ".join(f"{k}={_override(v)}" for k, v in changes.items())
                   + (f" ({why})" if why and i == 0 else ""))
  return "set " + ", or ".join(working) if working else ""


def _check_sequence(config: ml_collections.ConfigDict, fsdp: int | None, source: Source) -> None:
  """Sequence parallelism: a Llama whose heads and sequence split over the fsdp devices."""
  m, where = config.model, source_of(source, "mesh.sequence_parallel", "mesh.fsdp")
  if m.name != "llama":
    raise ConfigError(f"splits sequences inside Llama's attention; this model is {m.name!r}.",
                      key="mesh.sequence_parallel", source=where,
                      fix="use model.name='llama' or mesh.sequence_parallel=False")
  if fsdp is None:
    return  # Checked again once the device count is known (train.py always knows it).
  for what, n, ok in [("model.n_heads", m.n_heads, m.n_heads % fsdp == 0),
                      ("model.n_kv_heads", m.n_kv_heads,
                       m.n_kv_heads % fsdp == 0 or fsdp % m.n_kv_heads == 0),
                      ("train.seq_len", config.train.seq_len, config.train.seq_len % fsdp == 0)]:
    if not ok:
      divides = "a divisor or multiple of" if what == "model.n_kv_heads" else "divisible by"
      raise ConfigError(f"{what}={n} is not {divides} mesh.fsdp={fsdp}, the devices each "
                        "sequence is split over.", key=what,
                        source=source_of(source, what, "mesh.fsdp"),
                        fix=f"use mesh.fsdp dividing {n}, or mesh.sequence_parallel=False")


def _check_mlp_chunk(config: ml_collections.ConfigDict, fsdp: int | None,
                     source: Source) -> None:
  """A tile count that is not whole pads every layer's MLP input with positions computed
  for nothing (`zerojax.models.tiled`): the tile must divide each device's sequence."""
  chunk, seq_len, sp = config.model.mlp_chunk, config.train.seq_len, config.mesh.sequence_parallel
  if not chunk or (sp and fsdp is None):
    return  # Sequence parallel: checked again once the device count is known.
  local = seq_len // fsdp if sp else seq_len
  if local % chunk:
    what = (f"train.seq_len / mesh.fsdp = {seq_len} / {fsdp} with mesh.sequence_parallel"
            if sp else "train.seq_len")
    divisors = [d for d in range(min(chunk, local), 0, -1) if local % d == 0]
    raise ConfigError(f"{chunk} does not divide {local}, the positions each device's MLP "
                      f"sees ({what}).", key="model.mlp_chunk",
                      source=source_of(source, "model.mlp_chunk", "train.seq_len",
                                       *(("mesh.fsdp",) if sp else ())),
                      fix=f"use a divisor of {local} (e.g. {divisors[0]}), or 0 to run the MLP "
                          "untiled")


def _check_release(config: ml_collections.ConfigDict, fsdp: int | None, source: Source,
                   num_devices: int | None, check_fixes: bool) -> None:
  """What gradient release (`zerojax.release`) cannot do yet, named by its keys. Each fix
  is a list of alternative overrides; only those that validate are printed."""
  o, p = config.optimizer, config.precision
  fixes = lambda *alternatives, why="": (
      _fixes(config, num_devices, list(alternatives), why) if check_fixes else None)
  # Turning release off also resets the keys only release reads.
  off = {"optimizer.release": False, **{f"optimizer.{k}": "none" for k in (
      "release_accumulation", "release_clipping") if o[k] != "none"},
         **{f"optimizer.{k}": False for k in ("release_write_behind", "release_writes_first")
            if o[k]}}
  offloaded = "host" in (config.zero.param_offload, o.offload)
  if o.release_write_behind and not (o.release and offloaded):
    raise ConfigError(
        "writes each layer's update back to host memory during the next layer's backward "
        "pass: it needs gradient release and a layer stack in host memory "
        f"(optimizer.release={o.release}, zero.param_offload={config.zero.param_offload!r}, "
        f"optimizer.offload={o.offload!r}).", key="optimizer.release_write_behind",
        source=source_of(source, "optimizer.release_write_behind", "optimizer.release",
                         "zero.param_offload", "optimizer.offload"),
        fix=fixes({"optimizer.release_write_behind": False}))
  if o.release_writes_first and not o.release_write_behind:
    raise ConfigError(
        "orders the writes of an update carried to the next trip: it needs "
        "optimizer.release_write_behind=True.", key="optimizer.release_writes_first",
        source=source_of(source, "optimizer.release_writes_first",
                         "optimizer.release_write_behind"),
        fix=fixes({"optimizer.release_writes_first": False},
                  {"optimizer.release_write_behind": True}))
  if not o.release:
    for key in ("release_accumulation", "release_clipping"):
      if o[key] != "none":
        raise ConfigError(f"is {o[key]!r}, but optimizer.release=False: only "
                          "gradient release reads it.", key=f"optimizer.{key}",
                          source=source_of(source, f"optimizer.{key}", "optimizer.release"),
                          fix=fixes({f"optimizer.{key}": "none"}, {"optimizer.release": True}))
    return
  where = lambda key: source_of(source, key, "optimizer.release")
  accumulate, clip = o.release_accumulation == "optimizer", o.release_clipping != "none"
  problems = [
      ("zero.stage", config.zero.stage != 3,
       f"zero.stage={config.zero.stage}: release updates stage-3 shards",
       [{"zero.stage": 3}], ""),
      ("train.microbatches", config.train.microbatches != 1 and not accumulate,
       f"train.microbatches={config.train.microbatches} and "
       f"optimizer.release_accumulation={o.release_accumulation!r}: there is no gradient "
       "accumulator to sum microbatches into",
       [{"optimizer.release_accumulation": "optimizer"}, {"train.microbatches": 1}],
       "the moments absorb each microbatch; approximates accumulation"),
      ("optimizer.release_accumulation", accumulate and o.name == "sgd",
       "optimizer.release_accumulation='optimizer' and optimizer.name='sgd': optimizer "
       "accumulation is defined for adamw and lion",
       [{"optimizer.name": "adamw"}, {"optimizer.name": "lion"}], ""),
      ("optimizer.grad_clip", o.grad_clip > 0 and not clip,
       f"optimizer.grad_clip={o.grad_clip:g} and optimizer.release_clipping='none': the "
       "global norm is known only after every layer is updated",
       [{"optimizer.release_clipping": "previous_norm"},
        {"optimizer.release_clipping": "per_layer"}, {"optimizer.grad_clip": 0.0}],
       "the previous step's global norm"),
      ("optimizer.release_clipping", clip and o.grad_clip == 0,
       f"optimizer.release_clipping={o.release_clipping!r} and optimizer.grad_clip=0: "
       "nothing to clip to",
       [{"optimizer.grad_clip": 1.0}, {"optimizer.release_clipping": "none"}],
       "or any positive norm"),
      ("precision.param_dtype", "float16" in (p.param_dtype, p.compute_dtype),
       "float16: dynamic loss scaling (precision.loss_scale) finds an overflow only after "
       "layers were updated, and cannot undo them",
       [{"precision.param_dtype": "bfloat16", "precision.compute_dtype": "bfloat16"}], ""),
  ]
  for key, bad, problem, alternatives, why in problems:
    if bad:
      raise ConfigError(f"optimizer.release=True with {problem}.", key=key, source=where(key),
                        fix=fixes(*alternatives, off, why=why))


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None,
             source: Source = "the config", check_fixes: bool = True) -> None:
  """Checks every key, type, value range and combination; raises ConfigError on the first mistake.

  Args:
    config: a config tree with exactly the keys of base_config().
    num_devices: when given, the mesh and the batch are checked against this many devices.
    source: where values came from: one string, or {dotted key: source} with "" as the fallback.
    check_fixes: validate each suggested fix of the release rules, printing only those that
      pass (False inside that check).
  """
  check_tree(config, source)
  values, _ = flatten(config)
  for key, default in flat_schema()[0].items():
    check_value(key, values[key], default, source_of(source, key))
  free = [k for k in ("data", "expert", "fsdp") if config.mesh[k] == -1]
  if len(free) > 1:
    keys = [f"mesh.{k}" for k in free]
    raise ConfigError(f"{' and '.join(keys)} are {'both' if len(keys) == 2 else 'all'} -1; at "
                      "most one may take the devices left "
                      "over.", key="mesh", source=source_of(source, *keys),
                      fix="give all but one of them a size")
  if config.optimizer.warmup_steps > config.train.steps:
    raise ConfigError(f"warmup of {config.optimizer.warmup_steps} steps is longer than train.steps="
                      f"{config.train.steps}.", key="optimizer.warmup_steps",
                      source=source_of(source, "optimizer.warmup_steps", "train.steps"),
                      fix=f"use optimizer.warmup_steps <= {config.train.steps}")
  _check_precision(config, source)
  _check_model(config, source)
  _check_data(config, source)
  _check_workdir(config, source)
  _check_logging(config, source)
  if config.model.name == "mlp_lm" and config.model.context > config.train.seq_len:
    raise ConfigError(f"context {config.model.context} is longer than "
                      f"train.seq_len={config.train.seq_len}.", key="model.context",
                      source=source_of(source, "model.context", "train.seq_len"),
                      fix=f"use model.context <= {config.train.seq_len}")
  sp = config.mesh.sequence_parallel  # The examples are split over 'data' only.
  if num_devices is not None:
    data, expert, fsdp = resolve_mesh_shape(config, num_devices, source=source)
    _check_batch(config, data * expert if sp else data * expert * fsdp,
                 f"the example-parallel size (mesh.data = {data}; sequence parallelism splits "
                 "each sequence over mesh.fsdp)" if sp else
                 "the data-parallel size (mesh.data x mesh.expert x mesh.fsdp = "
                 f"{data * expert * fsdp})", source)
  else:
    sizes = (config.mesh.data, config.mesh.expert) if sp else (
        config.mesh.data, config.mesh.expert, config.mesh.fsdp)
    fixed = math.prod(s for s in sizes if s > 0)
    _check_batch(config, fixed, f"the fixed mesh sizes ({fixed})" if fixed > 1 else "", source)
    fsdp = config.mesh.fsdp if config.mesh.fsdp > 0 else None
  if sp:
    _check_sequence(config, fsdp, source)
  if config.model.activation_offload != "none" and config.model.remat == "none":
    raise ConfigError("moves what remat saves per layer to host memory; with "
                      "model.remat='none' the backward pass keeps every value of every layer.",
                      key="model.activation_offload",
                      source=source_of(source, "model.activation_offload", "model.remat"),
                      fix="use model.remat='full' (or a named policy), or "
                          "model.activation_offload='none'")
  if config.zero.param_offload != "none" and config.zero.stage != 3:
    raise ConfigError(f"streams stage 3's layer shards; zero.stage={config.zero.stage} keeps "
                      "whole params on every device.", key="zero.param_offload",
                      source=source_of(source, "zero.param_offload", "zero.stage"),
                      fix="use zero.stage=3, or zero.param_offload='none'")
  _check_mlp_chunk(config, fsdp, source)
  _check_release(config, fsdp, source, num_devices, check_fixes)
