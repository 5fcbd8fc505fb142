"""Optimizers for low-precision parameters, as optax transforms.

The optimizer room: the optimizers here, `update_rules` (how an fp32 update reaches a
bf16 parameter) and `precision` (loss scaling and skipped steps). It imports no other
zerojax room.

Two independent choices make a recipe:

* **state dtype**: every moment (Adam's `mu` *and* `nu`, Lion's and SGD's momentum) is
  stored in `state_dtype` (fp32 or bf16) and computed in fp32. optax keeps Adam's `nu`
  in the parameter dtype whatever `mu_dtype` says, so these are zerojax's own. (Any
  optax transform wrapped in `update_rules.with_update_rule` keeps its state in fp32.)
* **update rule**: how the fp32 update reaches a bf16 parameter: nearest, kahan,
  stochastic or master (`zerojax.optim.update_rules`).

Gradient clipping is deliberately not in these chains: the train step clips by the
fp32 global norm of the reduced gradients itself (`make_train_step(max_grad_norm=)`).
Gradient release (`zerojax.release`) cannot wait for that norm: `carry_grad_norm`
keeps the previous step's norm in the state for it to clip by.

**Optimizer accumulation** (gradient release with microbatches): the moment transforms
take two extra arguments, `decay` (False: do not decay the moments, a later microbatch
of the same step) and `weight` (the share of the moving average this gradient gets,
1/microbatches). `absorb` runs the update but keeps only the new moments: the params
do not move and counts, schedules and Kahan buffers are untouched. With n microbatches
of gradients g_1..g_n (g_bar = their mean, what gradient accumulation would use):

* AdamW: mu = b1 mu + (1 - b1) g_bar exactly; nu = b2 nu + (1 - b2) mean_k(g_k^2),
  which is the true nu plus (1 - b2) var_k(g_k) >= 0 (the microbatches' variance), so
  each update is at most as large as accumulation's. The count advances once.
* Lion: the momentum mu = b2 mu + (1 - b2) g_bar exactly; for n > 1 the direction
  sign(b1 m + (1 - b1) g_n) reads m, the momentum before the last microbatch's share
  (b2 mu + (1 - b2) sum_{k<n} g_k / n), instead of sign(b1 mu + (1 - b1) g_bar):
  the old momentum weighs b1 b2 instead of b1, the last microbatch (1 - b1) instead of
  (1 - b1) / n, the others b1 (1 - b2) / n instead of (1 - b1) / n (one buffer cannot
  hold both the old momentum and the step's gradient sum).

With one microbatch (decay True, weight 1) both are the plain update, bit for bit.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zerojax.optim.update_rules import f32 as _f32, with_update_rule

PyTree = Any


def _average(m: jax.Array, x: jax.Array, beta: float, decay: bool | jax.Array,
             weight: float) -> jax.Array:
  """fp32 `beta m + (1 - beta) x`; with optimizer accumulation `m` decays only if
  `decay` (the step's first microbatch) and `x` gets `weight` of its share."""
  keep = beta if decay is True else jnp.where(decay, beta, 1.0)
  return keep * _f32(m) + ((1 - beta) * weight) * x


# --- Leafwise transforms --------------------------------------------------------------


class LeafwiseTransformation(optax.GradientTransformationExtraArgs):
  """A transform whose update of each parameter element is elementwise.

  That is: the new value of each element of each param (and of the state leaves that
  mirror it) depends only on that element's gradient, param and state and on the
  state's scalars (step counts), never on other elements or leaves. Such an update
  can run on any slice of the leaves, e.g. one layer of layer-stacked params at a
  time, and give the same result as on the whole tree; `make_train_step` does that
  for the layer-stacked leaves, so the update's fp32 temporaries are one layer's.
  `adamw`, `lion` and `sgd` return one, except with a callable decay mask (it may look
  at the shapes it is given); with stochastic rounding, a `SeededLeafwise`.
  """
  __slots__ = ()


class SeededLeafwise(LeafwiseTransformation):
  """Leafwise but for its random bits (stochastic rounding): an update of a slice must
  say which (the extra argument `stream`, e.g. the layer index), and the update of a
  slice is then an equally distributed draw, not that slice of the whole tree's draw.
  The train step's per-layer update passes the layer; gradient release the layer and
  the device's shard."""
  __slots__ = ()


def _leafwise(tx: optax.GradientTransformation, update_rule: str,
              mask: Any) -> optax.GradientTransformation:
  """`tx` marked leafwise, where the rule and the mask allow it."""
  if callable(mask):
    return tx
  kind = SeededLeafwise if update_rule == "stochastic" else LeafwiseTransformation
  return kind(tx.init, tx.update)


# --- Moments in a chosen dtype --------------------------------------------------------


class ScaleByAdamState(NamedTuple):
  count: jax.Array  # int32 scalar: updates taken.
  mu: PyTree  # First moment, state_dtype.
  nu: PyTree  # Second moment, state_dtype.


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  state_dtype: Any = jnp.float32) -> optax.GradientTransformation:
  """Adam's direction, with both moments stored in `state_dtype`.

  With g the fp32 gradient and t the step (from 1):
  mu = b1 mu + (1 - b1) g,  nu = b2 nu + (1 - b2) g^2,
  u = (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t)) + eps), all in fp32; mu and nu are
  then stored in `state_dtype`.

  Raises:
    ValueError: 1 - b2 is under half of `state_dtype`'s epsilon (bf16 with b2 > 0.996):
      `b2 * nu` would round back to `nu`, so nu could never decay.
  """
  half_eps = float(jnp.finfo(state_dtype).eps) / 2
  if 1 - b2 < half_eps:
    raise ValueError(f"b2={b2} with {jnp.dtype(state_dtype).name} moments: nu * b2 rounds back to "
                     f"nu, so nu never decays; use b2 <= {1 - half_eps:.8g} or float32 state")

  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, state_dtype)
    return ScaleByAdamState(jnp.zeros((), jnp.int32), jax.tree.map(zeros, params),
                            jax.tree.map(zeros, params))

  def update(grads, state, params=None, *, decay=True, weight=1.0, **unused):
    del params, unused
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: _average(m, _f32(g), b1, decay, weight), state.mu, grads)
    nu = jax.tree.map(lambda v, g: _average(v, jnp.square(_f32(g)), b2, decay, weight),
                      state.nu, grads)
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** count.astype(jnp.float32)
    u = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
    store = lambda t: jax.tree.map(lambda x: x.astype(state_dtype), t)
    return u, ScaleByAdamState(count, store(mu), store(nu))

  return optax.GradientTransformationExtraArgs(init, update)


