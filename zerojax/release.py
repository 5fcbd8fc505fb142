"""Gradient release at ZeRO stage 3: each layer's update runs inside the backward pass.

The normal step (`zerojax.step`) first computes the whole gradient, then updates: at
stage 3 that is one fp32 gradient shard per local param, alive at once (4 bytes per
param / devices). Here the backward pass is an explicit loop over the layers in
reverse, and layer i's shard is updated as soon as its gradient exists:

1. forward (`_forward`): `embed`, then the layers under `lax.scan`, each gathered
   (`stage3.gather_leaf`) and its input saved (full remat);
2. the head's loss and, by `jax.vjp`, its cotangent (`_head`);
3. for i = L-1 ... 0 (`_backward`, a trip each `_layer_trip`): gather layer i again,
   `jax.vjp` of the layer with respect to its shard cast to the reduce dtype and its
   input. The gather's backward pass reduce-scatters the layer's gradient in fp32, so
   the cotangent of the shard is already summed over the ZeRO axes (the replica axes
   are `psum`med). The optimizer then updates layer i's shard of the params and of its
   state in place and the gradient is dropped: no fp32 gradient of the layer stack
   ever exists;
4. embedding, head and norms outside the stack get their gradients the normal way and
   are updated after the loop (`_update_rest`), where the optimizer's scalars (Adam's
   count) advance, once per step.

One microbatch runs these phases (`_microbatch`), one step its microbatches (`_local`);
the update runs per device inside `jax.shard_map`, on the local shards. For a leafwise
optimizer (`optim.LeafwiseTransformation`) an update of a shard with its gradient's
shard is that shard of the whole update, so with one microbatch and no clipping a
release step computes what `make_train_step` computes.

What release changes, each chosen explicitly (`check_release` refuses the rest):

- **Non-finite gradients** are checked per layer (on any device): such a layer is not
  updated, `skipped_layers` counts it, and the step counts as skipped (`skipped`,
  `consecutive_skips`), so a run of them stops train.py (`max_consecutive_skips`).
- **Microbatches** (`accumulation='optimizer'`): there is no gradient accumulator. The
  microbatches run one after another, each with its own forward and released backward
  pass; in all but the last the moments absorb the layer's gradient and the params do
  not move (`optim.absorb`), in the last the update runs. So every forward pass sees
  the same params, as with gradient accumulation, but AdamW's nu averages the squared
  microbatch gradients and Lion's direction reads mostly the last microbatch (the
  math: `zerojax.optim`'s docstring).
- **Clipping** (`clipping`): the global norm exists only after every layer was updated,
  so either the previous step's norm, carried in the optimizer state
  (`optim.carry_grad_norm`; the first step is unclipped), or each layer's own norm
  ('per_layer': each layer, and the non-stacked leaves as one group, to max_grad_norm).
- **Dynamic loss scaling** (fp16) is refused: an overflow is known only after layers
  were updated, and an update cannot be undone without a copy of the state.
- Optimizers that are not leafwise are refused.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zerojax import optim, sequence, stage3, step as step_lib, streaming, updates, zero
from zerojax.layered import LayeredLoss
from zerojax.optim import precision, update_rules
from zerojax.runtime import dispatch, platform

PyTree = Any


ACCUMULATION = ("none", "optimizer")
CLIPPING = ("none", "previous_norm", "per_layer")


def check_release(plan: zero.ZeroPlan, parts: LayeredLoss,
                  tx: optax.GradientTransformation, *, microbatches: int = 1,
                  accumulation: str = "none", max_grad_norm: float = 0.0,
                  clipping: str = "none",
                  loss_scaling: precision.LossScaling = precision.NO_SCALING) -> int:
  """Raises ValueError for what release cannot do (yet); returns the stack's depth."""
  if plan.stage != 3:  # One shard is fine: nothing is gathered, every leaf is psummed.
    raise ValueError(f"gradient release runs at ZeRO stage 3; this plan is stage {plan.stage}")
  update_rules.check_state_precision(tx, plan.params)  # No silent bf16 moments.
  if plan.model_state is not None:
    raise ValueError("gradient release carries no model state (BatchNorm statistics): "
                     "use make_train_step, or a model without it")
  if accumulation not in ACCUMULATION or clipping not in CLIPPING:
    raise ValueError(f"gradient release: accumulation={accumulation!r} (one of "
                     f"{ACCUMULATION}), clipping={clipping!r} (one of {CLIPPING})")
  if microbatches != 1 and accumulation != "optimizer":
    raise ValueError(
        f"gradient release with microbatches={microbatches}: there is no gradient "
        "accumulator to sum microbatches into; use accumulation='optimizer' (the "
        "moments absorb each microbatch) or microbatches=1")
  if microbatches != 1 and not optim.accumulates(plan.opt_state):
    raise ValueError(
        f"gradient release with microbatches={microbatches}: optimizer accumulation "
        "needs moments to absorb the microbatches (zerojax's adamw or lion)")
  if max_grad_norm > 0 and clipping == "none":
    raise ValueError(
        f"gradient release with max_grad_norm={max_grad_norm}: the global norm is known "
        "only after every layer is updated; use clipping='previous_norm' or "
        "'per_layer', or max_grad_norm=0")
  carries = lambda x: isinstance(x, optim.PreviousNormState)
  if clipping == "previous_norm" and not any(
      carries(x) for x in jax.tree.leaves(plan.opt_state, is_leaf=carries)):
    raise ValueError("gradient release with clipping='previous_norm': the optimizer "
                     "state must carry the norm: tx = optim.carry_grad_norm(tx)")
  if loss_scaling.dynamic:
    raise ValueError("gradient release with dynamic loss scaling (float16): an overflow "
                     "is found after layers were updated; use bfloat16 or float32")
  if not updates.can_update_by_layer(plan, tx):
    raise ValueError(
        "gradient release needs an optimizer that updates each element on its own "
        "(optim.LeafwiseTransformation: zerojax's adamw, lion or sgd without a callable "
        "mask) whose other state is scalars")
  if not isinstance(plan.params, dict) or parts.stack not in plan.params:
    raise ValueError(f"gradient release: the params have no top-level {parts.stack!r} key")
  in_stack = {k: jax.tree.map(lambda _, k=k: k == parts.stack, v)
              for k, v in plan.params.items()}
  if jax.tree.leaves(in_stack) != jax.tree.leaves(plan.per_layer):
    raise ValueError(f"gradient release: the layer-stacked leaves (logical axis "
                     f"'layers') must be exactly those under {parts.stack!r}")
  depths = {x.shape[0] for x in jax.tree.leaves(plan.params[parts.stack])}
  if len(depths) != 1:
    raise ValueError(f"gradient release: the leaves under {parts.stack!r} stack "
                     f"different numbers of layers {sorted(depths)}")
  return depths.pop()


