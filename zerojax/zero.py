"""The ZeRO plan: which dimension of which leaf is sharded, and where it is gathered.

One plan serves all four stages. For every parameter leaf it fixes a *shard
dimension* (or none, for small or indivisible leaves) and whether the model gathers it
one layer at a time inside its scan. The stage then only decides who uses those
dimensions:

| stage | params   | gradients (after reduction)  | optimizer state |
| ----- | -------- | ---------------------------- | --------------- |
| 0     | replicated | replicated (all-reduce)    | replicated      |
| 1     | replicated | replicated (all-reduce)    | sharded         |
| 2     | replicated | sharded (reduce-scatter)   | sharded         |
| 3     | sharded    | sharded (reduce-scatter)   | sharded         |

At stage 3 the train step hands the model `Sharded` leaves for the layer-stacked
parameters; the model calls `gather` on one layer's slice inside its scan body. The
gather is an all-gather in the parameter dtype whose backward pass upcasts the
cotangent to the reduce dtype and reduce-scatters it, so neither the whole gathered
model nor its whole gradient is ever alive at once.
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.mesh import MESH_AXES

PyTree = Any

# Logical axis name of the stacked-layers dimension (flax's nn.scan convention). A leaf
# with this axis is gathered per layer at stage 3 and never sharded along it.
LAYERS_AXIS = "layers"


@jax.tree_util.register_pytree_node_class
class Sharded:
  """A stage-3 parameter shard that the model must `gather` before use.

  Attributes:
    value: the local shard, in the reduce dtype (the step differentiates with respect
      to it, so its gradient comes back already reduce-scattered).
    dim: the sharded dimension counted from the end (negative), so it stays right
      after `lax.scan` slices off the leading layers axis.
    axes: mesh axes the leaf is sharded over.
    dtype: the dtype the gathered parameter is used in.
  """

  def __init__(self, value: jax.Array, dim: int, axes: tuple[str, ...], dtype: Any):
    self.value, self.dim, self.axes, self.dtype = value, dim, axes, dtype

  def tree_flatten(self):
    return (self.value,), (self.dim, self.axes, self.dtype)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self):
    return f"Sharded({getattr(self.value, 'shape', '?')}, dim={self.dim}, axes={self.axes})"

  def __jax_array__(self):
    raise TypeError(
        "a stage-3 parameter shard was used without zerojax.gather(): call "
        "`zerojax.gather(layer_params)` on each layer's params inside the scan body")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather(x: jax.Array, dim: int, axes: tuple[str, ...], dtype: Any) -> jax.Array:
  return jax.lax.all_gather(x.astype(dtype), axes, axis=dim, tiled=True)


def _all_gather_fwd(x, dim, axes, dtype):
  # The residual is a zero-size array that only carries the primal's dtype.
  return _all_gather(x, dim, axes, dtype), jnp.zeros((0,), x.dtype)


def _all_gather_bwd(dim, axes, dtype, like, cotangent):
  del dtype
  # The primal is in the reduce dtype, so the cotangent is upcast *before* the
  # reduction: the sum over devices happens in fp32 even though the gather was bf16.
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
    The same tree with each `Sharded` leaf replaced by the whole parameter in its
    compute dtype (shape of the unsharded leaf).
  """
  def one(leaf):
    if not isinstance(leaf, Sharded):
      return leaf
    return gather_leaf(leaf.value, leaf.value.ndim + leaf.dim, leaf.axes, leaf.dtype)
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, Sharded))


def gather_leaf(x: jax.Array, dim: int, axes: tuple[str, ...], dtype: Any) -> jax.Array:
  """All-gathers a shard in `dtype`; its gradient is reduce-scattered in `x.dtype`."""
  return _all_gather(x, dim, tuple(axes), jnp.dtype(dtype))


def scan_layers(fn: Any, params: PyTree, carry: PyTree, *args: Any) -> PyTree:
  """`carry = fn(gather(params[i]), carry, *args)` for each layer i, rematerialized.

  The layer loop of a stage-3 model with full remat (each layer's input is saved, its
  forward recomputed in the backward pass, its weights gathered again there), as
  `lax.scan` under `jax.checkpoint(policy=nothing_saveable)` would run it, with one
  difference in memory: the backward pass writes layer i's gradient into the buffer
  of the stacked `params` themselves, slice i, once layer i is done with them. The
  train step differentiates with respect to fp32 params (so that every reduction is
  fp32); JAX's own scan transpose would keep that fp32 copy of the model alive next to
  a second, zero-initialised fp32 array for the gradients (4 bytes per param more
  than needed). Here the two share one buffer: XLA updates it in place.

  Args:
    fn: `(layer_params, carry, *args) -> carry`, one layer (plain arrays: gathered).
    params: the stacked layer params (leading axis: layers); leaves may be `Sharded`.
    carry: the layer input (e.g. the residual stream), any pytree.
    *args: other inputs every layer sees (e.g. rotary tables), differentiable.

  Returns:
    The last layer's output carry.
  """
  return _scan_layers(fn, params, carry, args)