class MomentumState(NamedTuple):
  mu: PyTree  # state_dtype.


class LionState(NamedTuple):
  mu: PyTree  # The momentum, state_dtype.


def scale_by_lion(b1: float = 0.9, b2: float = 0.99,
                  state_dtype: Any = jnp.float32) -> optax.GradientTransformation:
  """Lion's direction: u = sign(b1 mu + (1 - b1) g), then mu = b2 mu + (1 - b2) g."""
  def init(params):
    return LionState(jax.tree.map(lambda p: jnp.zeros(p.shape, state_dtype), params))

  def update(grads, state, params=None, *, decay=True, weight=1.0, **unused):
    del params, unused
    u = jax.tree.map(lambda m, g: jnp.sign(b1 * _f32(m) + (1 - b1) * _f32(g)),
                     state.mu, grads)
    mu = jax.tree.map(lambda m, g: _average(m, _f32(g), b2, decay, weight).astype(
        state_dtype), state.mu, grads)
    return u, LionState(mu)

  return optax.GradientTransformationExtraArgs(init, update)


def trace(momentum: float, nesterov: bool = False,
          state_dtype: Any = jnp.float32) -> optax.GradientTransformation:
  """SGD momentum: mu = momentum mu + g; u = mu, or g + momentum mu (Nesterov)."""
  def init(params):
    return MomentumState(jax.tree.map(lambda p: jnp.zeros(p.shape, state_dtype), params))

  def update(grads, state, params=None):
    del params
    mu = jax.tree.map(lambda m, g: momentum * _f32(m) + _f32(g), state.mu, grads)
    u = jax.tree.map(lambda m, g: _f32(g) + momentum * m, mu, grads) if nesterov else mu
    return u, MomentumState(jax.tree.map(lambda m: m.astype(state_dtype), mu))

  return optax.GradientTransformation(init, update)