@dataclasses.dataclass(frozen=True)
class _Release:
  """What every phase of one release step reads: fixed when the step is made."""
  plan: zero.ZeroPlan
  parts: LayeredLoss
  depth: int  # Layers in the stack.
  microbatches: int
  reduce_dtype: jnp.dtype
  upcast_params: str
  clipping: str
  max_grad_norm: float
  read_ahead: bool | None
  write_behind: bool
  writes_first: bool
  # Per leaf, how many devices of a shard group hold the same (unsharded) leaf: each
  # counts 1/copies when the squares are summed over the ZeRO axes (an experts' kernel
  # is the same on its own ZeRO axes' devices only: each 'expert' device holds others).
  copies: PyTree
  mean_scale: jax.Array  # 1 / data-parallel devices, in the reduce dtype.
  # The optimizer's update of a group of shards: `apply` brings offloaded state slices to
  # the device itself, `arrived` takes them there already (read ahead), `kept` takes
  # state kept on the device with its update (written behind).
  apply: Callable
  arrived: Callable
  kept: Callable

  @property
  def stack(self) -> str:
    return self.parts.stack


class _Trips(NamedTuple):
  """How the layer loops move offloaded params and state (`_trips`)."""
  ahead_p: bool  # The params of the layer a trip needs next come in during this one.
  ahead_s: bool  # The optimizer state likewise (backward pass).
  behind: bool  # Each layer's update goes back in the next trip (`write_behind`).


