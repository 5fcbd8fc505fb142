"""Fine-tune part of a model: optax `multi_transform` freezes the embedding, the rest is
trained by AdamW with gradient accumulation over microbatches, at ZeRO stage 1.

Shows: any optax transform on the plan (the frozen leaves get `optax.set_to_zero`, so
they never move, and their optimizer state is empty), microbatches, the metrics a step
reports.

    python examples/frozen_layers_microbatches.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax

VOCAB, D = 64, 32


def init_fn(rng):
  k1, k2, k3 = jax.random.split(rng, 3)
  return {"embed": jax.random.normal(k1, (VOCAB, D)),
          "hidden": {"kernel": jax.random.normal(k2, (D, 4 * D)) / np.sqrt(D),
                     "bias": jnp.zeros(4 * D)},
          "head": jax.random.normal(k3, (4 * D, VOCAB)) / np.sqrt(4 * D)}


def loss_fn(params, batch, rng):
  """Predicts the token after each one from it alone (a bigram model)."""
  del rng
  x = params["embed"][batch["tokens"][:, :-1]]
  h = jax.nn.gelu(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  return optax.softmax_cross_entropy_with_integer_labels(
      h @ params["head"], batch["tokens"][:, 1:]).mean()


def data(step, batch_size=32, seq=17):
  start = np.random.default_rng(step).integers(0, VOCAB, (batch_size, 1))
  return {"tokens": ((start + 3 * np.arange(seq)) % VOCAB).astype(np.int32)}


def main(steps: int = 30) -> dict:
  labels = lambda params: jax.tree.map(lambda _: "train", params) | {"embed": "frozen"}
  tx = optax.multi_transform({"train": optax.adamw(1e-3), "frozen": optax.set_to_zero()},
                             labels)
  shapes = jax.eval_shape(init_fn, jax.random.key(0))
  plan = zerojax.make_plan(zerojax.make_mesh(data=2, fsdp=4), stage=1, params=shapes, tx=tx)
  state = zerojax.init_state(plan, init_fn, tx, jax.random.key(0))
  embed_before = np.asarray(state.params["embed"])
  # 32 sequences a step: 8 devices x 4 microbatches of 1 sequence each.
  step = zerojax.make_train_step(plan, loss_fn, tx, microbatches=4, max_grad_norm=1.0)
  for i in range(steps):
    state, metrics = step(state, data(i))
  assert np.array_equal(np.asarray(state.params["embed"]), embed_before)  # frozen
  print(f"step {steps}: loss {float(metrics['loss']):.3f}, grad norm "
        f"{float(metrics['grad_norm']):.3f}; the embedding did not move")
  return {"train": metrics, "state": state}


if __name__ == "__main__":
  zerojax.fake_cpu_devices(8)                        # before JAX starts its backend
  main()
