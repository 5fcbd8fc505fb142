"""What gradient release changes, against a float64 numpy reference of the documented
math (`zerojax.optim`'s docstring): optimizer accumulation over microbatches (AdamW,
Lion) and clipping by the previous step's norm or per layer, on 8 CPU devices, fp32.

The reference takes each microbatch's gradient from `jax.grad` of the whole (unsharded)
model in fp32 and does everything else in float64; the release step shards, reduces
and updates in fp32, so they agree to fp32 reduction-order noise (1e-5 relative per
leaf over 3 steps; `pytest -s` prints the worst per case: docs/design/release.md has them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax import optim
from zerojax.models.llama import LlamaConfig, LlamaLM
from zerojax.models.mlp_lm import MlpLM
from zerojax.release import make_release_step

from test_release import LLAMA
from test_release_packed import packed_batches

SMALL = dict(vocab_size=64, d_model=32, d_ff=64, n_layers=3, context=4)
HYPER = {"adamw": dict(learning_rate=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
         "lion": dict(learning_rate=1e-3, b1=0.9, b2=0.99, weight_decay=0.1)}
STEPS, DEVICES, TOLERANCE = 3, 8, 1e-5


def optimizer(name, clipping):
  tx = {"adamw": optim.adamw, "lion": optim.lion}[name](**HYPER[name])
  return optim.carry_grad_norm(tx) if clipping == "previous_norm" else tx


def moments(opt_state):
  """(mu, nu or None) of the optimizer state, wherever the chain keeps them."""
  found = lambda x: isinstance(x, (optim.ScaleByAdamState, optim.LionState))
  (state,) = [x for x in jax.tree.leaves(opt_state, is_leaf=found) if found(x)]
  return state.mu, getattr(state, "nu", None)


def microbatches_of(batch, n):
  """Microbatch k as the release step makes it: the k-th n-th of every device's rows
  (of every array of the batch)."""
  def split(x, k):
    rows = len(x) // DEVICES
    per = rows // n
    return np.concatenate([x[d * rows + k * per:d * rows + (k + 1) * per]
                           for d in range(DEVICES)])
  return [jax.tree.map(lambda x, k=k: split(x, k), batch) for k in range(n)]


def clip_per_layer(g, max_norm, factors):
  """Each layer of the stack, and the other leaves as one group, clipped to max_norm;
  the scales go to `factors`."""
  scale = lambda tree, f: jax.tree.map(lambda x: x * f, tree)
  factor = lambda sq: min(1.0, max_norm / (np.sqrt(sq) + 1e-6))
  layers = jax.tree.map(np.copy, g["layers"])
  for i in range(len(jax.tree.leaves(layers)[0])):
    f = factor(sum(np.sum(v[i] ** 2) for v in jax.tree.leaves(layers)))
    factors.append(f)
    for v in jax.tree.leaves(layers):
      v[i] *= f
  rest = {k: v for k, v in g.items() if k != "layers"}
  return {**scale(rest, factor(sum(np.sum(v ** 2) for v in jax.tree.leaves(rest)))),
          "layers": layers}


def reference(model, params, data, name, n, clipping, max_norm):
  """float64 numpy: params and moments after len(data) release steps (the math of
  `zerojax.optim`'s docstring); also the largest clipping scale below 1 seen."""
  h = HYPER[name]
  lr, wd, b1, b2 = h["learning_rate"], h["weight_decay"], h["b1"], h["b2"]
  grad = jax.jit(jax.grad(model.loss))
  p = jax.tree.map(np.float64, params)
  mu = jax.tree.map(np.zeros_like, p)
  nu = jax.tree.map(np.zeros_like, p)
  previous, clipped = 0.0, []
  sq = lambda tree: sum(np.sum(x ** 2) for x in jax.tree.leaves(tree))
  for t, batch in enumerate(data, start=1):
    at = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)
    gs = [jax.tree.map(np.float64, grad(at, micro)) for micro in microbatches_of(batch, n)]
    norm = np.sqrt(np.mean([sq(g) for g in gs]))
    if clipping == "previous_norm":
      f = min(1.0, max_norm / (previous + 1e-6))
      clipped.append(f)
      gs = [jax.tree.map(lambda x, f=f: x * f, g) for g in gs]
    elif clipping == "per_layer":
      gs = [clip_per_layer(g, max_norm, clipped) for g in gs]
    previous = norm
    mean = lambda xs: sum(xs) / n
    if name == "adamw":
      mu = jax.tree.map(lambda m, *g: b1 * m + (1 - b1) * mean(g), mu, *gs)
      nu = jax.tree.map(lambda v, *g: b2 * v + (1 - b2) * mean([x ** 2 for x in g]), nu, *gs)
      u = jax.tree.map(lambda m, v: (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t))
                                                         + h["eps"]), mu, nu)
    else:
      # The momentum before the last microbatch's share (n > 1), then the direction.
      before = mu if n == 1 else jax.tree.map(
          lambda m, *g: b2 * m + (1 - b2) * sum(g[:-1]) / n, mu, *gs)
      u = jax.tree.map(lambda m, g: np.sign(b1 * m + (1 - b1) * g), before, gs[-1])
      mu = jax.tree.map(lambda m, g: b2 * m + (1 - b2) * g if n == 1 else m + (1 - b2) * g / n,
                        before, gs[-1])
    p = jax.tree.map(lambda x, u: x - lr * (u + wd * x), p, u)
  return p, mu, (nu if name == "adamw" else None), clipped