# --- Gradient release: optimizer accumulation and clipping by the previous norm ------


def accumulates(opt_state: PyTree) -> bool:
  """Whether an optimizer state has moments that can absorb microbatches (`absorb`):
  zerojax's adamw and lion (SGD's momentum is not offered)."""
  found = lambda x: isinstance(x, (ScaleByAdamState, LionState))
  return any(found(x) for x in jax.tree.leaves(opt_state, is_leaf=found))


def absorb(tx: optax.GradientTransformation, grads: PyTree, state: PyTree, params: PyTree,
           **extra) -> PyTree:
  """Optimizer accumulation's partial step: `state` with `grads` absorbed into its moments.

  Runs `tx.update(grads, state, params, **extra)` (`decay`, `weight`: see the module
  docstring) and keeps only the new moments (Adam's mu and nu, Lion's mu): the params
  do not move, and counts, schedules, Kahan and master buffers stay as they were. The
  unused parts of the update are dead code under `jax.jit`.
  """
  _, new = tx.update(grads, state, params, **extra)
  moments = lambda x: isinstance(x, (ScaleByAdamState, LionState))

  def keep(old, new):
    if isinstance(old, ScaleByAdamState):
      return old._replace(mu=new.mu, nu=new.nu)
    return new if isinstance(old, LionState) else old
  return jax.tree.map(keep, state, new, is_leaf=moments)


class PreviousNormState(NamedTuple):
  """`norm`: float32, the last applied step's global gradient norm; 0 before the first."""
  norm: jax.Array


