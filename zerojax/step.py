"""The train state and the one train step that serves every ZeRO stage.

A step has two halves:

1. **Gradients, per device** (`jax.shard_map`): each device runs `loss_fn` on its
   slice of the batch, microbatch by microbatch under `lax.scan`, and differentiates
   with respect to its parameters *cast to the reduce dtype*. That cast is what makes
   every cross-device reduction fp32 while the forward pass stays bf16: the cotangent
   of the cast is the upcast gradient, and at stage 3 the gather's backward
   reduce-scatters it in fp32 layer by layer. Stages 2 and 3 reduce-scatter each
   microbatch's gradient into an fp32 accumulator that is already sharded; stage 1
   accumulates locally and reduce-scatters once (each device updates only its shard,
   so the rest of the sum would be thrown away); stage 0 all-reduces once
   (`plan.behaviour.grad_reduction` names which).
2. **The update, per shard** (GSPMD): clipping by the fp32 global norm and the optax
   update run on arrays laid out by the plan, so each device updates only its shard of
   the optimizer state, and any optax transform (global-norm clipping included) sees
   the whole logical gradient. The new params are re-laid out to their stage's spec,
   which is the all-gather of stages 1 and 2. An optimizer that updates each element
   on its own (`optim.LeafwiseTransformation`: zerojax's adamw, lion, sgd) runs one
   layer at a time on the layer-stacked leaves, in place, so its fp32 temporaries are
   one layer's.

Memory: beyond the state, a stage-3 step needs one fp32 gradient per local param
(with `stage3.scan_layers` the fp32 params made for differentiation become it), the
layer inputs saved for the backward pass, the gathered embedding and head, and one
layer's worth of the rest (`benchmarks/memory_70b.py` shows where it goes).
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zerojax import sequence, stage3, streaming, updates, vocab, zero
from zerojax.optim import precision, update_rules
from zerojax.runtime import dispatch, platform

PyTree = Any
LossFn = Callable[[PyTree, PyTree, jax.Array], Any]


class TrainState(NamedTuple):
  """Everything a step reads and writes.

  Attributes:
    step: int32 scalar, optimizer steps taken.
    params: the parameter pytree, in the param dtype, laid out by the plan.
    opt_state: the optax state, laid out by the plan.
    rng: uint32[2] key data; each step folds in its step number (and each device its
      index), so randomness is a pure function of (seed, step, device).
    loss_scale: the loss-scale and skipped-step counters (`precision.LossScale`).
    model_state: the model's non-trainable state (`make_plan(model_state=...)`: linen
      collections such as `batch_stats`), replicated; None for a model without any.
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  rng: jax.Array
  loss_scale: precision.LossScale
  model_state: PyTree = None


def state_shardings(plan: zero.ZeroPlan) -> TrainState:
  """The NamedSharding of every leaf of the train state (offloaded params and optimizer
  state in host memory: `plan.param_shardings`, `plan.opt_shardings`)."""
  scalars = jax.tree.map(lambda _: P(), jax.eval_shape(precision.init_loss_scale))
  replicated = jax.tree.map(lambda _: P(), plan.model_state)
  return plan.shardings(TrainState(step=P(), params=(), opt_state=(), rng=P(),
                                   loss_scale=scalars, model_state=replicated))._replace(
                                       params=plan.param_shardings,
                                       opt_state=plan.opt_shardings)


def abstract_state(plan: zero.ZeroPlan) -> TrainState:
  """The train state as sharded `jax.ShapeDtypeStruct`s: lower a step without memory."""
  shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), plan.params, plan.opt_state,
                      jax.ShapeDtypeStruct((2,), jnp.uint32),
                      jax.eval_shape(precision.init_loss_scale), plan.model_state)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes, state_shardings(plan))


