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
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.mesh import EXPERT_AXIS, MESH_AXES
from zerojax.runtime import dispatch
from zerojax.runtime.units import fmt_bytes

PyTree = Any

# Logical axis name of the stacked-layers dimension (flax's nn.scan convention). A leaf
# with this axis is gathered per layer at stage 3 and never sharded along it.
LAYERS_AXIS = "layers"
# Logical axis name of a mixture-of-experts block's expert dimension. On a mesh with an
# 'expert' axis a leaf with it is split along it over that axis at every stage (each
# device holds its experts: expert parallelism), and ZeRO shards it over the other
# shard axes along another dimension.
EXPERTS_AXIS = "experts"
# Logical axis name of a vocabulary dimension (an embedding's rows, a head's columns):
# with `make_plan(vocab_parallel=True)` a stage-3 leaf is sharded along it and used in
# place (`zerojax.vocab`).
VOCAB_AXIS = "vocab"
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
    logical_axes: per parameter leaf, its logical axis names as `make_plan` was given
      them (None: none given), for `gathered_whole`.
    model_state: the shapes of the model's non-trainable state (linen collections such
      as `batch_stats`, NNX `BatchStat`s), replicated on every device and averaged over
      the data-parallel devices each step; None: the model has none.
    vocab_dims: per parameter leaf, its vocabulary dimension where the model uses the
      leaf's shard in place (`zerojax.vocab`: stage 3, sharded along that dimension),
      else None; None: no such leaf.
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
  logical_axes: PyTree = None
  model_state: PyTree = None
  vocab_dims: PyTree = None

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

  def check_batch(self, batch: PyTree, microbatches: int = 1) -> None:
    """Raises a one-line `ValueError` naming the fix if `batch` (a global batch: arrays,
    or their shapes) cannot be split over the example devices into `microbatches` equal
    microbatches. The step builders run it before `jax.jit` lays the batch out
    (`checks_batch`): a batch indivisible by the devices would meet JAX's own
    `IndivisibleError` first."""
    multiple = self.num_examples * microbatches
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
      shape = tuple(getattr(leaf, "shape", ()))
      if not shape or shape[0] % multiple:
        n = shape[0] if shape else 0
        fix = (f"make the global batch a multiple of {multiple} ("
               + " or ".join(str(k) for k in sorted({max(multiple, n // multiple * multiple),
                                                    -(-n // multiple) * multiple} - {0}))
               + ")" + (", or use fewer microbatches" if microbatches > 1 else ""))
        raise ValueError(
            f"batch leaf {jax.tree_util.keystr(path)} has shape {shape}: its leading "
            f"(example) dimension must be divisible by {multiple} = data-parallel devices "
            f"({self.num_examples}) x microbatches ({microbatches}): {fix}")

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

  @property
  def gathered_whole(self) -> tuple["WholeLeaf", ...]:
    """The sharded params stage 3 gathers whole, at once, before the loss (`step.materialize`:
    `stage3.gather_leaf`), not one layer at a time: every sharded leaf without a 'layers'
    logical axis and not used on its vocabulary shards (`vocab_dims`), largest first.
    Empty below stage 3 or with one shard (nothing is gathered). `whole_gather_line` says
    it in one line, `whole_gather_warning` warns."""
    if not self.behaviour.shards_params:
      return ()
    is_dim = lambda d: d is None
    paths = jax.tree_util.tree_flatten_with_path(self.params)[0]
    dims = jax.tree.leaves(self.param_dims, is_leaf=is_dim)
    if self.vocab_dims is not None:  # Used in place: never gathered.
      dims = [d if v is None else None for d, v in zip(
          dims, jax.tree.leaves(self.vocab_dims, is_leaf=is_dim), strict=True)]
    layered = jax.tree.leaves(self.per_layer)
    names = self._names()
    stacks: dict[tuple, set[tuple[int, int]]] = {}  # Module path -> (layers dim, layers).
    for (path, x), n, by_layer in zip(paths, names, layered):
      if by_layer:
        d = n.index(LAYERS_AXIS)
        for k in range(1, len(path)):
          stacks.setdefault(path[:k], set()).add((d, x.shape[d]))
    whole = []
    for (path, x), d, by_layer in zip(paths, dims, layered):
      if d is None or by_layer:
        continue
      beside = set().union(*(stacks.get(path[:k], set()) for k in range(1, len(path))))
      whole.append(WholeLeaf(
          jax.tree_util.keystr(path, simple=True, separator="/"), tuple(x.shape),
          jnp.dtype(x.dtype).name, math.prod(x.shape) * jnp.dtype(x.dtype).itemsize,
          any(i < len(x.shape) and x.shape[i] == k for i, k in beside)))
    return tuple(sorted(whole, key=lambda w: -w.bytes))

  @property
  def per_layer_bytes(self) -> int:
    """Bytes of one layer of the layer stacks stage 3 gathers a layer at a time (each
    stack's bytes over its layer count), in the param dtype; 0 below stage 3."""
    if not self.behaviour.shards_params:
      return 0
    total = 0
    for x, d, by_layer, n in zip(jax.tree.leaves(self.params),
                                 jax.tree.leaves(self.param_dims, is_leaf=lambda d: d is None),
                                 jax.tree.leaves(self.per_layer), self._names()):
      if by_layer and d is not None:
        total += math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // x.shape[
            n.index(LAYERS_AXIS)]
    return total

  def _names(self) -> list:
    """Per parameter leaf, in the params' order: its logical axis names (or None)."""
    if self.logical_axes is None:
      return [None] * len(jax.tree.leaves(self.params))
    return jax.tree.leaves(self.logical_axes, is_leaf=_is_names)


class WholeLeaf(NamedTuple):
  """A sharded param that stage 3 gathers whole (`ZeroPlan.gathered_whole`).

  Attributes:
    path: its key path, "/"-joined ("layers/LayerNorm_0/scale").
    shape: its whole shape.
    dtype: the param dtype's name.
    bytes: its whole size in the param dtype: what the gather holds at once.
    in_stack: it looks like a layer stack's leaf that lacks the 'layers' axis: it sits in
      a module beside leaves that have a 'layers' axis, and has their layer count along
      their 'layers' dimension (an unannotated LayerNorm scale, bias or kernel inside an
      `nn.scan` block: flax adds the axis only to params with partitioning metadata).
  """
  path: str
  shape: tuple[int, ...]
  dtype: str
  bytes: int
  in_stack: bool


class WholeGatherWarning(UserWarning):
  """`make_plan`'s warning that stage 3 gathers params whole, not per layer (filter it with
  `warnings.filterwarnings("ignore", category=zerojax.zero.WholeGatherWarning)`)."""


# How a scanned block's params get the 'layers' axis, in the words of a linen or NNX user.
SCAN_FIX = ("nn.scan(..., metadata_params={nn.PARTITION_NAME: 'layers'}) gives it to the "
            "params made with nn.with_logical_partitioning (NNX: nnx.vmap / nnx.scan with "
            "transform_metadata={nnx.PARTITION_NAME: 'layers'} over nnx.with_partitioning), "
            "and the scan body calls zerojax.gather on its layer's params")


def _leaves(n: int) -> str:
  return f"{n} leaf" if n == 1 else f"{n} leaves"


def _listed(leaves: tuple[WholeLeaf, ...], most: int = 3) -> str:
  shown = ", ".join(f"{w.path} {list(w.shape)} {fmt_bytes(w.bytes)}" for w in leaves[:most])
  return shown + (f" and {len(leaves) - most} more" if len(leaves) > most else "")


def _has_stacks(plan: ZeroPlan) -> bool:
  return any(jax.tree.leaves(plan.per_layer))


def whole_gather_line(plan: ZeroPlan) -> str | None:
  """One line on what stage 3 gathers whole and per layer; None below stage 3 (or with
  one shard: nothing is gathered). For a start report (`zerojax.train`)."""
  if not plan.behaviour.shards_params:
    return None
  whole = plan.gathered_whole
  per_layer = (f"one layer of the layer stacks: {fmt_bytes(plan.per_layer_bytes)}"
               if _has_stacks(plan) else "no leaf has a 'layers' axis")
  if not whole:
    return f"stage 3 gathers nothing whole; {per_layer}"
  dtypes = "/".join(sorted({w.dtype for w in whole}))
  return (f"stage 3 gathers {_leaves(len(whole))} whole before the loss, "
          f"{fmt_bytes(sum(w.bytes for w in whole))} in {dtypes} ({_listed(whole)}); "
          f"{per_layer}")


def whole_gather_warning(plan: ZeroPlan) -> str | None:
  """The one-line warning `make_plan` gives on what stage 3 gathers whole; None if
  nothing calls for one.

  It warns, whatever the bytes, for what looks like a mistake, and not for what stage 3
  gathers whole by design:

  - leaves of a layer stack without the 'layers' axis (`WholeLeaf.in_stack`: flax's
    `nn.scan` adds it only to params with partitioning metadata, so a default-init
    LayerNorm scale or Dense bias in the scanned block keeps its leading layer
    dimension and no name): every layer of them is gathered at once, beside one layer
    of the rest. Norms and biases are small against a layer, an unannotated kernel is
    not; the message gives both sizes, and the fix costs one init argument;
  - a model with sharded params and no 'layers' axis at all: the whole model is
    gathered before the loss, so the step's peak holds every param whole and stage 3
    saves param memory only between steps.

  A model that has layer stacks and gathers other leaves whole (an embedding, a head, a
  final norm: outside any stack) gets no warning: each is used whole, and that is how
  zerojax's own Llama runs (its 'vocab' / 'embed' leaves); `ZeroPlan.gathered_whole`
  and `whole_gather_line` list them with their bytes.
  """
  whole = plan.gathered_whole
  if not whole:
    return None
  stray = tuple(w for w in whole if w.in_stack)
  if stray:
    return (f"stage 3 gathers {_leaves(len(stray))} of a layer stack whole, every layer at "
            f"once: {fmt_bytes(sum(w.bytes for w in stray))} ({_listed(stray)}), beside "
            f"{fmt_bytes(plan.per_layer_bytes)} a layer for the rest of the stack. They have "
            f"no 'layers' logical axis: {SCAN_FIX}; give them inits made by "
            "nn.with_logical_partitioning too (Dense's bias_init, LayerNorm's scale_init and "
            "bias_init), or raise make_plan's min_shard_size above their size (kept "
            "whole on every device, never gathered)")
  if not _has_stacks(plan):
    return (f"stage 3 gathers the whole model at once before the loss: {_leaves(len(whole))}, "
            f"{fmt_bytes(sum(w.bytes for w in whole))} ({_listed(whole)}), no leaf having "
            "a 'layers' logical axis: the step's peak holds every param whole, and stage 3 "
            f"saves param memory only between steps. To gather a layer at a time: {SCAN_FIX}")
  return None


class BatchChecked(dispatch.Wrapped):
  """A jitted step (`jax.jit`'s function) whose batch, its second argument, is checked
  against the plan (`ZeroPlan.check_batch`) before `jax.jit` sees it: when called, and in
  `lower`, `trace` and `eval_shape`. Everything else is the jitted function's."""

  def __init__(self, fn: Callable, plan: ZeroPlan, microbatches: int):
    super().__init__(fn)
    self._plan, self._microbatches = plan, microbatches

  def _check(self, args: tuple, kwargs: dict) -> None:
    batch = args[1] if len(args) > 1 else kwargs.get("batch")
    if batch is not None:
      self._plan.check_batch(batch, self._microbatches)


def checks_batch(make: Callable) -> Callable:
  """Decorates a step builder, `make(plan, ..., microbatches=...)` -> jitted `step(x,
  batch)`, so that its step checks the batch before `jax.jit` does (`BatchChecked`)."""
  @functools.wraps(make)
  def build(*args, **kwargs):
    plan = args[0] if args else kwargs["plan"]
    return BatchChecked(make(*args, **kwargs), plan, kwargs.get("microbatches", 1))
  return build


def _is_names(x: Any) -> bool:
  """A leaf of a logical-axes tree: None or a tuple of axis names."""
  return x is None or (isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))


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
              model_state: PyTree | None = None,
              vocab_parallel: bool = False) -> ZeroPlan:
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
    vocab_parallel: at stage 3, shard each leaf with a 'vocab' logical axis (and no
      'layers' one) along it, and hand the model its shard in place of the gathered
      leaf (`zerojax.vocab.VocabShard`): for a model that computes its embedding and
      loss on vocabulary shards (`zerojax.vocab.embed`, `nll`). A leaf the shards do not
      divide is gathered as before.

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
  try:
    names = jax.tree.map(lambda n, _: n, logical_axes, params, is_leaf=_is_names)
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

  expert_dims = jax.tree.map(expert_dim, params, names, is_leaf=_is_names)

  def leaf_dim(x, n, e):
    shards = math.prod(mesh.shape[a] for a in leaf_axes(mesh, shard_axes, e))
    return shard_dim(tuple(x.shape), n, shards, min_shard_size)

  param_dims = jax.tree.map(leaf_dim, params, names, expert_dims, is_leaf=_is_names)
  per_layer = jax.tree.map(lambda n, _: bool(n and LAYERS_AXIS in n), names, params,
                           is_leaf=_is_names)
  shards = math.prod(mesh.shape[a] for a in shard_axes)
  vocab_dims = None
  if vocab_parallel and StageBehaviour.of(stage, shards).shards_params:
    def vocab_dim(x, n, e, d):
      if d is None or e is not None or not n or VOCAB_AXIS not in n or LAYERS_AXIS in n:
        return None
      v = n.index(VOCAB_AXIS)
      return v if x.shape[v] % shards == 0 else None
    vocab_dims = jax.tree.map(vocab_dim, params, names, expert_dims, param_dims,
                              is_leaf=_is_names)
    param_dims = jax.tree.map(lambda d, v: d if v is None else v, param_dims, vocab_dims,
                              is_leaf=lambda d: d is None)
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
  plan = ZeroPlan(mesh=mesh, stage=stage, shard_axes=tuple(shard_axes),
                  data_axes=data_axes, params=abstract(params),
                  opt_state=abstract(opt_state), param_dims=param_dims,
                  per_layer=per_layer, opt_dims=opt_dims, offload=offload,
                  sequence_axes=tuple(sequence_axes), param_offload=param_offload,
                  expert_dims=expert_dims, logical_axes=names,
                  model_state=None if model_state is None else abstract(model_state),
                  vocab_dims=vocab_dims)
  if warning := whole_gather_warning(plan):
    warnings.warn(warning, WholeGatherWarning, stacklevel=2)
  return plan


def local_shape(shape: tuple[int, ...], dim: int | None, num_shards: int) -> tuple[int, ...]:
  """The shape of one device's shard of a leaf sharded along `dim`."""
  if dim is None:
    return tuple(shape)
  return tuple(n // num_shards if d == dim else n for d, n in enumerate(shape))

