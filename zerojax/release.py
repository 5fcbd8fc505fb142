"""Gradient release at ZeRO stage 3: each layer's update runs inside the backward pass.

The normal step (`zerojax.step`) first computes the whole gradient, then updates: at
stage 3 that is one fp32 gradient shard per local param, alive at once (4 bytes per
param / devices). Here the backward pass is an explicit loop over the layers in
reverse, and layer i's shard is updated as soon as its gradient exists:

1. forward: `embed`, then the layers under `lax.scan`, each gathered
   (`stage3.gather_leaf`) and its input saved (full remat);
2. the head's loss and, by `jax.vjp`, its cotangent;
3. for i = L-1 ... 0: gather layer i again, `jax.vjp` of the layer with respect to
   its shard cast to the reduce dtype and its input. The gather's backward pass
   reduce-scatters the layer's gradient in fp32, so the cotangent of the shard is
   already summed over the ZeRO axes (the replica axes are `psum`med). The optimizer
   then updates layer i's shard of the params and of its state in place and the
   gradient is dropped: no fp32 gradient of the layer stack ever exists;
4. embedding, head and norms outside the stack get their gradients the normal way and
   are updated after the loop, where the optimizer's scalars (Adam's count) advance,
   once per step.

The update runs per device inside `jax.shard_map`, on the local shards. For a leafwise
optimizer (`optim.LeafwiseTransformation`) an update of a shard with its gradient's
shard is that shard of the whole update, so with one microbatch and no clipping a
release step computes what `make_train_step` computes.

What release changes: a layer whose gradient is not finite (on any device) is not
updated and the step reports how many were skipped (`skipped_layers`); the step
counts as skipped for `consecutive_skips` if any part was. Refused for now, each with
a ValueError: microbatches > 1 (needs optimizer accumulation), global-norm clipping
(needs every gradient first), dynamic loss scaling (fp16), optimizers that are not
leafwise.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zerojax import offload, precision, stage3, step as step_lib, updates, zero

PyTree = Any


class LayeredLoss(NamedTuple):
  """A loss cut at its layer loop: what gradient release needs from a model.

  `loss(params, batch) = head_loss(rest, layer(params[stack][L-1], ... layer(
  params[stack][0], embed(rest, batch))), batch)`, where `rest` is `params` without
  the `stack` key. Every function sees plain arrays (gathered, in the param dtype).

  Attributes:
    embed: `(rest, batch) -> carry`, the input of the first layer (any pytree).
    layer: `(layer_params, carry) -> carry`, one layer.
    head_loss: `(rest, carry, batch) -> loss`, a scalar: the mean over the examples.
    stack: the top-level key of the params dict that holds the layer stack (every
      leaf below it has a leading layers axis; no other leaf has one).
  """
  embed: Callable[[PyTree, PyTree], PyTree]
  layer: Callable[[PyTree, PyTree], PyTree]
  head_loss: Callable[[PyTree, PyTree, PyTree], jax.Array]
  stack: str


def check_release(plan: zero.ZeroPlan, parts: LayeredLoss,
                  tx: optax.GradientTransformation, *, microbatches: int = 1,
                  max_grad_norm: float = 0.0,
                  loss_scaling: precision.LossScaling = precision.NO_SCALING) -> int:
  """Raises ValueError for what release cannot do (yet); returns the stack's depth."""
  if plan.behaviour.stage != 3:
    raise ValueError(
        f"gradient release runs at ZeRO stage 3 over more than one shard; this plan "
        f"runs stage {plan.behaviour.stage} (configured {plan.stage}, "
        f"{plan.num_shards} shard(s))")
  if microbatches != 1:
    raise ValueError(
        f"gradient release with microbatches={microbatches}: there is no gradient "
        "accumulator to sum microbatches into; use microbatches=1 (optimizer "
        "accumulation is not built yet)")
  if max_grad_norm > 0:
    raise ValueError(
        f"gradient release with max_grad_norm={max_grad_norm}: the global norm is known "
        "only after every layer is updated; use max_grad_norm=0 (clipping by the "
        "previous step's norm is not built yet)")
  if loss_scaling.dynamic:
    raise ValueError("gradient release with dynamic loss scaling (float16): an overflow "
                     "is found after layers were updated; use bfloat16 or float32")
  if not updates.can_update_by_layer(plan, tx):
    raise ValueError(
        "gradient release needs an optimizer that updates each element on its own "
        "(optim.LeafwiseTransformation: zerojax's adamw, lion or sgd without stochastic "
        "rounding or a callable mask) whose other state is scalars")
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