def init_state(plan: zero.ZeroPlan, init_fn: Callable[[jax.Array], PyTree],
               tx: optax.GradientTransformation, rng: jax.Array,
               loss_scaling: precision.LossScaling = precision.NO_SCALING, *,
               params: PyTree | None = None) -> TrainState:
  """Creates the train state already sharded: no leaf is ever whole on one device.

  Args:
    plan: the ZeRO plan (from the same `init_fn` shapes and `tx`).
    init_fn: `rng -> params`; for a plan with model state, `rng -> (params,
      model_state)` (e.g. a linen model's `variables.pop('params')`).
    tx: the optimizer.
    rng: a PRNG key (raw uint32[2] or typed).
    loss_scaling: sets the initial loss scale (fp16); the default is a static 1.
    params: start from these params (e.g. `zerojax.hf.load_params`, already
      laid out by the plan) instead of `init_fn`; the optimizer state is initialised
      from them. Their device leaves are donated: the state's params reuse their
      buffers; offloaded ones already in their dtype and layout are the state's.

  Returns:
    The `TrainState`, each leaf with the sharding the plan gives it. With params or
    optimizer state offloaded, the leaves in host memory are made by `init_programs`'
    programs one group at a time, so they are never all on the device at once.
  """
  key_data = rng if rng.dtype == jnp.uint32 else jax.random.key_data(rng)
  host = jax.tree.leaves(host_leaves(plan))
  out: list[Any] = [None] * len(host)
  kept = []  # Given offloaded params already as the plan lays them out: the state's own.
  if params is not None and plan.param_offload:
    for i, (p, like, s, h) in enumerate(zip(
        jax.tree.leaves(params), jax.tree.leaves(plan.params),
        jax.tree.leaves(plan.param_shardings), jax.tree.leaves(plan.param_offloaded))):
      if h and p.dtype == like.dtype and getattr(p, "sharding", None) == s:
        kept.append(i)
        out[_PARAMS_AT + i] = p
  on_device, off = _split_params(params, plan)
  for jitted, picks in init_programs(plan, init_fn, tx, loss_scaling, params is not None,
                                     skip=[_PARAMS_AT + i for i in kept]):
    # Each program ends before the next starts (an init runs once): on XLA:CPU no
    # programs queue up (`runtime.dispatch`), and a GPU holds one group at a time.
    for i, x in zip(picks, jax.block_until_ready(jitted(key_data, on_device, off))):
      out[i] = x
  return jax.tree.unflatten(jax.tree.structure(host_leaves(plan)), out)


_PARAMS_AT = 1  # TrainState's leaves: step, then the params'.


def _state_mask(plan: zero.ZeroPlan, params: PyTree, opt_state: PyTree) -> TrainState:
  """A bool per leaf of the train state: `params` / `opt_state` (masks of the plan's
  params and optimizer state) for theirs, False for the rest."""
  no = lambda t: jax.tree.map(lambda _: False, t)  # noqa: E731
  return TrainState(False, params, opt_state, False,
                    no(jax.eval_shape(precision.init_loss_scale)), no(plan.model_state))


def host_leaves(plan: zero.ZeroPlan) -> TrainState:
  """Per leaf of the train state: True if it lives in host memory (`state_shardings`)."""
  return _state_mask(plan, plan.param_offloaded, plan.opt_offloaded)


def _split_params(params: PyTree | None, plan: zero.ZeroPlan) -> tuple[list, list]:
  """Given params as (device leaves, offloaded leaves), in leaf order (None: none)."""
  if params is None:
    return [], []
  host = jax.tree.leaves(plan.param_offloaded)
  leaves = jax.tree.leaves(params)
  return ([x for x, h in zip(leaves, host) if not h], [x for x, h in zip(leaves, host) if h])


