"""The stage-3 runtime: parameter shards the model gathers where it uses them.

At ZeRO stage 3 the train step hands the model `Sharded` leaves for its layer-stacked
parameters; the model calls `gather` on one layer's slice inside its scan body (or runs
its layers with `scan_layers`, which does so and saves memory in the backward pass).
The gather is an all-gather in the parameter dtype whose backward pass upcasts the
cotangent to the reduce dtype and reduce-scatters it, so neither the whole gathered
model nor its whole gradient is ever alive at once. Outside a stage-3 step there are no
`Sharded` leaves and `gather` is the identity, so models stay usable without zerojax.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from zerojax import streaming
from zerojax.runtime import platform

PyTree = Any


@jax.tree_util.register_pytree_node_class
class Sharded:
  """A stage-3 parameter shard that the model must `gather` before use.

  Attributes:
    value: the local shard, in the reduce dtype (the step differentiates with respect
      to it, so its gradient comes back already reduce-scattered).
    dim: the sharded dimension counted from the end (negative), so it stays right
      after `lax.scan` slices off the leading layers axis.
    axes: mesh axes the leaf is sharded over.
    dtype: the dtype the parameter is gathered in (its stored dtype).
    upcast: hand the model the gathered parameter in `value`'s dtype (its values
      `dtype`'s), not in `dtype`: see `gather_leaf`.
  """

  def __init__(self, value: jax.Array, dim: int, axes: tuple[str, ...], dtype: Any,
               upcast: bool = False):
    self.value, self.dim, self.axes, self.dtype, self.upcast = value, dim, axes, dtype, upcast

  def tree_flatten(self):
    return (self.value,), (self.dim, self.axes, self.dtype, self.upcast)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self):
    return f"Sharded({getattr(self.value, 'shape', '?')}, dim={self.dim}, axes={self.axes})"

  def __jax_array__(self):
    raise TypeError(
        "a stage-3 parameter shard was used without zerojax.gather(): call "
        "`zerojax.gather(layer_params)` on each layer's params inside the scan body")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _all_gather(x: jax.Array, dim: int, axes: tuple[str, ...], dtype: Any,
                upcast: bool) -> jax.Array:
  whole = jax.lax.all_gather(x.astype(dtype), axes, axis=dim, tiled=True)
  return whole.astype(x.dtype) if upcast else whole


def _all_gather_fwd(x, dim, axes, dtype, upcast):
  # The residual is a zero-size array that only carries the primal's dtype.
  return _all_gather(x, dim, axes, dtype, upcast), jnp.zeros((0,), x.dtype)


def _all_gather_bwd(dim, axes, dtype, upcast, like, cotangent):
  del dtype, upcast
  # The primal is in the reduce dtype, so the cotangent is upcast *before* the
  # reduction: the sum over devices happens in fp32 even though the gather was bf16.
  # (With `upcast` it arrives in fp32: the model's weight gradients were never bf16.)
  return (jax.lax.psum_scatter(cotangent.astype(like.dtype), axes,
                               scatter_dimension=dim, tiled=True),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


def gather(tree: PyTree) -> PyTree:
  """Gathers every `Sharded` leaf of `tree`; other leaves pass through unchanged.

  Call it on one layer's parameters inside the scan body. Outside a stage-3 step the
  tree holds no `Sharded` leaves and this is the identity, so models stay usable
  without zerojax. Wrap the scan body in `jax.checkpoint` with a policy that does not
  save the gathered weights (`nothing_saveable`, `dots_with_no_batch_dims_saveable`):
  without it the backward pass keeps every layer's gathered weights alive, which is
  the whole model again.

  Args:
    tree: a pytree whose leaves are arrays or `Sharded`.

  Returns:
    The same tree with each `Sharded` leaf replaced by the whole parameter (shape of
    the unsharded leaf) in its stored dtype, or with `upcast` in the shard's.
  """
  def one(leaf):
    if not isinstance(leaf, Sharded):
      return leaf
    # An offloaded layer (`zero.param_offload`) comes to the device first.
    value = streaming.on_device(leaf.value)
    return gather_leaf(value, value.ndim + leaf.dim, leaf.axes, leaf.dtype, leaf.upcast)
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, Sharded))


def gather_leaf(x: jax.Array, dim: int, axes: tuple[str, ...], dtype: Any,
                upcast: bool = False) -> jax.Array:
  """All-gathers a shard in `dtype`; its gradient is reduce-scattered in `x.dtype`.

  Args:
    x: this device's shard, in the reduce dtype (fp32; its values `dtype`'s).
    dim: the dimension the shards are concatenated along.
    axes: the mesh axes to gather over.
    dtype: the dtype on the wire (the stored param dtype, e.g. bf16).
    upcast: return the whole param in `x.dtype` (fp32 holding `dtype`'s values), not
      in `dtype`. The gradient of its uses then reaches the reduce-scatter in fp32: a
      model that casts the weight to its compute dtype inside a matmul whose weight
      gradient it emits in the weight's dtype (`zerojax.models.llama.cast_matmul`)
      never rounds a layer's local gradient to bf16 (docs/design/precision.md).

  Returns:
    The whole param, in `dtype` (or `x.dtype` with `upcast`).
  """
  return _all_gather(x, dim, tuple(axes), jnp.dtype(dtype), upcast)


def after(tree: PyTree, deps: PyTree) -> PyTree:
  """`tree`, computed on XLA:CPU only once every leaf of `deps` is; elsewhere `tree`.

  XLA:CPU orders the collectives of one loop body among themselves and those outside
  every loop among themselves, but not the two with each other (its while thunk does
  not hold the collectives' ordering resource): a gather of a whole leaf (the head)
  that neither needs nor feeds the layer loop runs on one device while that device's
  loop gathers a layer, in another order on another device, and the step deadlocks
  ("Expected 4 threads to join the rendezvous, but only 3 of them arrived") once each
  of XLA's threads waits in one (docs/design/cpu-collectives.md). An
  `optimization_barrier` does not order them: XLA:CPU drops it before it emits the
  program. A data dependency does: `tree` passes through a select on a predicate that
  is true at run time but that XLA cannot prove true, computed from one element of
  each leaf of `deps` (a slice and a compare per leaf, one select per element of
  `tree`). XLA:GPU issues collectives in stream order: nothing changes there, a GPU
  target's compile included.

  Args:
    tree: a pytree of arrays (any dtypes).
    deps: a pytree of arrays; only their first elements are read, not differentiated.

  Returns:
    `tree`'s values.
  """
  deps = [d for d in jax.tree.leaves(deps) if d.size]
  if platform.backend() != "cpu" or not deps or not jax.tree.leaves(tree):
    return tree
  pred = jnp.bool_(True)
  for d in deps:
    first = jax.lax.stop_gradient(d).reshape(-1)[0]
    if jnp.issubdtype(first.dtype, jnp.floating):  # Its bits: a NaN must not matter.
      first = jax.lax.bitcast_convert_type(first, jnp.dtype(f"uint{first.dtype.itemsize * 8}"))
    pred = pred & ((first.astype(jnp.uint32) | 1) != 0)  # Always true.
  return jax.tree.map(lambda x: jnp.where(pred, x, jnp.zeros_like(x)), tree)


@jax.custom_vjp
def before_loops(whole: PyTree, stacks: PyTree) -> tuple[PyTree, PyTree]:
  """(`whole`, `stacks`) as they are; on XLA:CPU the cotangents of `whole` wait for
  those of `stacks` (`after`), so the reduce-scatters of the whole leaves' gathers
  run after the backward layer loop, not beside it."""
  return whole, stacks


def _before_loops_fwd(whole, stacks):
  return (whole, stacks), None


def _before_loops_bwd(_, cts):
  ct_whole, ct_stacks = cts
  return after(ct_whole, ct_stacks), ct_stacks


before_loops.defvjp(_before_loops_fwd, _before_loops_bwd)


def scan_layers(fn: Any, params: PyTree, carry: PyTree, *args: Any, policy: Any = None,
                offload: bool = False) -> PyTree:
  """`carry = fn(gather(params[i]), carry, *args)` for each layer i, rematerialized.

  The layer loop of a stage-3 model under remat (each layer's input and what `policy`
  saves are kept, the rest of its forward recomputed in the backward pass, its weights
  gathered again there), as `lax.scan` under `jax.checkpoint(policy=policy)` would run
  it, with one difference in memory: the backward pass writes layer i's gradient into
  the buffer of the stacked `params` themselves, slice i, once layer i is done with
  them. The train step differentiates with respect to fp32 params (so that every
  reduction is fp32); JAX's own scan transpose would keep that fp32 copy of the model
  alive next to a second, zero-initialised fp32 array for the gradients (4 bytes per
  param more than needed). Here the two share one buffer: XLA updates it in place.

  Args:
    fn: `(layer_params, carry, *args) -> carry`, one layer (plain arrays: gathered).
    params: the stacked layer params (leading axis: layers); leaves may be `Sharded`.
    carry: the layer input (e.g. the residual stream), any pytree.
    *args: other inputs every layer sees (e.g. rotary tables), differentiable.
    policy: a `jax.checkpoint` policy, what each layer saves besides its input (e.g.
      `zerojax.models.remat.policy(name)`); None saves nothing else (full remat).
    offload: keep what each layer saves in pinned host memory between the passes
      (activation offload, `zerojax.streaming`): moved there as the layer's forward pass
      ends, back one layer ahead in the backward pass.

  Returns:
    The last layer's output carry.
  """
  return _scan_layers(fn, policy or jax.checkpoint_policies.nothing_saveable, offload,
                      params, carry, args)


def _layer_residuals(fn, policy, p, c, args):
  """One layer's output and the residuals of its vjp under remat `policy`: (output,
  residual leaves, their treedef, indices of the leaves to save per layer).

  Which residuals a layer needs is JAX's to decide (its inputs, what the policy saves);
  those that are the layer's own params or the shared `args` are not saved per layer:
  the backward pass passes in the params from the stack and `args` as given.
  """
  layer = jax.checkpoint(lambda p, c, a: fn(gather(p), c, *a), policy=policy,
                         prevent_cse=False)
  out, vjp = jax.vjp(layer, p, c, args)
  leaves, tree = jax.tree.flatten(vjp)
  given = {id(x) for x in jax.tree.leaves((p, args))}
  saved = [k for k, x in enumerate(leaves) if id(x) not in given]
  return out, leaves, tree, saved


def _layer(tree: PyTree, i: jax.Array) -> PyTree:
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def to_bits(x):
  """The saved layer inputs are kept as their bits (unsigned ints of the same width):
  XLA:CPU would otherwise turn "slice, then upcast to fp32" in the backward loop into
  "upcast the whole stack" and hoist that out of the loop (loop-invariant code motion),
  an fp32 copy of every layer's input."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def from_bits(bits, like):
  return bits if bits.dtype == like.dtype else jax.lax.bitcast_convert_type(bits, like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _scan_layers(fn, policy, offload, params, carry, args):
  del offload
  return jax.lax.scan(lambda c, p: (fn(gather(p), c, *args), None), carry, params)[0]


def _scan_layers_fwd(fn, policy, offload, params, carry, args):
  def body(c, p):
    out, leaves, _, saved = _layer_residuals(fn, policy, p, c, args)
    return out, streaming.outbound([to_bits(leaves[k]) for k in saved], offload)

  out, stacked = jax.lax.scan(body, carry, params)
  return out, (params, stacked, args)


def _scan_layers_bwd(fn, policy, offload, residuals, ct):
  params, stacked, args = residuals
  layers = jax.tree.leaves(params)[0].shape[0]
  put = lambda tree, new, i: jax.tree.map(
      lambda x, n: jax.lax.dynamic_update_index_in_dim(x, n.astype(x.dtype), i, 0), tree, new)

  def body(i, layer_saved, state):
    ct, grads, pending, ct_args = state
    # The gradient of layer i + 1 (the previous iteration's) is written first and layer
    # i's params are read from the result: the read depends on the write, so XLA
    # updates the buffer in place. Written after the read, some gradients would not
    # depend on it (a down projection's does not use its own weights), and XLA, unable
    # to order the two, would copy the whole stack every layer. On the first trip the
    # index is clamped to the last layer, whose params `pending` holds unchanged.
    grads = put(grads, pending, jnp.minimum(i + 1, layers - 1))
    p = _layer(grads, i)
    # The layer's vjp, its saved residuals put back in: tracing it again gives the
    # residuals' structure; its forward is dead code (XLA removes it).
    _, leaves, tree, saved = _layer_residuals(fn, policy, p, jax.tree.map(jnp.zeros_like, ct),
                                              args)
    for k_saved, bits in zip(saved, layer_saved, strict=True):
      leaves[k_saved] = from_bits(bits, leaves[k_saved])
    pending, ct, d_args = jax.tree.unflatten(tree, leaves)(ct)
    ct_args = jax.tree.map(lambda a, d: a + d.astype(a.dtype), ct_args, _floats(d_args))
    return ct, grads, pending, ct_args

  zeros = jax.tree.map(jnp.zeros_like, _floats(args))
  ct, grads, pending, ct_args = streaming.backward_layers(
      body, (ct, params, _layer(params, layers - 1), zeros), stacked, layers, offload)
  return put(grads, pending, 0), ct, ct_args


def _floats(tree: PyTree) -> PyTree:
  """`tree` with its non-float leaves (e.g. segment ids, whose cotangent is float0) as
  None: no cotangent to sum, and None is a zero cotangent to `custom_vjp`."""
  return jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else None, tree)


_scan_layers.defvjp(_scan_layers_fwd, _scan_layers_bwd)
