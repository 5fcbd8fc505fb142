"""A small causal language model with scanned layers, in plain JAX.

Each block mixes the last `context` positions with a learned per-channel causal
filter, then applies a GELU MLP; blocks are stacked along a leading 'layers' axis and
run under `lax.scan`, the layout the Llama model uses too. It is the model of the
quick start and of the tests: big enough to have layer-stacked matrices for ZeRO to
shard and gather, small enough to train on a CPU in seconds.

Shapes: B batch, T sequence, V vocab, D d_model, F d_ff, L layers, C context.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from zerojax.layered import LayeredLoss
from zerojax.stage3 import gather

Params = dict[str, Any]

# Per-layer rematerialization. Any policy here recomputes a stage-3 layer's gathered
# weights in the backward pass (they are not matmul outputs), so the scan never keeps
# all layers' gathered weights alive; "none" saves everything, gathered weights too.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class MlpLM:
  """Hyper-parameters and dtypes; methods are pure functions of (params, inputs)."""
  vocab_size: int = 256
  d_model: int = 128
  d_ff: int = 512
  n_layers: int = 4
  context: int = 8
  remat: str = "dots"  # What the backward pass keeps: see `REMAT_POLICIES`.
  param_dtype: Any = jnp.float32
  compute_dtype: Any = jnp.float32

  def init(self, rng: jax.Array) -> Params:
    """Random parameters in `param_dtype` (scaled normal, unit norms)."""
    V, D, F, L, C = self.vocab_size, self.d_model, self.d_ff, self.n_layers, self.context
    k = jax.random.split(rng, 5)
    normal = lambda key, shape, fan_in: (
        jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(fan_in)
    ).astype(self.param_dtype)
    ones = lambda shape: jnp.ones(shape, self.param_dtype)
    return {
        "embed": normal(k[0], (V, D), 1.0),
        "layers": {
            "norm": ones((L, D)),
            "mix": normal(k[1], (L, C, D), C),
            "w_in": normal(k[2], (L, D, F), D),
            "w_out": normal(k[3], (L, F, D), F),
        },
        "final_norm": ones((D,)),
        "head": normal(k[4], (D, V), D),
    }

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the matmul parameters (mixing, MLP, head)."""
    del seq_len  # No attention.
    D, F, L, V, C = self.d_model, self.d_ff, self.n_layers, self.vocab_size, self.context
    return 6.0 * (L * (2 * D * F + C * D) + D * V)

  def param_shapes(self) -> dict[tuple[str, ...], tuple[tuple[int, ...], tuple[str, ...]]]:
    """{leaf path: (shape, logical axis names)} of `init`'s params, without JAX work."""
    V, D, F, L, C = self.vocab_size, self.d_model, self.d_ff, self.n_layers, self.context
    return {
        ("embed",): ((V, D), ("vocab", "embed")),
        ("layers", "norm"): ((L, D), ("layers", "embed")),
        ("layers", "mix"): ((L, C, D), ("layers", "context", "embed")),
        ("layers", "w_in"): ((L, D, F), ("layers", "embed", "mlp")),
        ("layers", "w_out"): ((L, F, D), ("layers", "mlp", "embed")),
        ("final_norm",): ((D,), ("embed",)),
        ("head",): ((D, V), ("embed", "vocab")),
    }

  def logical_axes(self) -> dict[str, Any]:
    """Axis names per parameter dimension, for `zerojax.make_plan`."""
    tree = {}
    for (*parents, name), (_, names) in self.param_shapes().items():
      node = tree
      for p in parents:
        node = node.setdefault(p, {})
      node[name] = names
    return tree

  def apply(self, params: Params, tokens: jax.Array) -> jax.Array:
    """Next-token logits.

    Args:
      params: from `init` (layer leaves may be `zerojax.Sharded` at ZeRO stage 3).
      tokens: int32[B, T].

    Returns:
      float32[B, T, V] logits.
    """
    def block(x, layer):
      # Stage 3: this layer's weights only, gathered here.
      return self.block(gather(layer), x), None

    if self.remat != "none":
      block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat])
    x, _ = jax.lax.scan(block, self.embed(params, tokens), params["layers"])
    return self.head(params, x)

  def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
    """The residual stream entering the first block: [B, T, D] in the compute dtype."""
    return params["embed"].astype(self.compute_dtype)[tokens]

  def block(self, layer: Params, x: jax.Array) -> jax.Array:
    """One block on the residual stream; `layer` holds one layer's (whole) params."""
    cd = self.compute_dtype
    h = _rms_norm(x, layer["norm"]).astype(cd)
    # Causal depthwise filter: position t sees t, t-1, ..., t-C+1.
    shifted = [jnp.pad(h, ((0, 0), (c, 0), (0, 0)))[:, :h.shape[1]]
               for c in range(self.context)]
    h = jnp.einsum("cbtd,cd->btd", jnp.stack(shifted), layer["mix"].astype(cd))
    h = jax.nn.gelu(h @ layer["w_in"].astype(cd)) @ layer["w_out"].astype(cd)
    return x + h

  def head(self, params: Params, x: jax.Array) -> jax.Array:
    """float32[B, T, V] logits from the last block's output."""
    x = _rms_norm(x, params["final_norm"]).astype(self.compute_dtype)
    return (x @ params["head"].astype(self.compute_dtype)).astype(jnp.float32)

  def loss(self, params: Params, batch: dict[str, jax.Array], rng: jax.Array = None):
    """Mean next-token cross-entropy (fp32) over `batch['tokens']`: int32[B, T+1]."""
    del rng  # No dropout.
    tokens = batch["tokens"]
    return _nll(self.apply(params, tokens[:, :-1]), tokens)

  def layered(self) -> LayeredLoss:
    """`loss` cut at its layer loop, for gradient release (`zerojax.release`)."""
    return LayeredLoss(
        embed=lambda rest, batch: self.embed(rest, batch["tokens"][:, :-1]),
        layer=lambda p, x, batch: self.block(p, x),
        head_loss=lambda rest, x, batch: _nll(self.head(rest, x), batch["tokens"]),
        stack="layers")


def _nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy of `tokens[:, 1:]` under `logits` (one row per position)."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.mean(-jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0])


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
  """RMSNorm computed in fp32, whatever the input dtype."""
  x = x.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return x * scale.astype(jnp.float32)
