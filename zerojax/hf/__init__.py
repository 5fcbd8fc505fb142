"""Hugging Face checkpoints <-> zerojax params, streamed tensor by tensor.

The families: `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
`MistralForCausalLM`, `Gemma3ForCausalLM`, the text tower of
`Gemma3ForConditionalGeneration` (its vision tower is not read; export writes the text
model as a `Gemma3ForCausalLM`), and the mixtures of experts `Qwen3MoeForCausalLM` and
`MixtralForCausalLM` (one tensor per expert in the files, stacked here). The family
comes from config.json's `architectures` (else `model_type`) and becomes the decoder's
fields (`config_overrides`); a checkpoint with a feature the decoder lacks is refused with
one line naming the config.json field.

The Hugging Face room: import and export of parameters here, `safetensors_file`
(headers, index, the streaming writer) and `export` (`zerojax-export`: a train.py
checkpoint to a folder transformers loads). It sits above the models, the checkpoints
and `zerojax.build`.

    params = hf.load_params("Meta-Llama-3.1-8B", plan)     # straight onto the mesh
    hf.save_params(state.params, model.config, "out/")     # config.json + safetensors
    python -m zerojax.hf.export --workdir runs/x --out hf_model/   # a train.py checkpoint

Import: `config.json` gives the model shape (`config_overrides`, `llama_config`); the
tensors come from `model.safetensors` or the files of `model.safetensors.index.json`.
Every leaf is built with `jax.make_array_from_callback`: each device's callback reads
only its own block of the HF tensors (memory-mapped `get_slice`), one layer at a time,
so a host holds at most its own shards, never a whole stacked leaf at stage 3. With
several processes every process reads its shards from the same folder (a shared file
system, or a copy per host).

Export: one (leaf, layer) slice at a time is made whole on every process (a jitted
slice, then `process_allgather` across processes) and written by process 0 into a
safetensors file whose header was written first, so host memory is one HF tensor.
Files over `max_shard_size` are split as `save_pretrained` does (`model-0000i-of-0000N`
plus an index). `_HF_NAMES` below is the table that follows as code, joined by leaf
path to the model's own shapes (`llama.param_shapes`). The files themselves (headers,
index, the streaming writer) are `zerojax.hf.safetensors_file`'s.

Parameters and the Hugging Face tensor each one is (i = layer index). HF's
`nn.Linear.weight` is (out, in) and ours (in, out), so kernels are transposed; layer
params are stacked along a leading layers axis of size L. The text tower of a
`Gemma3ForConditionalGeneration` has `model.language_model.` (saved by transformers 5)
or `language_model.model.` (the published files) where the table has `model.`:

| zerojax                                | Hugging Face                                     |
| -------------------------------------- | ------------------------------------------------ |
| embed_tokens/embedding (V, D)          | model.embed_tokens.weight                        |
| layers/input_layernorm/scale (L, D)    | model.layers.i.input_layernorm.weight            |
| layers/self_attn/{q,k,v,o}_proj/kernel | model.layers.i.self_attn.{q,k,v,o}_proj.weight.T |
| layers/post_attention_layernorm/scale  | model.layers.i.post_attention_layernorm.weight   |
| layers/mlp/{gate,up,down}_proj/kernel  | model.layers.i.mlp.{gate,up,down}_proj.weight.T  |
| layers/self_attn/{q,k,v}_proj/bias     | model.layers.i.self_attn.{q,k,v}_proj.bias       |
| layers/self_attn/{q,k}_norm/scale      | model.layers.i.self_attn.{q,k}_norm.weight       |
| layers/{pre,post}_feedforward_layernorm | model.layers.i.{pre,post}_feedforward_layernorm |
|   /scale (Gemma)                       |   .weight                                        |
| norm/scale (D,)                        | model.norm.weight                                |
| lm_head/kernel (D, V), absent if tied  | lm_head.weight.T                                 |
| layers/mlp/router/kernel (L, D, E)     | model.layers.i.mlp.gate.weight.T (Qwen3-MoE)     |
| layers/mlp/experts/{gate,up,down}_proj | model.layers.i.mlp.experts.e.{gate,up,down}_proj |
|   (L, E, D, F) / (L, E, F, D)          |   .weight.T (Mixtral: block_sparse_moe.gate,     |
|                                        |   block_sparse_moe.experts.e.{w1,w3,w2})         |
"""

import contextlib
import json
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open