def init_programs(plan: zero.ZeroPlan, init_fn: Callable[[jax.Array], PyTree],
                  tx: optax.GradientTransformation,
                  loss_scaling: precision.LossScaling = precision.NO_SCALING,
                  given: bool = False, skip: Sequence[int] = ()) -> list[tuple[Any, list[int]]]:
  """`init_state`'s jitted programs: [(jitted(key_data, device params, offloaded
  params), the state leaves it returns, by index in `jax.tree.leaves(state)`)].

  Without offload, one program makes the whole state. With it, each group of offloaded
  leaves (`streaming.host_groups`: up to the largest one's bytes) has its own program,
  which computes the same init and keeps only those leaves (XLA drops the rest),
  written to host memory (on one device, layer-stacked leaves a layer a trip:
  `streaming.made_in_host`); the device leaves come last, from one more program that
  donates the given device params. Each program computes what one program for the whole
  state did, so the state is bit for bit the same; that one program made the offloaded
  leaves on the device before copying them out (the 8B under release with params and
  optimizer state in host memory: 22.96 GiB for XLA's GPU compiler, the H200's measured
  peak, beside a 13.91 GiB step; now 1.97: docs/design/gpu-targets.md). `skip`: state
  leaves made elsewhere (given offloaded params, kept as they are).
  """
  treedef = jax.tree.structure(plan.params)
  host_params = jax.tree.leaves(plan.param_offloaded)

  def init(key_data, on_device, off):
    init_key, state_key = jax.random.split(jax.random.wrap_key_data(key_data))
    made, model_state = init_fn(init_key), None
    if plan.model_state is not None:
      made, model_state = _split_init(made, plan)
    if not given:  # Else `made` is dead code: jit never computes it.
      params = made
    else:
      dev, hst = iter(on_device), iter(off)
      params = jax.tree.unflatten(treedef, [next(hst) if h else next(dev) for h in host_params])
      params = jax.tree.map(lambda p, like: p.astype(like.dtype), params, plan.params)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                      jax.random.key_data(state_key),
                      precision.init_loss_scale(loss_scaling), model_state)

  host = jax.tree.leaves(host_leaves(plan))
  shardings = jax.tree.leaves(state_shardings(plan))
  if not any(host):
    return [(jax.jit(lambda k, d, o: jax.tree.leaves(init(k, d, o)), out_shardings=shardings,
                     donate_argnums=1), list(range(len(host))))]
  sizes = [streaming.memory.nbytes(x) for x in jax.tree.leaves(abstract_state(plan))]
  stacked = jax.tree.leaves(_state_mask(plan, plan.per_layer, plan.opt_per_layer))
  groups = streaming.host_groups([i for i, h in enumerate(host) if h and i not in skip], sizes)
  groups.append([i for i, h in enumerate(host) if not h])

  def program(picks, donate):
    def made(key_data, on_device, off):
      leaves = jax.tree.leaves(init(key_data, on_device, off))
      return [leaves[i] for i in picks]
    if not donate and plan.mesh.size == 1:  # Stacks a layer at a time where it can.
      return jax.jit(lambda *a: streaming.made_in_host(made, [stacked[i] for i in picks], *a),
                     out_shardings=[shardings[i] for i in picks])
    return jax.jit(made, out_shardings=[shardings[i] for i in picks],
                   donate_argnums=(1,) if donate else ())

  return [(program(g, g is groups[-1]), g) for g in groups if g]


def _split_init(made: Any, plan: zero.ZeroPlan) -> tuple[PyTree, PyTree]:
  """`init_fn`'s (params, model_state), checked against the plan's model state."""
  if not (isinstance(made, tuple) and len(made) == 2):
    raise ValueError("the plan has model state (make_plan(model_state=...)), so init_fn "
                     "must return (params, model_state), e.g. variables.pop('params')")
  _check_model_state(made[1], plan, "init_fn's model state")
  return made


def _check_model_state(tree: PyTree, plan: zero.ZeroPlan, what: str) -> None:
  """One line if `tree` is not the plan's model state (structure, shapes, dtypes)."""
  shapes = lambda t: jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype).name), t)
  try:
    want, got = shapes(plan.model_state), shapes(tree)
  except (TypeError, AttributeError) as e:
    raise ValueError(f"{what} is not a pytree of arrays: {e}") from None
  if want != got:
    raise ValueError(f"{what} does not match the plan's (make_plan(model_state=...)): "
                     f"{jax.tree.structure(got)} {jax.tree.leaves(got)[:3]} against "
                     f"{jax.tree.structure(want)} {jax.tree.leaves(want)[:3]}")


def split_output(out: Any, stateful: bool) -> tuple[jax.Array, dict, PyTree]:
  """A loss function's result as (loss, aux, new model state), checked.

  Without model state `out` is `loss` or `(loss, aux)`; with it, `(loss, aux,
  new_model_state)`. Every aux value must be a scalar: the step reports its mean over
  the data-parallel devices, and anything else (batch statistics) belongs in the model
  state, which is carried and averaged leaf by leaf.
  """
  if stateful:
    if not (isinstance(out, tuple) and len(out) == 3):
      raise ValueError("with model state (make_plan(model_state=...)) the loss function "
                       "returns (loss, aux_dict, new_model_state)")
    loss, aux, new = out
  else:
    loss, aux = out if isinstance(out, tuple) else (out, {})
    new = None
  for path, value in jax.tree_util.tree_leaves_with_path(aux):
    if jnp.ndim(value) != 0:
      raise ValueError(
          f"aux value {jax.tree_util.keystr(path)} has shape {jnp.shape(value)}: aux values "
          "are scalar metrics "
          "(the step averages them); carry arrays such as batch statistics as model "
          "state: make_plan(model_state=...), returned by the loss as its third value")
  return loss, aux, new


