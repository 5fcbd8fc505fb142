"""The optimizer update, on the whole tree or one layer at a time.

The train step (`zerojax.step`) runs it under GSPMD on arrays laid out by the plan;
gradient release (`zerojax.release`) runs it per device, on one layer's shards inside
the backward pass. An optimizer that updates each element on its own
(`optim.LeafwiseTransformation`) may run on any slice of the leaves: `LayerViews`
cuts layer i out of the stacks as trees the transform takes whole.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zerojax import optim, zero

PyTree = Any


def apply(tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree,
          params: PyTree, *, finite: jax.Array, scale: jax.Array,
          factor: jax.Array | None, copies: PyTree | None = None, move: bool = True,
          **extra):
  """One optimizer update: (new params, new optimizer state, sum of squared updates).

  The gradient is `grads * scale` (the mean of the summed gradients), clipped by
  `factor` (None: no clipping). Keeps the optimizer state in the dtypes it
  was created with (fp32 gradients would promote bf16 moments otherwise, changing the
  state's type from step to step), and changes nothing when the gradients are not
  `finite` (the step is skipped). `copies` (per param leaf, optional) divides each
  leaf's squared update by the devices holding that same leaf, for a caller that sums
  the squares over devices (a per-device update inside `jax.shard_map`). `move=False`
  is optimizer accumulation's partial step (`optim.absorb`): the moments absorb the
  gradient, the params stay, the squared update is 0; a traced `move` (a loop over the
  microbatches) computes both and keeps one. `extra` goes to `tx.update`
  (`decay`, `weight`, `clip_to`, `grad_norm`: see `zerojax.optim`).
  """
  grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
  if factor is not None:
    grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
  # A traced `move` computes both and keeps one (one layer's worth in per-layer updates).
  if move is not False:
    updates, new_state = tx.update(grads, opt_state, params, **extra)
    new_params, squares = optax.apply_updates(params, updates), sum_squares(updates, copies)
  if move is False:
    new_state = optim.absorb(tx, grads, opt_state, params, **extra)
    new_params, squares = params, jnp.zeros((), jnp.float32)
  elif move is not True:
    pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(move, x, y), a, b)
    new_state = pick(new_state, optim.absorb(tx, grads, opt_state, params, **extra))
    new_params, squares = pick(new_params, params), jnp.where(move, squares, 0.0)
  new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, opt_state)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  return keep(new_params, params), keep(new_state, opt_state), squares


def sum_squares(tree: PyTree, copies: PyTree | None = None,
                scale: jax.Array | None = None) -> jax.Array:
  """Sum of the squares of `tree * scale`'s elements in fp32, leaf i's divided by
  `copies[i]` (default 1)."""
  leaves = jax.tree.leaves(tree)
  copies = jax.tree.leaves(copies) if copies is not None else [1] * len(leaves)
  scaled = lambda x: x if scale is None else x * scale.astype(x.dtype)
  squares = [jnp.sum(jnp.square(scaled(x).astype(jnp.float32))) / n
             for x, n in zip(leaves, copies, strict=True)]
  return sum(squares, jnp.zeros((), jnp.float32))


def can_update_by_layer(plan: zero.ZeroPlan, tx: optax.GradientTransformation) -> bool:
  """Whether the update may run one layer at a time (`optim.LeafwiseTransformation`)."""
  if not isinstance(tx, optim.LeafwiseTransformation) or not any(
      jax.tree.leaves(plan.per_layer)):
    return False
  # State leaves that mirror no param must be small and shared by every slice: counts
  # (scalars) and the stochastic-rounding key (two words).
  return all(mirror or x.ndim <= 1 for x, mirror in zip(
      jax.tree.leaves(plan.opt_state), jax.tree.leaves(plan.opt_mirrors), strict=True))


def update_by_layer(plan: zero.ZeroPlan, update: Callable, grads: PyTree,
                    opt_state: PyTree, params: PyTree):
  """`update` on the whole tree, run one layer at a time on layer-stacked leaves.

  A leafwise update (`optim.LeafwiseTransformation`) of a slice equals that slice of
  the update. Run on whole (layers, ...) stacks, XLA:CPU materialises fp32
  temporaries of whole stacks (the update, the Kahan sum, the clipped gradient, the
  kept old values); here they are one layer's, and the stacked params and state are
  updated in place, slice by slice, in a loop over the layers. The other leaves
  (embedding, head, norms) and the state's scalars are updated in one call of their
  own. Each call sees the tree whole, the leaves it does not update emptied (zero
  size), so the transform's structure and scalar state are untouched.

  Returns:
    (new params, new optimizer state, sum of squared updates).
  """
  layered, opt_layered = plan.per_layer, plan.opt_per_layer
  # Everything but the layer stacks; the state's scalars advance here, once.
  rest_p, rest_s, total = update(*without_stacks(plan, grads, opt_state, params))

  for length in sorted({x.shape[0] for x, m in zip(jax.tree.leaves(params),
                                                   jax.tree.leaves(layered)) if m}):
    # One loop per stack length (a model may stack layers of different depths).
    views = LayerViews(plan, params, opt_state, length)

    def body(i, carry, views=views):
      p, s, total = carry
      # `stream`: a stochastic-rounding update draws layer i's own bits (the other
      # rules ignore it).
      new_p, new_s, squares = update(views.params(grads, i), views.state(s, i),
                                     views.params(p, i), stream=i)
      return views.put(p, new_p, i), views.put_state(s, new_s, i), total + squares

    params, opt_state, total = jax.lax.fori_loop(0, length, body,
                                                 (params, opt_state, total))
  return pick(layered, params, rest_p), pick(opt_layered, opt_state, rest_s), total


def _empty(x: jax.Array) -> jax.Array:
  return jnp.zeros((0,), x.dtype)


def pick(mask: PyTree, a: PyTree, b: PyTree) -> PyTree:
  """`a`'s leaves where `mask` is True, `b`'s elsewhere."""
  return jax.tree.map(lambda m, x, y: x if m else y, mask, a, b)


def without_stacks(plan: zero.ZeroPlan, grads: PyTree, opt_state: PyTree,
                    params: PyTree) -> tuple[PyTree, PyTree, PyTree]:
  """The update's arguments with every layer-stacked leaf emptied (zero size)."""
  select = lambda tree, mask: jax.tree.map(lambda x, m: _empty(x) if m else x, tree, mask)
  return (select(grads, plan.per_layer), select(opt_state, plan.opt_per_layer),
          select(params, plan.per_layer))


class LayerViews:
  """Layer i of the stacks of one length, as trees an update takes whole.

  Leaves of other stacks and the non-stacked ones are emptied (zero size), except the
  optimizer state's scalars, which every slice reads as they were before the step.

  With `rows=True` a loop over the layers carries the stacks as rows, `[layers, n]`
  (`rows` before it, `from_rows` after: reshapes, no copy), and the views cut and write
  rows. Why (gradient release): carried as `[layers, d, f]` through a loop whose layer
  feeds gemms, XLA:GPU's layout assignment gives a stack the layout those gemms want
  for one layer (`{1,0,2}`: the layer axis in the middle) and copies the whole stack
  into it around the loop (4.4 GiB a leaf for the 70B on 8 GPUs); a row-major
  `[layers, n]` has no other layout to take, so only the layer read is relaid. Not for
  `update_by_layer`, whose loop is elementwise: there XLA:CPU copies reshaped stacks
  whole on every trip (the 70B's update by layer: 104 -> 522 GB compiled).
  """

  def __init__(self, plan: zero.ZeroPlan, params: PyTree, opt_state: PyTree,
               length: int, rows: bool = False):
    self.as_rows = rows
    stacked = lambda m, x: bool(m) and x.shape[0] == length
    self.in_loop = jax.tree.map(stacked, plan.per_layer, params)
    self.opt_in_loop = jax.tree.map(stacked, plan.opt_per_layer, opt_state)
    self.mirrored = plan.opt_mirrors
    layer = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    self.shapes, self.opt_shapes = jax.tree.map(layer, params), jax.tree.map(layer, opt_state)

  def rows(self, tree: PyTree) -> PyTree:
    """A params-like tree as the loop carries it: this loop's stacks as rows (`rows`)."""
    return (_rows if self.as_rows else _no_rows)(tree, self.in_loop)

  def state_rows(self, tree: PyTree) -> PyTree:
    return (_rows if self.as_rows else _no_rows)(tree, self.opt_in_loop)

  def from_rows(self, tree: PyTree) -> PyTree:
    return (_unrows if self.as_rows else _no_rows)(tree, self.in_loop, self.shapes)

  def state_from_rows(self, tree: PyTree) -> PyTree:
    return (_unrows if self.as_rows else _no_rows)(tree, self.opt_in_loop, self.opt_shapes)

  def params(self, tree: PyTree, i: jax.Array) -> PyTree:
    """Layer i of a params-like tree in rows."""
    return jax.tree.map(lambda x, m, like: _index(x, i).reshape(like.shape) if m else _empty(x),
                        tree, self.in_loop, self.shapes)

  def state(self, tree: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(
        lambda x, m, mirror, like: (_index(x, i).reshape(like.shape) if m else
                                    _empty(x) if mirror else x),
        tree, self.opt_in_loop, self.mirrored, self.opt_shapes)

  def put(self, tree: PyTree, new: PyTree, i: jax.Array) -> PyTree:
    return _put(tree, new, self.in_loop, i)

  def put_state(self, tree: PyTree, new: PyTree, i: jax.Array) -> PyTree:
    return _put(tree, new, self.opt_in_loop, i)


def _rows(tree: PyTree, mask: PyTree) -> PyTree:
  return jax.tree.map(lambda x, m: x.reshape(x.shape[0], -1) if m else x, tree, mask)


def _no_rows(tree: PyTree, *_) -> PyTree:
  return tree


def _unrows(tree: PyTree, mask: PyTree, layers: PyTree) -> PyTree:
  return jax.tree.map(lambda x, m, like: x.reshape(x.shape[0], *like.shape) if m else x,
                      tree, mask, layers)


def _index(x: jax.Array, i: jax.Array) -> jax.Array:
  return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _put(tree: PyTree, new: PyTree, mask: PyTree, i: jax.Array) -> PyTree:
  """Writes layer i of each masked leaf (a stack, or rows) in place."""
  return jax.tree.map(
      lambda x, n, m: jax.lax.dynamic_update_index_in_dim(x, n.reshape(x.shape[1:]), i, 0)
      if m else x, tree, new, mask)