def make_release_step(plan: zero.ZeroPlan, parts: LayeredLoss,
                      tx: optax.GradientTransformation, *, microbatches: int = 1,
                      max_grad_norm: float = 0.0,
                      learning_rate: optax.ScalarOrSchedule | None = None,
                      reduce_dtype: Any = jnp.float32,
                      loss_scaling: precision.LossScaling = precision.NO_SCALING,
                      donate: bool = True) -> Callable[[step_lib.TrainState, PyTree],
                                                       tuple[step_lib.TrainState, dict]]:
  """Returns the jitted `step(state, batch) -> (state, metrics)` with gradient release.

  Args:
    plan: a stage-3 plan over more than one shard.
    parts: the model's loss cut at its layer loop (e.g. `MlpLM.layered()`).
    tx: a leafwise optimizer (`optim.adamw`, `optim.lion`, `optim.sgd`).
    microbatches, max_grad_norm, loss_scaling: accepted so that a caller passing its
      config gets a clear error: only 1, 0 and no dynamic scaling run.
    learning_rate: the schedule (or constant) `tx` uses, reported in the metrics.
    reduce_dtype: dtype of every cross-device gradient reduction.
    donate: donate the input state's buffers to the output.

  Returns:
    A `jax.jit` function, as `make_train_step`'s, whose metrics are loss, grad_norm,
    update_norm, tokens, skipped (1 if the non-stacked leaves were not updated),
    skipped_layers, consecutive_skips, loss_scale and learning_rate (if given).

  Raises:
    ValueError: for what release does not support (`check_release`).
  """
  depth = check_release(plan, parts, tx, microbatches=microbatches,
                        max_grad_norm=max_grad_norm, loss_scaling=loss_scaling)
  reduce_dtype, stack = jnp.dtype(reduce_dtype), parts.stack
  is_dim = lambda d: d is None
  dims = plan.param_dims
  # Devices of a shard group holding the same (unsharded) leaf: each counts 1/copies
  # when the squares are summed over the ZeRO axes.
  copies = jax.tree.map(lambda d: 1 if d is not None else plan.num_shards, dims,
                        is_leaf=is_dim)
  mean_scale = jnp.asarray(1.0 / plan.num_data, reduce_dtype)
  cast = lambda tree: jax.tree.map(lambda x: x.astype(reduce_dtype), tree)
  agree = lambda ok: jax.lax.pmin(ok.astype(jnp.int32), plan.mesh.axis_names) > 0
  # Offloaded optimizer state: layer i's slice comes to the device for its update.
  apply = offload.streamed(functools.partial(updates.apply, tx), plan)

  def gathered(layer):
    """One layer's shards as the whole params in the param dtype. Differentiated with
    respect to shards in the reduce dtype, the gathers' backward passes reduce-scatter
    in it; the forward pass gathers the stored shards as they are (an fp32 cast of the
    scanned stack would be hoisted out of the loop: a whole fp32 copy)."""
    return jax.tree.map(
        lambda d, p, like: p.astype(like.dtype) if d is None else stage3.gather_leaf(
            p, d - 1, plan.shard_axes, like.dtype),
        dims[stack], layer, plan.params[stack], is_leaf=is_dim)

  def reduced(grads, dims):
    return jax.tree.map(lambda d, g: step_lib.sum_unreduced(plan, g.astype(reduce_dtype), d),
                        dims, grads, is_leaf=is_dim)

  def local(params, opt_state, batch):
    view = lambda rest: {k: v for k, v in step_lib.materialize(
        plan, {**rest, stack: params[stack]}).items() if k != stack}
    rest32 = cast({k: v for k, v in params.items() if k != stack})
    rest_dims = {k: v for k, v in dims.items() if k != stack}

    x, embed_vjp = jax.vjp(lambda r: parts.embed(view(r), batch), rest32)
    # The stack is scanned as its bits: XLA:CPU gathers in fp32 and would otherwise
    # hoist the upcast of the whole stack out of the loop (`stage3.to_bits`).
    unbits = lambda bits: jax.tree.map(stage3.from_bits, bits, plan.params[stack])
    x, inputs = jax.lax.scan(
        lambda x, bits: (parts.layer(gathered(unbits(bits)), x),
                         jax.tree.map(stage3.to_bits, x)),
        x, jax.tree.map(stage3.to_bits, params[stack]))
    loss, head_vjp = jax.vjp(
        lambda r, x: parts.head_loss(view(r), x, batch).astype(jnp.float32), rest32, x)
    d_rest, ct = head_vjp(jnp.ones((), jnp.float32))

    views = updates.LayerViews(plan, params, opt_state, depth)

    def body(k, carry):
      ct, p, s, skipped, grad_sq, update_sq = carry
      i = depth - 1 - k
      layer_p = views.params(p, i)
      x = jax.tree.map(stage3.from_bits,
                       jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(
                           a, i, keepdims=False), inputs), ct)
      _, vjp = jax.vjp(lambda q, x: parts.layer(gathered(q), x), cast(layer_p[stack]), x)
      g, ct = vjp(ct)
      g = reduced(g, dims[stack])
      finite = agree(precision.all_finite(g))
      new_p, new_s, squares = apply(
          {**layer_p, stack: g}, views.state(s, i), layer_p, finite=finite,
          scale=mean_scale, factor=None, copies=copies)
      grad_sq += updates.sum_squares(g, copies[stack], mean_scale)
      return (ct, views.put(p, new_p, i), views.put_state(s, new_s, i),
              skipped + 1 - finite.astype(jnp.int32), grad_sq,
              update_sq + jnp.where(finite, squares, 0.0))

    zero_sq = jnp.zeros((), jnp.float32)
    ct, p, s, skipped, grad_sq, update_sq = jax.lax.fori_loop(
        0, depth, body, (ct, params, opt_state, jnp.zeros((), jnp.int32), zero_sq, zero_sq))

    (d_embed,) = embed_vjp(ct)
    d_rest = reduced(jax.tree.map(jnp.add, d_rest, d_embed), rest_dims)
    finite = agree(precision.all_finite(d_rest))
    rest_p, rest_s, squares = apply(
        *updates.without_stacks(plan, {**d_rest, stack: p[stack]}, s, p),
        finite=finite, scale=mean_scale, factor=None, copies=copies)
    p = updates.pick(plan.per_layer, p, rest_p)
    s = updates.pick(plan.opt_per_layer, s, rest_s)
    grad_sq += updates.sum_squares(d_rest, {k: copies[k] for k in d_rest}, mean_scale)
    update_sq += jnp.where(finite, squares, 0.0)
    total = lambda x: jax.lax.psum(x, plan.shard_axes)
    metrics = dict(loss=jax.lax.pmean(loss, plan.data_axes),
                   grad_norm=jnp.sqrt(total(grad_sq)),
                   update_norm=jnp.sqrt(total(update_sq)),
                   skipped=(~finite).astype(jnp.float32),
                   skipped_layers=skipped.astype(jnp.float32))
    return p, s, metrics

  shardings = step_lib.state_shardings(plan)

  def step(state: step_lib.TrainState, batch: PyTree):
    step_lib.check_batch(batch, plan.num_data, 1)
    params, opt_state, metrics = jax.shard_map(
        local, mesh=plan.mesh, in_specs=(plan.param_specs, plan.opt_specs, plan.batch_spec),
        out_specs=(plan.param_specs, plan.opt_specs, P()), check_vma=False)(
            state.params, state.opt_state, batch)
    applied = (metrics["skipped"] == 0) & (metrics["skipped_layers"] == 0)
    loss_scale = precision.update_loss_scale(state.loss_scale, applied, loss_scaling)
    metrics.update(tokens=jnp.asarray(step_lib.leading_size(batch), jnp.float32),
                   consecutive_skips=loss_scale.consecutive_skips.astype(jnp.float32),
                   loss_scale=loss_scale.scale,
                   **step_lib.learning_rate_metric(state, learning_rate))
    return step_lib.TrainState(state.step + 1, params, opt_state, state.rng,
                           loss_scale), metrics

  batch_sharding = jax.sharding.NamedSharding(plan.mesh, plan.batch_spec)
  return jax.jit(step, in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, None), donate_argnums=(0,) if donate else ())
