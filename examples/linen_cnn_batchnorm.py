"""A linen CNN with BatchNorm trained by zerojax at ZeRO stage 2 on 8 fake CPU devices.

Shows: your own linen model and optax optimizer on the plan, BatchNorm's statistics as
model state (carried in the train state, synchronised over the data-parallel devices,
checkpointed with it), an eval step in inference mode.

    python examples/linen_cnn_batchnorm.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax


class CNN(nn.Module):
  """28 x 28 x 1 images -> 10 logits. `axis_name`: the mesh axes BatchNorm averages its
  batch statistics over (the plan's data axes: the global batch's statistics)."""
  axis_name: tuple[str, ...] | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    norm = lambda: nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)
    x = nn.relu(norm()(nn.Conv(16, (3, 3), use_bias=False)(x)))
    x = nn.avg_pool(x, (2, 2), (2, 2))
    x = nn.relu(norm()(nn.Conv(32, (3, 3), use_bias=False)(x)))
    x = nn.avg_pool(x, (2, 2), (2, 2))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


def data(step, batch_size=64):
  """A toy task: the label is which of 10 bands holds the image's brightest row."""
  rng = np.random.default_rng(step)
  y = rng.integers(0, 10, batch_size)
  x = rng.normal(size=(batch_size, 28, 28, 1)).astype(np.float32)
  x[np.arange(batch_size), 2 * y + 4] += 3.0
  return {"x": x, "y": y.astype(np.int32)}


def main(steps: int = 30) -> dict:
  mesh = zerojax.make_mesh(data=2, fsdp=4)            # 8 devices: 2 replicas x 4 shards
  tx = optax.adamw(3e-3, weight_decay=1e-4)
  image = jnp.zeros((1, 28, 28, 1))
  shapes = jax.eval_shape(lambda k: CNN().init(k, image, train=False), jax.random.key(0))
  params, model_state = shapes["params"], {"batch_stats": shapes["batch_stats"]}
  plan = zerojax.make_plan(mesh, stage=2, params=params, tx=tx, model_state=model_state)
  model = CNN(axis_name=plan.data_axes)

  def init_fn(rng):                                  # -> (params, model state)
    variables = dict(CNN().init(rng, image, train=False))
    return variables.pop("params"), variables

  def loss_fn(params, batch, rng, model_state):      # -> (loss, metrics, new model state)
    logits, new_state = model.apply({"params": params, **model_state}, batch["x"],
                                    train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}, new_state

  def eval_fn(params, batch, rng, model_state):      # inference: the running statistics
    logits = model.apply({"params": params, **model_state}, batch["x"], train=False)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(),
            {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])})

  state = zerojax.init_state(plan, init_fn, tx, jax.random.key(0))
  step = zerojax.make_train_step(plan, loss_fn, tx)
  evaluate = zerojax.make_eval_step(plan, eval_fn)
  for i in range(steps):
    state, metrics = step(state, data(i))
  held_out = evaluate(state.params, data(10_000), state.model_state)
  print(f"step {steps}: train loss {float(metrics['loss']):.3f}, held-out accuracy "
        f"{float(held_out['accuracy']):.2f}")
  return {"train": metrics, "eval": held_out, "state": state}


if __name__ == "__main__":
  zerojax.fake_cpu_devices(8)                        # before JAX starts its backend
  main()