def average_model_state(plan: zero.ZeroPlan, new: PyTree) -> PyTree:
  """The new model state averaged over the data-parallel devices (inside shard_map):
  float leaves by their mean (BatchNorm's running statistics, as a synchronised copy
  would hold them); others (counters) must agree and are kept."""
  mean = lambda x: (jax.lax.pmean(x, plan.data_axes)
                    if jnp.issubdtype(x.dtype, jnp.inexact) else x)
  return jax.tree.map(mean, new)


def leading_size(batch: PyTree) -> int:
  leaf = jax.tree.leaves(batch)[0]
  return math.prod(leaf.shape[:2])


# Which params `materialize` hands the model in the reduce dtype (`upcast_params`).
UPCAST = ("none", "gathered", "all")


def materialize(plan: zero.ZeroPlan, params: PyTree, upcast: str = "none",
                whole_vocab: bool = False) -> PyTree:
  """What the model sees of one device's params: their own dtype, gathered by stage.

  With sharded params, leaves the model gathers per layer become `stage3.Sharded`, those
  it uses on their vocabulary shards `vocab.VocabShard` (`plan.vocab_dims`), the other
  sharded leaves are gathered here; otherwise params are whole already. `params` may be
  in another dtype (the reduce dtype, when differentiating).

  Args:
    plan: the ZeRO plan.
    params: this device's params (shards where sharded), in their own dtype or the
      reduce dtype.
    upcast: one of `UPCAST`: which leaves the model sees in `params`' dtype (the reduce
      dtype, holding the param dtype's values: the step casts the stored params up),
      still gathered in the param dtype (`stage3.gather_leaf`): none; those it gathers a
      layer at a time (`stage3.Sharded`: each layer's gradient is reduce-scattered
      inside the layer loop, so in fp32 it is one layer's); or all (an unsharded
      stack's or the head's gradient is then whole in fp32). A model that casts each
      weight to its compute dtype where it uses it gets their gradients in fp32 to the
      reduction, never rounded to bf16 (`make_train_step`'s `upcast_params`).
    whole_vocab: gather the vocabulary leaves too (KV-cached decoding reads the whole
      embedding and head).
  """
  if upcast not in UPCAST:
    raise ValueError(f"upcast_params={upcast!r}: one of {UPCAST}")
  vocab_dims = (plan.vocab_dims if plan.vocab_dims is not None and not whole_vocab
                else jax.tree.map(lambda _: None, plan.params))

  def leaf(p, d, layered, host, like, e, v):
    axes = plan.axes_of(e)
    if v is not None:  # Its shard, in the params' dtype: the gradient comes back in it.
      return vocab.VocabShard(p, v, axes, like.dtype)
    # Gathered a layer at a time over more than one shard (one device gathers nothing).
    by_layer = layered and d is not None and (host or plan.behaviour.shards_params)
    up = upcast == "all" or (upcast == "gathered" and by_layer)
    if host:  # Gathered (over one shard: moved) by the model, a layer at a time.
      return stage3.Sharded(p, -1 if d is None else d - p.ndim, axes, like.dtype, up)
    if not plan.behaviour.shards_params or d is None:
      # Not `p.astype(like.dtype).astype(p.dtype)`: its gradient would round to bf16.
      return p if up else p.astype(like.dtype)
    if layered:
      return stage3.Sharded(p, d - p.ndim, axes, like.dtype, up)
    return stage3.gather_leaf(p, d, axes, like.dtype, up)
  host = jax.tree.map(lambda h, p: h and streaming.in_host_memory(p), plan.param_offloaded,
                      params)
  seen = jax.tree.map(leaf, params, plan.param_dims, plan.per_layer, host, plan.params,
                      plan.expert_dims, vocab_dims, is_leaf=lambda d: d is None)
  if not plan.behaviour.shards_params:
    return seen
  # On XLA:CPU the reduce-scatters of the whole leaves' gathers wait for the backward
  # layer loop (`stage3.before_loops`; the forward order is `ordered_batch`'s). Shards in
  # host memory are read by the loop itself and stay out of it.
  is_sharded = lambda x: isinstance(x, stage3.Sharded)
  leaves, tree = jax.tree.flatten(seen, is_leaf=is_sharded)
  kept = [not h for h in jax.tree.leaves(host)]
  whole = {i: x for i, x in enumerate(leaves) if kept[i] and not is_sharded(x)}
  stacks = {i: x.value for i, x in enumerate(leaves) if kept[i] and is_sharded(x)}
  if whole and stacks:
    whole, stacks = stage3.before_loops(whole, stacks)
    for i, v in stacks.items():
      x = leaves[i]
      leaves[i] = stage3.Sharded(v, x.dim, x.axes, x.dtype, x.upcast)
    leaves = [whole.get(i, x) for i, x in enumerate(leaves)]
  return jax.tree.unflatten(tree, leaves)


