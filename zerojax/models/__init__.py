"""Models, and the one place a config's `model` section becomes a model object.

Every model here has the interface zerojax's train step wants: `init(rng) -> params`,
`loss(params, batch, rng) -> scalar`, `logical_axes()`, and `flops_per_token(seq_len)`
for the MFU estimate.
"""

import jax.numpy as jnp

from zerojax.models.llama import LlamaConfig, LlamaLM
from zerojax.models.mlp_lm import MlpLM


def from_config(config):
  """The model of a validated config (`config.model`, `config.precision`)."""
  m, p = config.model, config.precision
  dtypes = dict(param_dtype=jnp.dtype(p.param_dtype), compute_dtype=jnp.dtype(p.compute_dtype))
  if m.name == "mlp_lm":
    return MlpLM(vocab_size=m.vocab_size, d_model=m.d_model, d_ff=m.d_ff, n_layers=m.n_layers,
                 context=m.context, remat=m.remat, **dtypes)
  scaling = None
  if m.rope_scaling_factor:
    scaling = dict(factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                   high_freq_factor=m.rope_high_freq_factor,
                   original_max_position_embeddings=m.rope_original_context)
  return LlamaLM(LlamaConfig(
      vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
      n_kv_heads=m.n_kv_heads, d_ff=m.d_ff, rope_theta=m.rope_theta, rope_scaling=scaling,
      norm_eps=m.norm_eps, tie_embeddings=m.tie_embeddings, attention=m.attention,
      attention_block=m.attention_block, loss_chunk=m.loss_chunk, remat=m.remat, **dtypes))


__all__ = ["LlamaConfig", "LlamaLM", "MlpLM", "from_config"]