def carry_grad_norm(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` with the previous step's global gradient norm in its state, to clip by it.

  Gradient release updates each layer before the step's global norm exists. An update
  given `clip_to` (extra argument) first scales the gradients by
  `min(1, clip_to / (norm + 1e-6))` with the stored norm: the first step (norm 0) is
  not clipped. An update given a finite `grad_norm` stores it for the next step (a
  step whose norm is not finite keeps the old one). Both are scalars of the state,
  so the result is leafwise when `tx` is.
  """
  def init(params):
    return PreviousNormState(jnp.zeros((), jnp.float32)), tx.init(params)

  def update(grads, state, params=None, *, clip_to=None, grad_norm=None, **extra):
    previous, inner = state
    if clip_to is not None:
      factor = jnp.minimum(1.0, clip_to / (previous.norm + 1e-6))
      grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
    u, inner = optax.with_extra_args_support(tx).update(grads, inner, params, **extra)
    norm = previous.norm if grad_norm is None else jnp.where(
        jnp.isfinite(grad_norm), grad_norm, previous.norm).astype(jnp.float32)
    return u, (PreviousNormState(norm), inner)

  wrap = type(tx) if isinstance(tx, LeafwiseTransformation) else (
      optax.GradientTransformationExtraArgs)
  return wrap(init, update)


# --- Optimizers -----------------------------------------------------------------------

Mask = PyTree | Callable[[PyTree], PyTree] | None


def adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 0.0, *, state_dtype: Any = jnp.float32,
          update_rule: str = "nearest", mask: Mask = None,
          seed: int = 0) -> optax.GradientTransformation:
  """AdamW: p <- p - lr * (adam(g) + weight_decay * p), landed by `update_rule`.

  Args:
    learning_rate: a float or an optax schedule of the step.
    b1, b2, eps: Adam's hyper-parameters (`scale_by_adam`).
    weight_decay: decoupled weight decay, multiplied by the learning rate.
    state_dtype: dtype of both moments (float32 or bfloat16).
    update_rule: one of `zerojax.optim.update_rules.UPDATE_RULES`.
    mask: which params decay (a pytree of bools or a function of the params).
    seed: stochastic-rounding seed.
  """
  tx = with_update_rule(optax.chain(
      scale_by_adam(b1, b2, eps, state_dtype),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate)), update_rule, seed=seed,
      state_dtype=state_dtype, fp32_params=False)
  return _leafwise(tx, update_rule, mask)


def lion(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99,
         weight_decay: float = 0.0, *, state_dtype: Any = jnp.float32,
         update_rule: str = "nearest", mask: Mask = None,
         seed: int = 0) -> optax.GradientTransformation:
  """Lion: p <- p - lr * (sign(b1 mu + (1 - b1) g) + weight_decay * p)."""
  tx = with_update_rule(optax.chain(
      scale_by_lion(b1, b2, state_dtype),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate)), update_rule, seed=seed,
      state_dtype=state_dtype, fp32_params=False)
  return _leafwise(tx, update_rule, mask)


def sgd(learning_rate: optax.ScalarOrSchedule, momentum: float = 0.0,
        nesterov: bool = False, weight_decay: float = 0.0, *,
        state_dtype: Any = jnp.float32, update_rule: str = "nearest", mask: Mask = None,
        seed: int = 0) -> optax.GradientTransformation:
  """SGD with L2 weight decay (added to the gradient) and optional (Nesterov) momentum."""
  parts = [optax.add_decayed_weights(weight_decay, mask)]
  if momentum:
    parts.append(trace(momentum, nesterov, state_dtype))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  tx = with_update_rule(optax.chain(*parts), update_rule, seed=seed, state_dtype=state_dtype,
                        fp32_params=False)
  return _leafwise(tx, update_rule, mask)


def decay_mask(logical_axes: PyTree) -> PyTree:
  """Decay matrices only: leaves with two or more axes besides a stacked 'layers' axis.

  Norm scales and biases (one axis per layer) are left alone, as is usual for LLMs.
  """
  return jax.tree.map(lambda names: sum(n != "layers" for n in names) >= 2, logical_axes,
                      is_leaf=lambda x: isinstance(x, tuple))


# --- From a config --------------------------------------------------------------------


def learning_rate_schedule(cfg_optimizer, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then constant, cosine or linear decay.

  Args:
    cfg_optimizer: the config's `optimizer` section (learning_rate, schedule,
      warmup_steps, min_lr_ratio).
    total_steps: steps of the run; cosine and linear decay reach
      `min_lr_ratio * learning_rate` here and stay there.

  Returns:
    An optax schedule: int step -> float32 learning rate.
  """
  peak, warmup = cfg_optimizer.learning_rate, cfg_optimizer.warmup_steps
  end = peak * cfg_optimizer.min_lr_ratio
  decay_steps = max(total_steps - warmup, 1)  # optax schedules need at least one step.
  after = {
      "constant": lambda: optax.constant_schedule(peak),
      "cosine": lambda: optax.cosine_decay_schedule(peak, decay_steps, alpha=end / peak),
      "linear": lambda: optax.linear_schedule(peak, end, decay_steps),
  }[cfg_optimizer.schedule]()
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def optimizer_from_config(cfg_optimizer, total_steps: int, *, mask: Mask = None,
                          seed: int = 0
                          ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optax transform and its schedule, from the config's `optimizer` section.

  Returns:
    (tx, schedule): the schedule is also what the step reports as `learning_rate`.
    With `release` and `release_clipping='previous_norm'`, tx carries the previous
    step's gradient norm in its state (`carry_grad_norm`).
  """
  c = cfg_optimizer
  schedule = learning_rate_schedule(c, total_steps)
  common = dict(weight_decay=c.weight_decay, state_dtype=jnp.dtype(c.state_dtype),
                update_rule=c.update_rule, mask=mask, seed=seed)
  if c.name == "adamw":
    tx = adamw(schedule, c.b1, c.b2, c.eps, **common)
  elif c.name == "lion":
    tx = lion(schedule, c.b1, c.b2, **common)
  elif c.name == "sgd":
    tx = sgd(schedule, c.momentum, c.nesterov, **common)
  else:
    raise ValueError(f"unknown optimizer {c.name!r}; use adamw, lion or sgd")
  if c.release and c.release_clipping == "previous_norm":
    tx = carry_grad_norm(tx)
  return tx, schedule
