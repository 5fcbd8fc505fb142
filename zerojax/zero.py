"""The ZeRO plan: which dimension of which leaf is sharded, and who uses those dimensions.

One plan serves all four stages. For every parameter leaf it fixes a *shard
dimension* (or none, for small or indivisible leaves) and whether the model gathers it
one layer at a time inside its scan. The stage then only decides what is sharded and
how the gradient is reduced, and `StageBehaviour` says so in words the step, the
planner (`zerojax.memory`) and its report all read:

| stage | params     | gradient reduction (accumulated over microbatches)        | optimizer state |
| ----- | ---------- | --------------------------------------------------------- | --------------- |
| 0     | replicated | all-reduce once (`psum`)                                  | replicated      |
| 1     | replicated | reduce-scatter once (`psum_scatter_once`)                 | sharded         |
| 2     | replicated | reduce-scatter each microbatch into a sharded accumulator | sharded         |
| 3     | sharded    | reduce-scatter inside the gather's backward pass          | sharded         |

From stage 1 each device updates only its shard, so it needs only its shard of the
summed gradient: a reduce-scatter, half an all-reduce's traffic on the wire. With one
shard nothing is sharded or gathered and every stage runs as stage 0 does.

The stage-3 runtime (`Sharded`, `gather`, `scan_layers`) is `zerojax.stage3`'s.
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.mesh import EXPERT_AXIS, MESH_AXES

PyTree = Any

# Logical axis name of the stacked-layers dimension (flax's nn.scan convention). A leaf
# with this axis is gathered per layer at stage 3 and never sharded along it.
LAYERS_AXIS = "layers"
# Logical axis name of a mixture-of-experts block's expert dimension. On a mesh with an
# 'expert' axis a leaf with it is split along it over that axis at every stage (each
# device holds its experts: expert parallelism), and ZeRO shards it over the other
# shard axes along another dimension.
EXPERTS_AXIS = "experts"
# The memory kind of offloaded optimizer state: page-locked host memory, which the
# device reads and writes by DMA (an unpinned buffer would be staged through a copy).
HOST_MEMORY = "pinned_host"


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

  The first (most major) dimension divisible by `num_shards`, never the stacked-layers
  axis (a scan slices it; each layer must keep its own shard) nor the experts axis (the
  expert axis splits it). A shard of the most major dimension is one contiguous block of
  the row-major leaf (of each layer's slice, for a stack), so its all-gather and
  reduce-scatter move whole blocks; sharded along a minor one, XLA's GPU compiler lays
  the reduce-scattered gradients out transposed and copies them back after the layer
  loop (the 8B's MLP stacks on h100:8: 17.84 GiB compiled against 17.23 along the major
  dimension). Leaves under `min_size` elements stay replicated: sharding them saves
  little and costs a collective each.
  """
  if num_shards == 1 or math.prod(shape) < max(min_size, 1):
    return None
  candidates = [d for d, n in enumerate(shape) if n % num_shards == 0
                and not (names and names[d] in (LAYERS_AXIS, EXPERTS_AXIS))]
  if not candidates:
    return None
  return min(candidates)


@dataclasses.dataclass(frozen=True)
class StageBehaviour:
  """What a ZeRO stage does, in words: one definition for the step, planner and report.

  Build it with `StageBehaviour.of(stage, num_shards)`; `ZeroPlan.behaviour` is the
  plan's. The planner makes one from a config without building a plan.

  Attributes:
    stage: the stage that runs: the configured one, or 0 with one shard (nothing to
      shard, nothing to gather).
    shards_params: the stored params are sharded; the model gathers layer-stacked
      leaves one layer at a time (`zerojax.stage3.gather`), the others are gathered
      before the loss.
    shards_grads: the gradient is accumulated over microbatches in sharded form (each
      device holds its shard's sum, not the whole gradient).
    shards_opt_state: the optimizer state is sharded and the update runs per shard, on
      the shard of the reduced gradient it needs.
    grad_reduction: how the gradient is summed over the devices: 'psum' (all-reduce
      once, after the microbatches), 'psum_scatter_once' (reduce-scatter once, after
      them), 'psum_scatter_per_microbatch' (reduce-scatter each microbatch's gradient
      into the sharded accumulator), 'psum_scatter_in_gather' (in the backward pass
      of each gather, layer by layer for stacked leaves: never whole on a device).
  """
  stage: int
  shards_params: bool
  shards_grads: bool
  shards_opt_state: bool
  grad_reduction: str

  @classmethod
  def of(cls, stage: int, num_shards: int) -> "StageBehaviour":
    """The behaviour of `stage` over `num_shards` devices (the ZeRO axes' size)."""
    stage = stage if num_shards > 1 else 0
    reduction = ("psum", "psum_scatter_once", "psum_scatter_per_microbatch",
                 "psum_scatter_in_gather")[stage]
    return cls(stage=stage, shards_params=stage >= 3, shards_grads=stage >= 2,
               shards_opt_state=stage >= 1, grad_reduction=reduction)


