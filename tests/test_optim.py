"""bf16 update rules and optimizers: stalls, compensation, unbiased rounding, memory."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import optim, updates
from zerojax.gpu import compile as gpu_compile, targets
from zerojax.models.mlp_lm import MlpLM
from zerojax.optim import update_rules

BF16, F32 = jnp.bfloat16, jnp.float32


def stall_run(make_tx, param_dtype, steps=300, n=2048, seed=0):
  """Small updates on weights of magnitude 0.02-1: the regime where bf16 stalls.

  The gradients are a fixed direction plus noise (1e-3 scale), the same stream for
  every run, so the fp32 reference moves steadily.

  Returns (initial fp32 params, final params as fp32).
  """
  rs = np.random.RandomState(seed)
  w0 = np.exp(rs.uniform(np.log(0.02), 0.0, n)) * rs.choice([-1.0, 1.0], n)
  w0 = np.asarray(jnp.asarray(w0, BF16), np.float32)  # Every run starts at the same point.
  direction = rs.normal(size=n)
  grads = (1e-3 * (direction + 0.5 * rs.normal(size=(steps, n)))).astype(np.float32)
  params = jnp.asarray(w0, param_dtype)
  tx = make_tx()
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  for g in grads:
    params, state = step(params, state, jnp.asarray(g))
  return w0, np.asarray(params, np.float32)


def stall_errors(factory, lr, steps=300):
  """||p - p_fp32|| / ||p_fp32 - p_init|| for each recipe, plus bf16's own floor.

  The floor is the error of the fp32 result itself rounded to bf16: no bf16-stored
  result can do better.
  """
  init, ref = stall_run(lambda: factory(lr, state_dtype=F32), F32, steps)
  moved = np.linalg.norm(ref - init)
  err = lambda p: float(np.linalg.norm(p - ref) / moved)
  recipes = {"nearest": ("nearest", BF16), "kahan_bf16": ("kahan", BF16),
             "kahan_fp32": ("kahan", F32), "stochastic": ("stochastic", BF16),
             "master": ("master", F32)}
  out = {name: err(stall_run(lambda: factory(lr, update_rule=rule, state_dtype=sd),
                             BF16, steps)[1])
         for name, (rule, sd) in recipes.items()}
  out["bf16_floor"] = err(np.asarray(jnp.asarray(ref, BF16), np.float32))
  return out


# b2 = 0.95: a bf16 nu cannot decay with optax's default 0.999 (adamw refuses it).
@pytest.mark.parametrize("factory", [functools.partial(optim.adamw, b2=0.95), optim.lion],
                         ids=["adamw", "lion"])
def test_stall_regime(factory):
  """lr 1e-5 for 300 steps: every update is under half an ulp of every weight.

  The weights move by ~3e-3 in total, under one bf16 ulp of the larger ones, so the
  bf16 floor itself is ~0.2-0.3 here; at lr 1e-4 it is ~0.02.
  """
  for lr in (1e-5, 1e-4):
    e = stall_errors(factory, lr)
    floor = e["bf16_floor"]
    assert e["nearest"] > 0.95, e  # Round-to-nearest loses (almost) every update.
    assert e["kahan_bf16"] <= 1.05 * floor and e["kahan_fp32"] <= 1.05 * floor, e
    assert e["master"] <= 1.01 * floor, e  # fp32 underneath: only the last rounding.
    assert e["kahan_bf16"] < e["stochastic"] < e["nearest"], e
    if lr == 1e-4:
      assert e["kahan_bf16"] <= 0.1, e


def test_weight_decay_acts_through_kahan():
  """lr * wd = 1e-5 < 2^-9: a plain bf16 decay rounds away, Kahan's accumulates."""
  def effect(rule, dtype):
    run = lambda wd: stall_run(lambda: optim.adamw(
        1e-4, weight_decay=wd, update_rule=rule, state_dtype=F32), dtype, steps=1000)[1]
    return np.linalg.norm(run(0.1) - run(0.0))

  fp32, kahan, nearest = effect("nearest", F32), effect("kahan", BF16), effect("nearest", BF16)
  assert abs(kahan - fp32) <= 0.1 * fp32, (kahan, fp32)
  assert nearest < 0.5 * fp32, (nearest, fp32)