def release_run(model, params, data, name, n, mesh_shape, clipping, max_norm,
                accumulation="optimizer"):
  tx = optimizer(name, clipping)
  plan = zerojax.make_plan(zerojax.make_mesh(*mesh_shape), 3,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  step = make_release_step(plan, model.layered(), tx, microbatches=n,
                           accumulation=accumulation, max_grad_norm=max_norm,
                           clipping=clipping)
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0), params=jax.device_put(
      params, plan.shardings(plan.param_specs)))
  for batch in data:
    state, metrics = step(state, batch)
  return state, metrics


def relative(a, b):
  a, b = np.float64(a), np.float64(b)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def setup(batch):
  model = MlpLM(**SMALL)
  params = jax.tree.map(np.asarray, model.init(jax.random.key(1)))
  rs = np.random.RandomState(0)
  data = [{"tokens": rs.randint(0, 64, size=(batch, 17)).astype(np.int32)}
          for _ in range(STEPS)]
  return model, params, data


def setup_packed(batch):
  """A Llama in fp32 on packed fine-tuning rows (>= 3 examples a row, `packed_batches`)."""
  model = LlamaLM(LlamaConfig(**LLAMA, param_dtype="float32", compute_dtype="float32"))
  params = jax.tree.map(np.asarray, model.init(jax.random.key(1)))
  return model, params, packed_batches(STEPS, batch)


@pytest.mark.parametrize("name, n, mesh_shape, clipping, max_norm, data", [
    ("adamw", 2, (1, 8), "none", 0.0, "tokens"),
    ("lion", 4, (2, 4), "none", 0.0, "tokens"),
    ("adamw", 1, (1, 8), "previous_norm", 0.5, "tokens"),
    ("lion", 2, (1, 8), "previous_norm", 0.5, "tokens"),
    ("adamw", 2, (2, 4), "per_layer", 0.2, "tokens"),
    ("adamw", 2, (1, 8), "previous_norm", 0.1, "packed"),
    ("lion", 2, (2, 4), "per_layer", 0.05, "packed"),
])
def test_release_matches_the_reference(name, n, mesh_shape, clipping, max_norm, data):
  """3 steps: params and moments within 1e-5 of the float64 reference, every leaf; with
  clipping the reference did clip (by the previous norm: from step 2 on). 'packed': a
  Llama on packed fine-tuning rows (segment ids, positions, loss mask in every layer)."""
  model, params, data = {"tokens": setup, "packed": setup_packed}[data](DEVICES * n * 2)
  want_p, want_mu, want_nu, clipped = reference(model, params, data, name, n, clipping,
                                                max_norm)
  # The test sees clipping at work (and the first step unclipped by the previous norm).
  if clipping == "previous_norm":
    assert clipped[0] == 1.0 and max(clipped[1:]) < 0.9, clipped
  if clipping == "per_layer":
    assert max(clipped) < 0.9, clipped
  state, metrics = release_run(model, params, data, name, n, mesh_shape, clipping, max_norm)
  mu, nu = moments(state.opt_state)
  pairs = [("params", state.params, want_p), ("mu", mu, want_mu)]
  pairs += [("nu", nu, want_nu)] if want_nu is not None else []
  for what, got, want in pairs:
    errors = [relative(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                                             strict=True)]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)]
    print(f"{name} n={n} {mesh_shape} {clipping}: worst {what} {max(errors):.1e}")
    assert max(errors) <= TOLERANCE, (what, dict(zip(paths, errors, strict=True)))
  assert metrics["skipped_layers"] == 0 and metrics["skipped"] == 0


def test_one_microbatch_with_accumulation_is_the_plain_release_step():
  """accumulation='optimizer' with one microbatch: bit for bit the plain release step,
  which `tests/test_release.py` shows equal to the normal step."""
  model, params, data = setup(batch=DEVICES * 2)
  runs = [release_run(model, params, data, "adamw", 1, (1, 8), "none", 0.0, accumulation=a)[0]
          for a in ("none", "optimizer")]
  for a, b in zip(*(jax.tree.leaves((s.params, s.opt_state)) for s in runs), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_optimizer_accumulation_against_gradient_accumulation():
  """One AdamW step, 4 microbatches: optimizer accumulation's mu is gradient
  accumulation's (the normal step with microbatches=4), its nu is at least as large
  (it averages the squares of the microbatch gradients instead of squaring their mean)
  and strictly larger somewhere, so its update is no larger."""
  model, params, data = setup(batch=DEVICES * 4)
  tx = optimizer("adamw", "none")
  plan = zerojax.make_plan(zerojax.make_mesh(1, 8), 3,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  normal = zerojax.make_train_step(plan, model.loss, tx, microbatches=4)
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0), params=jax.device_put(
      params, plan.shardings(plan.param_specs)))
  true_state, true_metrics = normal(state, data[0])
  ours, metrics = release_run(model, params, data[:1], "adamw", 4, (1, 8), "none", 0.0)
  (true_mu, true_nu), (mu, nu) = moments(true_state.opt_state), moments(ours.opt_state)
  for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(true_mu), strict=True):
    assert relative(a, b) <= 1e-6
  excess = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
            for a, b in zip(jax.tree.leaves(nu), jax.tree.leaves(true_nu), strict=True)]
  assert all((e >= -1e-6 * np.abs(b).max()).all()
             for e, b in zip(excess, jax.tree.leaves(true_nu), strict=True))
  assert max(e.max() for e in excess) > 0
  assert float(metrics["update_norm"]) <= float(true_metrics["update_norm"])
  assert float(metrics["grad_norm"]) >= float(true_metrics["grad_norm"])