def _is_dim(d) -> bool:
  return d is None


def _setup(plan: zero.ZeroPlan, parts: LayeredLoss, tx: optax.GradientTransformation,
           depth: int, *, reduce_dtype: Any, **options) -> _Release:
  copies = jax.tree.map(lambda d, e: 1 if d is not None else plan.shards_of(e),
                        plan.param_dims, plan.expert_dims, is_leaf=_is_dim)
  reduce_dtype = jnp.dtype(reduce_dtype)
  update = functools.partial(updates.apply, tx)
  return _Release(plan, parts, depth, reduce_dtype=reduce_dtype, copies=copies,
                  mean_scale=jnp.asarray(1.0 / plan.num_data, reduce_dtype),
                  apply=streaming.streamed(update, plan),
                  arrived=streaming.streamed(update, plan, arrived=True), kept=update,
                  **options)


def _trips(r: _Release) -> _Trips:
  """Read at trace time (`platform.backend` is the target's). Offloaded params and
  state: the layer a trip needs next comes in while it computes (the forward pass reads
  layer i+1 during trip i, the backward pass layer i-1, `read_ahead`), carried. Not on
  XLA:CPU unless asked: its host and device are one RAM (the moves lower to nothing),
  and there the backward barrier costs a copy of the stacks it reads (43 GiB of
  optimizer state at 70B). Written behind, a trip reads its own layer's state: read
  ahead, it would be a third layer's on the device, beside the carried update and the
  layer read ahead."""
  plan = r.plan
  ahead = r.read_ahead if r.read_ahead is not None else platform.backend() != "cpu"
  behind = r.write_behind and ahead and (plan.param_offload or plan.offload)
  return _Trips(ahead and plan.param_offload, ahead and plan.offload and not behind, behind)


# Helpers of the phases below, each per device inside the step's `shard_map`.

def _cast(r: _Release, tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: x.astype(r.reduce_dtype), tree)


def _total(r: _Release, x: jax.Array) -> jax.Array:
  return jax.lax.psum(x, r.plan.shard_axes)


def _agree(r: _Release, ok: jax.Array) -> jax.Array:
  """True on every device when `ok` is on all of them."""
  return jax.lax.pmin(ok.astype(jnp.int32), r.plan.mesh.axis_names) > 0


def _rounding_streams(r: _Release, i) -> PyTree:
  """Stochastic rounding's bits (`update_rules`, `stream`): each layer's and each
  shard's own; a leaf every device of the shard group holds whole rounds alike on all."""
  plan = r.plan
  return jax.tree.map(
      lambda d, e: i * plan.num_shards + (
          0 if d is None else jax.lax.axis_index(plan.axes_of(e))),
      plan.param_dims, plan.expert_dims, is_leaf=_is_dim)


def _factor(r: _Release, squares: jax.Array) -> jax.Array | None:
  """Per-layer clipping's scale for a group whose squared gradient norm (summed over
  this device's shards) is `squares`."""
  if r.clipping != "per_layer":
    return None
  return jnp.minimum(1.0, r.max_grad_norm / (jnp.sqrt(_total(r, squares)) + 1e-6))


def _clip_to(r: _Release) -> dict:
  return {"previous_norm": dict(clip_to=r.max_grad_norm)}.get(r.clipping, {})


def _gathered(r: _Release, layer: PyTree) -> PyTree:
  """One layer's shards as the whole params in the param dtype (with `upcast_params`,
  in the shards' dtype: `step.materialize`). Differentiated with respect to shards in
  the reduce dtype, the gathers' backward passes reduce-scatter in it; the forward pass
  gathers the stored shards as they are (an fp32 cast of the scanned stack would be
  hoisted out of the loop: a whole fp32 copy)."""
  plan, stack, up = r.plan, r.stack, r.upcast_params
  return jax.tree.map(
      lambda d, p, like, e: (p if up == "all" else p.astype(like.dtype))
      if d is None else stage3.gather_leaf(p, d - 1, plan.axes_of(e), like.dtype, up != "none"),
      plan.param_dims[stack], layer, plan.params[stack], plan.expert_dims[stack],
      is_leaf=_is_dim)


