"""The Llama family in Flax: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The one decoder of every family zerojax runs (Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 3,
and the mixtures of experts Qwen3-MoE and Mixtral): a family is a few config fields,
each one of its differences from Llama (q/k/v biases, q/k norms, an explicit head
dimension, Gemma's (1 + w) norms, scaled embedding, GeGLU, extra norms around each
sublayer, its attention scale, sliding-window layers with a RoPE base of their own,
experts in place of the MLP); every field's default is Llama's. In a stack that mixes
local (sliding-window) and global layers the layer index travels with the residual
stream through the layer loop (the carry `(x, float32 index)`: the loops know nothing of
it), and each layer picks its RoPE tables by data and its attention kernel by
`lax.cond`; with experts, the carry also sums each layer's router statistics for the
load-balancing loss.

One file, read top to bottom (the config, `LlamaConfig`, is `zerojax.models.llama_config`'s,
re-exported here): the pieces (norm, attention; RoPE and kernels are
`zerojax.models.rope`'s and `.attention`'s; a mixture of experts, `.moe`'s), the block,
the model (`extend`: the KV-cached pass of `zerojax.generate`), the loss and the helpers
a trainer needs (`param_shapes`: each parameter's shape and axes, the one copy the
planner and the HF mapping read). Layers run under `nn.scan` with a leading 'layers'
axis; each layer's params pass through `zerojax.gather` inside the scan body, so at ZeRO
stage 3 one layer is gathered at a time (under remat, gathered again in the backward
pass, not saved).

Long context: the blocked attention recomputes each query block's scores in the backward
pass; the loss runs `loss_chunk` positions at a time. HF names: `zerojax.hf`.
Shapes: B batch, T sequence, V vocab, D d_model, H query heads, K key/value heads,
G = H // K queries per key/value head, Dh head_dim (D // H unless `head_size`), F d_ff,
L layers.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zerojax import sequence, vocab
from zerojax.layered import LayeredLoss
from zerojax.models import chunked_loss, moe, tiled
from zerojax.models.attention import (
  Mask,
  attention_kernel,
  cached_attention,
  causal_attention,
  ring_attention,
  ring_sources,
  ring_write,
)
from zerojax.models.llama_config import (  # noqa: F401 (the decoder's names, re-exported)
  ACTIVATIONS,
  ATTENTION,
  FAMILIES,
  INIT_STD,
  LINEAR_SCALING_KEYS,
  ROPE_SCALING,
  ROPE_SCALING_KEYS,
  LlamaConfig,
)
from zerojax.models.remat import named, policy
from zerojax.models.rope import apply_rope, rope_frequencies, rope_tables  # noqa: F401
from zerojax.stage3 import gather, scan_layers
from zerojax.zero import flax_logical_axes

Params = Any
# {leaf path: (shape, logical axis names)}: what `param_shapes` returns.
ParamShapes = dict[tuple[str, ...], tuple[tuple[int, ...], tuple[str, ...]]]

# ---------------------------------------------------------------------------- pieces


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) * (offset + scale), in fp32: [..., D] (any float), [D] ->
  f32[..., D]."""
  x = x.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  scale = scale.astype(jnp.float32)
  return x * (offset + scale if offset else scale)


class RMSNorm(nn.Module):
  """RMSNorm with a learned scale ('scale': param_dtype[D], logical axis `axis`), times
  (offset + scale); output in `dtype`."""
  eps: float
  dtype: Any
  param_dtype: Any
  offset: float = 0.0
  axis: str = "embed"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    ones = nn.initializers.constant(1.0 - self.offset) if self.offset else nn.initializers.ones
    init = nn.with_logical_partitioning(ones, (self.axis,))
    scale = self.param("scale", init, (x.shape[-1],), self.param_dtype)
    return rms_norm(x, scale, self.eps, self.offset).astype(self.dtype)


def _norm(config: "LlamaConfig", name: str, axis: str = "embed") -> RMSNorm:
  return RMSNorm(config.norm_eps, config.compute_dtype, config.param_dtype, config.norm_offset,
                 axis, name=name)


# ------------------------------------------------------------------------ the model


def _matmul(x: jax.Array, w: jax.Array, b: jax.Array | None, out_dtype: Any,
            rows: bool) -> jax.Array:
  """x [..., I] @ w [I, O] (`rows`: w [O, I], a row per output) (+ b [O]) -> [..., O] in
  `out_dtype` (None: the inputs' dtype)."""
  y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1 if rows else 0,)), ((), ())),
                          preferred_element_type=out_dtype)
  return y if b is None else y + b.astype(y.dtype)