def test_kahan_lands_exactly_and_keeps_the_remainder():
  p = jnp.asarray([1.0, -0.5, 0.03125], BF16)
  u = jnp.asarray([1e-3, -1e-4, 3e-6], F32)
  tx = update_rules.with_update_rule(optax.identity(), "kahan")
  updates, state = jax.jit(tx.update)(u, tx.init(p), p)
  new = optax.apply_updates(p, updates)
  assert new.dtype == BF16 and state.compensation.dtype == BF16
  exact = p.astype(F32) + u
  # The new weight plus what is carried forward is the exact sum, to bf16 precision
  # of the (small) remainder.
  np.testing.assert_allclose(new.astype(F32) + state.compensation.astype(F32), exact,
                             rtol=0, atol=2e-3 * np.abs(np.asarray(u)).max())
  assert float(state.compensation[1]) != 0.0  # -1e-4 is below half an ulp of 0.5.


def test_stochastic_rounding_is_unbiased():
  lo = jnp.asarray(1.0, BF16).astype(F32)
  ulp = float(jnp.finfo(BF16).eps)  # Spacing of bf16 numbers in [1, 2).
  x = jnp.full((200_000,), lo + 0.3 * ulp, F32)
  r = jax.jit(update_rules.stochastic_round, static_argnums=1)(x, BF16, jax.random.key(0))
  values = set(np.unique(np.asarray(r)).tolist())
  assert values == {1.0, 1.0 + ulp}  # Only the two neighbours.
  # E[r] = x; the standard error of the mean is sqrt(0.3 * 0.7 / n) ulps.
  bias = (float(jnp.mean(r.astype(jnp.float64) if jax.config.jax_enable_x64 else r))
          - float(x[0])) / ulp
  assert abs(bias) < 5 * np.sqrt(0.21 / x.size), bias
  neg = jax.jit(update_rules.stochastic_round, static_argnums=1)(-x, BF16, jax.random.key(1))
  assert abs(float(jnp.mean(neg)) + float(x[0])) / ulp < 5 * np.sqrt(0.21 / x.size)


def test_moments_are_stored_in_state_dtype_even_for_nu():
  params = {"w": jnp.ones((4, 4), BF16)}
  for state_dtype in (BF16, F32):
    state = optim.adamw(1e-3, b2=0.95, state_dtype=state_dtype).init(params)
    adam = state[0]
    assert adam.mu["w"].dtype == state_dtype and adam.nu["w"].dtype == state_dtype
  assert optim.lion(1e-3, state_dtype=BF16).init(params)[0].mu["w"].dtype == BF16