def _layer(tree: PyTree, i: jax.Array) -> PyTree:
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _to_bits(x):
  """The saved layer inputs are kept as their bits (unsigned ints of the same width):
  XLA:CPU would otherwise turn "slice, then upcast to fp32" in the backward loop into
  "upcast the whole stack" and hoist that out of the loop (loop-invariant code motion),
  an fp32 copy of every layer's input."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _from_bits(bits, like):
  return bits if bits.dtype == like.dtype else jax.lax.bitcast_convert_type(bits, like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan_layers(fn, params, carry, args):
  return jax.lax.scan(lambda c, p: (fn(gather(p), c, *args), None), carry, params)[0]


def _scan_layers_fwd(fn, params, carry, args):
  # Saves each layer's input carry, as full remat does; `params` is an input already.
  out, inputs = jax.lax.scan(
      lambda c, p: (fn(gather(p), c, *args), jax.tree.map(_to_bits, c)), carry, params)
  return out, (params, inputs, args)


def _scan_layers_bwd(fn, residuals, ct):
  params, inputs, args = residuals
  layers = jax.tree.leaves(params)[0].shape[0]
  layer_fn = lambda p, c, a: fn(gather(p), c, *a)
  put = lambda tree, new, i: jax.tree.map(
      lambda x, n: jax.lax.dynamic_update_index_in_dim(x, n.astype(x.dtype), i, 0), tree, new)

  def body(k, state):
    ct, grads, pending, ct_args = state
    i = layers - 1 - k
    # The gradient of layer i + 1 (the previous iteration's) is written first and layer
    # i's params are read from the result: the read depends on the write, so XLA
    # updates the buffer in place. Written after the read, some gradients would not
    # depend on it (a down projection's does not use its own weights), and XLA, unable
    # to order the two, would copy the whole stack every layer. At k = 0 the index is
    # clamped to the last layer, whose params `pending` holds unchanged.
    grads = put(grads, pending, jnp.minimum(i + 1, layers - 1))
    x = jax.tree.map(_from_bits, _layer(inputs, i), ct)
    _, vjp = jax.vjp(layer_fn, _layer(grads, i), x, args)
    pending, ct, d_args = vjp(ct)
    ct_args = jax.tree.map(lambda a, d: a + d.astype(a.dtype), ct_args, d_args)
    return ct, grads, pending, ct_args

  zeros = jax.tree.map(jnp.zeros_like, args)
  ct, grads, pending, ct_args = jax.lax.fori_loop(
      0, layers, body, (ct, params, _layer(params, layers - 1), zeros))
  return put(grads, pending, 0), ct, ct_args


_scan_layers.defvjp(_scan_layers_fwd, _scan_layers_bwd)


def flax_logical_axes(boxed_params: PyTree) -> PyTree:
  """Axis names of flax params boxed by `nn.with_logical_partitioning` (or `nn.Partitioned`).

  Args:
    boxed_params: params as `model.init` returns them (or `jax.eval_shape` of it),
      before `nn.unbox`.

  Returns:
    A pytree matching the unboxed params whose leaves are tuples of axis names (None
    for a leaf without metadata), for `make_plan(logical_axes=...)`. `nn.scan` with
    `metadata_params={nn.PARTITION_NAME: 'layers'}` adds the 'layers' axis.
  """
  boxed = lambda x: isinstance(x, nn.Partitioned)
  return jax.tree.map(lambda x: tuple(x.names) if boxed(x) else None, boxed_params,
                      is_leaf=boxed)


def shard_dim(shape: tuple[int, ...], names: tuple[str | None, ...] | None,
              num_shards: int, min_size: int) -> int | None:
  """The dimension to shard a leaf along, or None to keep it replicated.

  The largest dimension divisible by `num_shards`, never the stacked-layers axis (a
  scan slices it; each layer must keep its own shard). Leaves under `min_size`
  elements stay replicated: sharding them saves little and costs a collective each.
  """
  if num_shards == 1 or math.prod(shape) < max(min_size, 1):
    return None
  candidates = [d for d, n in enumerate(shape)
                if n % num_shards == 0 and not (names and names[d] == LAYERS_AXIS)]
  if not candidates:
    return None
  return max(candidates, key=lambda d: (shape[d], -d))


def _spec(ndim: int, dim: int | None, axes: tuple[str, ...]) -> P:
  if dim is None:
    return P()
  entries = [None] * ndim
  entries[dim] = axes if len(axes) > 1 else axes[0]
  return P(*entries)


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
  """Where every leaf of the train state lives, for one ZeRO stage.

  Build it with `make_plan`. All fields are data; the specs derive from them.

  Attributes:
    mesh: the device mesh.
    stage: ZeRO stage, 0 to 3.
    shard_axes: mesh axes ZeRO shards over (default ('fsdp',)).
    data_axes: mesh axes the batch is split over (all of them).
    params: the parameters' shapes and dtypes (`jax.ShapeDtypeStruct` tree).
    opt_state: the optimizer state's shapes and dtypes.
    param_dims: per parameter leaf, the dimension it is sharded along (None: kept
      replicated at every stage).
    per_layer: per parameter leaf, True if the model gathers it one layer at a time
      inside a scan (stage 3); other sharded leaves are gathered before the loss.
    opt_dims: per optimizer-state leaf, the dimension it is sharded along at stages
      >= 1 (leaves that mirror a parameter follow it; scalars are None).
  """
  mesh: Mesh
  stage: int
  shard_axes: tuple[str, ...]
  data_axes: tuple[str, ...]
  params: PyTree
  opt_state: PyTree
  param_dims: PyTree
  per_layer: PyTree
  opt_dims: PyTree

  @property
  def num_shards(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.shard_axes)

  @property
  def num_data(self) -> int:
    """Devices the batch is split over."""
    return math.prod(self.mesh.shape[a] for a in self.data_axes)

  @property
  def replica_axes(self) -> tuple[str, ...]:
    """Axes that hold copies of the same shard (the 'data' axis of a hybrid mesh)."""
    return tuple(a for a in self.data_axes if a not in self.shard_axes)

  def _specs(self, dims: PyTree, like: PyTree, sharded: bool) -> PyTree:
    return jax.tree.map(
        lambda d, x: _spec(len(x.shape), d if sharded else None, self.shard_axes),
        dims, like, is_leaf=lambda d: d is None)

  @property
  def param_specs(self) -> PyTree:
    """PartitionSpecs of the stored parameters: sharded at stage 3 only."""
    return self._specs(self.param_dims, self.params, self.stage >= 3)

  @property
  def grad_specs(self) -> PyTree:
    """PartitionSpecs of the reduced gradients: sharded from stage 1 (stage 1 scatters
    once after accumulating, stage 2 every microbatch)."""
    return self._specs(self.param_dims, self.params, self.stage >= 1)

  @property
  def update_specs(self) -> PyTree:
    """PartitionSpecs the optimizer update runs in: each device its shard from stage 1."""
    return self._specs(self.param_dims, self.params, self.stage >= 1)

  @property
  def opt_specs(self) -> PyTree:
    """PartitionSpecs of the optimizer state: sharded from stage 1."""
    return self._specs(self.opt_dims, self.opt_state, self.stage >= 1)

  def opt_like(self, tree: PyTree, other: Any) -> PyTree:
    """A tree shaped like the optimizer state, from one shaped like the params.

    Each subtree of the state that mirrors the params (Adam's mu, a Kahan buffer) gets
    `tree`; every other state leaf (a step count) gets `other`.
    """
    mirrors = lambda t: _mirrors(t, self.params)
    return jax.tree.map(lambda t: tree if mirrors(t) else other, self.opt_state,
                        is_leaf=mirrors)

  @property
  def opt_per_layer(self) -> PyTree:
    """Per optimizer-state leaf: True if it mirrors a layer-stacked param leaf."""
    return self.opt_like(self.per_layer, False)

  @property
  def batch_spec(self) -> P:
    """Every batch leaf is split along its leading (example) dimension."""
    return P(self.data_axes)

  def shardings(self, specs: PyTree) -> PyTree:
    """NamedShardings on the plan's mesh for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))


def _mirrors(tree: PyTree, params: PyTree) -> bool:
  """True if `tree` has the structure and leaf shapes of `params` (a moment, say)."""
  try:
    if jax.tree.structure(tree) != jax.tree.structure(params):
      return False
  except Exception:  # pylint: disable=broad-except
    return False
  return all(getattr(a, "shape", None) == b.shape
             for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(params)))


