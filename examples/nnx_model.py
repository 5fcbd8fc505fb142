"""An NNX model with BatchNorm and dropout at ZeRO stage 3, through `zerojax.from_nnx`.

Shows: an NNX module on the plan (its `nnx.Param`s trained and sharded, its
`nnx.BatchStat`s carried as model state and synchronised over the data-parallel
devices), dropout drawing from the step's rng passed per call, an eval step on the
module in inference mode, and the trained module back as an NNX object.

    python examples/nnx_model.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zerojax

# The mesh axes the batch is split over (`zerojax.make_mesh`'s): BatchNorm averages its
# batch statistics over them, so they are the global batch's.
DATA_AXES = ("data", "expert", "fsdp")


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(16, 64, use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(64, axis_name=DATA_AXES, rngs=rngs)
    self.dropout = nnx.Dropout(0.1)
    self.out = nnx.Linear(64, 4, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    h = nnx.relu(self.norm(self.hidden(x)))
    return self.out(self.dropout(h, rngs=rngs))


def loss_fn(module, batch, rng):
  """The step's rng reaches dropout per call: a key stored in the module cannot advance
  inside the jitted step."""
  logits = module(batch["x"], rngs=nnx.Rngs(dropout=rng))
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {
      "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def data(step, batch_size=64):
  """Which of 4 quarters of the features has the largest sum."""
  x = np.random.default_rng(step).normal(1.0, 2.0, size=(batch_size, 16)).astype(np.float32)
  return {"x": x, "y": x.reshape(batch_size, 4, 4).sum(-1).argmax(-1).astype(np.int32)}


def main(steps: int = 40) -> dict:
  model = zerojax.from_nnx(MLP, loss_fn)
  tx = zerojax.with_update_rule(optax.adamw(3e-3), "nearest")
  plan = zerojax.make_plan(zerojax.make_mesh(data=2, fsdp=4), stage=3, params=model.params,
                           tx=tx, model_state=model.model_state)
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0))
  step = zerojax.make_train_step(plan, model.loss, tx)
  evaluate = zerojax.make_eval_step(plan, model.eval_loss)
  for i in range(steps):
    state, metrics = step(state, data(i))
  held_out = evaluate(state.params, data(10_000), state.model_state)
  trained = model.module(jax.device_get(state.params), jax.device_get(state.model_state))
  print(f"step {steps}: train loss {float(metrics['loss']):.3f}, held-out accuracy "
        f"{float(held_out['accuracy']):.2f}; running mean of the first feature "
        f"{float(trained.norm.mean[...][0]):.3f}")
  return {"train": metrics, "eval": held_out, "state": state, "module": trained}


if __name__ == "__main__":
  zerojax.fake_cpu_devices(8)                        # before JAX starts its backend
  main()