def test_fp32_adamw_matches_optax():
  params = {"w": jnp.linspace(-1, 1, 64, dtype=F32).reshape(8, 8)}
  ours = optim.adamw(1e-2, 0.9, 0.99, 1e-8, weight_decay=0.1)
  theirs = optax.adamw(1e-2, 0.9, 0.99, 1e-8, weight_decay=0.1)
  p1, p2, s1, s2 = params, params, ours.init(params), theirs.init(params)
  for i in range(10):
    g = jax.tree.map(lambda p: jnp.sin(p * (i + 1)), p1)
    u1, s1 = ours.update(g, s1, p1)
    u2, s2 = theirs.update(g, s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
  np.testing.assert_allclose(p1["w"], p2["w"], rtol=1e-6, atol=1e-7)


def test_kahan_compensation_carries_what_bf16_rounds_away():
  """1e-3 steps on 1.0 (half ulp 3.9e-3): only the compensation makes progress. (XLA:CPU
  compiles the same module whether `xla_allow_excess_precision` is on or off; what XLA's
  GPU compiler does with it is the next test.)"""
  p = jnp.ones((1024,), BF16)
  tx = update_rules.with_update_rule(optax.identity(), "kahan")
  step = jax.jit(lambda p, s: tx.update(jnp.full((1024,), 1e-3, F32), s, p))
  state = tx.init(p)
  for _ in range(10):
    u, state = step(p, state)
    p = optax.apply_updates(p, u)
  # Ten steps of 1e-3: the weight has moved (1.0078125 is the nearest bf16 to 1.01), and
  # weight + compensation holds the exact 1.01.
  assert float(p[0]) == pytest.approx(1.0078125)
  assert float(p[0]) + float(state.compensation[0]) == pytest.approx(1.01, abs=1e-4)


@pytest.mark.skipif(not targets.plugin_installed(), reason="XLA's GPU compiler is in JAX's "
                    "CUDA plugin: pip install -e '.[gpu-compile]'")
@pytest.mark.parametrize("excess", [True, False])
def test_kahan_rounding_survives_the_gpu_compilers_excess_precision(excess):
  """XLA's GPU compiler with `xla_allow_excess_precision` on (its default) drops an f32 ->
  bf16 -> f32 round trip: `x.astype(bf16).astype(f32) - x` compiles to `x - x`, which
  would leave Kahan's compensation at zero. The update rule rounds with
  `lax.reduce_precision` instead, which it keeps: the compiled Kahan update holds its
  rounding to bf16's 8 exponent and 7 mantissa bits with the flag on or off (h100:1)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  sharded = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  spec, options = targets.parse("h100:1"), {"xla_allow_excess_precision": excess}
  tx = update_rules.with_update_rule(optax.identity(), "kahan")
  p = sharded(jax.ShapeDtypeStruct((1024,), BF16))
  state = jax.tree.map(sharded, jax.eval_shape(tx.init, p))
  g = sharded(jax.ShapeDtypeStruct((1024,), F32))

  def kahan(p, state, g):
    u, state = tx.update(g, state, p)
    return optax.apply_updates(p, u), state

  out = gpu_compile.compile_jitted(jax.jit(kahan), (p, state, g), mesh, spec, options)
  rounded = re.findall(r"reduce-precision\(.*?exponent_bits=(\d+), mantissa_bits=(\d+)",
                       out.hlo)
  assert rounded and set(rounded) == {("8", "7")}, out.hlo
  naive = gpu_compile.compile_jitted(jax.jit(lambda x: x.astype(BF16).astype(F32) - x),
                                     (g,), mesh, spec, options)
  assert ("bf16" in naive.hlo) == (not excess)


RECIPES = {  # (factory kwargs, optimizer bytes per param before sharding)
    "adamw_nearest_bf16": (dict(update_rule="nearest", state_dtype=BF16), 4),
    "adamw_kahan_bf16": (dict(update_rule="kahan", state_dtype=BF16), 6),
    "adamw_stochastic_bf16": (dict(update_rule="stochastic", state_dtype=BF16), 4),
    "adamw_master_fp32": (dict(update_rule="master", state_dtype=F32), 12),
}


# Stages 1 and 3: stage 2 places params and optimizer state as stage 1 does (it differs
# in the gradients, which are not arguments), so its bytes are stage 1's formula;
# test_zero.test_argument_bytes_equal_zero_formula compiles stage 2 (AdamW, bf16).
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("recipe", sorted(RECIPES) + ["lion_kahan_bf16"])
def test_optimizer_bytes_per_device_follow_formula(recipe, stage):
  """Per-device params + optimizer state from the compiled step: 2Ψ + KΨ/N, or (2+K)Ψ/N."""
  if recipe == "lion_kahan_bf16":
    tx, k = optim.lion(1e-4, update_rule="kahan", state_dtype=BF16), 4
  else:
    kwargs, k = RECIPES[recipe]
    tx = optim.adamw(1e-4, b2=0.95, **kwargs)
  model = MlpLM(vocab_size=64, d_model=64, d_ff=128, n_layers=2, context=4,
                param_dtype=BF16, compute_dtype=BF16)
  mesh = zerojax.make_mesh(1, 8)
  plan = zerojax.make_plan(mesh, stage, jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  step = zerojax.make_train_step(plan, model.loss, tx)
  sharding = jax.sharding.NamedSharding(mesh, plan.batch_spec)
  batch = {"tokens": jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=sharding)}
  args = step.lower(zerojax.abstract_state(plan), batch).compile().memory_analysis()
  psi = sum(x.size for x in jax.tree.leaves(plan.params))
  formula = (2 * psi + k * psi / 8) if stage < 3 else (2 + k) * psi / 8
  # Besides the model state: the batch, rng, step, loss-scale scalars, Adam's count
  # and the stochastic key: under 1 KiB.
  measured = args.argument_size_in_bytes - 8 * 17 * 4 / 8
  assert abs(measured - formula) <= 0.01 * formula + 1024, (measured, formula)


def test_bf16_second_moment_that_cannot_decay_is_refused():
  """b2 = 0.999: nu * b2 rounds back to a bf16 nu, which then never decays."""
  with pytest.raises(ValueError, match="never decays"):
    optim.adamw(1e-3, b2=0.999, state_dtype=BF16)
  nu = jnp.asarray(1.0, BF16)
  assert (0.999 * nu).astype(BF16) == nu and (0.996 * nu).astype(BF16) < nu
  optim.adamw(1e-3, b2=0.996, state_dtype=BF16)  # The largest that still decays.


def grads_at(tree, path):
  """The leaf of `tree` at `path` (a `tree_leaves_with_path` path)."""
  for k in path:
    tree = tree[k.key]
  return tree


def test_stochastic_rounding_by_layer_draws_each_layers_own_bits():
  """The train step's per-layer update (`updates.update_by_layer`) with stochastic
  rounding: every layer starts equal and gets the same sub-ulp update, yet the layers
  round differently (each draws `fold_in(step key, layer)`), each element lands on one
  of its two bf16 neighbours, layer i is `tx.update(..., stream=i)` of its own slice,
  and the state's key advances once."""
  model = MlpLM(vocab_size=64, d_model=64, d_ff=128, n_layers=4, context=4,
                param_dtype=BF16, compute_dtype=BF16)
  tx = optim.sgd(1.0, update_rule="stochastic", seed=3)
  plan = zerojax.make_plan(zerojax.make_mesh(1, 8), 1,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  assert isinstance(tx, optim.SeededLeafwise) and updates.can_update_by_layer(plan, tx)
  same = lambda x, m: jnp.broadcast_to(x[:1], x.shape) if m else x
  params = jax.tree.map(same, model.init(jax.random.key(0)), plan.per_layer)
  # A third of an ulp of each weight, down: rounds down with probability ~1/3.
  grads = jax.tree.map(lambda p: jnp.abs(p.astype(F32)) * 2.0 ** -8 / 3 + 1e-30, params)
  state = tx.init(params)
  update = functools.partial(updates.apply, tx, finite=jnp.bool_(True),
                             scale=jnp.float32(1), factor=None)
  new, new_state, _ = jax.jit(functools.partial(updates.update_by_layer, plan, update))(
      grads, state, params)
  # The reference: leaf j of layer i rounds with key j of the step key folded with i.
  step_key = jax.random.split(jax.random.wrap_key_data(state.key))[1]
  flat = jax.tree_util.tree_leaves_with_path(params)
  for j, (path, p) in enumerate(flat):
    if path[0].key != "layers":
      continue
    for i in range(model.n_layers):
      key = jax.random.split(jax.random.fold_in(step_key, i), len(flat))[j]
      want = update_rules.stochastic_round(p[i].astype(F32) - grads_at(grads, path)[i], BF16, key)
      np.testing.assert_array_equal(np.asarray(grads_at(new, path)[i], F32), np.asarray(want))
  for path, leaf in jax.tree_util.tree_leaves_with_path(new["layers"]):
    old = np.asarray(params["layers"][path[0].key], F32)
    got = np.asarray(leaf, F32)
    below = np.asarray(jnp.nextafter(jnp.asarray(old, BF16), jnp.asarray(-np.inf, BF16)), F32)
    assert np.all((got == old) | (got == below)), path
    assert 0.2 < np.mean(got != old) < 0.5, path  # About a third rounded down.
    assert not np.array_equal(got[0], got[1]), path  # Each layer its own bits.
  key = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.key))[0])
  np.testing.assert_array_equal(new_state.key, key)