def ordered_batch(seen: PyTree, batch: PyTree) -> PyTree:
  """`batch`, read on XLA:CPU only once every gather of `seen` (`materialize`'s) is
  done, so that none of them runs beside the layer loop (`stage3.after`)."""
  return stage3.after(batch, seen)


def sum_unreduced(plan: zero.ZeroPlan, g: jax.Array, dim: int | None,
                  expert_dim: int | None = None) -> jax.Array:
  """Sums one gradient leaf over the mesh axes no reduce-scatter has summed it over.

  A leaf reduce-scattered over its ZeRO axes (sharded with the optimizer state) still
  needs the replica axes; any other leaf needs every data axis; an experts' kernel never
  'expert' (`zero.ZeroPlan.reduce_axes`).
  """
  done = plan.behaviour.shards_opt_state and dim is not None
  over = plan.reduce_axes(expert_dim, done)
  return jax.lax.psum(g, over) if over else g


def _local_grads(plan: zero.ZeroPlan, loss_fn: LossFn, microbatches: int,
                 reduce_dtype, accum_dtype, upcast_params: str):
  """Builds the per-device half: (params, batch, rng, loss scale) -> (grads, loss, aux).

  The grads are the sums over devices and microbatches of the (loss-scaled)
  gradients; the update half scales them to the mean.
  """
  dims, experts, behaviour = plan.param_dims, plan.expert_dims, plan.behaviour
  per_microbatch = behaviour.grad_reduction == "psum_scatter_per_microbatch"
  is_dim = lambda d: d is None
  sharded = lambda d: d is not None

  def scatter(g):
    """Reduce-scatters each microbatch's gradient where the accumulator is sharded and
    no gather's backward pass did so already."""
    if not per_microbatch:
      return g
    return jax.tree.map(
        lambda g, d, e: g if d is None else jax.lax.psum_scatter(
            g, plan.axes_of(e), scatter_dimension=d, tiled=True),
        g, dims, experts, is_leaf=is_dim)

  def finish(acc):
    """Sums over the mesh axes not yet reduced, in the reduce dtype.

    Not yet averaged: the update half multiplies by the mean's scale where XLA can
    fuse it into each consumer (here it would be a second whole fp32 gradient).
    """
    def leaf(g, d, e):
      g = g.astype(reduce_dtype)
      if behaviour.grad_reduction == "psum_scatter_once" and sharded(d):
        # Half an all-reduce's traffic: the update is per shard.
        g = jax.lax.psum_scatter(g, plan.axes_of(e), scatter_dimension=d, tiled=True)
      return sum_unreduced(plan, g, d, e)
    return jax.tree.map(leaf, acc, dims, experts, is_leaf=is_dim)

  def acc_zeros(params):
    def leaf(p, d, e):
      # `p` is what this device holds (a shard if params are sharded); scattered each
      # microbatch, a whole param's gradient is summed into one shard.
      scattered = per_microbatch and sharded(d)
      shape = zero.local_shape(p.shape, d if scattered else None, plan.shards_of(e))
      return jnp.zeros(shape, accum_dtype)
    return jax.tree.map(leaf, params, dims, experts, is_leaf=is_dim)

  def local(params, batch, rng, scale, model_state):
    rng = jax.random.fold_in(jax.random.wrap_key_data(rng),
                             jax.lax.axis_index(plan.data_axes))
    split = lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])
    micro = jax.tree.map(split, batch)

    def objective(p32, mb, key, model_state):
      seen = materialize(plan, p32, upcast_params)
      args = () if model_state is None else (model_state,)
      loss, aux, new = split_output(
          loss_fn(seen, ordered_batch(seen, mb), key, *args), model_state is not None)
      if model_state is not None:
        _check_model_state(new, plan, "the loss function's new model state")
      loss = loss.astype(jnp.float32)
      return loss * scale, (loss, aux, new)  # fp16: scaled so small gradients survive.

    def body(carry, xs):
      acc, model_state = carry
      mb, i = xs
      # Cast in the loop: a model may write its gradient over these fp32 params
      # (`stage3.scan_layers`), so each microbatch differentiates a fresh copy.
      p32 = jax.tree.map(lambda p: p.astype(reduce_dtype), params)
      (_, (loss, aux, model_state)), g = jax.value_and_grad(objective, has_aux=True)(
          p32, mb, jax.random.fold_in(rng, i), model_state)
      g = jax.tree.map(lambda g: g.astype(accum_dtype), scatter(g))
      acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
      return (acc, model_state), (loss, aux)  # Each microbatch sees the last's state.

    first = jax.tree.map(lambda x: x[0], micro)
    if microbatches == 1:
      # No loop: XLA:CPU runs a while body's convolutions several times slower than the
      # same ops outside one (a linen CNN: 6x; issue 51), and a one-trip loop buys nothing.
      (acc, model_state), out = body((None, model_state), (first, 0))
      losses, aux = jax.tree.map(lambda x: x[None], out)
    else:
      # A loop keeps one microbatch's activations live; on XLA:CPU a model that convolves
      # is unrolled instead (4 microbatches of the CNN: 6.6-12.4x jax.jit's time in a
      # loop, 1.3-1.6x unrolled), at the cost of compiling the body once a microbatch.
      unroll = platform.backend() == "cpu" and _convolves(
          objective, jax.tree.map(lambda p: p.astype(reduce_dtype), params), first,
          jax.random.fold_in(rng, 0), model_state)
      (acc, model_state), (losses, aux) = jax.lax.scan(
          body, (acc_zeros(params), model_state), (micro, jnp.arange(microbatches)),
          unroll=unroll)
    grads = finish(acc)
    mean = lambda x: jax.lax.pmean(jnp.mean(x.astype(jnp.float32)), plan.data_axes)
    if model_state is not None:
      model_state = average_model_state(plan, model_state)
    return grads, mean(losses), jax.tree.map(mean, aux), model_state

  return local


