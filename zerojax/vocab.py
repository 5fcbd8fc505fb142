"""The vocabulary kept sharded at stage 3: the embedding and head used where they are.

Gathered like any other stage-3 leaf, the embedding [V, D] and head [D, V] are whole on
every device in the step, and so are their fp32 gradients before the reduce-scatter: on
Llama-3-8B over 8 devices two f32[128256, 4096] (4.2 GB) and two gathered bf16 copies
sit at the step's peak. Here each device keeps its rows of the vocabulary and the
activations travel instead (fewer bytes whenever the step's tokens over the shard axes
are fewer than the vocabulary: 8 x 4096 against 128,256):

* `embed`: the tokens of every device of the shard axes are gathered (int32), each
  device looks up those in its rows (zeros elsewhere), and an all-to-all hands each
  device what every shard found for its own tokens, summed there (exact: one shard has
  each token). The backward
  pass gathers the embeddings' cotangents and scatter-adds them into the device's rows:
  the gradient is born sharded, summed in the shard's dtype (fp32 when differentiated).
* `nll`: the normed hidden states of every device are gathered, each device computes
  the logits of its rows of the vocabulary, and the log-sum-exp and the target's logit
  cross the shards as a max and two sums (fp32); a device's loss is that of its own
  positions. The backward pass recomputes the logits, forms the softmax's cotangent on
  the device's rows, and makes the head's gradient there, born sharded in fp32, and
  the hidden states' gradient, reduce-scattered in fp32 to the devices that own them.

Both are `custom_vjp`s that run inside the step's `shard_map`: the collectives' own
transposes are never relied on. The model sees a `VocabShard` leaf where it would see the
gathered embedding or head (`zerojax.step.materialize` with a plan that keeps the
vocabulary sharded: `make_plan(vocab_parallel=True)`), and calls these with it.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class VocabShard:
  """This device's rows of a vocabulary leaf, used in place (`embed`, `nll`).

  Attributes:
    value: the shard (the stored dtype, or fp32 holding its values where the step
      differentiates: its gradient then comes back in fp32).
    dim: the leaf's vocabulary dimension (0: an embedding [V, D], rows; 1: a head
      kernel [D, V], columns).
    axes: the mesh axes the vocabulary is split over (device k of them holds rows
      k * V / n to (k + 1) * V / n).
    dtype: the leaf's stored dtype (the values `value` holds).
  """

  def __init__(self, value: jax.Array, dim: int, axes: tuple[str, ...], dtype: Any):
    self.value, self.dim, self.axes, self.dtype = value, dim, tuple(axes), dtype

  def tree_flatten(self):
    return (self.value,), (self.dim, self.axes, self.dtype)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self):
    return f"VocabShard({getattr(self.value, 'shape', '?')}, dim={self.dim}, axes={self.axes})"

  def __jax_array__(self):
    raise TypeError("a vocabulary shard was used as an array: a model that keeps the "
                    "vocabulary sharded calls zerojax.vocab.embed / zerojax.vocab.nll with it")


def pays(tokens: int, vocab_size: int) -> bool:
  """Whether keeping the vocabulary sharded moves fewer bytes than gathering it: the
  tokens a microbatch has over the shard axes (their activations travel, [tokens, D])
  against the vocabulary's rows ([V, D] gathered, its gradient reduce-scattered). A
  4M-token sequence over 8 devices would gather 32 GiB of embeddings; its 128K-row
  vocabulary is 1 GiB."""
  return tokens < vocab_size


def _first_row(shard: jax.Array, dim: int, axes: tuple[str, ...]) -> jax.Array:
  """The vocabulary row this device's shard starts at."""
  return jax.lax.axis_index(axes) * shard.shape[dim]


