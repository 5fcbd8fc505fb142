"""Non-trainable model state through the sharded step (issue 51): a linen BatchNorm's
statistics carried in `TrainState.model_state`, averaged over the data-parallel devices,
equal to a single-device run of the global batch, checkpointed and resumed."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import checkpoint


class Net(nn.Module):
  """A dense layer, BatchNorm, a head: 8 features -> 4 logits."""
  axis_name: tuple[str, ...] | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(32, use_bias=False)(x)  # BatchNorm subtracts any bias.
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                     axis_name=self.axis_name)(x)
    return nn.Dense(4)(nn.relu(x))


def xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(n):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(2.0, 3.0, size=(16, 8)).astype(np.float32),
           "y": rng.integers(0, 4, size=(16,)).astype(np.int32)} for _ in range(n)]


def single_device(steps):
  """The reference: plain jax.jit of the same model and optax on the whole batch."""
  model, tx = Net(), optax.sgd(0.1, momentum=0.9)
  # init_state splits its key and initialises the params from the first half.
  init_key = jax.random.split(jax.random.key(0))[0]
  variables = model.init(init_key, jnp.zeros((1, 8)), train=False)
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = tx.init(params)

  @jax.jit
  def step(params, stats, opt_state, batch):
    def loss(p):
      logits, new = model.apply({"params": p, "batch_stats": stats}, batch["x"], train=True,
                                mutable=["batch_stats"])
      return xent(logits, batch["y"]), new["batch_stats"]
    (_, stats), g = jax.value_and_grad(loss, has_aux=True)(params)
    u, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, u), stats, opt_state

  for batch in batches(steps):
    params, stats, opt_state = step(params, stats, opt_state, batch)
  return params, stats


def sharded(stage, steps, mesh, checkpoint_dir=None, stop_at=None):
  """The same run through zerojax on `mesh`; with `stop_at`, saved there and resumed from
  the checkpoint by a new plan and step."""
  tx = optax.sgd(0.1, momentum=0.9)
  shapes = jax.eval_shape(lambda k: Net().init(k, jnp.zeros((1, 8)), train=False),
                          jax.random.key(0))
  params, stats = shapes["params"], {"batch_stats": shapes["batch_stats"]}

  def build():
    plan = zerojax.make_plan(mesh, stage, params, tx, min_shard_size=0, model_state=stats)
    model = Net(axis_name=plan.data_axes)  # Synchronised BatchNorm: the global batch's.

    def loss_fn(p, batch, rng, model_state):
      del rng
      logits, new = model.apply({"params": p, **model_state}, batch["x"], train=True,
                                mutable=["batch_stats"])
      return xent(logits, batch["y"]), {}, new

    def eval_fn(p, batch, rng, model_state):
      del rng
      return xent(model.apply({"params": p, **model_state}, batch["x"], train=False),
                  batch["y"])
    return plan, zerojax.make_train_step(plan, loss_fn, tx), zerojax.make_eval_step(
        plan, eval_fn)

  def init_fn(key):
    variables = dict(Net().init(key, jnp.zeros((1, 8)), train=False))
    return variables.pop("params"), variables

  plan, step, _ = build()
  state = zerojax.init_state(plan, init_fn, tx, jax.random.key(0))
  for i, batch in enumerate(batches(steps)):
    if i == stop_at:
      with checkpoint.Checkpointer(checkpoint_dir, save_every_steps=1) as ckpt:
        ckpt.save(i, state)
      del state
      plan, step, _ = build()
      with checkpoint.Checkpointer(checkpoint_dir, save_every_steps=1) as ckpt:
        state, _ = ckpt.restore(i, plan)
    state, metrics = step(state, batch)
  _, _, evaluate = build()
  return state, evaluate(state.params, batches(1)[0], state.model_state), metrics


@pytest.mark.parametrize("stage", [0, 3])
def test_batch_stats_equal_a_single_device_run_and_resume(stage, tmp_path):
  mesh = zerojax.make_mesh(2, 4)
  state, evaluated, metrics = sharded(stage, 3, mesh)
  ref_params, ref_stats = single_device(3)
  for got, want in ((state.model_state["batch_stats"], ref_stats), (state.params, ref_params)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
  assert np.isfinite(float(evaluated["loss"])) and set(metrics) >= {"loss", "grad_norm"}

  resumed, _, _ = sharded(stage, 3, mesh, checkpoint_dir=tmp_path, stop_at=2)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_scalar_aux_and_missing_state_are_refused():
  mesh = zerojax.make_mesh(1, 8)
  tx = optax.sgd(0.1)
  params = {"w": jnp.zeros((8, 4))}
  plan = zerojax.make_plan(mesh, 2, params, tx)
  state = zerojax.init_state(plan, lambda k: params, tx, jax.random.key(0))
  batch = {"x": jnp.ones((16, 8))}
  stats = lambda p, b, r: (jnp.mean(b["x"] @ p["w"]), {"mean": jnp.mean(b["x"], 0)})
  with pytest.raises(ValueError, match=r"aux value \['mean'\] has shape .8,.*model state"):
    zerojax.make_train_step(plan, stats, tx)(state, batch)

  stateful = zerojax.make_plan(mesh, 2, params, tx, model_state={"n": jnp.zeros(())})
  with pytest.raises(ValueError, match="init_fn must return .params, model_state."):
    zerojax.init_state(stateful, lambda k: params, tx, jax.random.key(0))
  state = zerojax.init_state(stateful, lambda k: (params, {"n": jnp.zeros(())}), tx,
                             jax.random.key(0))
  two = lambda p, b, r, s: (jnp.mean(b["x"] @ p["w"]), {})
  with pytest.raises(ValueError, match=r"returns \(loss, aux_dict, new_model_state\)"):
    zerojax.make_train_step(stateful, two, tx)(state, batch)