# --- Optimizer-state precision for any optax transform --------------------------------

FOREIGN = {  # optax's own, which make their state in the dtype of the params they get.
    "adamw": lambda: optax.adamw(1e-2),
    "lion": lambda: optax.lion(1e-3),
    # min_dim_size_to_factor=4: the [4, 8] leaf's statistics are factored, the [8] one's not.
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}


def float_leaves(tree):
  return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
          if jnp.issubdtype(x.dtype, jnp.floating)]


@pytest.mark.parametrize("rule", update_rules.UPDATE_RULES)
@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_wrapped_optax_state_on_bf16_params_is_the_fp32_runs(name, rule):
  """10 steps of a constant gradient, then 200 of zero gradients: every float leaf of the
  inner transform's state on bf16 params is within 1e-3 of the fp32-param run's, relative
  to the leaf's max abs after the 10 real steps. With the state in bf16 (optax's own, on
  bf16 params) Adam's nu never decays (1.9e-1) and Lion's momentum carries bf16's
  rounding (5.0e-2). The rule's own buffers (Kahan's compensation: bf16's residual, 0 in
  fp32) are not the optimizer's state."""
  rs = np.random.RandomState(0)
  # Values bf16 holds: both runs start from the same params and see the same gradients.
  bf16_values = lambda *shape: np.asarray(jnp.asarray(rs.normal(size=shape), BF16), np.float32)
  p0, g0 = ({"w": bf16_values(4, 8), "b": bf16_values(8)} for _ in range(2))
  inner = lambda state: state if rule == "nearest" else state.inner

  def run(dtype):
    tx = update_rules.with_update_rule(FOREIGN[name](), rule)
    cast = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)

    def steps(carry, grads, n):
      def body(carry, _):
        params, state = carry
        u, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, u), state), None
      return jax.lax.scan(body, carry, length=n)[0]

    params = cast(p0)
    carry = steps((params, tx.init(params)), cast(g0), 10)
    after_real = inner(carry[1])
    return after_real, inner(steps(carry, cast(jax.tree.map(np.zeros_like, g0)), 200)[1])

  (sizes, want), (_, got) = jax.jit(lambda: (run(F32), run(BF16)))()
  errors = {}
  for (path, w), (_, g), (_, size) in zip(float_leaves(want), float_leaves(got),
                                          float_leaves(sizes), strict=True):
    assert g.dtype == F32, (path, g.dtype)
    scale = float(jnp.max(jnp.abs(size)))
    errors[path] = float(jnp.max(jnp.abs(g - w))) / (scale if scale > 0 else 1.0)
  assert errors and max(errors.values()) <= 1e-3, errors


