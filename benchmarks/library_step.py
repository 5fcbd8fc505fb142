"""A user's own model through zerojax's step, against plain `jax.jit` of the same model.

Issue 51's benchmark: a linen CNN (two 3x3 convolutions, a dense head; fp32) trained by
`zerojax.make_train_step` at stages 0-3 on 8 fake CPU devices, each step's time divided
by a plain `jax.jit` step of the same model and optimizer on the same devices (params
and Adam state replicated, the batch split over all devices: GSPMD's all-reduce).
Rounds are interleaved (baseline, stage 0, ..., stage 3; again), so the machine's noise
falls on every arm alike; the ratio is of medians. Goal: <= 1.2 at every stage with one
microbatch. With `--microbatches 4` zerojax's step splits each device's batch in four
(the baseline still takes the whole batch at once: the cost of accumulating).
Results: `benchmarks/results/library_step[_mbN].json`, the table in benchmarks/README.md.

    python benchmarks/library_step.py [--rounds 7] [--steps 10] [--microbatches 1]
"""

import argparse
import json
import pathlib
import statistics
import time

from zerojax.runtime.devices import fake_cpu_devices

fake_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zerojax  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


class CNN(nn.Module):
  """28 x 28 x 1 images -> 10 logits (MNIST's shapes)."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(32, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), (2, 2))
    x = nn.relu(nn.Conv(64, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), (2, 2))
    x = nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1)))
    return nn.Dense(10)(x)


def loss_fn(params, batch, rng):
  del rng
  logits = CNN().apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def timed(step, state, batch, steps):
  """Seconds a step, the median of `steps` (after one to warm up)."""
  state, m = step(state, batch)
  jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  return state, statistics.median(times)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--microbatches", type=int, default=1)
  args = ap.parse_args()

  mesh = zerojax.make_mesh(1, 8)
  rng = jax.random.key(0)
  x = jnp.zeros((1, 28, 28, 1))
  params_shape = jax.eval_shape(lambda k: CNN().init(k, x)["params"], rng)
  tx = optax.adamw(1e-3)
  data = np.random.default_rng(0)
  batch_sharding = NamedSharding(mesh, P(("data", "expert", "fsdp")))
  batch = jax.device_put({
      "x": data.normal(size=(args.batch, 28, 28, 1)).astype(np.float32),
      "y": data.integers(0, 10, size=(args.batch,)).astype(np.int32)}, batch_sharding)

  # The baseline: what a JAX user writes by hand.
  replicated = NamedSharding(mesh, P())

  def plain_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, None)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

  params = jax.device_put(CNN().init(rng, x)["params"], replicated)
  arms = {"jax.jit": (jax.jit(plain_step, donate_argnums=0),
                      (params, jax.device_put(tx.init(params), replicated)))}
  for stage in range(4):
    plan = zerojax.make_plan(mesh, stage, params_shape, tx, min_shard_size=0)
    step = zerojax.make_train_step(plan, loss_fn, tx, microbatches=args.microbatches)
    arms[f"stage {stage}"] = (step, zerojax.init_state(
        plan, lambda k: CNN().init(k, x)["params"], tx, rng))

  seconds = {name: [] for name in arms}
  for _ in range(args.rounds):
    for name, (step, state) in arms.items():
      state, s = timed(step, state, batch, args.steps)
      arms[name] = (step, state)
      seconds[name].append(s)
  base = statistics.median(seconds["jax.jit"])
  rows = {name: dict(median_ms=1e3 * statistics.median(t),
                     ratio=statistics.median(t) / base) for name, t in seconds.items()}
  print(f"| arm | ms / step (median of {args.rounds} rounds) | / jax.jit |")
  print("| --- | --- | --- |")
  for name, r in rows.items():
    print(f"| {name} | {r['median_ms']:.1f} | {r['ratio']:.2f} |")
  suffix = "" if args.microbatches == 1 else f"_mb{args.microbatches}"
  out = RESULTS / f"library_step{suffix}.json"
  out.write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
  main()
