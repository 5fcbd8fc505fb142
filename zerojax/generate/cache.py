"""The KV cache of `zerojax.generate`: its state, layout on the mesh and size.

Layout: [L, B, S, K, Dh] per keys and values, in the model's compute dtype, each token at
its own position (slot s of row b holds the token at RoPE position s). On the plan's mesh
the batch is split over every data axis, as training splits its batch: the decoder
rounds its batch up to a multiple of those devices (`decode.batch_bucket`), so the split
always divides and attention needs no communication (each device attends over its own
rows). Splitting KV heads instead would put an all-gather of the attention output in
every layer of every step, and K (8 for Llama 3) rarely divides a training mesh;
splitting the sequence would make every step's softmax a cross-device reduction.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


class KVCache(NamedTuple):
  """Keys and values of every layer: each [L, B, S, K, Dh] in the compute dtype."""
  keys: jax.Array
  values: jax.Array


def check_model(model: Any) -> None:
  """A clear error for a model without a KV-cached pass (`extend`), e.g. `MlpLM`."""
  if not hasattr(model, "extend"):
    raise TypeError(f"{type(model).__name__} has no KV-cached pass (extend(params, tokens, "
                    "positions, cache)): zerojax.generate decodes Llama models; "
                    "generate.greedy(model.logits, ...) decodes any model without a cache")


def shape(config: Any, batch: int, length: int) -> tuple[int, int, int, int, int]:
  """(L, B, S, K, Dh) of a Llama config's cache for `batch` rows of `length` tokens."""
  return (config.n_layers, batch, length, config.n_kv_heads, config.head_dim)


def init(config: Any, batch: int, length: int) -> KVCache:
  """A zero cache (inside the decoder's `shard_map`: `batch` is this device's rows)."""
  zeros = jnp.zeros(shape(config, batch, length), config.compute_dtype)
  return KVCache(zeros, zeros)


def spec(data_axes: tuple[str, ...]) -> P:
  """The cache's PartitionSpec: batch over the data axes (see the module docstring)."""
  return P(None, data_axes, None, None, None)


def shardings(mesh: jax.sharding.Mesh, data_axes: tuple[str, ...]) -> KVCache:
  s = NamedSharding(mesh, spec(data_axes))
  return KVCache(s, s)


def cache_bytes(config: Any, batch: int, length: int, devices: int = 1) -> int:
  """The KV cache's bytes per device: 2 x L x B x S x K x Dh x dtype bytes over `devices`.

  Args:
    config: a `LlamaConfig` (its compute dtype is the cache's).
    batch: prompts decoded at once; each device holds ceil(batch / devices) rows (the
      decoder pads its batch to a multiple of the data devices).
    length: S, tokens per row (prompt + new tokens, as the decoder rounds it).
    devices: the devices the batch is split over (the plan's data axes).

  Returns:
    Bytes on each device, keys and values together.
  """
  rows = -(-batch // devices)
  return 2 * math.prod(shape(config, rows, length)) * jnp.dtype(config.compute_dtype).itemsize