def test_narrow_inner_state_is_refused_unless_declared():
  """A leaf the transform itself makes bf16 (optax.adam's mu_dtype) is refused at init;
  declared, it stays bf16 step after step (nu, made like the params, is fp32). An update
  that narrows its state is refused too."""
  params = {"w": jnp.ones((4, 8), BF16)}
  adam = lambda: optax.adam(1e-3, mu_dtype=BF16)
  with pytest.raises(ValueError, match=r"\[0\]\.mu\['w'\] \(bfloat16\).*state_dtype=jnp.bfloat16"):
    update_rules.with_update_rule(adam(), "kahan").init(params)
  with pytest.raises(ValueError, match="float dtype"):
    update_rules.with_update_rule(adam(), "kahan", state_dtype=jnp.int32)
  tx = update_rules.with_update_rule(adam(), "kahan", state_dtype=BF16)
  state = tx.init(params)
  _, state = jax.jit(tx.update)({"w": jnp.ones((4, 8), BF16)}, state, params)
  assert state.inner[0].mu["w"].dtype == BF16 and state.inner[0].nu["w"].dtype == F32
  update_rules.check_state_precision(tx, params)  # Declared: the step's check passes.
  # Handed the bf16 params (zerojax's own optimizers' bit-for-bit mode), optax's adafactor
  # makes its statistics in their dtype: refused when traced, not rounded step by step.
  tx = update_rules.with_update_rule(optax.adafactor(1e-3), "nearest", fp32_params=False)
  with pytest.raises(ValueError, match=r"\[0\]\.v\['w'\] \(bfloat16\).*fp32_params=True"):
    jax.eval_shape(tx.update, params, tx.init(params), params)


def test_check_state_precision_refuses_unwrapped_bf16_state():
  """The train step's guard: optax's own on bf16 params is refused (naming the leaves and
  with_update_rule); wrapped, zerojax's own (bf16 moments declared, with carry_grad_norm),
  fp32 params, and a wrapped transform inside optax.multi_transform pass; the raw part
  of a multi_transform is named."""
  params = {"w": jnp.ones((4, 8), BF16), "b": jnp.ones((8,), BF16)}
  check = update_rules.check_state_precision
  with pytest.raises(ValueError,
                     match=r"\[0\]\.mu\['b'\] \(bfloat16\).*and 1 more.*zerojax.with_update_rule"):
    check(optax.adamw(1e-3), params)
  check(optax.adamw(1e-3), jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, F32), params))
  for rule in update_rules.UPDATE_RULES:
    check(update_rules.with_update_rule(optax.adamw(1e-3), rule), params)
  check(optim.carry_grad_norm(optim.adamw(1e-3, b2=0.95, state_dtype=BF16, update_rule="kahan")),
        params)
  check(optim.lion(1e-3, state_dtype=BF16, update_rule="stochastic"), params)
  labels = {"w": "train", "b": "other"}
  wrapped = update_rules.with_update_rule(optax.adamw(1e-3), "kahan")
  check(optax.multi_transform({"train": wrapped, "other": optax.set_to_zero()}, labels), params)
  with pytest.raises(ValueError, match=r"^optimizer state leaves \[1\]\.inner_states\['other'\]"
                     r"\.inner_state\[0\]\.trace\['b'\] \(bfloat16\) are below float32"):
    check(optax.chain(optax.clip(1.0), optax.multi_transform(
        {"train": wrapped, "other": optax.sgd(1e-2, momentum=0.9)}, labels)), params)