def _convolves(fn: Callable, *args) -> bool:
  """Whether `fn(*args)` runs a convolution, read from its jaxpr (nested ones too)."""
  def found(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "conv_general_dilated":
        return True
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          sub = getattr(sub, "jaxpr", sub)  # A ClosedJaxpr's Jaxpr.
          if hasattr(sub, "eqns") and found(sub):
            return True
    return False
  return found(jax.make_jaxpr(fn)(*args).jaxpr)


def learning_rate_metric(state: TrainState,
                         learning_rate: optax.ScalarOrSchedule | None) -> dict:
  """{'learning_rate': the step's rate} if it is known. The schedule counts applied
  updates: skipped steps do not advance it."""
  if learning_rate is None:
    return {}
  applied = state.step - state.loss_scale.total_skips
  lr = learning_rate(applied) if callable(learning_rate) else learning_rate
  return {"learning_rate": jnp.asarray(lr, jnp.float32)}


@zero.checks_batch
def make_train_step(plan: zero.ZeroPlan, loss_fn: LossFn,
                    tx: optax.GradientTransformation, *, microbatches: int = 1,
                    max_grad_norm: float = 0.0,
                    learning_rate: optax.ScalarOrSchedule | None = None,
                    reduce_dtype: Any = jnp.float32, accum_dtype: Any = jnp.float32,
                    loss_scaling: precision.LossScaling = precision.NO_SCALING,
                    update_by_layer: bool | None = None,
                    upcast_params: str = "none",
                    donate: bool = True) -> Callable[[TrainState, PyTree],
                                                     tuple[TrainState, dict]]:
  """Returns the jitted `step(state, batch) -> (state, metrics)` for the plan's stage.

  Args:
    plan: the ZeRO plan of the params and optimizer state.
    loss_fn: `(params, batch, rng) -> loss` or `(loss, aux_dict)`, the mean over the
      examples it is given (one device's microbatch); aux values are scalars. At stage
      3 the layer-stacked params arrive as `zerojax.Sharded` leaves: call
      `zerojax.gather` on each layer's slice inside the scan body. With model state
      (`make_plan(model_state=...)`): `(params, batch, rng, model_state) -> (loss,
      aux_dict, new_model_state)`; microbatches see it in turn, and the step stores the
      last one's averaged over the data-parallel devices (float leaves; a BatchNorm
      with `axis_name=plan.data_axes` computes the global batch's statistics itself).
    tx: any optax transform. It runs on sharded arrays under GSPMD, so transforms
      that reduce over the whole tree (global-norm clipping) stay correct.
    microbatches: gradient accumulation steps; each device's batch slice is split
      into this many equal microbatches.
    max_grad_norm: clip the global gradient norm (computed in fp32) to this; 0 = off.
    learning_rate: the schedule (or constant) `tx` uses, reported in the metrics.
    reduce_dtype: dtype of every cross-device gradient reduction.
    accum_dtype: dtype of the gradient accumulator over microbatches.
    loss_scaling: how the loss scale evolves (fp16); by default a static 1. Either
      way a step whose gradients are not finite is skipped: params and optimizer
      state stay as they were and the metrics say so.
    update_by_layer: run the optimizer update one layer at a time on layer-stacked
      leaves, in place (its fp32 temporaries are then one layer's, not the whole
      stack's). The default (None) does so when `tx` allows it: a
      `optim.LeafwiseTransformation` (zerojax's `adamw`, `lion`, `sgd`) with only
      scalars in its state besides leaves that mirror the params. True insists.
      The params and optimizer state are bit-for-bit those of the whole-tree
      update; the reported update_norm is summed layer by layer (last-bit changes).
    upcast_params: which params `loss_fn` gets in the reduce dtype (their values the
      param dtype's; stage 3 still gathers in the param dtype: `materialize`), not in
      the param dtype: 'none', 'gathered' (the leaves the model gathers a layer at a
      time: stage 3's layer stacks) or 'all'. For a model that casts each weight to
      its compute dtype where it uses it, in a matmul that emits the weight gradient
      in the weight's dtype (zerojax's Llama: `zerojax.models.llama.cast_matmul`),
      those local weight gradients reach the fp32 reduction without being rounded to
      bf16. A model that computes in its params' dtype would compute in fp32: leave it
      'none' there. Memory (docs/design/precision.md): 'gathered' within 0.5 GiB of
      'none' for the 70B on 8 x H100; 'all' keeps whole gradients in fp32 (the head's
      over the loss chunks: +8.08 GiB there; an unsharded layer stack's).
    donate: donate the input state's buffers to the output.

  Returns:
    A `jax.jit` function (so `.lower(...)` works, e.g. on `abstract_state(plan)`).
    `batch` is a pytree of arrays whose leading dimension is the
    global batch, divisible by (data-parallel devices x microbatches). `metrics` holds
    fp32 scalars: loss, grad_norm (before clipping), update_norm, learning_rate (if
    given), tokens (product of the first batch leaf's two leading dims), skipped (1 if
    the gradients were not finite and the update was skipped), consecutive_skips,
    loss_scale, and the means of the loss_fn's aux values.
  """
  # optax keeps its state in the params' dtype: a raw transform on bf16 params would
  # hold Adam's second moment in bf16, where it stops decaying. Refused, naming the fix.
  update_rules.check_state_precision(tx, plan.params)
  reduce_dtype, accum_dtype = jnp.dtype(reduce_dtype), jnp.dtype(accum_dtype)
  local = _local_grads(plan, loss_fn, microbatches, reduce_dtype, accum_dtype, upcast_params)

  shardings = state_shardings(plan)
  # The update runs in the reduced gradient's layout: each device its shard (or all).
  update_shardings = plan.shardings(plan.grad_specs)
  by_layer = updates.can_update_by_layer(plan, tx)
  if update_by_layer and not by_layer:
    raise ValueError(
        "update_by_layer=True needs layer-stacked params and an optimizer that updates "
        "each element on its own (optim.LeafwiseTransformation: zerojax's adamw, lion or "
        "sgd without a callable mask) whose other state is scalars")
  by_layer = by_layer if update_by_layer is None else update_by_layer

  def step(state: TrainState, batch: PyTree):
    # Offloaded params come over whole: the gradient half differentiates an fp32 copy
    # of them anyway (gradient release is the path that streams them by layer).
    params = streaming.to_device(state.params, plan.param_offloaded)
    rng = jax.random.key_data(jax.random.fold_in(
        jax.random.wrap_key_data(state.rng), state.step))
    grads, loss, aux, model_state = jax.shard_map(
        local, mesh=plan.mesh,
        in_specs=(plan.param_specs, plan.local_batch_spec, P(), P(), P()),
        out_specs=(plan.grad_specs, P(), P(), P()), check_vma=False)(
            params, sequence.shard_batch(plan, batch), rng, state.loss_scale.scale,
            state.model_state)
    # `grads` are sums; the mean is `grads * mean_scale`, applied by each consumer (the
    # reductions here, the update slice by slice) rather than once into a second whole
    # fp32 gradient. The arithmetic is the same as scaling first.
    mean_scale = jnp.asarray(1.0 / (plan.num_data * microbatches * state.loss_scale.scale),
                             reduce_dtype)
    mean = jax.tree.map(lambda g: g * mean_scale.astype(g.dtype), grads)
    finite = precision.all_finite(mean)
    grad_norm = optax.tree.norm(mean)
    factor = None
    if max_grad_norm > 0:
      factor = jnp.minimum(1.0, max_grad_norm / (grad_norm + 1e-6))

    # The update runs where each device holds only its shard of the optimizer state.
    on_shards = lambda tree: jax.lax.with_sharding_constraint(tree, update_shardings)
    # Offloaded state comes to the device for the update (layer by layer if by_layer).
    update = streaming.streamed(functools.partial(updates.apply, tx, finite=finite,
                                                scale=mean_scale, factor=factor), plan)
    if by_layer:
      new_params, opt_state, update_sq = updates.update_by_layer(
          plan, update, on_shards(grads), state.opt_state, on_shards(params))
    else:
      new_params, opt_state, update_sq = update(on_shards(grads), state.opt_state,
                                                on_shards(params))
    # Back to the stage's layout: the all-gather of the updated params at stages 1, 2.
    # Pinning the result to the shards first keeps the gather after the rounding to the
    # param dtype; otherwise GSPMD gathers the fp32 sum and halves nothing.
    new_params = streaming.to_host(jax.lax.with_sharding_constraint(
        on_shards(new_params), plan.shardings(plan.param_specs)), plan.param_offloaded)
    loss_scale = precision.update_loss_scale(state.loss_scale, finite, loss_scaling)

    metrics = dict(loss=loss, grad_norm=grad_norm,
                   update_norm=jnp.where(finite, jnp.sqrt(update_sq), 0.0).astype(
                       jnp.float32),
                   tokens=jnp.asarray(leading_size(batch), jnp.float32),
                   skipped=(~finite).astype(jnp.float32),
                   consecutive_skips=loss_scale.consecutive_skips.astype(jnp.float32),
                   loss_scale=loss_scale.scale, **aux)
    metrics.update(learning_rate_metric(state, learning_rate))
    # A skipped step keeps the model state too: its statistics saw the same batch.
    model_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), model_state,
                               state.model_state)
    return TrainState(state.step + 1, new_params, opt_state, state.rng,
                      loss_scale, model_state), metrics

  batch_sharding = jax.sharding.NamedSharding(plan.mesh, plan.batch_spec)
  return dispatch.guarded(jax.jit(step, in_shardings=(shardings, batch_sharding),
                                  out_shardings=(shardings, None),
                                  donate_argnums=(0,) if donate else ()))