def cast_matmul(x: jax.Array, w: jax.Array, b: jax.Array | None, dtype: Any,
                out_dtype: Any = None, rows: bool = False) -> jax.Array:
  """x @ w.astype(dtype) (+ b): x [..., I] (`dtype`), w [I, O] (`rows`: [O, I], as the
  tied head reads the embedding), b [O] or None, any float dtype -> [..., O] in
  `out_dtype` (None: `dtype`).

  A weight wider than `dtype` is cast here, inside a vjp, so its (and the bias's)
  gradient is emitted in its own dtype by the matmul itself (`preferred_element_type`;
  the bias's summed in fp32): given fp32 weights (the step's `upcast_params`: fp32
  holding bf16 values), a layer's local weight gradient is never rounded to bf16 before
  its fp32 reduction. JAX's own transpose emits it in the dtype the weight had at the
  matmul, bf16. Weights already in `dtype` take JAX's matmul and its gradients as they
  are (the same dtypes; the program, and so XLA's buffers, unchanged).
  """
  if w.dtype == jnp.dtype(dtype) and (b is None or b.dtype == jnp.dtype(dtype)):
    return _matmul(x, w, b, out_dtype, rows)
  return _cast_matmul(x, w, b, dtype, out_dtype, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _cast_matmul(x, w, b, dtype, out_dtype, rows):
  return _cast_matmul_fwd(x, w, b, dtype, out_dtype, rows)[0]


def _cast_matmul_fwd(x, w, b, dtype, out_dtype, rows):
  y = _matmul(x, w.astype(dtype), b, out_dtype, rows)
  # The weight is saved in `dtype` (as JAX's own matmul would), its dtypes as zero-size
  # arrays: no fp32 copy of a weight is kept for the backward pass.
  like = (jnp.zeros((0,), w.dtype), None if b is None else jnp.zeros((0,), b.dtype))
  return y, (x, w.astype(dtype), like)


def _cast_matmul_bwd(dtype, out_dtype, rows, residuals, dy):
  x, w, (w_like, b_like) = residuals
  # JAX's own transpose for the input (not `jax.vjp`, whose forward would be traced too).
  dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (0 if rows else 1,)), ((), ())),
                           preferred_element_type=out_dtype).astype(x.dtype)
  batch = tuple(range(x.ndim - 1))
  # In the weight's dtype, or wider where dy is (the head's fp32 logits), as JAX's.
  wide = jnp.promote_types(w_like.dtype, jnp.result_type(x, dy))
  a, c = (dy, x) if rows else (x, dy)  # dW in w's layout: [O, I] or [I, O].
  dw = jax.lax.dot_general(a, c, ((batch, batch), ((), ())),
                           preferred_element_type=wide).astype(w_like.dtype)
  db = None if b_like is None else jnp.sum(dy.astype(jnp.float32), batch).astype(b_like.dtype)
  return dx, dw, db


_cast_matmul.defvjp(_cast_matmul_fwd, _cast_matmul_bwd)


class Dense(nn.Module):
  """`nn.Dense`'s params and forward pass by `cast_matmul`: kernel param_dtype[in,
  out] (logical axes `names`), with `bias` a bias param_dtype[out] (zeros, names[1]);
  [..., in] -> [..., out] in `dtype` (or `out_dtype`)."""
  features: int
  names: tuple[str, str]
  dtype: Any
  param_dtype: Any
  bias: bool = False
  out_dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), self.names)
    kernel = self.param("kernel", init, (x.shape[-1], self.features), self.param_dtype)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.names[1:]),
                      (self.features,), self.param_dtype) if self.bias else None
    return cast_matmul(x.astype(self.dtype), kernel, bias, self.dtype, self.out_dtype)


def _dense(config: LlamaConfig, features: int, names: tuple[str, str], name: str,
           bias: bool = False) -> Dense:
  """A Dense layer (`Dense`): kernel param_dtype[in, out] with logical axis `names`;
  with `bias`, a bias param_dtype[out] (zeros, logical axis names[1])."""
  return Dense(features, names, config.compute_dtype, config.param_dtype, bias, name=name)


def _mask(c: LlamaConfig, window: int) -> Mask:
  """A layer's `Mask`: `window` (0: none) and the family's score scale."""
  return Mask(window, c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar else None)


def _by_layer(c: LlamaConfig, local: jax.Array | None, attend: Any) -> Any:
  """The layer's attention: `attend(mask)` with its window and scale (`Mask`). In a stack
  of local and global layers (`local` a traced bool) both are compiled and `lax.cond`
  runs the layer's: each kernel keeps a static window (cuDNN's must be)."""
  if local is None:  # One kind of layer: local everywhere or nowhere.
    return attend(_mask(c, c.sliding_window if any(c.local_layers) else 0))
  windowed, whole = attend(_mask(c, c.sliding_window)), attend(_mask(c, 0))
  return lambda *args: jax.lax.cond(local, windowed, whole, *args)