def _reduced(r: _Release, grads: PyTree, dims: PyTree, experts: PyTree) -> PyTree:
  """Gradients summed over the axes their shards' gathers did not reduce them over."""
  return jax.tree.map(
      lambda d, e, g: step_lib.sum_unreduced(r.plan, g.astype(r.reduce_dtype), d, e),
      dims, experts, grads, is_leaf=_is_dim)


def _without_stack(tree: dict, stack: str) -> dict:
  return {k: v for k, v in tree.items() if k != stack}


def _params_at(r: _Release, views: updates.LayerViews, p: PyTree, i) -> PyTree:
  return streaming.to_device(views.params(p, i), r.plan.param_offloaded)


def _state_at(r: _Release, views: updates.LayerViews, s: PyTree, i) -> PyTree:
  return streaming.to_device(views.state(s, i), r.plan.opt_offloaded)


def _put_back(r: _Release, views: updates.LayerViews, p: PyTree, s: PyTree, update, i):
  """The stacks with layer i's (params, state) `update`, both on the device, written in
  place (to host memory where offloaded)."""
  return (views.put(p, streaming.to_host(update[0], r.plan.param_offloaded), i),
          views.put_state(s, streaming.to_host(update[1], r.plan.opt_offloaded), i))


# The phases of one microbatch: forward, head, the released backward pass, the rest.

def _forward(r: _Release, trips: _Trips, views: updates.LayerViews, rows: PyTree,
             x: jax.Array, batch: PyTree):
  """Phase 1: the layers' forward pass, each layer gathered, its input saved (to host
  memory with `parts.offload`). Returns the last layer's output and the saved inputs."""
  return streaming.forward_layers(
      lambda i, layer, x: (r.parts.layer(_gathered(r, layer), x, batch), streaming.outbound(
          jax.tree.map(stage3.to_bits, x), r.parts.offload)),
      x, lambda i: _params_at(r, views, rows, i)[r.stack], r.depth, trips.ahead_p)


def _head(r: _Release, view: Callable, rest32: PyTree, x: jax.Array, batch: PyTree):
  """Phase 2: the loss and its cotangents, of the non-stacked leaves (fp32: `rest32`)
  and of the last layer's output. Returns (loss, d_rest, ct, reported): what the model
  reports of that output (the routers' statistics), as the loss, the mean over devices."""
  plan, parts = r.plan, r.parts
  reported = jax.tree.map(lambda v: jax.lax.pmean(v.astype(jnp.float32), plan.data_axes),
                          parts.metrics(x, batch) if parts.metrics else {})
  # On XLA:CPU the head's gathers wait for the forward loop, and the backward loop for
  # their reduce-scatters (`stage3.after`: no collective beside a loop's).
  loss, head_vjp = jax.vjp(
      lambda rest, x: parts.head_loss(view(rest), x, batch).astype(jnp.float32),
      stage3.after(rest32, x), x)
  d_rest, ct = head_vjp(jnp.ones((), jnp.float32))
  return loss, d_rest, stage3.after(ct, d_rest), reported