@zero.checks_batch
def make_eval_step(plan: zero.ZeroPlan, loss_fn: LossFn) -> Callable[..., dict]:
  """Returns the jitted `eval_step(params, batch[, model_state]) -> metrics`, gathering
  as training does.

  Args:
    plan: the ZeRO plan; at stage 3 the params stay sharded and the model gathers one
      layer at a time, as in the train step.
    loss_fn: as for `make_train_step`; it gets a fixed rng (evaluation is
      deterministic). With model state it gets `state.model_state` too (pass it as the
      third argument) and may return `loss`, `(loss, aux)` or the train step's `(loss,
      aux, new_model_state)`, whose state is dropped: for BatchNorm's running
      statistics, a loss function that runs the model in inference mode.

  Returns:
    A `jax.jit` function of (params laid out by the plan, global batch[, model state])
    whose metrics are the fp32 means over the batch: loss and the loss_fn's aux values.
  """
  stateful = plan.model_state is not None

  def local(params, batch, model_state):
    seen = materialize(plan, params)
    out = loss_fn(seen, ordered_batch(seen, batch), jax.random.key(0),
                  *((model_state,) if stateful else ()))
    # The train step's loss (returning a new state) or one written for inference.
    loss, aux, _ = split_output(out[:2] if isinstance(out, tuple) else out, False)
    mean = lambda x: jax.lax.pmean(jnp.mean(x.astype(jnp.float32)), plan.data_axes)
    return dict(loss=mean(loss), **jax.tree.map(mean, aux))

  def evaluate(params, batch, model_state=None):
    return jax.shard_map(local, mesh=plan.mesh,
                         in_specs=(plan.param_specs, plan.local_batch_spec, P()),
                         out_specs=P(), check_vma=False)(
                             params, sequence.shard_batch(plan, batch), model_state)

  # With model state the third argument is required (jit counts the shardings).
  model_state = (state_shardings(plan).model_state,) if stateful else ()
  return dispatch.guarded(jax.jit(evaluate, in_shardings=(
      plan.param_shardings,
      jax.sharding.NamedSharding(plan.mesh, plan.batch_spec), *model_state)))
