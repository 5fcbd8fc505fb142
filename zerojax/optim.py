"""Optimizers and learning-rate schedules from the `optimizer` section of a config.

Gradient clipping is deliberately not part of these chains: the train step clips by
the fp32 global norm of the reduced gradients itself (`make_train_step(max_grad_norm=)`),
so the clip sees exactly the gradient the update uses, whatever the optimizer.
"""

import optax


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


def optimizer_from_config(cfg_optimizer, total_steps: int
                          ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optax transform and its schedule.

  adamw: optax.adamw with (b1, b2, eps, weight_decay), decoupled weight decay.
  sgd: weight decay (`add_decayed_weights`, i.e. L2 on the gradient), then SGD with
  (momentum, nesterov); momentum 0 keeps no momentum buffer.

  Args:
    cfg_optimizer: the config's `optimizer` section.
    total_steps: steps of the run, for the schedule.

  Returns:
    (tx, schedule): the schedule is also what the step reports as `learning_rate`.
  """
  c = cfg_optimizer
  schedule = learning_rate_schedule(c, total_steps)
  if c.name == "adamw":
    tx = optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)
  elif c.name == "sgd":
    tx = optax.chain(
        optax.add_decayed_weights(c.weight_decay),
        optax.sgd(schedule, momentum=c.momentum or None, nesterov=c.nesterov))
  else:
    raise ValueError(f"unknown optimizer {c.name!r}; use adamw or sgd")
  return tx, schedule