def _layer_trip(r: _Release, trips: _Trips, views: updates.LayerViews, batch: PyTree,
                phase: dict, i, saved, carry):
  """Phase 3, one trip of the backward loop: layer i recomputed from its saved input,
  its gradient reduce-scattered by its gathers' backward, checked, and the layer's
  shards of params and state updated; the gradient is dropped.

  Written behind (`write_behind`): trip i writes layer i+1's update, carried from the
  trip before. XLA must finish a trip's reads of a stack before its in-place write into
  it, and its scheduler does not see the matmuls' time (a gemm costs it almost
  nothing): left alone it puts both at one end of the trip, one waiting for the other.
  Reads first, one barrier on the reads, the stacks, the pending update and the
  residuals of the layer's recomputed forward pass splits the trip: the reads land
  under the recompute, the writes start after it and run under the backward matmuls.
  Writes first (`writes_first`), the trip's reads are of the written stacks: each
  leaf's read follows its write, and no barrier is needed.
  """
  plan, stack, depth = r.plan, r.stack, r.depth
  ct, p, s, skipped, grad_sq, update_sq, (layer_p, state), pending = carry
  before, written = jnp.maximum(i - 1, 0), jnp.minimum(i + 1, depth - 1)
  if trips.behind and r.writes_first:
    p, s = _put_back(r, views, p, s, pending, written)
  # A read ahead comes before the trip's write of its stack: by `read_ahead`'s barrier,
  # or written behind, by the barrier below (reads first) or the write before it
  # (writes first).
  order = (lambda t, read: (read(t), t)) if trips.behind else streaming.read_ahead
  if trips.ahead_p:
    next_p, p = order(p, lambda p: _params_at(r, views, p, before))
  else:  # Nothing carried: each trip reads its own layer.
    layer_p, next_p = _params_at(r, views, p, i), None
  if trips.ahead_s:
    next_s, s = order(s, lambda s: _state_at(r, views, s, before))
  elif trips.behind:  # Its own layer's, kept on the device with its update.
    state, next_s = _state_at(r, views, s, i), None
  else:  # `apply` brings an offloaded slice over itself.
    state, next_s = views.state(s, i), None
  x = jax.tree.map(stage3.from_bits, saved, ct)
  _, vjp = jax.vjp(lambda q, x: r.parts.layer(_gathered(r, q), x, batch),
                   _cast(r, layer_p[stack]), x)
  if trips.behind and not r.writes_first:
    # This trip's own slices too, if read here: they are read before the write. The
    # pullback `jax.vjp` returns is a `tree_util.Partial`: its leaves are the residuals,
    # all computed once the recompute is.
    residuals, tree = jax.tree.flatten(vjp)
    next_p, next_s, layer_p, state, p, s, pending, residuals = jax.lax.optimization_barrier(
        (next_p, next_s, layer_p, state, p, s, pending, residuals))
    vjp = jax.tree.unflatten(tree, residuals)
    p, s = _put_back(r, views, p, s, pending, written)
  g, ct = vjp(ct)
  g = _reduced(r, g, plan.param_dims[stack], plan.expert_dims[stack])
  finite = _agree(r, precision.all_finite(g))
  squares = updates.sum_squares(g, r.copies[stack], r.mean_scale)
  update = r.kept if trips.behind else r.arrived if trips.ahead_s else r.apply
  new_p, new_s, update_squares = update(
      {**layer_p, stack: g}, state, layer_p, finite=finite, scale=r.mean_scale,
      factor=_factor(r, squares), copies=r.copies, stream=_rounding_streams(r, i),
      **phase, **_clip_to(r))
  if trips.behind:  # The next trip writes it.
    pending = (new_p, new_s)
  else:  # Straight back (`update` sent the state there).
    new_p = streaming.to_host(new_p, plan.param_offloaded)
    p, s = views.put(p, new_p, i), views.put_state(s, new_s, i)
  return (ct, p, s, skipped + 1 - finite.astype(jnp.int32), grad_sq + squares,
          update_sq + jnp.where(finite, update_squares, 0.0), (next_p, next_s), pending)


def _backward(r: _Release, trips: _Trips, views: updates.LayerViews, rows: PyTree,
              opt_state: PyTree, inputs, ct: jax.Array, batch: PyTree, phase: dict):
  """Phase 3: the layers' backward pass in reverse, each layer updated in its trip
  (`_layer_trip`). Returns the cotangent of the first layer's input, the params and
  state with every layer updated, and the layers' (skipped, squared gradient norm,
  squared update norm) sums on this device."""
  zero_sq = jnp.zeros((), jnp.float32)
  s = views.state_rows(opt_state)
  last_p = _params_at(r, views, rows, r.depth - 1) if trips.ahead_p or trips.behind else None
  last_s = _state_at(r, views, s, r.depth - 1) if trips.ahead_s or trips.behind else None
  first = (last_p if trips.ahead_p else None, last_s if trips.ahead_s else None)
  # The first trip writes the last layer back as it is (a trip has one code: the write
  # of one layer more than needed, as the reads' clamped index reads one more).
  ct, p, s, skipped, grad_sq, update_sq, _, pending = streaming.backward_layers(
      functools.partial(_layer_trip, r, trips, views, batch, phase),
      (ct, rows, s, jnp.zeros((), jnp.int32), zero_sq, zero_sq, first,
       (last_p, last_s) if trips.behind else None), inputs, r.depth, r.parts.offload)
  if trips.behind:  # Layer 0's update, after the loop, back before the embedding's
    # backward: held on the device through the embedding and head's update instead, it
    # would sit beside their state (4.8 GiB more for the 70B on one RTX 4090, over its pool).
    p, s = _put_back(r, views, p, s, pending, 0)
    p, s, ct = jax.lax.optimization_barrier((p, s, ct))
  return ct, views.from_rows(p), views.state_from_rows(s), (skipped, grad_sq, update_sq)