class Attention(nn.Module):
  """Grouped-query causal self-attention with rotary embeddings (HF's `self_attn`)."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
               segment_ids: jax.Array | None = None, cache: tuple | None = None,
               local: jax.Array | None = None) -> Any:
    """[B, T, D] (compute dtype) -> [B, T, D]; cos, sin: float32[(B,) T, Dh]; segment_ids:
    int32[B, T] or None (a position attends only to its own segment). With `cache` =
    (keys, values [B, S, K, Dh] compute dtype, positions int32[B, T], ring): ring None,
    the new keys and values written at `positions` and attention over the cache; a local
    layer's ring (held int32[B, S], sources int32[B, S]: `KVCache`), attention over the
    ring and the new tokens, then each slot written from its source. Returns (out, (keys,
    values)). `local`: bool[], this layer's kind in a stack that mixes them (else None).
    """
    c = self.config
    B, T, _ = x.shape
    H, K, Dh = c.n_heads, c.n_kv_heads, c.head_dim
    proj = lambda n, name, axis: named(
        _dense(c, n * Dh, ("embed", axis), name, c.qkv_bias)(x), name)
    q = proj(H, "q_proj", "heads").reshape(B, T, H, Dh)
    k = proj(K, "k_proj", "kv_heads").reshape(B, T, K, Dh)
    v = proj(K, "v_proj", "kv_heads").reshape(B, T, K, Dh)
    if c.qk_norm:  # Per head, before RoPE (HF's q_norm, k_norm).
      q, k = _norm(c, "q_norm", "head_dim")(q), _norm(c, "k_norm", "head_dim")(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None and cache[3] is not None:  # A local layer's ring.
      keys, values, positions, (held, sources) = cache
      out = ring_attention(q, k, v, keys, values, held, positions, _mask(c, c.sliding_window))
      keys, values = ring_write(keys, k, sources), ring_write(values, v, sources)
    elif cache is not None:
      keys, values, positions, _ = cache
      at = (jnp.arange(B)[:, None], positions)  # A row's positions out of range: dropped.
      keys = keys.at[at].set(k.astype(keys.dtype), mode="drop")
      values = values.at[at].set(v.astype(values.dtype), mode="drop")
      out = _by_layer(c, local, lambda m: functools.partial(cached_attention, mask=m))(
          q, keys, values, positions)
    else:
      kernel = _by_layer(c, local, lambda m: functools.partial(
          causal_attention, attention_kernel(c.attention, q.dtype, head_dim=Dh), c.attention_block,
          mask=m))
      out = (kernel(q, k, v, segment_ids) if c.sequence_axis is None else
             sequence.attention(q, k, v, segment_ids, c.sequence_axis, kernel))
    out = named(out.reshape(B, T, H * Dh), "attention_out")
    out = named(_dense(c, c.d_model, ("heads", "embed"), "o_proj")(out), "o_proj")
    return out if cache is None else (out, (keys, values))


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)) (HF's `mlp`); GeGLU with `hidden_act` gelu_tanh."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, T, D] -> [B, T, D], compute dtype."""
    c = self.config
    dense = lambda h, width, axes, name: named(_dense(c, width, axes, name)(h), name)
    gate, up = (dense(x, c.d_ff, ("embed", "mlp"), name) for name in ("gate_proj", "up_proj"))
    return dense(ACTIVATIONS[c.hidden_act](gate) * up, c.d_model, ("mlp", "embed"), "down_proj")


