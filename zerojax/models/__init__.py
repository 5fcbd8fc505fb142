"""Models, and the one place a config's `model` section becomes a model object.

The models room: `llama` (the decoder), `mlp_lm` (the small test model), their parts
(`attention`, `rope`, `remat`, `tiled`, `chunked_loss`) and `flax_nnx` (a Flax NNX
module on a ZeRO plan). A model implements `zerojax.layered.LayeredLoss`; this room
imports the ZeRO core below the step (`zero`, `stage3`), `sequence` and the runtime,
never the algorithms that run it.

Every model here has the interface zerojax's train step wants: `init(rng) -> params`,
`loss(params, batch, rng) -> scalar`, `logical_axes()`, `param_shapes()` (shapes and
axis names without JAX work, for the memory planner), and `flops_per_token(seq_len)`
for the MFU estimate.
"""

import dataclasses

import jax.numpy as jnp

from zerojax.models.llama import LlamaConfig, LlamaLM
from zerojax.models.mlp_lm import MlpLM


def from_config(config):
  """The model of a validated config (`config.model`, `config.precision`).

  Model keys are taken by field name (`LlamaConfig.from_keys`), so a new key is a
  schema row and a model field, nothing here.
  """
  m, p = config.model, config.precision
  dtypes = dict(param_dtype=jnp.dtype(p.param_dtype), compute_dtype=jnp.dtype(p.compute_dtype))
  if m.name == "mlp_lm":
    fields = {f.name for f in dataclasses.fields(MlpLM)} - set(dtypes)
    return MlpLM(**{k: m[k] for k in fields}, **dtypes)
  # Sequence parallelism splits each sequence over the ZeRO axis (`zerojax.sequence`).
  axis = "fsdp" if config.mesh.sequence_parallel else None
  return LlamaLM(LlamaConfig.from_keys(m, **dtypes, sequence_axis=axis))


__all__ = ["LlamaConfig", "LlamaLM", "MlpLM", "from_config"]