def _update_rest(r: _Release, p: PyTree, s: PyTree, d_rest: PyTree, grad_sq: jax.Array,
                 sums: tuple, phase: dict, last):
  """Phase 4: the leaves outside the stack (embedding, head, norms) reduced and updated,
  where the optimizer's scalars (Adam's count) advance, once per step (in the last
  microbatch). With clipping by the previous norm, this step's norm is stored for the
  next. Returns the params, the state, the rest's finiteness and squared norms."""
  plan, stack = r.plan, r.stack
  d_rest = _reduced(r, d_rest, _without_stack(plan.param_dims, stack),
                    _without_stack(plan.expert_dims, stack))
  finite = _agree(r, precision.all_finite(d_rest))
  squares = updates.sum_squares(d_rest, _without_stack(r.copies, stack), r.mean_scale)
  grad_sq = _total(r, grad_sq + squares)
  clip_to = _clip_to(r)
  # (A norm that is not finite is not stored: NaN outside the last microbatch.)
  norm = {} if not clip_to else dict(grad_norm=jnp.where(
      last, jnp.sqrt((sums[1] + grad_sq) / r.microbatches), jnp.nan))
  rest_p, rest_s, update_squares = r.apply(
      *updates.without_stacks(plan, {**d_rest, stack: p[stack]}, s, p),
      finite=finite, scale=r.mean_scale, factor=_factor(r, squares), copies=r.copies,
      stream=_rounding_streams(r, r.depth), **phase, **clip_to, **norm)
  p = updates.pick(plan.per_layer, p, rest_p)
  s = updates.pick(plan.opt_per_layer, s, rest_s)
  return p, s, finite, grad_sq, update_squares


def _microbatch(r: _Release, params: PyTree, opt_state: PyTree, batch: PyTree, sums: tuple,
                *, decay, last):
  """Forward and released backward of one microbatch. Not `last`: the moments absorb
  its gradients and the params stay. `sums` (loss, squared gradient norm, skipped
  layers, skipped rest, squared update norm; fp32) add up over the microbatches."""
  plan, stack = r.plan, r.stack
  phase = dict(move=last, **({} if r.microbatches == 1 else dict(
      decay=decay, weight=1.0 / r.microbatches)))
  view = lambda rest: _without_stack(step_lib.materialize(
      plan, {**rest, stack: params[stack]}, r.upcast_params), stack)
  rest32 = _cast(r, _without_stack(params, stack))
  x, embed_vjp = jax.vjp(lambda rest: r.parts.embed(view(rest), batch), rest32)
  # The stack is scanned as it is stored. Scanning its bits instead (`stage3.to_bits`)
  # stops XLA:CPU's loop-invariant code motion from hoisting the fp32 upcast of its
  # gathers out of the loop, but costs a copy of the stack in them (15.8 GiB a device
  # for the 70B at 8 devices); that pass is off where memory counts
  # (`device_env.CPU_MEMORY_FLAGS`), and a GPU gathers bf16 as it is.
  # Both loops read the stacks as rows (`updates.LayerViews`: no whole-stack relayout).
  views = updates.LayerViews(plan, params, opt_state, r.depth, rows=True)
  rows = views.rows(params)
  trips = _trips(r)
  x, inputs = _forward(r, trips, views, rows, x, batch)
  loss, d_rest, ct, reported = _head(r, view, rest32, x, batch)
  ct, p, s, (skipped, grad_sq, update_sq) = _backward(
      r, trips, views, rows, opt_state, inputs, ct, batch, phase)
  (d_embed,) = embed_vjp(ct)
  p, s, finite, grad_sq, update_squares = _update_rest(
      r, p, s, jax.tree.map(jnp.add, d_rest, d_embed), grad_sq, sums, phase, last)
  update_sq = _total(r, update_sq + jnp.where(finite, update_squares, 0.0))
  step_sums = (jax.lax.pmean(loss, plan.data_axes), grad_sq, skipped.astype(jnp.float32),
               (~finite).astype(jnp.float32), update_sq)
  return p, s, tuple(a + b for a, b in zip(sums, step_sums, strict=True)), reported