from zerojax.hf.safetensors_file import INDEX, HFError, tensor_index, write_folder
from zerojax.models.llama import FAMILIES, ROPE_SCALING, LlamaConfig, param_shapes
from zerojax.zero import ZeroPlan

PyTree = Any
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # save_pretrained's default, "5GB".
# zerojax leaf path -> HF tensor name ('{i}': layer index), transposed (HF keeps torch
# Linear's [out, in]; our kernels are [in, out]). Leaves under 'layers' are stacked. In
# HF's order: the export writes tensors in it.
_HF_NAMES = dict((path, (name, transposed)) for path, name, transposed in (
    (("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
    (("layers", "input_layernorm", "scale"), "model.layers.{i}.input_layernorm.weight", False),
    (("layers", "mlp", "down_proj", "kernel"), "model.layers.{i}.mlp.down_proj.weight", True),
    (("layers", "mlp", "gate_proj", "kernel"), "model.layers.{i}.mlp.gate_proj.weight", True),
    (("layers", "mlp", "up_proj", "kernel"), "model.layers.{i}.mlp.up_proj.weight", True),
    (("layers", "post_attention_layernorm", "scale"),
     "model.layers.{i}.post_attention_layernorm.weight", False),
    (("layers", "post_feedforward_layernorm", "scale"),
     "model.layers.{i}.post_feedforward_layernorm.weight", False),
    (("layers", "pre_feedforward_layernorm", "scale"),
     "model.layers.{i}.pre_feedforward_layernorm.weight", False),
    (("layers", "self_attn", "k_norm", "scale"), "model.layers.{i}.self_attn.k_norm.weight", False),
    (("layers", "self_attn", "k_proj", "bias"), "model.layers.{i}.self_attn.k_proj.bias", False),
    (("layers", "self_attn", "k_proj", "kernel"), "model.layers.{i}.self_attn.k_proj.weight", True),
    (("layers", "self_attn", "o_proj", "kernel"), "model.layers.{i}.self_attn.o_proj.weight", True),
    (("layers", "self_attn", "q_norm", "scale"), "model.layers.{i}.self_attn.q_norm.weight", False),
    (("layers", "self_attn", "q_proj", "bias"), "model.layers.{i}.self_attn.q_proj.bias", False),
    (("layers", "self_attn", "q_proj", "kernel"), "model.layers.{i}.self_attn.q_proj.weight", True),
    (("layers", "self_attn", "v_proj", "bias"), "model.layers.{i}.self_attn.v_proj.bias", False),
    (("layers", "self_attn", "v_proj", "kernel"), "model.layers.{i}.self_attn.v_proj.weight", True),
    (("norm", "scale"), "model.norm.weight", False),
    (("lm_head", "kernel"), "lm_head.weight", True),
    # Experts ('{e}': expert index): Qwen3-MoE's names; Mixtral's in `_FAMILY_NAMES`.
    (("layers", "mlp", "router", "kernel"), "model.layers.{i}.mlp.gate.weight", True),
    (("layers", "mlp", "experts", "gate_proj"),
     "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", True),
    (("layers", "mlp", "experts", "up_proj"), "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
     True),
    (("layers", "mlp", "experts", "down_proj"),
     "model.layers.{i}.mlp.experts.{e}.down_proj.weight", True),
))
# A family's own names where they differ from the table's.
_FAMILY_NAMES = {"mixtral": {
    ("layers", "mlp", "router", "kernel"): ("model.layers.{i}.block_sparse_moe.gate.weight", True),
    ("layers", "mlp", "experts", "gate_proj"):
        ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", True),
    ("layers", "mlp", "experts", "up_proj"):
        ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", True),
    ("layers", "mlp", "experts", "down_proj"):
        ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", True)}}
# The zerojax `model.*` keys an HF config determines, in the schema's names
# (zerojax/config/schema.py).
MODEL_KEYS = ("vocab_size", "d_model", "d_ff", "n_layers", "n_heads", "n_kv_heads", "rope_theta",
              "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
              "rope_original_context", "norm_eps", "tie_embeddings", "family", "head_size",
              "qkv_bias", "qk_norm", "norm_offset", "scale_embeddings", "hidden_act",
              "post_norms", "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
              "rope_local_theta", "rope_scaling_type", "n_experts", "experts_per_token",
              "expert_d_ff", "norm_topk_prob")
# Only meaningful with Llama 3.1's scaling (rope_scaling_factor set, rope_scaling_type llama3).
_ROPE_KEYS = tuple(k for k in ROPE_SCALING if k != "rope_scaling_factor")
# config.json's `architectures` (else `model_type`) -> the family; export writes the first
# of each family's.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
                 "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
               "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3_moe": "qwen3_moe",
               "mixtral": "mixtral"}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
# What transformers' config classes take for a key a config.json leaves out (published
# Gemma 3 text_configs give only a few keys), per family.
_HF_DEFAULTS = {
    "llama": dict(rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=10000.0, tie_word_embeddings=False),
    "qwen3": dict(rope_theta=10000.0, tie_word_embeddings=False, head_dim=128),
    "mistral": dict(rope_theta=10000.0, tie_word_embeddings=False, sliding_window=4096),
    "qwen3_moe": dict(rope_theta=10000.0, tie_word_embeddings=False, head_dim=128,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(rope_theta=1e6, tie_word_embeddings=False, sliding_window=None),
    "gemma3": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                   tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                   sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4),
}
# HF's activation names -> `LlamaConfig.hidden_act`.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


# ------------------------------------------------------------------------- config.json


def read_config(folder: str) -> dict:
  """The parsed `config.json` of a HF folder, checked to be of a family we run (`family`).

  Raises:
    HFError: no folder, no or unparseable config.json, another architecture.
  """
  if not os.path.isdir(folder):
    raise HFError("no such folder", path=folder, fix="pass a folder holding config.json "
                  "and model.safetensors (a Hugging Face Llama download)")
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise HFError("no config.json in this folder", path=folder,
                  fix="download the whole model repository, config.json included")
  try:
    with open(path) as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise HFError(f"cannot read it: {e}", path=path) from None
  family(raw, path)
  return raw


def family(raw: dict, path: str = "config.json") -> str:
  """The family (`FAMILIES`) of a parsed config.json: its first known `architectures`
  entry, else its `model_type`. Raises `HFError` naming both when neither is known."""
  known = [ARCHITECTURES[a] for a in raw.get("architectures") or [] if a in ARCHITECTURES]
  if known:
    return known[0]
  if raw.get("model_type") in MODEL_TYPES and not raw.get("architectures"):
    return MODEL_TYPES[raw["model_type"]]
  raise HFError(f"architectures {raw.get('architectures')} / model_type "
                f"{raw.get('model_type')!r} is not a family zerojax runs", path=path,
                fix=f"zerojax imports {', '.join(ARCHITECTURES)} checkpoints")


def _text_config(raw: dict) -> dict:
  """The decoder's keys of a config.json: a multimodal Gemma 3's `text_config`, over the
  family's HF defaults (`_HF_DEFAULTS`)."""
  text = raw.get("text_config") if raw.get("model_type") == "gemma3" else None
  return {**_HF_DEFAULTS[family(raw)], **(raw if text is None else text)}


def _layer_kinds(fam: str, cfg: dict, need: Callable) -> tuple[int, int]:
  """(sliding_window, sliding_window_pattern) of a config.json's layers (HF's rules: an
  explicit `layer_types`, else each family's), or HFError naming the field."""
  n = int(need("num_hidden_layers"))
  window = cfg.get("sliding_window") or 0
  if fam in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
    window = 0  # HF: sliding_window is read only with use_sliding_window.
  # Mistral's and Mixtral's HF ignore layer_types.
  types = cfg.get("layer_types") if fam not in ("mistral", "mixtral") else None
  if types is None and fam == "gemma3":
    P = int(cfg["sliding_window_pattern"])
    types = ["sliding_attention" if (i + 1) % P else "full_attention" for i in range(n)]
  elif types is None and fam in ("qwen2", "qwen3", "qwen3_moe"):
    start = int(cfg.get("max_window_layers", 0))
    types = ["sliding_attention" if window and i >= start else "full_attention"
             for i in range(n)]
  elif types is None:
    types = ["sliding_attention" if window else "full_attention"] * n
  local = [t == "sliding_attention" for t in types]
  if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
    raise HFError(f"layer_types {types}: zerojax has sliding_attention and full_attention "
                  f"layers, one per layer ({n})")
  if not any(local) or not window:
    return 0, 0
  if all(local):
    return int(window), 0
  P = local.index(False) + 1  # Every P-th layer global (Gemma 3's pattern), or refused.
  if local != [(i + 1) % P != 0 for i in range(n)]:
    raise HFError(f"layer_types {types}: zerojax has every layer local, or every P-th "
                  "global and the others local")
  return int(window), P


def config_overrides(folder: str) -> dict[str, Any]:
  """The zerojax `model.*` values (the schema's names) of a HF folder of any family.

  Reads both RoPE conventions: `rope_theta` / `rope_scaling` at the top level
  (transformers 4.x, and Gemma 3's `rope_local_base_freq`) and `rope_parameters:
  {rope_theta, rope_type, factor, ...}` (newer; Gemma 3's per layer type). RoPE types:
  'default', 'llama3' and 'linear'.

  Returns:
    {key: value} for every key of `MODEL_KEYS`; without scaling the factor is 0.0 and
    the other RoPE-scaling keys keep the schema's defaults.

  Raises:
    HFError: a missing key, or a feature the decoder lacks (named by its field: an
      o_proj or MLP bias, another activation, RoPE type or layer pattern, softcapping).
  """
  raw, path = read_config(folder), os.path.join(folder, "config.json")
  fam, cfg = family(raw, path), _text_config(raw)

  def need(key, where=cfg):
    if key not in where:
      raise HFError(f"has no {key!r}", path=path)
    return where[key]

  heads = int(need("num_attention_heads"))
  d_model = int(need("hidden_size"))
  act = cfg.get("hidden_activation") if fam == "gemma3" else None
  act = act or cfg.get("hidden_act", "silu")
  unsupported = [
      (act not in _ACTIVATIONS, f"hidden_act {act!r}"),
      (bool(cfg.get("attention_bias")), "attention_bias true (an o_proj bias)"),
      (bool(cfg.get("mlp_bias")), "mlp_bias true"),
      (cfg.get("partial_rotary_factor", 1.0) != 1.0, "partial_rotary_factor"),
      (cfg.get("final_logit_softcapping") is not None, "final_logit_softcapping"),
      (cfg.get("attn_logit_softcapping") is not None, "attn_logit_softcapping"),
      (bool(cfg.get("use_bidirectional_attention")), "use_bidirectional_attention true"),
      (fam == "qwen3_moe" and cfg.get("decoder_sparse_step", 1) != 1,
       f"decoder_sparse_step {cfg.get('decoder_sparse_step')} (experts on every layer only)"),
      (fam == "qwen3_moe" and bool(cfg.get("mlp_only_layers")),
       "mlp_only_layers (experts on every layer only)"),
      (bool(cfg.get("router_jitter_noise")), "router_jitter_noise")]
  for bad, what in unsupported:
    if bad:
      raise HFError(f"{what}: zerojax's decoder does not have this", path=path)
  try:
    window, pattern = _layer_kinds(fam, cfg, need)
  except HFError as e:
    raise HFError(e.args[0], path=path) from None
  # Newer transformers: everything in rope_parameters (Gemma 3: one per layer type);
  # older: top-level keys.
  rope = cfg.get("rope_parameters") or {}
  local_theta = 0.0
  if fam == "gemma3":
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
      raise HFError(f"rope_parameters.sliding_attention rope_type {local['rope_type']!r}: "
                    "zerojax's local layers have the 'default' RoPE", path=path)
    local_theta = float(local.get("rope_theta", cfg["rope_local_base_freq"]))
    rope = rope.get("full_attention", rope)
  theta = rope.get("rope_theta", cfg.get("rope_theta"))
  scaling = cfg.get("rope_scaling") or rope
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  head_dim = int(cfg.get("head_dim") or d_model // heads)
  out = dict(vocab_size=int(need("vocab_size")), d_model=d_model,
             d_ff=int(need("intermediate_size")), n_layers=int(need("num_hidden_layers")),
             n_heads=heads, n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
             rope_theta=float(theta), rope_scaling_factor=0.0, rope_low_freq_factor=1.0,
             rope_high_freq_factor=4.0, rope_original_context=8192,
             norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),  # HF's configs' defaults.
             tie_embeddings=bool(cfg["tie_word_embeddings"]), family=fam,
             head_size=0 if head_dim == d_model // heads else head_dim,
             qkv_bias=fam == "qwen2", qk_norm=fam in ("qwen3", "gemma3", "qwen3_moe"),
             norm_offset=1.0 if fam == "gemma3" else 0.0, scale_embeddings=fam == "gemma3",
             hidden_act=_ACTIVATIONS[act], post_norms=fam == "gemma3",
             query_pre_attn_scalar=int(cfg["query_pre_attn_scalar"]) if fam == "gemma3"
             else 0, sliding_window=window, sliding_window_pattern=pattern,
             rope_local_theta=local_theta, rope_scaling_type="llama3", n_experts=0,
             experts_per_token=0, expert_d_ff=0, norm_topk_prob=True)
  if fam in MOE_FAMILIES:  # Qwen3-MoE (transformers 5 writes num_local_experts) or Mixtral.
    out.update(n_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or need(
        "num_experts" if fam == "qwen3_moe" else "num_local_experts")),
               experts_per_token=int(need("num_experts_per_tok")),
               expert_d_ff=int(need("moe_intermediate_size" if fam == "qwen3_moe"
                                    else "intermediate_size")),
               norm_topk_prob=bool(cfg["norm_topk_prob"]) if fam == "qwen3_moe" else True)
  if kind == "llama3":
    out.update(rope_scaling_factor=float(need("factor", scaling)),
               rope_low_freq_factor=float(need("low_freq_factor", scaling)),
               rope_high_freq_factor=float(need("high_freq_factor", scaling)),
               rope_original_context=int(need("original_max_position_embeddings", scaling)))
  elif kind == "linear":
    out.update(rope_scaling_factor=float(need("factor", scaling)), rope_scaling_type="linear")
  elif kind != "default":
    raise HFError(f"RoPE type {kind!r}: zerojax's decoder has 'default', 'llama3' and "
                  "'linear' only", path=path)
  return out


def llama_config(folder: str, **kwargs: Any) -> LlamaConfig:
  """The `LlamaConfig` of a HF folder; `kwargs` set the rest (dtypes, remat, ...)."""
  return LlamaConfig.from_keys(config_overrides(folder), **kwargs)


def check_config(folder: str, model: Any) -> None:
  """Raises `HFError` listing every `model.*` key of a config that config.json contradicts.

  Args:
    folder: the HF folder.
    model: the config's `model` section (ConfigDict or dict with the schema's keys).
  """
  if model["name"] != "llama":
    raise HFError(f"model.name is {model['name']!r}, the folder holds a decoder (family "
                  f"{config_overrides(folder)['family']!r})", path=folder,
                  fix="set --config.model.name=llama")
  hf = config_overrides(folder)
  llama3 = hf["rope_scaling_factor"] and hf["rope_scaling_type"] == "llama3"
  keys = [k for k in MODEL_KEYS if (k not in _ROPE_KEYS or llama3) and (
      k != "rope_scaling_type" or hf["rope_scaling_factor"])]
  differ = [k for k in keys if (float(model[k]) != float(hf[k]) if isinstance(hf[k], float)
                                else model[k] != hf[k])]
  if differ:
    raise HFError(
        "the config's model section does not match config.json:\n    " +
        "\n    ".join(f"model.{k}: config {model[k]!r}, config.json {hf[k]!r}" for k in differ),
        path=os.path.join(folder, "config.json"),
        fix=" ".join(f"--config.model.{k}={hf[k]}" for k in differ))


def seq_len_warning(folder: str, seq_len: int) -> str | None:
  """A warning if `seq_len` is longer than config.json's `max_position_embeddings`, else None.

  A warning, not an error: RoPE runs at any position, and training past the model's
  context is how context is extended, but done by mistake it trains on positions the
  model never saw (with a Llama 3.1 rope_scaling, on frequencies tuned for shorter).
  """
  limit = read_config(folder).get("max_position_embeddings")
  if not isinstance(limit, int) or seq_len <= limit:
    return None
  return (f"warning: train.seq_len={seq_len} is longer than max_position_embeddings={limit} in "
          f"{os.path.join(folder, 'config.json')}: positions past {limit} are new to this model "
          "(fine to extend its context on purpose; else use "
          f"--config.train.seq_len={limit} or less)")


def text_prefix(names: Any) -> str:
  """Where the decoder's tensors are among tensor `names`: 'model.' (a causal LM), or a
  `Gemma3ForConditionalGeneration`'s text tower, 'model.language_model.' (transformers
  5) or 'language_model.model.' (the published files)."""
  for prefix in ("model.language_model.", "language_model.model."):
    if any(n.startswith(prefix) for n in names):
      return prefix
  return "model."


def _expected(c: LlamaConfig, prefix: str = "model."
              ) -> dict[tuple, tuple[str, bool, tuple, tuple]]:
  """{our leaf path: (HF name template, transposed, HF tensor shape, our leaf shape)}.

  In HF's order, names under `prefix` (`text_prefix`). Tied, there is no head: HF
  files usually omit lm_head.weight.
  """
  ours = param_shapes(c)
  names = {**_HF_NAMES, **_FAMILY_NAMES.get(c.family, {})}
  assert ours.keys() <= names.keys(), sorted(ours.keys() - names.keys())
  head = "language_model." if prefix == "language_model.model." else ""
  out = {}
  for path, (name, transposed) in names.items():
    if path in ours:
      shape = ours[path][0]
      one = shape[_stacked(name):]  # One (layer's, expert's) tensor.
      name = prefix + name[len("model."):] if name.startswith("model.") else head + name
      out[path] = (name, transposed, one[::-1] if transposed else one, shape)
  return out


def _leaves(tree: PyTree, expected: dict, what: str) -> dict[tuple, Any]:
  """{path: leaf} of a Llama param tree; ValueError unless it has `expected`'s shapes."""
  leaves = {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  want = {p: e[3] for p, e in expected.items()}
  have = {p: tuple(x.shape) for p, x in leaves.items()}
  differ = [f"{'/'.join(p)}: {what} {have.get(p, 'absent')}, config {want.get(p, 'absent')}"
            for p in sorted(want.keys() | have.keys()) if want.get(p) != have.get(p)]
  if differ:
    raise ValueError(f"the {what} does not have the config's shapes:\n    " + "\n    ".join(differ))
  return leaves


def _check_tensors(folder: str, c: LlamaConfig, tensors: dict, prefix: str) -> None:
  """Every expected tensor present with its shape, none unexpected (a multimodal
  checkpoint's tensors outside its text tower `prefix` are not read); errors name files."""
  expected = {}
  for path, (name, _, shape, ours) in _expected(c, prefix).items():
    for index in np.ndindex(ours[:_stacked(name)]):
      expected[name.format(**dict(zip("ie", index)))] = shape
  index = os.path.join(folder, INDEX)
  where = lambda n: tensors[n][0] if n in tensors else (
      index if os.path.isfile(index) else ", ".join(sorted({t[0] for t in tensors.values()})))
  for name, shape in expected.items():
    if name not in tensors:
      raise HFError(f"missing tensor {name} (shape {shape})", path=where(name),
                    fix="the download is incomplete, or config.json does not describe it")
    if tuple(tensors[name][2]) != shape:
      raise HFError(f"tensor {name} has shape {tensors[name][2]}, config.json implies {shape}",
                    path=where(name))
  # HF buffers that are not parameters; a tied head may be saved anyway (it is ignored).
  tower = prefix != "model."
  ignored = lambda n: (n.endswith("rotary_emb.inv_freq")
                       or (n.endswith("lm_head.weight") and c.tie_embeddings)
                       or (tower and not n.startswith(prefix) and not n.endswith("lm_head.weight")))
  extra = sorted(n for n in tensors if n not in expected and not ignored(n))
  if extra:
    raise HFError(f"unexpected tensor {extra[0]}" + (f" (and {len(extra) - 1} more)"
                  if len(extra) > 1 else "") + ": not part of a model with this config.json",
                  path=where(extra[0]))


# ------------------------------------------------------------------------------ import


def _stacked(template: str) -> int:
  """Leading axes of a leaf stacked over HF tensors: 0, 1 (layers: '{i}') or 2 (layers
  and experts: '{i}', '{e}')."""
  return ("{i}" in template) + ("{e}" in template)


def _read_slice(files: Callable[[str], Any], tensors: dict, name: str, index: tuple) -> np.ndarray:
  """`tensors[name][index]` from its file, in the file's dtype (mmap: reads only those pages)."""
  return files(tensors[name][0]).get_slice(name)[index]


def _read_block(files, tensors, template: str, transposed: bool, shape: tuple,
                dtype: np.dtype, index: tuple) -> np.ndarray:
  """One device's block `index` of a leaf of `shape`, read tensor by tensor, in `dtype`.

  A leaf's leading axes stacked over HF tensors (`_stacked`: layers, and experts) are
  read one HF tensor at a time; each is sliced in its own layout ([out, in]: the index
  reversed for a kernel) and then transposed, so only the block is read, and converted
  to the param dtype (fp32 -> bf16 rounds to nearest even: ml_dtypes' cast, the same as
  `jnp.astype`), so the host holds the block plus one tensor's slice.
  """
  index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
  n = _stacked(template)
  inner = index[n:]
  hf_index = inner[::-1] if transposed else inner
  block = np.empty(tuple(s.stop - s.start for s in index), dtype)
  for at in np.ndindex(block.shape[:n]):
    names = dict(zip("ie", (s.start + j for s, j in zip(index, at))))
    x = _read_slice(files, tensors, template.format(**names), hf_index)
    block[at] = (x.T if transposed else x).astype(dtype)
  return block


def load_params(folder: str, target: Any) -> PyTree:
  """Reads a HF checkpoint's weights straight onto the mesh, each device its own block.

  Args:
    folder: a HF folder (config.json + model.safetensors, or sharded files with
      model.safetensors.index.json; fp32, bf16 or fp16 tensors).
    target: a `zerojax.ZeroPlan` (params take its param dtype and the stage's
      shardings: at stage 3 layer-stacked leaves are sharded), or a params-shaped
      pytree of `jax.ShapeDtypeStruct`s with shardings (none: the default device).

  Returns:
    The param tree of `zerojax.models.llama.Llama`: nested dicts of `jax.Array`s
    in the target's dtypes and shardings, kernels [in, out], layers stacked on axis 0.

  Raises:
    HFError: naming the file, for any problem in the folder (see `read_config`,
      `tensor_index`), and when the target does not have config.json's shapes.
  """
  if isinstance(target, ZeroPlan):
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          target.params, target.param_shardings)
  c = llama_config(folder)
  tensors = tensor_index(folder)
  prefix = text_prefix(tensors)
  _check_tensors(folder, c, tensors, prefix)
  expected = _expected(c, prefix)
  try:
    _leaves(target, expected, "model")
  except ValueError as e:
    raise HFError(f"{e} (of config.json)", path=os.path.join(folder, "config.json"),
                  fix="build the model from hf.llama_config(folder) (train.py: match "
                  "the model section)") from None

  with contextlib.ExitStack() as stack:
    handles = {}

    def files(path):  # One open (memory-mapped) handle per file, closed at the end.
      if path not in handles:
        handles[path] = stack.enter_context(safe_open(path, framework="numpy"))
      return handles[path]

    def leaf(path, x):
      name, transposed, _, _ = expected[path]
      sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
      cache = {}  # Devices holding the same block (replicas) share one read.

      def callback(index):
        key = tuple((s.start, s.stop) for s in index)
        if key not in cache:
          cache[key] = _read_block(files, tensors, name, transposed, tuple(x.shape),
                                   np.dtype(x.dtype), index)
        return cache[key]
      # Waits for the copies to the devices, so the host blocks go before the next leaf.
      return jax.make_array_from_callback(tuple(x.shape), sharding, callback,
                                          dtype=x.dtype).block_until_ready()

    # One leaf at a time: its host blocks are freed before the next leaf is read.
    return jax.tree_util.tree_map_with_path(
        lambda p, x: leaf(tuple(k.key for k in p), x), target)


# ------------------------------------------------------------------------------ export


# family -> (architectures entry, model_type) that export writes.
_CLASSES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3"), "mistral": ("MistralForCausalLM", "mistral"),
            "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
            "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
            "mixtral": ("MixtralForCausalLM", "mixtral")}
assert set(_CLASSES) == set(FAMILIES)


def hf_config(c: LlamaConfig, dtype: str, max_position_embeddings: int | None = None) -> dict:
  """config.json of `c`'s family (`_CLASSES`) with `c`'s shape, in transformers' standard
  layout (top-level rope_theta / rope_scaling, explicit layer_types)."""
  s = c.rope_scaling
  scaling = None if s is None else {**dict(s), "rope_type": s.get("rope_type", "llama3")}
  if max_position_embeddings is None:  # Unknown to zerojax: Llama 3.1-3.3's 128K if scaled.
    max_position_embeddings = 131072 if s else 8192
  architecture, model_type = _CLASSES[c.family]
  act = {v: k for k, v in _ACTIVATIONS.items()}[c.hidden_act]
  out = {
      "architectures": [architecture], "model_type": model_type,
      "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_ff,
      "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
      "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "hidden_act": act,
      "max_position_embeddings": max_position_embeddings, "rms_norm_eps": c.norm_eps,
      "rope_theta": c.rope_theta, "rope_scaling": scaling,
      "tie_word_embeddings": c.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1,
      "use_cache": True, "torch_dtype": str(np.dtype(dtype)),
  }
  if c.family == "llama":
    return out
  del out["mlp_bias"], out["pretraining_tp"]
  W = c.sliding_window
  kinds = ["sliding_attention" if local else "full_attention" for local in c.local_layers]
  if c.family in ("qwen2", "qwen3", "qwen3_moe"):
    out.update(use_sliding_window=bool(W), sliding_window=W or None, layer_types=kinds,
               max_window_layers=kinds.index("sliding_attention") if W else c.n_layers)
  if c.family in MOE_FAMILIES:  # Experts on every layer, routed as `moe.route`.
    out.update(num_experts_per_tok=c.experts_per_token, router_aux_loss_coef=float(
        c.router_aux_loss_coef), output_router_logits=bool(c.router_aux_loss_coef))
  if c.family == "qwen3_moe":
    out.update(num_experts=c.n_experts, moe_intermediate_size=c.expert_d_ff,
               norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
  if c.family == "mixtral":
    out.update(num_local_experts=c.n_experts, intermediate_size=c.expert_d_ff,
               sliding_window=W or None, router_jitter_noise=0.0)
  if c.family == "qwen2":
    del out["attention_bias"]  # Qwen2's q/k/v biases are always there.
  if c.family == "mistral":
    out.update(sliding_window=W or None)
  if c.family == "gemma3":
    del out["hidden_act"]
    out.update(hidden_activation=act, query_pre_attn_scalar=c.query_pre_attn_scalar or c.head_dim,
               sliding_window=W or None, layer_types=kinds,
               rope_local_base_freq=c.rope_local_theta or c.rope_theta,
               final_logit_softcapping=None, attn_logit_softcapping=None)
  return out


_take = jax.jit(lambda x, i: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False))


def _fetch(x: jax.Array, index: tuple) -> np.ndarray:
  """Leaf `x` indexed by `index` (its layer, and expert) whole on the host of every process.

  Every process must call this in the same order: with several processes the slice is
  made whole by an all-gather (`process_allgather`), a collective.
  """
  for i in index:
    x = _take(x, i)  # Stays sharded: only one layer's (expert's) tensor moves.
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  return multihost_utils.process_allgather(x, tiled=True)


def save_params(params: PyTree, config: LlamaConfig, folder: str, *, dtype: Any = None,
                max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                max_position_embeddings: int | None = None) -> list[str]:
  """Writes params as a HF folder of the config's family: config.json + safetensors (+ index
  if split).

  Args:
    params: the Llama param tree (or a `TrainState`), any sharding or stage; every
      process of a multi-process run must call this (the gathers are collectives);
      only process 0 writes.
    config: the model's `LlamaConfig`.
    folder: created if missing; weights of an earlier export there are removed.
    dtype: tensor dtype in the files: 'bfloat16', 'float32' or 'float16'; default the
      params' own (bit-exact round trip). fp32 -> bf16 rounds to nearest even.
    max_shard_size: bytes per file before a new one starts (one tensor larger than
      this gets a file of its own), as `save_pretrained`.
    max_position_embeddings: for config.json (zerojax has no such limit).

  Returns:
    The safetensors file names written, in order.
  """
  params = getattr(params, "params", params)
  expected = _expected(config)
  leaves = _leaves(params, expected, "params")
  out_dtype = np.dtype(dtype or leaves[("embed_tokens", "embedding")].dtype)

  def tensor(path, index):  # (HF name, HF shape, produce: the gathered HF tensor).
    name, transposed, shape, _ = expected[path]
    produce = lambda: (lambda x: x.T if transposed else x)(_fetch(leaves[path], index))
    return name.format(**dict(zip("ie", index))), shape, produce

  # HF's order: embedding, layer 0's tensors (each expert's in turn), layer 1's, ...,
  # final norm, head.
  order = [(p, ()) for p in expected if p[0] == "embed_tokens"]
  order += [(p, (i, *e)) for i in range(config.n_layers) for p in expected if p[0] == "layers"
            for e in np.ndindex(expected[p][3][1:_stacked(expected[p][0])])]
  order += [(p, ()) for p in expected if p[0] in ("norm", "lm_head")]
  write = jax.process_index() == 0
  if write:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
      json.dump(hf_config(config, out_dtype, max_position_embeddings), f, indent=2)
  names = write_folder(folder, [tensor(*o) for o in order], out_dtype, max_shard_size, write)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("zerojax.hf.save_params")  # Files complete.
  return names