def make_plan(mesh: Mesh, stage: int, params: PyTree,
              tx: optax.GradientTransformation | None = None, *,
              opt_state: PyTree | None = None,
              logical_axes: PyTree | None = None,
              min_shard_size: int = 4096,
              shard_axes: tuple[str, ...] = ("fsdp",)) -> ZeroPlan:
  """Plans the sharding of a parameter pytree and its optimizer state.

  Args:
    mesh: the device mesh (see `zerojax.mesh.make_mesh`).
    stage: ZeRO stage, 0 to 3.
    params: the parameters, or their shapes (`jax.eval_shape(init_fn, rng)`): any
      pytree of arrays / `jax.ShapeDtypeStruct`s.
    tx: the optimizer; its state's shapes come from `jax.eval_shape(tx.init, params)`.
    opt_state: the optimizer state (or shapes) instead of `tx`.
    logical_axes: optional pytree matching `params` whose leaves are tuples of axis
      names, one per dimension (as flax's `nn.get_partition_spec` gives). A leaf with a
      'layers' axis is gathered per layer at stage 3 and never sharded along that axis.
    min_shard_size: leaves with fewer elements stay replicated.
    shard_axes: mesh axes to shard over; ('data', 'fsdp') shards over every device.

  Returns:
    The `ZeroPlan`.

  Raises:
    ValueError: for a stage outside 0-3, unknown axes, or mismatched `logical_axes`.
  """
  if stage not in (0, 1, 2, 3):
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
  unknown = set(shard_axes) - set(mesh.axis_names)
  if unknown:
    raise ValueError(f"shard axes {sorted(unknown)} are not mesh axes {mesh.axis_names}")
  data_axes = tuple(a for a in mesh.axis_names if a in MESH_AXES)
  shards = math.prod(mesh.shape[a] for a in shard_axes)
  if logical_axes is None:
    logical_axes = jax.tree.map(lambda _: None, params)
  is_names = lambda x: x is None or (isinstance(x, tuple) and all(
      n is None or isinstance(n, str) for n in x))
  try:
    names = jax.tree.map(lambda n, _: n, logical_axes, params, is_leaf=is_names)
  except ValueError as e:
    raise ValueError(f"logical_axes does not match the params tree: {e}") from None

  def leaf_dim(x, n):
    if n is not None and len(n) != len(x.shape):
      raise ValueError(f"logical axes {n} do not fit a leaf of shape {x.shape}")
    return shard_dim(tuple(x.shape), n, shards, min_shard_size)

  param_dims = jax.tree.map(leaf_dim, params, names, is_leaf=is_names)
  per_layer = jax.tree.map(lambda n, _: bool(n and LAYERS_AXIS in n), names, params,
                           is_leaf=is_names)
  if opt_state is None:
    opt_state = jax.eval_shape(tx.init, params) if tx is not None else ()
  # A subtree of the state that mirrors the params (Adam's mu and nu, a Kahan buffer)
  # follows the param rule, so the update on a shard meets the same shard of its
  # moments; any other float leaf gets the generic rule by shape; integer leaves
  # (step counts, PRNG keys) stay replicated.
  mirrors = lambda t: _mirrors(t, params)

  def opt_dim(t):
    if mirrors(t):
      return param_dims
    if not jnp.issubdtype(t.dtype, jnp.floating):  # Counts and PRNG keys.
      return None
    return shard_dim(tuple(t.shape), None, shards, min_shard_size)

  opt_dims = jax.tree.map(opt_dim, opt_state, is_leaf=mirrors)
  abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  return ZeroPlan(mesh=mesh, stage=stage, shard_axes=tuple(shard_axes),
                  data_axes=data_axes, params=abstract(params),
                  opt_state=abstract(opt_state), param_dims=param_dims,
                  per_layer=per_layer, opt_dims=opt_dims)


def local_shape(shape: tuple[int, ...], dim: int | None, num_shards: int) -> tuple[int, ...]:
  """The shape of one device's shard of a leaf sharded along `dim`."""
  if dim is None:
    return tuple(shape)
  return tuple(n // num_shards if d == dim else n for d, n in enumerate(shape))

