"""Save and restore a zerojax run from Python: orbax checkpoints of the sharded state.

Shows: `zerojax.Checkpointer` saving every few steps (asynchronously, the newest kept),
restoring onto a plan (any mesh or stage: here stage 3 saved, stage 2 restored), and that
the resumed run equals the uninterrupted one bit for bit. The data order is a function
of the step, so a resumed run reads the same batches.

    python examples/checkpoint_resume.py [--dir /tmp/zerojax-example]
"""

import argparse
import tempfile

import jax
import numpy as np
import optax

import zerojax

D = 64


def init_fn(rng):
  k1, k2 = jax.random.split(rng)
  return {"w1": jax.random.normal(k1, (D, 4 * D)) / 8, "w2": jax.random.normal(k2, (4 * D, D)) / 16}


def loss_fn(params, batch, rng):
  del rng
  y = jax.nn.relu(batch["x"] @ params["w1"]) @ params["w2"]
  return ((y - batch["x"][:, ::-1]) ** 2).mean()     # learn to reverse the features


def data(step):
  return {"x": np.random.default_rng(step).normal(size=(16, D)).astype(np.float32)}


def run(plan, tx, state, start, stop):
  step = zerojax.make_train_step(plan, loss_fn, tx)
  for i in range(start, stop):
    state, metrics = step(state, data(i))
  return state, metrics


def main(directory: str | None = None, steps: int = 12) -> dict:
  directory = directory or tempfile.mkdtemp(prefix="zerojax-example-")
  tx = optax.adamw(1e-3)
  mesh = zerojax.make_mesh(data=1, fsdp=8)
  shapes = jax.eval_shape(init_fn, jax.random.key(0))
  plan3 = zerojax.make_plan(mesh, stage=3, params=shapes, tx=tx)
  state = zerojax.init_state(plan3, init_fn, tx, jax.random.key(0))

  with zerojax.Checkpointer(directory, save_every_steps=4, keep=2) as ckpt:
    for i in range(steps // 2):
      state, _ = run(plan3, tx, state, i, i + 1)
      ckpt.maybe_save(int(state.step), state)        # at steps 4, 8, ...
  uninterrupted, _ = run(plan3, tx, state, steps // 2, steps)

  # A new process would start here: the same plan code, then the newest checkpoint.
  plan2 = zerojax.make_plan(mesh, stage=2, params=shapes, tx=tx)
  with zerojax.Checkpointer(directory, save_every_steps=4) as ckpt:
    restored, _ = ckpt.restore_latest(plan2)
  saved_at = int(restored.step)
  resumed, metrics = run(plan2, tx, restored, saved_at, steps)
  same = all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(jax.device_get(resumed)), jax.tree.leaves(jax.device_get(uninterrupted))))
  print(f"saved in {directory} at step {saved_at}, resumed at stage 2 to step {steps}: "
        f"loss {float(metrics['loss']):.4f}, identical to the uninterrupted run: {same}")
  return {"same": same, "saved_at": saved_at}


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dir", default=None, help="where the checkpoints go (a new temp dir)")
  zerojax.fake_cpu_devices(8)                        # before JAX starts its backend
  main(ap.parse_args().dir)