def leaf_axes(mesh: Mesh, shard_axes: tuple[str, ...],
              expert_dim: int | None) -> tuple[str, ...]:
  """The ZeRO axes of a leaf: `shard_axes`, less 'expert' for an experts' kernel (one
  with an `expert_dim`), and less the axes of size 1 (unless none is larger: a spec then
  names no axis anyway)."""
  axes = tuple(a for a in shard_axes if expert_dim is None or a != EXPERT_AXIS)
  return tuple(a for a in axes if mesh.shape[a] > 1) or axes


def _spec(ndim: int, dim: int | None, axes: tuple[str, ...], expert_dim: int | None) -> P:
  if dim is None and expert_dim is None:
    return P()
  entries = [None] * ndim
  if dim is not None:
    entries[dim] = axes if len(axes) > 1 else axes[0]
  if expert_dim is not None:
    entries[expert_dim] = EXPERT_AXIS
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
    offload: the optimizer-state leaves that mirror the params (moments, Kahan /
      master buffers) live in host memory (`memory_kind='pinned_host'`); the update
      streams them to the device and back (`zerojax.streaming`). Scalars (counts) stay.
    sequence_axes: data axes each sequence is split over by position (sequence
      parallelism, `zerojax.sequence`); the examples are split over the others.
    param_offload: at stage 3, the layer-stacked parameter shards live in host memory
      (`param_shardings`); the step brings each layer to the device where it is used
      (`zerojax.streaming`). The other params (embedding, head, norms) stay.
    expert_dims: per parameter leaf, the dimension split over the mesh's 'expert' axis
      at every stage (an experts' kernel: expert parallelism), or None. Such a leaf is
      ZeRO-sharded over the shard axes less 'expert' (`leaf_axes`), and its gradient is
      never summed over 'expert' (each device holds other experts: `reduce_axes`).
    model_state: the shapes of the model's non-trainable state (linen collections such
      as `batch_stats`, NNX `BatchStat`s), replicated on every device and averaged over
      the data-parallel devices each step; None: the model has none.
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
  offload: bool = False
  sequence_axes: tuple[str, ...] = ()
  param_offload: bool = False
  expert_dims: PyTree = None
  model_state: PyTree = None

  @property
  def num_shards(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.shard_axes)

  def axes_of(self, expert_dim: int | None) -> tuple[str, ...]:
    """The ZeRO axes of a leaf (`leaf_axes`)."""
    return leaf_axes(self.mesh, self.shard_axes, expert_dim)

  def shards_of(self, expert_dim: int | None) -> int:
    """How many ZeRO shards a leaf has (`axes_of`'s devices)."""
    return math.prod(self.mesh.shape[a] for a in self.axes_of(expert_dim))

  def reduce_axes(self, expert_dim: int | None, scattered: bool) -> tuple[str, ...]:
    """The axes of size > 1 a gradient leaf is still summed over by an all-reduce: every
    data axis, less the leaf's ZeRO axes once a reduce-scatter over them is done
    (`scattered`), less 'expert' for an experts' kernel (each device holds its own)."""
    skip = set(self.axes_of(expert_dim)) if scattered else set()
    if expert_dim is not None:
      skip.add(EXPERT_AXIS)
    return tuple(a for a in self.data_axes if a not in skip and self.mesh.shape[a] > 1)

  @property
  def param_axes(self) -> PyTree:
    """Per parameter leaf, its ZeRO axes (`axes_of`)."""
    return jax.tree.map(self.axes_of, self.expert_dims, is_leaf=lambda d: d is None)

  @property
  def behaviour(self) -> StageBehaviour:
    """What is sharded and how gradients are reduced (see `StageBehaviour`)."""
    return StageBehaviour.of(self.stage, self.num_shards)

  @property
  def num_data(self) -> int:
    """Devices the batch is split over (by examples, or by positions too)."""
    return math.prod(self.mesh.shape[a] for a in self.data_axes)

  @property
  def example_axes(self) -> tuple[str, ...]:
    """Data axes the examples are split over: all but the sequence axes."""
    return tuple(a for a in self.data_axes if a not in self.sequence_axes)

  @property
  def num_examples(self) -> int:
    """Devices the examples are split over: the global batch must divide by this."""
    return math.prod(self.mesh.shape[a] for a in self.example_axes)

  @property
  def sequence_size(self) -> int:
    """Devices each sequence is split over (1: no sequence parallelism)."""
    return math.prod(self.mesh.shape[a] for a in self.sequence_axes)

  @property
  def replica_axes(self) -> tuple[str, ...]:
    """Axes that hold copies of the same shard (the 'data' axis of a hybrid mesh)."""
    return tuple(a for a in self.data_axes if a not in self.shard_axes)

  def _specs(self, dims: PyTree, expert_dims: PyTree, like: PyTree, sharded: bool) -> PyTree:
    is_dim = lambda d: d is None
    return jax.tree.map(
        lambda d, e, x: _spec(len(x.shape), d if sharded else None, self.axes_of(e), e),
        dims, expert_dims, like, is_leaf=is_dim)

  @property
  def param_specs(self) -> PyTree:
    """PartitionSpecs of the stored parameters."""
    return self._specs(self.param_dims, self.expert_dims, self.params,
                       self.behaviour.shards_params)

  @property
  def grad_specs(self) -> PyTree:
    """PartitionSpecs of the reduced gradients, which is also the layout the optimizer
    update runs in: sharded with the optimizer state, each device updating its shard."""
    return self._specs(self.param_dims, self.expert_dims, self.params,
                       self.behaviour.shards_opt_state)

  @property
  def opt_expert_dims(self) -> PyTree:
    """Per optimizer-state leaf, the dimension split over 'expert' (`expert_dims`)."""
    return self.opt_like(self.expert_dims, None)

  @property
  def opt_specs(self) -> PyTree:
    """PartitionSpecs of the optimizer state."""
    return self._specs(self.opt_dims, self.opt_expert_dims, self.opt_state,
                       self.behaviour.shards_opt_state)

  def opt_like(self, tree: PyTree, other: Any) -> PyTree:
    """A tree shaped like the optimizer state, from one shaped like the params.

    Each subtree of the state that mirrors the params (Adam's mu, a Kahan buffer) gets
    `tree`; every other state leaf (a step count) gets `other`.
    """
    mirrors = lambda t: _mirrors(t, self.params)
    return jax.tree.map(lambda t: tree if mirrors(t) else other, self.opt_state,
                        is_leaf=mirrors)

  @property
  def opt_mirrors(self) -> PyTree:
    """Per optimizer-state leaf: True if it mirrors a param leaf (layer-stacked or not)."""
    return self.opt_like(jax.tree.map(lambda _: True, self.per_layer), False)

  @property
  def opt_offloaded(self) -> PyTree:
    """Per optimizer-state leaf: True if it lives in host memory (see `offload`)."""
    return jax.tree.map(lambda m: m and self.offload, self.opt_mirrors)

  @property
  def opt_shardings(self) -> PyTree:
    """NamedShardings of the optimizer state: the one place its memory kind is set."""
    return self._placed(self.opt_specs, self.opt_offloaded)

  @property
  def param_offloaded(self) -> PyTree:
    """Per parameter leaf: True if it lives in host memory (see `param_offload`)."""
    return jax.tree.map(lambda m: m and self.param_offload, self.per_layer)

  @property
  def param_shardings(self) -> PyTree:
    """NamedShardings of the stored params: the one place their memory kind is set."""
    return self._placed(self.param_specs, self.param_offloaded)

  def _placed(self, specs: PyTree, host: PyTree) -> PyTree:
    """NamedShardings of `specs`, in pinned host memory where `host` says so."""
    return jax.tree.map(lambda s, h: s.with_memory_kind(HOST_MEMORY) if h else s,
                        self.shardings(specs), host)

  @property
  def opt_per_layer(self) -> PyTree:
    """Per optimizer-state leaf: True if it mirrors a layer-stacked param leaf."""
    return self.opt_like(self.per_layer, False)

  @property
  def batch_spec(self) -> P:
    """The global batch's layout: every leaf split along its leading (example) dimension."""
    return P(self.example_axes or None)

  @property
  def local_batch_spec(self) -> P:
    """The layout the step's `shard_map` takes the batch in: `batch_spec`, and with
    sequence parallelism each [B, T] leaf's positions split over the sequence axes."""
    return P(self.example_axes or None, self.sequence_axes) if self.sequence_axes else (
        self.batch_spec)

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
              shard_axes: tuple[str, ...] | None = None,
              offload: bool = False,
              sequence_axes: tuple[str, ...] = (),
              param_offload: bool = False,
              model_state: PyTree | None = None) -> ZeroPlan:
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
      'layers' axis is gathered per layer at stage 3 and never sharded along that axis;
      one with an 'experts' axis is split along it over the mesh's 'expert' axis.
    min_shard_size: leaves with fewer elements stay replicated.
    shard_axes: mesh axes to shard over; by default 'expert' and 'fsdp' (those the mesh
      has); ('data', 'expert', 'fsdp') shards over every device.
    offload: keep the optimizer state's param-shaped leaves in host memory.
    sequence_axes: mesh axes to split each sequence over (sequence parallelism;
      `zerojax.sequence`); the batch's examples are split over the other axes.
    param_offload: keep the layer-stacked params in host memory (stage 3 only).
    model_state: the model's non-trainable state, or its shapes (e.g. a linen model's
      `{'batch_stats': ...}` from `jax.eval_shape(model.init, ...)`): carried in
      `TrainState.model_state`, replicated, and handed to the loss function, whose new
      state the step averages over the data-parallel devices (`make_train_step`).

  Returns:
    The `ZeroPlan`.

  Raises:
    ValueError: for a stage outside 0-3, unknown axes, or mismatched `logical_axes`.
  """
  if stage not in (0, 1, 2, 3):
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
  if param_offload and stage != 3:
    raise ValueError(f"parameter offload streams stage 3's layers; this is stage {stage}")
  if shard_axes is None:
    shard_axes = tuple(a for a in (EXPERT_AXIS, "fsdp") if a in mesh.axis_names)
  unknown = set(shard_axes) - set(mesh.axis_names)
  if unknown:
    raise ValueError(f"shard axes {sorted(unknown)} are not mesh axes {mesh.axis_names}")
  data_axes = tuple(a for a in mesh.axis_names if a in MESH_AXES)
  if set(sequence_axes) - set(data_axes):
    raise ValueError(f"sequence axes {sequence_axes} are not data axes {data_axes}")
  if logical_axes is None:
    logical_axes = jax.tree.map(lambda _: None, params)
  is_names = lambda x: x is None or (isinstance(x, tuple) and all(
      n is None or isinstance(n, str) for n in x))
  try:
    names = jax.tree.map(lambda n, _: n, logical_axes, params, is_leaf=is_names)
  except ValueError as e:
    raise ValueError(f"logical_axes does not match the params tree: {e}") from None
  has_experts = EXPERT_AXIS in mesh.axis_names

  def expert_dim(x, n):
    if n is not None and len(n) != len(x.shape):
      raise ValueError(f"logical axes {n} do not fit a leaf of shape {x.shape}")
    if not (has_experts and n and EXPERTS_AXIS in n):
      return None
    d = n.index(EXPERTS_AXIS)
    if x.shape[d] % mesh.shape[EXPERT_AXIS]:
      raise ValueError(f"a leaf of shape {x.shape} has {x.shape[d]} experts, which the "
                       f"mesh's {mesh.shape[EXPERT_AXIS]} expert devices do not divide")
    return d

  expert_dims = jax.tree.map(expert_dim, params, names, is_leaf=is_names)

  def leaf_dim(x, n, e):
    shards = math.prod(mesh.shape[a] for a in leaf_axes(mesh, shard_axes, e))
    return shard_dim(tuple(x.shape), n, shards, min_shard_size)

  param_dims = jax.tree.map(leaf_dim, params, names, expert_dims, is_leaf=is_names)
  per_layer = jax.tree.map(lambda n, _: bool(n and LAYERS_AXIS in n), names, params,
                           is_leaf=is_names)
  shards = math.prod(mesh.shape[a] for a in shard_axes)
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
                  per_layer=per_layer, opt_dims=opt_dims, offload=offload,
                  sequence_axes=tuple(sequence_axes), param_offload=param_offload,
                  expert_dims=expert_dims,
                  model_state=None if model_state is None else abstract(model_state))


def local_shape(shape: tuple[int, ...], dim: int | None, num_shards: int) -> tuple[int, ...]:
  """The shape of one device's shard of a leaf sharded along `dim`."""
  if dim is None:
    return tuple(shape)
  return tuple(n // num_shards if d == dim else n for d, n in enumerate(shape))