def _local(r: _Release, params: PyTree, opt_state: PyTree, batch: PyTree):
  """One step on this device's shards: its microbatches, then the step's metrics."""
  microbatches = r.microbatches
  split = lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])
  micro = jax.tree.map(split, batch)
  sums = (jnp.zeros((), jnp.float32),) * 5
  if microbatches > 1:
    # One loop over the microbatches (one copy of their code, so XLA cannot run two at
    # once): all but the last only absorb, the params the same in every forward.
    def one(carry, xs):
      p, s, sums = carry
      mb, k = xs
      p, s, sums, reported = _microbatch(r, p, s, mb, sums, decay=k == 0,
                                         last=k == microbatches - 1)
      return (p, s, sums), reported
    (params, opt_state, sums), reported = jax.lax.scan(
        one, (params, opt_state, sums), (micro, jnp.arange(microbatches)))
    reported = jax.tree.map(lambda v: jnp.mean(v, axis=0), reported)
  else:
    params, opt_state, sums, reported = _microbatch(
        r, params, opt_state, jax.tree.map(lambda x: x[0], micro), sums, decay=True,
        last=True)
  loss, grad_sq, skipped_layers, skipped, update_sq = sums
  metrics = dict(loss=loss / microbatches, grad_norm=jnp.sqrt(grad_sq / microbatches),
                 update_norm=jnp.sqrt(update_sq),
                 # Any skipped part makes the step count as skipped (train.py's
                 # max_consecutive_skips reads it); skipped_layers says how much.
                 skipped=jnp.minimum(skipped + skipped_layers, 1.0),
                 skipped_layers=skipped_layers, **reported)
  return params, opt_state, metrics


