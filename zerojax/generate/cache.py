"""The KV cache of `zerojax.generate`: its state, layout on the mesh and size.

Layout (`zerojax.models.llama.KVCache`): keys and values [L, B, S, K, Dh] in the model's
compute dtype, each token at its own position (slot s of row b holds the token at RoPE
position s); a model's sliding-window layers keep only their window, a ring of min(W, S)
slots. On the plan's mesh the batch is split over every data axis, as training splits its
batch: the decoder rounds its batch up to a multiple of those devices
(`decode.batch_bucket`), so the split always divides and attention needs no
communication (each device attends over its own rows). Splitting KV heads instead would
put an all-gather of the attention output in every layer of every step, and K (8 for
Llama 3) rarely divides a training mesh; splitting the sequence would make every step's
softmax a cross-device reduction.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.models.llama import KVCache, cache_layout, init_cache

__all__ = ["KVCache", "cache_bytes", "check_model", "init_cache", "shardings", "spec"]


def check_model(model: Any) -> None:
  """A clear error for a model without a KV-cached pass (`extend`), e.g. `MlpLM`."""
  if not hasattr(model, "extend"):
    raise TypeError(f"{type(model).__name__} has no KV-cached pass (extend(params, tokens, "
                    "positions, cache)): zerojax.generate decodes Llama models; "
                    "generate.greedy(model.logits, ...) decodes any model without a cache")


def spec(config: Any, data_axes: tuple[str, ...]) -> KVCache:
  """The cache's PartitionSpecs: batch over the data axes (see the module docstring)."""
  layout = cache_layout(config, 1, 1)
  stack = lambda s: None if s is None else P(None, data_axes, None, None, None)  # noqa: E731
  return KVCache(*(stack(s) for s in layout[:4]), None if layout.held is None else
                 P(data_axes, None))


def shardings(config: Any, mesh: jax.sharding.Mesh, data_axes: tuple[str, ...]) -> KVCache:
  return jax.tree.map(lambda p: NamedSharding(mesh, p), spec(config, data_axes))


def cache_bytes(config: Any, batch: int, length: int, devices: int = 1) -> int:
  """The KV cache's bytes per device: keys and values of every layer, `length` positions
  on a global layer and min(window, length) on a local one (plus the ring's int32
  positions), over `devices`.

  Args:
    config: a `LlamaConfig` (its compute dtype is the cache's).
    batch: prompts decoded at once; each device holds ceil(batch / devices) rows (the
      decoder pads its batch to a multiple of the data devices).
    length: S, tokens per row (prompt + new tokens, as the decoder rounds it).
    devices: the devices the batch is split over (the plan's data axes).

  Returns:
    Bytes on each device.
  """
  layout = cache_layout(config, -(-batch // devices), length)
  item = jnp.dtype(config.compute_dtype).itemsize
  return sum(math.prod(s) * (4 if i == 4 else item) for i, s in enumerate(layout)
             if s is not None)