class Block(nn.Module):
  """One decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); with `post_norms`,
  x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: Any, rope: tuple[jax.Array, jax.Array],
               segment_ids: jax.Array | None = None, cache: tuple | None = None):
    """(x, (cos, sin), segment ids) -> (x, None): the `nn.scan` carry signature; with a
    `cache` (see `Attention`), (x, the layer's updated (keys, values)). x: [B, T, D]; in a
    stack of local and global layers (`mixed_layers`) the carry (x, float32[] layer
    index), the index advanced by one, and cos, sin [2, (B,) T, Dh] (global, local)."""
    c = self.config
    x, layer, stats = _unstack(c, x)
    local = None
    if layer is not None:
      local = jnp.asarray(c.local_layers)[layer.astype(jnp.int32)]
      rope = tuple(jnp.where(local, r[1], r[0]) for r in rope)
    out = Attention(c, name="self_attn")(_norm(c, "input_layernorm")(x), *rope, segment_ids,
                                         cache, local)
    out, cache = (out, None) if cache is None else out
    if c.n_experts:  # A mixture of experts; its router statistics join the carry's.
      experts = moe.MoeMlp(c.n_experts, c.experts_per_token, c.expert_d_ff, c.norm_topk_prob,
                           c.expert_capacity_factor, ACTIVATIONS[c.hidden_act],
                           c.compute_dtype, c.param_dtype, name="mlp")

      def mlp(h):
        nonlocal stats
        h, layer_stats = experts(h)
        stats = stats + layer_stats
        return h
    else:
      mlp = lambda h: tiled.apply(Mlp(c, name="mlp"), h, c.mlp_chunk)  # noqa: E731
    if c.post_norms:
      x = x + _norm(c, "post_attention_layernorm")(out)
      x = x + _norm(c, "post_feedforward_layernorm")(mlp(_norm(c, "pre_feedforward_layernorm")(x)))
    else:
      x = x + out
      x = x + mlp(_norm(c, "post_attention_layernorm")(x))
    return _restack(x, None if layer is None else layer + 1, stats), cache


def layer_rope(config: LlamaConfig, positions: int | jax.Array) -> tuple[jax.Array, jax.Array]:
  """The layer stack's (cos, sin) at `positions` (see `rope_tables`): the layers' kind's,
  or, in a stack of both kinds, each [2, ..., T, Dh]: the global and the local tables."""
  if not config.mixed_layers:
    return rope_tables(config, positions, local=any(config.local_layers))
  both = rope_tables(config, positions), rope_tables(config, positions, local=True)
  return tuple(jnp.stack(tables) for tables in zip(*both))


def stack_input(config: LlamaConfig, x: jax.Array, layer: int | jax.Array = 0) -> Any:
  """The layer loop's input for residual stream x at `layer`: x alone, or a tuple of x,
  float32[] layer in a mixed stack (`Block`) and float32[2 E + 2] router statistics
  summed over the layers so far with experts (`moe.stats`)."""
  extra = [jnp.asarray(layer, jnp.float32)] if config.mixed_layers else []
  if config.n_experts:
    extra.append(jnp.zeros(2 * config.n_experts + 2, jnp.float32))
  return (x, *extra) if extra else x


def _unstack(config: LlamaConfig, carry: Any) -> tuple[jax.Array, Any, Any]:
  """(x, layer or None, router statistics or None) of a layer loop's carry."""
  if not isinstance(carry, tuple):
    return carry, None, None
  x, *rest = carry
  layer = rest.pop(0) if config.mixed_layers else None
  return x, layer, rest.pop(0) if config.n_experts else None


def _restack(x: jax.Array, layer: Any, stats: Any) -> Any:
  return (x, *(a for a in (layer, stats) if a is not None)) if (
      layer is not None or stats is not None) else x


def stack_output(config: LlamaConfig, out: Any) -> jax.Array:
  """The residual stream of the layer loop's carry (`stack_input` undone)."""
  return _unstack(config, out)[0]


def router_loss(config: LlamaConfig, out: Any, tokens: int) -> jax.Array:
  """The router losses the training loss adds, from the layer loop's output carry: the
  load-balancing loss times `router_aux_loss_coef` plus the z-loss times
  `router_z_loss_coef` over `tokens` tokens a layer (float32; 0 without experts)."""
  if not config.n_experts:
    return jnp.float32(0)
  m = router_metrics(config, out, tokens)
  return (config.router_aux_loss_coef * m["router_aux_loss"]
          + config.router_z_loss_coef * m["router_z_loss"])


def router_metrics(config: LlamaConfig, out: Any, tokens: int) -> dict[str, jax.Array]:
  """What the routers did, from the layer loop's output carry, as float32 scalars: the
  load-balancing loss and the z-loss (before their coefficients), each expert's share
  of the token-expert assignments over all layers, 'expert_load/007' (1 / E when
  balanced), and 'router_dropped_tokens', the assignments of the device's tokens that a
  capacity dropped, summed over the layers (0 dropless; the step reports its mean over
  the devices). {} without experts."""
  if not config.n_experts:
    return {}
  summed = _unstack(config, out)[2]
  aux, z = moe.losses_from_stats(summed, tokens, config.n_layers)
  share = summed[:config.n_experts] / (tokens * config.n_layers * config.experts_per_token)
  return {"router_aux_loss": aux, "router_z_loss": z,
          "router_dropped_tokens": summed[2 * config.n_experts],
          **{f"expert_load/{e:03d}": share[e] for e in range(config.n_experts)}}


def apply_block(config: LlamaConfig, params: Params, x: Any, cos: jax.Array,
                sin: jax.Array, segment_ids: jax.Array | None = None,
                cache: tuple | None = None) -> Any:
  """One decoder layer with its own (whole) params: [B, T, D] -> [B, T, D] (the carry and
  tables of a mixed stack: see `Block`); with a `cache` (keys, values, positions, ring:
  see `Attention`), (x, the updated (keys, values))."""
  x, cache = Block(config, parent=None).apply({"params": params}, x, (cos, sin), segment_ids,
                                              cache)
  return x if cache is None else (x, cache)


class KVCache(NamedTuple):
  """The KV cache of `extend`: each layer's keys and values, in the compute dtype.

  Layers that attend to every position (global) keep them all; local (sliding-window)
  layers keep a ring of their window's latest positions (`attention.ring_sources`), so
  their bytes do not grow with the generated length. A kind the model lacks is None.

  Attributes:
    keys, values: [L_global, B, S, K, Dh]; slot s of row b holds position s.
    window_keys, window_values: [L_local, B, R, K, Dh], R = min(window, S); slot r holds
      the latest position p = r (mod R).
    held: int32[B, R], the position in each ring slot (-1: empty), the same on every
      local layer.
  """
  keys: jax.Array | None
  values: jax.Array | None
  window_keys: jax.Array | None
  window_values: jax.Array | None
  held: jax.Array | None


def cache_layout(config: LlamaConfig, batch: int, length: int) -> KVCache:
  """The cache's shapes (tuples; None for a kind the model lacks) for `batch` rows of
  `length` positions: see `KVCache`."""
  local = sum(config.local_layers)
  K, Dh = config.n_kv_heads, config.head_dim
  whole = (config.n_layers - local, batch, length, K, Dh) if local < config.n_layers else None
  ring = (local, batch, min(config.sliding_window, length), K, Dh) if local else None
  return KVCache(whole, whole, ring, ring, ring and ring[1:3])


def init_cache(config: LlamaConfig, batch: int, length: int) -> KVCache:
  """An empty cache (zeros; every ring slot held by no position)."""
  layout = cache_layout(config, batch, length)
  zeros = lambda s: None if s is None else jnp.zeros(s, config.compute_dtype)  # noqa: E731
  held = None if layout.held is None else jnp.full(layout.held, -1, jnp.int32)
  return KVCache(*(zeros(s) for s in layout[:4]), held)


def extend(config: LlamaConfig, params: Params, tokens: jax.Array, positions: jax.Array,
           cache: KVCache, last: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
  """The model over new tokens against a KV cache (prefill, or one decode step): training's
  blocks (`apply_block` with a cache) one layer at a time, each layer's params (leaves may
  be `zerojax.Sharded`) through `gather` (stage 3 in a `shard_map`: one layer's all-gather).

  Args:
    tokens: int32[B, T] at positions int32[B, T] (RoPE angles and cache slots), each row's
      consecutive.
    cache: a `KVCache` (`init_cache`).
    last: int32[B]: logits only at tokens[b, last[b]] (a prefill: not [B, T, V] in fp32);
      the tokens after it (a right-padded prompt's padding) stay out of the local layers'
      rings.

  Returns:
    (float32[B, T (1 with `last`), V] next-token logits, the updated `KVCache`).
  """
  rest = {k: v for k, v in params.items() if k != "layers"}
  model = Llama(config)
  x = model.apply({"params": rest}, tokens, method=Llama.embed)
  cos, sin = layer_rope(config, positions)
  local = jnp.asarray(config.local_layers)
  # Each layer's index among the layers of its kind (its row in that kind's stacks).
  index = jnp.asarray([sum(k == kind for k in config.local_layers[:i])
                       for i, kind in enumerate(config.local_layers)])
  ring = None
  if cache.held is not None:
    valid = jnp.ones(positions.shape, bool) if last is None else (
        jnp.arange(positions.shape[1]) <= last[:, None])
    ring = (cache.held, *ring_sources(cache.held, positions, valid))

  # The stacks go through the loop as rows ([L, n]) and layer i's row past a barrier: else
  # XLA:GPU relays each whole stack for the all-gathers (at 70B on 8: 2 x 4.4 GiB copies).
  def layer(i, carry):
    x, kv, rows = carry
    p = jax.lax.optimization_barrier(jax.tree.map(lambda r: r[i], rows))
    p = gather(jax.tree.map(lambda r, a: r.reshape(a.shape[1:]), p, params["layers"]))
    j = index[i]

    def attend(names, window, x, kv):  # This layer's row of the `names` stacks.
      keys, values = (getattr(kv, n) for n in names)
      h, (k, v) = apply_block(config, p, stack_input(config, x, i), cos, sin,
                              cache=(keys[j], values[j], positions, window))
      return stack_output(config, h), kv._replace(
          **dict(zip(names, (keys.at[j].set(k), values.at[j].set(v)))))

    whole = functools.partial(attend, ("keys", "values"), None)
    windowed = functools.partial(attend, ("window_keys", "window_values"), ring and ring[:2])
    if config.mixed_layers:
      return (*jax.lax.cond(local[i], windowed, whole, x, kv), rows)
    return (*(windowed if ring else whole)(x, kv), rows)

  rows = jax.tree.map(lambda a: a.reshape(len(a), -1), params["layers"])
  x, cache, _ = jax.lax.fori_loop(0, config.n_layers, layer, (x, cache, rows))
  if ring:
    cache = cache._replace(held=ring[2])
  x = x if last is None else x[jnp.arange(x.shape[0]), last][:, None]
  return model.apply({"params": rest}, x, method=Llama.head), cache


class Llama(nn.Module):
  """The Llama decoder. `__call__` gives logits; `hidden` and `head` its two halves."""
  config: LlamaConfig

  def setup(self):
    c = self.config
    embed_init = nn.with_logical_partitioning(nn.initializers.normal(INIT_STD),
                                              ("vocab", "embed"))
    self.embed_tokens = nn.Embed(c.vocab_size, c.d_model, dtype=c.compute_dtype,
                                 param_dtype=c.param_dtype, embedding_init=embed_init)
    # Stage 3: each layer's params are gathered inside the scan body, and remat
    # recomputes the gather in the backward pass instead of saving the weights.
    block = nn.map_variables(Block, "params", trans_in_fn=gather, mutable=True)
    if c.remat != "none":
      block = nn.remat(block, policy=policy(c.remat), prevent_cse=False)
    self.layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=(nn.broadcast, nn.broadcast), length=c.n_layers,
                          metadata_params={nn.PARTITION_NAME: "layers"})(c)
    self.norm = RMSNorm(c.norm_eps, c.compute_dtype, c.param_dtype, c.norm_offset)
    if not c.tie_embeddings:
      self.lm_head = Dense(c.vocab_size, ("embed", "vocab"), c.compute_dtype, c.param_dtype,
                           out_dtype=jnp.float32)  # bf16 inputs, fp32 logits.

  def embed(self, tokens: jax.Array) -> jax.Array:
    """int32[B, T] -> [B, T, D] (compute dtype): the embedding, times sqrt(D) rounded to
    the param dtype with `scale_embeddings` (as Gemma's). A vocabulary-sharded table
    (`zerojax.vocab.VocabShard`, stage 3) is read on its shards (`zerojax.vocab.embed`)."""
    c = self.config
    table = _vocab_shard(self.variables.get("params", {}), ("embed_tokens", "embedding"))
    x = self.embed_tokens(tokens) if table is None else vocab.embed(table, tokens,
                                                                     c.compute_dtype)
    if not c.scale_embeddings:
      return x
    return x * jnp.asarray(math.sqrt(c.d_model), c.param_dtype).astype(x.dtype)

  def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """int32[B, T] -> the last layer's output [B, T, D] (compute dtype, before `norm`);
    positions (None = 0..T-1), segment_ids (None = one): int32[B, T] (packed examples)."""
    return stack_output(self.config, self.layer_loop(tokens, positions, segment_ids))

  def layer_loop(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> Any:
    """`hidden`'s layer loop's output carry (`stack_input`: with experts, the router
    statistics beside the residual stream)."""
    c = self.config
    x = stack_input(c, self.embed(tokens))
    cos, sin = layer_rope(c, tokens.shape[1] if positions is None else positions)
    if c.remat != "none" and not self.is_initializing():
      # `self.layers` run by `zerojax.scan_layers`, whose backward pass writes each layer's
      # gradient over the (fp32) params given, not into a second model: 4 B/param less.
      return scan_layers(functools.partial(apply_block, c), self.variables["params"]["layers"],
                         x, cos, sin, segment_ids, policy=policy(c.remat),
                         offload=c.activation_offload == "host")
    return self.layers(x, (cos, sin), segment_ids)[0]

  def final_norm(self, x: jax.Array) -> jax.Array:
    """[..., D] -> [..., D]: the norm before the head."""
    return self.norm(x)

  def head(self, x: jax.Array) -> jax.Array:
    """[..., D] hidden states -> float32[..., V] logits (final norm, then the head)."""
    c = self.config
    x = self.norm(x)
    if not c.tie_embeddings:
      return self.lm_head(x)
    # The embedding [V, D] as the head's kernel, a row per token (no transposed copy).
    return cast_matmul(x, self.embed_tokens.embedding, None, c.compute_dtype, jnp.float32,
                       rows=True)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """int32[B, T] -> float32[B, T, V] next-token logits."""
    return self.head(self.hidden(tokens))


# ------------------------------------------------------------------- loss and helpers


def logits(config: LlamaConfig, params: Params, tokens: jax.Array) -> jax.Array:
  """Next-token logits, float32[B, T, V], for int32[B, T] tokens (tests; whole sequences)."""
  return Llama(dataclasses.replace(config, sequence_axis=None)).apply({"params": params}, tokens)


def loss(config: LlamaConfig, params: Params, batch: dict[str, jax.Array],
         rng: jax.Array | None = None) -> jax.Array:
  """Mean next-token cross-entropy, fp32: the layers, then `head_loss`.

  Args:
    config: the model.
    params: unboxed params (layer leaves may be `zerojax.Sharded` at ZeRO stage 3).
    batch: {'tokens': int32[B, T + 1]}: predicts tokens[:, 1:] from tokens[:, :-1];
      optionally (`zerojax.data.sft.batch_at`) the inputs' 'segment_ids' and 'positions'
      (int32[B, T]) and 'loss_mask' (float32[B, T], each target's weight).
    rng: unused (no dropout); `zerojax.make_train_step` passes one.

  Returns:
    The float32 scalar sum over B x T positions of nll x loss_mask (default 1) / (B x T);
    with experts, plus the router losses (`router_loss`), and with what the routers did
    (`router_metrics`): (loss, metrics), which the train step reports.
  """
  del rng
  inputs, targets = sequence.inputs_and_targets(batch)  # Either form: see its docstring.
  out = Llama(config).apply({"params": params}, inputs, batch.get("positions"),
                            batch.get("segment_ids"), method=Llama.layer_loop)
  total = head_loss(config, params, stack_output(config, out), targets,
                    batch.get("loss_mask")) + router_loss(config, out, inputs.size)
  return (total, router_metrics(config, out, inputs.size)) if config.n_experts else total


def head_loss(config: LlamaConfig, params: Params, x: jax.Array, targets: jax.Array,
              loss_mask: jax.Array | None = None) -> jax.Array:
  """Cross-entropy of `targets` int32[B, T] given the last layer's output x [B, T, D]: the
  final norm and head, `loss_chunk` positions at a time (`chunked_nll`: no whole-sequence
  fp32 logits); `params`: the non-layer leaves. Returns the float32 sum over B x T
  positions of nll x loss_mask (float[B, T], default 1) / (B x T)."""
  model = Llama(config)
  shard = _vocab_shard(params, ("embed_tokens", "embedding") if config.tie_embeddings
                       else ("lm_head", "kernel"))
  if shard is not None:  # Stage 3 with the vocabulary sharded: the loss on its shards.
    def chunk_loss(h, targets, weights):
      h = model.apply({"params": params}, h, method=Llama.final_norm)
      return vocab.nll(h, shard, targets, weights, config.compute_dtype)
    return chunked_loss.chunked(chunk_loss, x, targets, config.loss_chunk, loss_mask)
  head = lambda h: model.apply({"params": params}, h, method=Llama.head)  # noqa: E731
  return chunked_loss.chunked_nll(head, x, targets, config.loss_chunk, loss_mask)


def _vocab_shard(params: Any, path: tuple[str, str]) -> vocab.VocabShard | None:
  """The `VocabShard` at `path` of `params` (a stage-3 step's, `step.materialize`), or
  None where the leaf is an array (or absent, as in init)."""
  leaf = params.get(path[0], {}).get(path[1]) if hasattr(params, "get") else None
  return leaf if isinstance(leaf, vocab.VocabShard) else None


def init_params(config: LlamaConfig, rng: jax.Array, seq_len: int = 1) -> Params:
  """Params boxed with logical axis names (for `jax.eval_shape`); shapes do not depend
  on `seq_len`. HF's init: normal(0.02) for embeddings and kernels, ones for norms."""
  whole = dataclasses.replace(config, sequence_axis=None)  # Outside the step's mesh axes.
  return Llama(whole).init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]


def param_shapes(config: LlamaConfig) -> ParamShapes:
  """{leaf path: (shape, logical axis names)} of every parameter, without any JAX work.

  The one written-out copy of the model's shapes (`init_params` makes these; a test
  checks it against `jax.eval_shape`): the planner (`zerojax.memory`) counts and shards
  them, `zerojax.hf` joins its tensor names to them by path. Layer leaves are
  stacked on a leading 'layers' axis; kernels are [in, out]; no head when tied.
  """
  c = config
  D, F, V, Dh = c.d_model, c.d_ff, c.vocab_size, c.head_dim
  q, kv = c.n_heads * Dh, c.n_kv_heads * Dh
  layer = {
      ("input_layernorm", "scale"): ((D,), ("embed",)),
      ("mlp", "down_proj", "kernel"): ((F, D), ("mlp", "embed")),
      ("mlp", "gate_proj", "kernel"): ((D, F), ("embed", "mlp")),
      ("mlp", "up_proj", "kernel"): ((D, F), ("embed", "mlp")),
      ("post_attention_layernorm", "scale"): ((D,), ("embed",)),
      ("self_attn", "k_proj", "kernel"): ((D, kv), ("embed", "kv_heads")),
      ("self_attn", "o_proj", "kernel"): ((q, D), ("heads", "embed")),
      ("self_attn", "q_proj", "kernel"): ((D, q), ("embed", "heads")),
      ("self_attn", "v_proj", "kernel"): ((D, kv), ("embed", "kv_heads")),
  }
  if c.qkv_bias:
    layer.update({("self_attn", f"{x}_proj", "bias"): ((n,), (axis,)) for x, n, axis in (
        ("q", q, "heads"), ("k", kv, "kv_heads"), ("v", kv, "kv_heads"))})
  if c.qk_norm:
    layer.update({("self_attn", f"{x}_norm", "scale"): ((Dh,), ("head_dim",)) for x in "qk"})
  if c.post_norms:
    layer.update({(f"{x}_feedforward_layernorm", "scale"): ((D,), ("embed",))
                  for x in ("pre", "post")})
  if c.n_experts:  # The experts replace the MLP (`moe.MoeMlp`).
    E, Fe = c.n_experts, c.expert_d_ff
    for name in ("gate_proj", "up_proj", "down_proj"):
      del layer[("mlp", name, "kernel")]
    layer.update({
        ("mlp", "router", "kernel"): ((D, E), ("embed", "router")),
        ("mlp", "experts", "gate_proj"): ((E, D, Fe), ("experts", "embed", "mlp")),
        ("mlp", "experts", "up_proj"): ((E, D, Fe), ("experts", "embed", "mlp")),
        ("mlp", "experts", "down_proj"): ((E, Fe, D), ("experts", "mlp", "embed"))})
  shapes = {("embed_tokens", "embedding"): ((V, D), ("vocab", "embed"))}
  shapes.update({("layers", *path): ((c.n_layers, *shape), ("layers", *names))
                 for path, (shape, names) in layer.items()})
  shapes[("norm", "scale")] = ((D,), ("embed",))
  if not c.tie_embeddings:
    shapes[("lm_head", "kernel")] = ((D, V), ("embed", "vocab"))
  return shapes


def param_count(config: LlamaConfig) -> int:
  """Total parameters (of `param_shapes`)."""
  return sum(math.prod(shape) for shape, _ in param_shapes(config).values())


def flops_per_token(config: LlamaConfig, seq_len: int, causal: bool = True) -> float:
  """Training FLOPs per token (forward + backward), for MFU.

  6 N for the N parameters used in matmuls (every layer's projections and the head;
  not the embedding lookup or the norms), plus attention's QK^T and PV: 12 L H Dh T,
  halved when `causal` (only the visible half of the scores is model work, as
  MaxText counts; PaLM's formula counts all of it). Remat's recomputation is not
  counted: this is model FLOPs. With experts, a token's k experts and the router (the
  active parameters), not all E.
  """
  c = config
  D, q_dim, kv_dim = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  mlp = (3 * D * c.expert_d_ff * c.experts_per_token + D * c.n_experts if c.n_experts
         else 3 * D * c.d_ff)
  matmul = c.n_layers * (2 * D * q_dim + 2 * D * kv_dim + mlp) + D * c.vocab_size
  attention = 12 * c.n_layers * q_dim * seq_len * (0.5 if causal else 1.0)
  return 6.0 * matmul + attention


@dataclasses.dataclass(frozen=True)
class LlamaLM:
  """The model as zerojax's train step wants it: pure functions of (params, inputs).

  Same interface as `MlpLM`: `init(rng)`, `loss(params, batch, rng)`, `layered()`,
  `logical_axes()`, `param_shapes()`, plus `logits(params, tokens)`.
  """
  config: LlamaConfig
  # Its loss reads a vocabulary-sharded embedding and head (`zerojax.vocab`) in place.
  vocab_parallel = True

  def init(self, rng: jax.Array) -> Params:
    """Unboxed params in `param_dtype` (for `zerojax.init_state`)."""
    return nn.unbox(init_params(self.config, rng))

  def logical_axes(self) -> Params:
    """Axis names per parameter dimension, for `zerojax.make_plan(logical_axes=...)`."""
    boxed = jax.eval_shape(lambda rng: init_params(self.config, rng), jax.random.key(0))
    return flax_logical_axes(boxed)

  def param_shapes(self) -> ParamShapes:
    """{leaf path: (shape, logical axes)}, without JAX work: see `param_shapes`."""
    return param_shapes(self.config)

  def loss(self, params: Params, batch: dict[str, jax.Array], rng: jax.Array = None):
    return loss(self.config, params, batch, rng)

  def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
    return logits(self.config, params, tokens)

  def extend(self, params: Params, tokens: jax.Array, positions: jax.Array, cache, last=None):
    """KV-cached logits (`zerojax.generate`): see `extend`."""
    return extend(self.config, params, tokens, positions, cache, last)

  def layered(self) -> LayeredLoss:
    """`loss` cut at its layer loop, for gradient release (`zerojax.release`). Every
    layer reads the batch's positions and segment ids (packed examples) and makes its
    rotary tables from them: inputs of the batch, so nothing differentiates them and no
    layer input saves them."""
    c = self.config
    tokens = lambda x: math.prod(stack_output(c, x).shape[:2])  # noqa: E731

    def layer(p, x, batch):
      positions = batch.get("positions", stack_output(c, x).shape[1])
      return apply_block(c, p, x, *layer_rope(c, positions), batch.get("segment_ids"))

    return LayeredLoss(
        embed=lambda rest, batch: stack_input(c, Llama(c).apply(
            {"params": rest}, sequence.inputs_and_targets(batch)[0], method=Llama.embed)),
        layer=layer,
        head_loss=lambda rest, x, batch: head_loss(
            c, rest, stack_output(c, x), sequence.inputs_and_targets(batch)[1],
            batch.get("loss_mask")) + router_loss(c, x, tokens(x)),
        stack="layers", offload=c.activation_offload == "host",
        metrics=(lambda x, batch: router_metrics(c, x, tokens(x))) if c.n_experts else None)

  def flops_per_token(self, seq_len: int) -> float:
    return flops_per_token(self.config, seq_len)