def _gathered(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """`x` of every device of `axes`, stacked on a new leading axis in their order."""
  return jax.lax.all_gather(x, axes, axis=0, tiled=False)


def _local(ids: jax.Array, start: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """(ids as rows of this shard, clipped; whether each id is one of its rows)."""
  local = ids - start
  inside = (local >= 0) & (local < rows)
  return jnp.clip(local, 0, rows - 1), inside


def embed(shard: VocabShard, tokens: jax.Array, dtype: Any) -> jax.Array:
  """The embeddings of `tokens` int32[...] from a sharded table ([V, D] by rows):
  [..., D] in `dtype`, as `jnp.take(table.astype(dtype), tokens, axis=0)`."""
  if shard.dim != 0:
    raise ValueError(f"an embedding table is sharded by rows (dim 0), not dim {shard.dim}")
  return _embed(shard.value, tokens, shard.axes, jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _embed(table, tokens, axes, dtype):
  return _embed_fwd(table, tokens, axes, dtype)[0]


def _embed_fwd(table, tokens, axes, dtype):
  rows, inside = _local(_gathered(tokens, axes), _first_row(table, 0, axes), table.shape[0])
  found = jnp.where(inside[..., None], jnp.take(table.astype(dtype), rows, axis=0), 0)
  # Each device's found rows go to the tokens' owners; one device holds each token, so
  # the sum adds zeros to it: exact, and no reduction crosses the devices (the bytes of
  # a reduce-scatter, as an all-to-all).
  out = jnp.sum(jax.lax.all_to_all(found, axes, 0, 0, tiled=True), axis=0)
  # The table's rows and dtype as a zero-size array: nothing of it is kept.
  return out, (jnp.zeros((table.shape[0], 0), table.dtype), rows, inside)


def _embed_bwd(axes, dtype, residuals, ct):
  del dtype
  like, rows, inside = residuals
  cts = jnp.where(inside[..., None], _gathered(ct, axes), 0).astype(like.dtype)
  d_table = jnp.zeros((like.shape[0], ct.shape[-1]), like.dtype).at[rows.reshape(-1)].add(
      cts.reshape(-1, ct.shape[-1]))
  return d_table, None


_embed.defvjp(_embed_fwd, _embed_bwd)


def nll(x: jax.Array, shard: VocabShard, targets: jax.Array, weights: jax.Array,
        dtype: Any) -> jax.Array:
  """Σ nll x weights over this device's positions, the logits `x @ head` over a sharded
  head (`shard`: [D, V] by columns, or a tied embedding [V, D] by rows).

  Args:
    x: [..., D] this device's (normed) hidden states.
    shard: the head's `VocabShard`.
    targets: int32[...], the next tokens.
    weights: float32[...], each position's weight (a loss mask).
    dtype: the matmul's inputs' dtype (x and the head cast to it; fp32 logits).

  Returns:
    The float32 scalar sum, as `sum((logsumexp(z) - z[target]) * weights)` of the fp32
    logits z of the whole vocabulary.
  """
  return _nll(x, shard.value, targets, weights, shard.dim, shard.axes, jnp.dtype(dtype))


def _shard_logits(x, head, targets, dim, axes, dtype):
  """(every device's x [n, ..., D], the fp32 logits [n, ..., v] of this shard's rows of
  the head ([D, v], or [v, D] rows), every device's targets as rows of this shard
  (clipped), whether each is one): the forward's and the backward's."""
  x_all = _gathered(x, axes)
  z = jax.lax.dot_general(x_all.astype(dtype), head.astype(dtype),
                          (((x_all.ndim - 1,), (1 - dim,)), ((), ())),
                          preferred_element_type=jnp.float32)
  rows, inside = _local(_gathered(targets, axes), _first_row(head, dim, axes), z.shape[-1])
  return x_all, z, rows, inside


def _at_targets(z, rows):
  """`z[..., rows]`: each position's logit at its target's row of this shard (a gather,
  no one-hot of the shard's width)."""
  return jnp.take_along_axis(z, rows[..., None], axis=-1)[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _nll(x, head, targets, weights, dim, axes, dtype):
  return _nll_fwd(x, head, targets, weights, dim, axes, dtype)[0]


def _nll_fwd(x, head, targets, weights, dim, axes, dtype):
  _, z, rows, inside = _shard_logits(x, head, targets, dim, axes, dtype)
  top = jax.lax.pmax(jnp.max(z, axis=-1), axes)
  logz = top + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(z - top[..., None]), axis=-1), axes))
  picked = jax.lax.psum(jnp.where(inside, _at_targets(z, rows), 0.0), axes)
  own = jax.lax.axis_index(axes)  # Every device computed every position: keep its own.
  total = jnp.sum((logz[own] - picked[own]) * weights.astype(jnp.float32))
  # The backward recomputes the logits from the input (a chunk's, under the chunked
  # loss's `jax.checkpoint`); the log-sum-exp is kept (a float a position), so it does
  # not cross the shards for it again.
  return total, (x, head, targets, weights, logz)


def _nll_bwd(dim, axes, dtype, residuals, g):
  x, head, targets, weights, logz = residuals
  x_all, z, rows, inside = _shard_logits(x, head, targets, dim, axes, dtype)
  # Each position's cotangent: its owner's g times its weight.
  scale = (_gathered(g, axes).reshape((-1,) + (1,) * (weights.ndim))
           * _gathered(weights.astype(jnp.float32), axes))
  # softmax - one-hot(target), times the position's scale: the one-hot subtracted at
  # each target's row by a scatter, in place (no [..., v] one-hot or iota).
  dz = scale[..., None] * jnp.exp(z - logz[..., None])
  flat = dz.reshape(-1, dz.shape[-1])
  dz = flat.at[jnp.arange(flat.shape[0]), rows.reshape(-1)].add(
      -jnp.where(inside, scale, 0.0).reshape(-1)).reshape(dz.shape)
  # The head's gradient on this shard (every device's positions: complete), in fp32.
  batch = tuple(range(dz.ndim - 1))
  a, b = (dz, x_all) if dim == 0 else (x_all, dz)
  d_head = jax.lax.dot_general(a, b.astype(jnp.float32), ((batch, batch), ((), ())),
                               preferred_element_type=jnp.float32).astype(head.dtype)
  # The hidden states' gradient: this shard's part for every position, summed over the
  # shards in fp32 onto the devices that own them.
  dx_all = jax.lax.dot_general(dz, head.astype(dtype), (((dz.ndim - 1,), (dim,)), ((), ())),
                               preferred_element_type=jnp.float32)
  dx = jax.lax.psum_scatter(dx_all, axes, scatter_dimension=0, tiled=False)
  return dx.astype(x.dtype), d_head, None, None


_nll.defvjp(_nll_fwd, _nll_bwd)
