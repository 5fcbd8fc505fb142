"""Loss scaling and non-finite steps, as pure state carried in the train state.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is scaled
up before the backward pass (and the gradients scaled back down, in fp32, after the
reduction). The scale is dynamic, with DeepSpeed's knobs: start at 2^initial_power,
halve it when gradients overflow (after `hysteresis` overflows in a row), never below
`min_scale`, and double it after `window` finite steps in a row.

Whatever the dtype, a step whose gradients are not finite is skipped: params and
optimizer state stay as they were, the step is counted (`skipped`,
`consecutive_skips` in the metrics) and the trainer logs it with its step number.
bf16 and fp32 use a static scale of 1.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class NonFiniteError(RuntimeError):
  """Too many consecutive steps had non-finite gradients."""


@dataclasses.dataclass(frozen=True)
class LossScaling:
  """How the loss scale evolves (all fields as DeepSpeed's fp16 section).

  Attributes:
    dynamic: adjust the scale from overflows; False keeps `2^initial_power`.
    initial_power: the first scale is 2**initial_power.
    window: finite steps in a row after which the scale doubles.
    hysteresis: overflows in a row tolerated before the scale halves.
    min_scale: the scale never goes below this.
  """
  dynamic: bool = True
  initial_power: int = 16
  window: int = 1000
  hysteresis: int = 2
  min_scale: float = 1.0


NO_SCALING = LossScaling(dynamic=False, initial_power=0)


def loss_scaling_from_config(cfg_precision) -> LossScaling:
  """Dynamic scaling when params or compute are float16; otherwise a static 1."""
  if "float16" not in (cfg_precision.param_dtype, cfg_precision.compute_dtype):
    return NO_SCALING
  ls = cfg_precision.loss_scale
  return LossScaling(True, ls.initial_power, ls.window, ls.hysteresis, ls.min_scale)


class LossScale(NamedTuple):
  """The loss-scale state: scalars, replicated.

  Attributes:
    scale: float32, what the loss is multiplied by before differentiation.
    good_steps: int32, finite steps since the scale last changed or overflowed.
    hysteresis: int32, overflows still tolerated before the next backoff.
    consecutive_skips: int32, skipped steps in a row up to now.
    total_skips: int32, skipped steps in all: the optimizer (and its schedule) has
      taken `step - total_skips` updates.
  """
  scale: jax.Array
  good_steps: jax.Array
  hysteresis: jax.Array
  consecutive_skips: jax.Array
  total_skips: jax.Array


def init_loss_scale(cfg: LossScaling = NO_SCALING) -> LossScale:
  zero = jnp.zeros((), jnp.int32)
  return LossScale(jnp.asarray(2.0 ** cfg.initial_power, jnp.float32), zero,
                   jnp.asarray(cfg.hysteresis, jnp.int32), zero, zero)


def update_loss_scale(state: LossScale, finite: jax.Array,
                      cfg: LossScaling = NO_SCALING) -> LossScale:
  """The loss scale after a step whose gradients were `finite` (a bool scalar)."""
  skips = jnp.where(finite, 0, state.consecutive_skips + 1)
  total = state.total_skips + jnp.where(finite, 0, 1)
  state = state._replace(consecutive_skips=skips.astype(jnp.int32),
                         total_skips=total.astype(jnp.int32))
  if not cfg.dynamic:
    return state
  grow = finite & (state.good_steps + 1 >= cfg.window)
  back_off = ~finite & (state.hysteresis <= 1)
  scale = jnp.where(grow, state.scale * 2,
                    jnp.where(back_off, jnp.maximum(state.scale / 2, cfg.min_scale),
                              state.scale))
  good = jnp.where(finite & ~grow, state.good_steps + 1, 0)
  # As DeepSpeed: once the tolerance is used up, every further overflow halves the
  # scale; it is restored only when the scale grows again.
  hysteresis = jnp.where(finite, jnp.where(grow, cfg.hysteresis, state.hysteresis),
                         jnp.maximum(state.hysteresis - 1, 1))
  return state._replace(scale=scale.astype(jnp.float32), good_steps=good.astype(jnp.int32),
                        hysteresis=hysteresis.astype(jnp.int32))


def all_finite(tree) -> jax.Array:
  """True if every element of every leaf is finite (a bool scalar)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def calibration_skips(cfg: LossScaling) -> int:
  """The overflows a run may start with while its loss scale finds its level.

  From 2^initial_power the first `hysteresis - 1` overflows use up the tolerance and
  each later one halves the scale, until it reaches `min_scale`: that many skips in a
  row before any finite step are the scale calibrating, not a sign that the run is
  broken (DeepSpeed configs often start at 2^32, far above what fp16 gradients bear).
  """
  if not cfg.dynamic or 2.0 ** cfg.initial_power <= cfg.min_scale:
    return 0
  return cfg.hysteresis - 1 + math.ceil(cfg.initial_power - math.log2(cfg.min_scale))


def check_skips(step: int, metrics: dict, limit: int,
                scaling: LossScaling = NO_SCALING, release: bool = False) -> str | None:
  """A log line for a skipped step, or NonFiniteError once `limit` came in a row.

  Skips before the run's first finite step do not count while the scale is still
  calibrating (`calibration_skips`): the limit counts only the skips after them. That
  is the whole allowance because a scale that has once seen a finite step is at a level
  the gradients bear; it climbs from there one doubling per `window` finite steps, and
  an overflow up there halves it back within `hysteresis` skips. A longer row later
  means the gradients themselves blew up, whatever the scale. (A limit that grew with
  initial_power for every row would let a diverged fp16 run go on for dozens of steps.)

  Args:
    step: the step number the metrics belong to (steps taken, skipped ones included).
    metrics: the step's metrics (host values): skipped, consecutive_skips, loss_scale.
    limit: consecutive skips that end the run; 0 never does.
    scaling: the run's loss scaling, for the calibration allowance and the advice.
    release: the run uses gradient release (clipping needs optimizer.release_clipping).

  Returns:
    None for a normal step, else the line to log.
  """
  if not metrics["skipped"]:
    return None
  row, scale = int(metrics["consecutive_skips"]), float(metrics["loss_scale"])
  # row == step: every step so far was skipped (the counter is in the checkpointed
  # state, so this holds across a resume too).
  allowance = calibration_skips(scaling) if row == step else 0
  calibrating = row <= allowance
  line = (f"step {step}: gradients not finite, update skipped ({row} in a row; loss scale "
          f"now {scale:g}" + (f", calibrating from 2^{scaling.initial_power}: not counted)"
                              if calibrating else ")"))
  if calibrating or not limit or row - allowance < limit:
    return line
  after = (f" after the {allowance} that brought the loss scale down from "
           f"2^{scaling.initial_power} to min_scale" if allowance else "")
  clip = "optimizer.grad_clip > 0" + (
      " with optimizer.release_clipping='per_layer' (or 'previous_norm')" if release else "")
  if not scaling.dynamic:
    advice = (f"Try: a lower learning rate or more warmup, {clip}, or check the data for bad "
              "tokens.")
  elif scale <= scaling.min_scale:  # At its floor: a smaller scale was not allowed.
    advice = (f"The loss scale is at precision.loss_scale.min_scale={scaling.min_scale:g}, "
              + ("so the scaled gradients may overflow. Try: a smaller "
                 "precision.loss_scale.min_scale, " if scaling.min_scale > 1 else
                 "so the float16 forward or backward itself overflows. Try: ")
              + f"bfloat16 instead of float16, a lower learning rate or more warmup, {clip}, "
              "or check the data for bad tokens.")
  else:
    advice = (f"The loss scale was still coming down (min_scale {scaling.min_scale:g}). Try: a "
              f"lower learning rate or more warmup, {clip}, bfloat16 instead of "
              "float16, a larger precision.max_consecutive_skips to let the scale go lower, or "
              "check the data for bad tokens.")
  raise NonFiniteError(
      f"{line}. {row - allowance} consecutive steps had non-finite gradients{after}, so "
      f"training stopped rather than run on without learning. {advice}")
