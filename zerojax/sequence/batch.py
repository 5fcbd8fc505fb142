"""The batch of a sequence-parallel step: inputs and targets of equal length, split by position.

A language-model batch holds `tokens` int32[B, T + 1] (each row's inputs and, shifted by
one, its targets): T + 1 positions do not split evenly over n devices, so the step first
makes `inputs` and `targets` [B, T] of it (and `positions` 0..T-1 when the batch has
none, so that every slice knows where it starts), then lays every leaf out as
[B over the example axes, T over the sequence axes].
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

Batch = dict[str, jax.Array]


def split_tokens(batch: Batch) -> Batch:
  """{'tokens': int32[B, T + 1], other [B, T] leaves} -> {'inputs', 'targets' int32[B, T],
  'positions' int32[B, T] (0..T-1 if absent), the others}."""
  if "tokens" not in batch:
    raise ValueError(f"sequence parallelism needs a 'tokens' leaf in the batch; it has "
                     f"{sorted(batch)}")
  out = {k: v for k, v in batch.items() if k != "tokens"}
  tokens = batch["tokens"]
  out["inputs"], out["targets"] = tokens[:, :-1], tokens[:, 1:]
  if "positions" not in out:
    B, T = out["inputs"].shape
    out["positions"] = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  return out


def inputs_and_targets(batch: Batch) -> tuple[jax.Array, jax.Array]:
  """(inputs, targets) int32[B, T] of a batch, split (`split_tokens`) or not ('tokens')."""
  if "inputs" in batch:
    return batch["inputs"], batch["targets"]
  return batch["tokens"][:, :-1], batch["tokens"][:, 1:]


def shard_batch(plan: Any, batch: Batch) -> Batch:
  """The global batch as the step's `shard_map` takes it (`plan.local_batch_spec`):
  unchanged without sequence parallelism, else `split_tokens`'s, laid out by position.

  Raises:
    ValueError: T is not divisible by the sequence devices.
  """
  if not plan.sequence_axes:
    return batch
  split = split_tokens(batch)
  T, n = split["inputs"].shape[1], plan.sequence_size
  if T % n:
    raise ValueError(f"sequences of {T} positions cannot be split over {n} devices "
                     f"(sequence parallelism over {plan.sequence_axes})")
  return jax.lax.with_sharding_constraint(split, NamedSharding(plan.mesh, plan.local_batch_spec))
