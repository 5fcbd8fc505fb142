"""The decoder's hyper-parameters: `LlamaConfig`, one frozen dataclass for every family.

A family (`FAMILIES`) is a few of its fields, each one of its differences from Llama,
with Llama's as every default: `zerojax.models.llama` builds the decoder from it,
`zerojax.hf` reads and writes it as config.json, the planner counts its shapes. Kept
apart from the model so that what a model *is* can be read in one place.
"""

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from zerojax.models.remat import POLICIES

ATTENTION = ("auto", "blocked", "dot_product")
# The Hugging Face families this decoder is (`zerojax.hf` maps each to its classes).
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "mixtral")
# MLP activations: SwiGLU's silu, GeGLU's tanh-approximated GELU (HF's gelu_pytorch_tanh).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
# The config's flat RoPE-scaling keys (zerojax/config/schema.py) -> `rope_scaling`'s (HF's names).
ROPE_SCALING = {"rope_scaling_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                "rope_high_freq_factor": "high_freq_factor",
                "rope_original_context": "original_max_position_embeddings"}
ROPE_SCALING_KEYS = set(ROPE_SCALING.values())
LINEAR_SCALING_KEYS = {"rope_type", "factor"}  # `rope_scaling` of linear RoPE scaling.
INIT_STD = 0.02  # Hugging Face's initializer_range.


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyper-parameters, dtypes and memory knobs of a Llama model.

  Attributes:
    vocab_size: V.
    d_model: D, the residual width.
    n_layers: L.
    n_heads: H, query heads; must divide d_model (unless `head_size` is set).
    n_kv_heads: K, key/value heads; must divide n_heads (K = H: multi-head attention).
    d_ff: F, the SwiGLU hidden width.
    rope_theta: the rotary base (10000 for Llama 2, 500000 for Llama 3).
    rope_scaling: None, or Llama 3.1's frequency scaling as a dict with keys factor,
      low_freq_factor, high_freq_factor, original_max_position_embeddings, or linear
      scaling as {'rope_type': 'linear', 'factor': f} (Gemma 3's global layers).
    norm_eps: RMSNorm epsilon.
    tie_embeddings: use the transposed token embedding as the output head.
    family: the Hugging Face family (`FAMILIES`): the names export writes; the
      differences themselves are the fields below.
    head_size: Dh when it is not d_model // n_heads (HF's head_dim: Qwen3, Gemma 3,
      Mistral-Small); 0 = d_model // n_heads.
    qkv_bias: q, k and v projections with biases (Qwen2).
    qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3).
    norm_offset: every RMSNorm multiplies by (norm_offset + scale), the scales
      initialised at 1 - norm_offset (Gemma: 1.0).
    scale_embeddings: the embedding's output times sqrt(d_model) (Gemma).
    hidden_act: the MLP's gate activation, a key of `ACTIVATIONS` (Gemma: gelu_tanh).
    post_norms: norms on each sublayer's output too (Gemma): 'post_attention_layernorm'
      is then the attention output's, 'pre_feedforward_layernorm' the MLP input's and
      'post_feedforward_layernorm' its output's.
    query_pre_attn_scalar: scores scaled by its -1/2 power (Gemma 3); 0 = Dh.
    sliding_window: W > 0: local layers attend to the W latest positions (itself
      included); 0 = every layer global.
    sliding_window_pattern: 0: every layer local (with a window); P: layer i global when
      (i + 1) % P == 0, the others local (Gemma 3: 6).
    rope_local_theta: local layers' own RoPE base, unscaled (Gemma 3: 10000); 0 = the
      global layers' RoPE.
    n_experts: E > 0: every layer's feed-forward block is a mixture of E experts
      (`zerojax.models.moe`: Qwen3-MoE, Mixtral); 0 = the dense MLP.
    experts_per_token: k, the experts each token is routed to.
    expert_d_ff: each expert's hidden width (HF's moe_intermediate_size; Mixtral's
      intermediate_size).
    norm_topk_prob: the k routing weights renormalized to sum to 1 (Mixtral always;
      Qwen3-MoE's option).
    router_aux_loss_coef: the load-balancing loss's weight in the training loss.
    router_z_loss_coef: the router z-loss's weight (ST-MoE); 0 = none.
    expert_capacity_factor: 0 = dropless dispatch; c > 0: each expert takes at most
      ceil(c N k / E) of a device's N tokens' assignments (`moe.with_capacity`), or with
      the experts split over devices, each device at most ceil(c N k / ep) of another's
      (`moe.expert_parallel`); the rest are dropped and counted.
    param_dtype: dtype the params are stored in.
    compute_dtype: dtype of activations and matmul inputs (norms, softmax, logits and
      loss are fp32 whatever this is).
    attention: 'blocked' (query blocks in a loop, each recomputed in the backward
      pass; portable) or 'dot_product' (`jax.nn.dot_product_attention`: cuDNN flash
      attention on GPU in bf16/fp16; XLA otherwise, which materialises the scores);
      'auto' is whichever `attention_kernel` picks for the backend.
    attention_block: query positions per block for 'blocked'.
    loss_chunk: sequence positions per chunk of the head + loss.
    mlp_chunk: positions per tile of the MLP, 0 = untiled (`zerojax.models.tiled`).
    remat: per-layer rematerialization, one of `zerojax.models.remat.POLICIES`: 'none',
      'full' (save only layer inputs), 'dots' (also matmul outputs without batch dims)
      or a set of named values ('minimal', 'save_qkv_proj', ...).
    sequence_axis: the mesh axis each sequence is split over inside the train step's
      `shard_map` (sequence parallelism: Ulysses attention, `zerojax.sequence`); None:
      every device holds whole sequences.
    activation_offload: 'host': remat's saved values in host memory (`zerojax.streaming`).
  """
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  d_ff: int = 384
  rope_theta: float = 500000.0
  rope_scaling: Any = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  family: str = "llama"
  head_size: int = 0
  qkv_bias: bool = False
  qk_norm: bool = False
  norm_offset: float = 0.0
  scale_embeddings: bool = False
  hidden_act: str = "silu"
  post_norms: bool = False
  query_pre_attn_scalar: int = 0
  sliding_window: int = 0
  sliding_window_pattern: int = 0
  rope_local_theta: float = 0.0
  n_experts: int = 0
  experts_per_token: int = 0
  expert_d_ff: int = 0
  norm_topk_prob: bool = True
  router_aux_loss_coef: float = 0.0
  router_z_loss_coef: float = 0.0
  expert_capacity_factor: float = 0.0
  param_dtype: Any = jnp.bfloat16
  compute_dtype: Any = jnp.bfloat16
  attention: str = "auto"
  attention_block: int = 512
  loss_chunk: int = 1024
  mlp_chunk: int = 0
  remat: str = "full"
  sequence_axis: str | None = None
  activation_offload: str = "none"

  def __post_init__(self):
    for ok, message in [
        (self.head_size or self.d_model % self.n_heads == 0, f"n_heads {self.n_heads} must "
         f"divide d_model {self.d_model} (or set head_size)"),
        (self.n_heads % self.n_kv_heads == 0, f"n_kv_heads {self.n_kv_heads} must divide "
         f"n_heads {self.n_heads}"),
        (self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE"),
        (self.attention in ATTENTION, f"attention must be one of {ATTENTION}"),
        (self.remat in POLICIES, f"remat must be one of {POLICIES}"),
        (min(self.attention_block, self.loss_chunk) > 0 and self.mlp_chunk >= 0,
         "attention_block and loss_chunk must be positive, mlp_chunk non-negative"),
        (self.activation_offload in ("none", "host"), "activation_offload: 'none' or 'host'"),
        (self.rope_scaling is None or set(self.rope_scaling) == ROPE_SCALING_KEYS or (
            set(self.rope_scaling) == LINEAR_SCALING_KEYS
            and self.rope_scaling["rope_type"] == "linear"),
         f"rope_scaling needs exactly the keys {sorted(ROPE_SCALING_KEYS)}, or "
         f"{sorted(LINEAR_SCALING_KEYS)} with rope_type 'linear'"),
        (self.family in FAMILIES, f"family must be one of {FAMILIES}"),
        (self.hidden_act in ACTIVATIONS, f"hidden_act must be one of {sorted(ACTIVATIONS)}"),
        (min(self.head_size, self.sliding_window, self.sliding_window_pattern) >= 0,
         "head_size, sliding_window and sliding_window_pattern must be non-negative"),
        (not self.n_experts or 0 < self.experts_per_token <= self.n_experts
         and self.expert_d_ff > 0, f"n_experts {self.n_experts} needs 0 < experts_per_token "
         f"({self.experts_per_token}) <= n_experts and expert_d_ff > 0"),
        (not self.n_experts or (self.mlp_chunk == 0 and self.sequence_axis is None),
         "a mixture of experts runs untiled (mlp_chunk 0) and without sequence parallelism "
         "(its router losses would count each device's slice of a sequence)")]:
      if not ok:
        raise ValueError(f"LlamaConfig: {message} (got {self})")
    if self.rope_scaling is not None:
      # Hashable, so the config can be a Flax attribute or a static jit argument.
      object.__setattr__(self, "rope_scaling", FrozenDict(self.rope_scaling))

  @property
  def head_dim(self) -> int:
    return self.head_size or self.d_model // self.n_heads

  @property
  def local_layers(self) -> tuple[bool, ...]:
    """Per layer: does it attend to a sliding window (a local layer)?"""
    P = self.sliding_window_pattern
    return tuple(bool(self.sliding_window) and (P == 0 or (i + 1) % P != 0)
                 for i in range(self.n_layers))

  @property
  def mixed_layers(self) -> bool:
    """Local and global layers in one stack: the layer loop's carry holds the index."""
    return len(set(self.local_layers)) > 1

  @classmethod
  def from_keys(cls, model: Mapping[str, Any], **kwargs: Any) -> "LlamaConfig":
    """The config of a `model` section (the schema's keys, zerojax/config/schema.py).

    Every key that names a field is taken by that name, so a new model key is a row in
    the schema and a field here; the RoPE-scaling keys become `rope_scaling`
    (`ROPE_SCALING`; `rope_scaling_type` 'linear': only the factor), set when
    `rope_scaling_factor` is. Other keys (`name`, another family's) are ignored.

    Args:
      model: a ConfigDict or dict (also `hf.config_overrides`' result).
      **kwargs: fields to set besides (dtypes, which live in the precision section).
    """
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: model[k] for k in names if k in model}
    if model.get("rope_scaling_factor") and model.get("rope_scaling_type") == "linear":
      values["rope_scaling"] = {"rope_type": "linear", "factor": model["rope_scaling_factor"]}
    elif model.get("rope_scaling_factor"):
      values["rope_scaling"] = {new: model[old] for old, new in ROPE_SCALING.items()}
    return cls(**values, **kwargs)