@zero.checks_batch
def make_release_step(plan: zero.ZeroPlan, parts: LayeredLoss,
                      tx: optax.GradientTransformation, *, microbatches: int = 1,
                      accumulation: str = "none", max_grad_norm: float = 0.0,
                      clipping: str = "none",
                      learning_rate: optax.ScalarOrSchedule | None = None,
                      reduce_dtype: Any = jnp.float32,
                      loss_scaling: precision.LossScaling = precision.NO_SCALING,
                      upcast_params: str = "none",
                      donate: bool = True,
                      read_ahead: bool | None = None,
                      write_behind: bool = False,
                      writes_first: bool = False) -> Callable[[step_lib.TrainState, PyTree],
                                                       tuple[step_lib.TrainState, dict]]:
  """Returns the jitted `step(state, batch) -> (state, metrics)` with gradient release.

  Args:
    plan: a stage-3 plan (one shard too: then nothing is gathered).
    parts: the model's loss cut at its layer loop (e.g. `MlpLM.layered()`).
    tx: a leafwise optimizer (`optim.adamw`, `optim.lion`, `optim.sgd`); wrapped in
      `optim.carry_grad_norm` for clipping 'previous_norm'.
    microbatches: each device's batch slice is split into this many; more than 1
      needs accumulation 'optimizer'.
    accumulation: 'optimizer': the moments absorb each microbatch's gradient as it is
      released and the params move once, in the last microbatch's backward pass
      (`optim` docstring: the math, and how it differs from accumulating gradients).
    max_grad_norm: clip to this (fp32 norms); 0 = off. Needs a `clipping`.
    clipping: 'previous_norm': every gradient of the step is scaled by
      min(1, max_grad_norm / the previous step's global norm), carried in the
      optimizer state (the first step is not clipped); 'per_layer': each layer's
      gradient, and the non-stacked leaves' as one group, is clipped to
      max_grad_norm by its own norm (each microbatch's, with accumulation).
    loss_scaling: only no dynamic scaling runs (accepted for a clear error).
    learning_rate: the schedule (or constant) `tx` uses, reported in the metrics.
    reduce_dtype: dtype of every cross-device gradient reduction.
    upcast_params: as `make_train_step`'s ('none', 'gathered', 'all'): which params the
      model sees in the reduce dtype (gathered in the param dtype), so that a model
      that casts its weights where it uses them gets their gradients (each layer's,
      inside the loop) in fp32 to the reduce-scatter.
    donate: donate the input state's buffers to the output.
    read_ahead: with offloaded params or optimizer state, fetch the next layer's during
      a layer's forward (params) and backward pass (`streaming.read_ahead`: one more
      layer of it on the device, the copy in flight under the layer's compute). None:
      where host memory is not the device's own (a GPU; not XLA:CPU, traced for a GPU
      target or not).
    write_behind: where the backward pass reads ahead (`read_ahead`), each layer's
      update goes back to host memory during the next layer's trip, once that layer's
      forward pass is recomputed, instead of at the end of its own trip: the copies
      back then run under the next layer's backward matmuls, and the reads ahead under
      its recompute (one more layer of params and optimizer state on the device, and
      its residuals held a little longer). A layer's optimizer state is then read in
      its own trip, not the one before: carried, it would be a third layer's state on
      the device. Layer 0's update goes back after the loop, before the embedding's
      backward pass. Numerically the same step.
    writes_first: written behind, each trip writes the carried update first, under the
      recompute, and reads after it, under the backward matmuls: the update leaves the
      device before the backward pass instead of sitting beside it (the least device
      memory; XLA's schedule decides which order hides more of the copies).

  Returns:
    A `jax.jit` function, as `make_train_step`'s, whose metrics are loss, grad_norm
    (with microbatches, the root mean square of the microbatch gradients' global
    norms: at least the accumulated gradient's), update_norm, tokens, skipped (1 if
    any layer or the non-stacked leaves were not updated: the step counts toward
    `consecutive_skips`), skipped_layers (layer updates skipped, summed over
    microbatches), consecutive_skips, loss_scale and learning_rate.

  Raises:
    ValueError: for what release does not support (`check_release`).
  """
  depth = check_release(plan, parts, tx, microbatches=microbatches,
                        accumulation=accumulation, max_grad_norm=max_grad_norm,
                        clipping=clipping, loss_scaling=loss_scaling)
  r = _setup(plan, parts, tx, depth, microbatches=microbatches, reduce_dtype=reduce_dtype,
             upcast_params=upcast_params, clipping=clipping, max_grad_norm=max_grad_norm,
             read_ahead=read_ahead, write_behind=write_behind, writes_first=writes_first)
  shardings = step_lib.state_shardings(plan)

  def step(state: step_lib.TrainState, batch: PyTree):
    params, opt_state, metrics = jax.shard_map(
        functools.partial(_local, r), mesh=plan.mesh,
        in_specs=(plan.param_specs, plan.opt_specs, plan.local_batch_spec),
        out_specs=(plan.param_specs, plan.opt_specs, P()), check_vma=False)(
            state.params, state.opt_state, sequence.shard_batch(plan, batch))
    applied = metrics["skipped"] == 0
    loss_scale = precision.update_loss_scale(state.loss_scale, applied, loss_scaling)
    metrics.update(tokens=jnp.asarray(step_lib.leading_size(batch), jnp.float32),
                   consecutive_skips=loss_scale.consecutive_skips.astype(jnp.float32),
                   loss_scale=loss_scale.scale,
                   **step_lib.learning_rate_metric(state, learning_rate))
    return step_lib.TrainState(state.step + 1, params, opt_state, state.rng,
                               loss_scale), metrics

  batch_sharding = jax.sharding.NamedSharding(plan.mesh, plan.batch_spec)
  return dispatch.guarded(jax.jit(step, in_shardings=(shardings, batch_sharding),
                                  out_shardings=(shardings, None),
                                  donate_argnums=(0,) if donate else ()))
