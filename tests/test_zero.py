"""The ZeRO plan and train step on 8 CPU devices: equivalence, memory, collectives."""

import dataclasses
import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.models import llama
from zerojax.models.mlp_lm import MlpLM
from zerojax.testing import hlo

MESHES = [(8, 1), (2, 4), (1, 8)]
STAGES = [0, 1, 2, 3]
SMALL = dict(vocab_size=64, d_model=64, d_ff=128, n_layers=3, context=4)


def tokens(batch=16, seq=16, vocab=64, seed=0):
  rs = np.random.RandomState(seed)
  return {"tokens": rs.randint(0, vocab, size=(batch, seq + 1)).astype(np.int32)}


def setup(model, stage, mesh_shape, tx, *, min_shard_size=0):
  mesh = zerojax.make_mesh(*mesh_shape)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  return zerojax.make_plan(mesh, stage, shapes, tx, logical_axes=model.logical_axes(),
                           min_shard_size=min_shard_size)


def train(model, stage, mesh_shape, tx, steps, *, microbatches=1, batches=None, **kw):
  plan = setup(model, stage, mesh_shape, tx)
  state = zerojax.init_state(plan, model.init, tx, jax.random.PRNGKey(0))
  step = zerojax.make_train_step(plan, model.loss, tx, microbatches=microbatches, **kw)
  losses = []
  for i in range(steps):
    state, metrics = step(state, batches[i % len(batches)] if batches else tokens())
    losses.append(float(metrics["loss"]))
  return np.array(losses), jax.tree.map(np.asarray, state.params), state


def reference(model, tx, steps, batch):
  """Single-device optax on the whole batch: what every stage must reproduce."""
  params = model.init(jax.random.split(jax.random.PRNGKey(0))[0])
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return np.array(losses), jax.tree.map(np.asarray, params)


@functools.cache
def fp32_reference():
  """(model, tx, losses, params): 20 AdamW steps of single-device optax in fp32, once for
  every mesh's test."""
  model, tx = MlpLM(**SMALL), optax.adamw(1e-3, weight_decay=0.1)
  return model, tx, *reference(model, tx, 20, tokens())


def rel(a, b):
  """Norm of the difference over the norm, over a whole pytree."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  num = sum(np.sum((np.float64(x) - np.float64(y)) ** 2) for x, y in zip(la, lb))
  return float(np.sqrt(num / sum(np.sum(np.float64(y) ** 2) for y in lb)))


# --- the plan -----------------------------------------------------------------------


def test_plan_shards_by_stage_and_keeps_layers_axis_whole():
  model = MlpLM(**SMALL)
  tx = optax.adamw(1e-3)
  plans = {s: setup(model, s, (2, 4), tx, min_shard_size=1000) for s in STAGES}
  w_in = lambda specs: specs["layers"]["w_in"]
  # w_in is (L=3, D=64, F=128): never the layers axis; the first divisible dim (a shard
  # is one contiguous block of the row-major leaf).
  assert w_in(plans[3].param_specs) == P(None, "fsdp", None)
  assert w_in(plans[2].param_specs) == P()
  assert w_in(plans[2].grad_specs) == P(None, "fsdp", None)
  assert w_in(plans[1].grad_specs) == P(None, "fsdp", None)  # Scattered once, after accumulating.
  assert w_in(plans[0].grad_specs) == P()
  # final_norm (64 elements) is under min_shard_size: replicated at every stage.
  assert plans[3].param_specs["final_norm"] == P()
  assert plans[3].per_layer["layers"]["w_in"] and not plans[3].per_layer["embed"]
  # Adam's mu and nu mirror the params; its step count stays replicated.
  adam = plans[1].opt_specs[0]
  assert w_in(adam.mu) == w_in(adam.nu) == P(None, "fsdp", None)
  assert adam.count == P()
  assert w_in(plans[0].opt_specs[0].mu) == P()


def test_stage_behaviour_names_what_each_stage_does():
  model, tx = MlpLM(**SMALL), optax.sgd(0.1)
  plans = {s: setup(model, s, (2, 4), tx) for s in STAGES}
  b = {s: plans[s].behaviour for s in STAGES}
  assert [b[s].grad_reduction for s in STAGES] == [
      "psum", "psum_scatter_once", "psum_scatter_per_microbatch", "psum_scatter_in_gather"]
  assert [(b[s].shards_params, b[s].shards_grads, b[s].shards_opt_state) for s in STAGES] == [
      (False, False, False), (False, False, True), (False, True, True), (True, True, True)]
  # One shard (a 'data'-only mesh): nothing to shard or gather, so stage 3 runs as 0 does,
  # and the planner, which builds no plan, gets the same answer from the same rule.
  one = setup(model, 3, (8, 1), tx)
  assert one.stage == 3 and one.behaviour == zerojax.StageBehaviour.of(0, 8)
  assert one.behaviour == zerojax.StageBehaviour.of(3, 1) and one.behaviour.stage == 0
  assert one.param_specs == jax.tree.map(lambda _: P(), one.param_specs,
                                         is_leaf=lambda s: isinstance(s, P))


def test_plan_rejects_bad_input():
  model = MlpLM(**SMALL)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  mesh = zerojax.make_mesh(1, 8)
  with pytest.raises(ValueError, match="stage"):
    zerojax.make_plan(mesh, 4, shapes, optax.sgd(0.1))
  with pytest.raises(ValueError, match="not mesh axes"):
    zerojax.make_plan(mesh, 3, shapes, optax.sgd(0.1), shard_axes=("tensor",))
  bad_axes = model.logical_axes()
  bad_axes["head"] = ("embed",)
  with pytest.raises(ValueError, match="do not fit"):
    zerojax.make_plan(mesh, 3, shapes, optax.sgd(0.1), logical_axes=bad_axes)


def scanned_net(annotate_norm):
  """The params and logical axes of a linen model of 8 scanned blocks (LayerNorm, then a
  Dense with a 'layers'-annotated kernel) and an unannotated head; the LayerNorm's scale
  and bias annotated or not (flax's default: no partitioning metadata)."""
  D, L = 64, 8
  names = lambda *n: (lambda init: nn.with_logical_partitioning(init, n))  # noqa: E731
  keep = lambda init: init  # noqa: E731
  norm_init = names("embed") if annotate_norm else keep

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.LayerNorm(scale_init=norm_init(nn.initializers.ones),
                       bias_init=norm_init(nn.initializers.zeros))(x)
      kernel = names("embed", "mlp")(nn.initializers.lecun_normal())
      return x + nn.Dense(D, use_bias=False, kernel_init=kernel)(h), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=L, metadata_params={nn.PARTITION_NAME: "layers"})(name="blocks")(
                         x, None)
      return nn.Dense(D, use_bias=False, name="head")(x)

  boxed = jax.eval_shape(Net().init, jax.random.key(0), jnp.zeros((1, D)))["params"]
  return nn.unbox(boxed), zerojax.flax_logical_axes(boxed)


def plan_warnings(*args, **kw):
  """(plan, the messages of the WholeGatherWarnings `make_plan` gave)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plan = zerojax.make_plan(zerojax.make_mesh(1, 8), *args, **kw)
  return plan, [str(w.message) for w in caught
                if issubclass(w.category, zerojax.zero.WholeGatherWarning)]


def test_stage_3_reports_what_it_gathers_whole():
  """At plan time: the sharded leaves stage 3 gathers whole (paths, shapes, bytes), in one
  line for a start report, and one warning naming the fix where it looks like a mistake:
  a scanned block's unannotated LayerNorm (every layer of it gathered at once), or a model
  with no 'layers' axis at all. The fix it names silences it; the Llama's embedding and
  head, gathered whole by design, and stage 2 say nothing."""
  params, axes = scanned_net(annotate_norm=False)
  plan, said = plan_warnings(3, params, logical_axes=axes, min_shard_size=256)
  whole = {w.path: w for w in plan.gathered_whole}
  assert sorted(whole) == ["blocks/LayerNorm_0/bias", "blocks/LayerNorm_0/scale", "head/kernel"]
  assert whole["blocks/LayerNorm_0/scale"] == zerojax.zero.WholeLeaf(
      "blocks/LayerNorm_0/scale", (8, 64), "float32", 8 * 64 * 4, True)
  assert not whole["head/kernel"].in_stack and whole["head/kernel"].bytes == 64 * 64 * 4
  assert plan.per_layer_bytes == 64 * 64 * 4  # One layer of the Dense kernels.
  assert len(said) == 1 and "\n" not in said[0], said
  assert said[0].startswith("stage 3 gathers 2 leaves of a layer stack whole, every layer at "
                            "once: 4.00 KiB (blocks/LayerNorm_0/bias [8, 64] 2.00 KiB, ")
  assert "metadata_params={nn.PARTITION_NAME: 'layers'}" in said[0]
  assert "LayerNorm's scale_init and bias_init" in said[0]
  assert zerojax.zero.whole_gather_line(plan) == (
      "stage 3 gathers 3 leaves whole before the loss, 20.00 KiB in float32 (head/kernel "
      "[64, 64] 16.00 KiB, blocks/LayerNorm_0/bias [8, 64] 2.00 KiB, blocks/LayerNorm_0/scale "
      "[8, 64] 2.00 KiB); one layer of the layer stacks: 16.00 KiB")
  assert plan_warnings(2, params, logical_axes=axes, min_shard_size=256)[0].gathered_whole == ()

  params, axes = scanned_net(annotate_norm=True)  # The fix: only the head is whole.
  plan, said = plan_warnings(3, params, logical_axes=axes, min_shard_size=256)
  assert [w.path for w in plan.gathered_whole] == ["head/kernel"] and said == []

  mlp = {"up": jax.ShapeDtypeStruct((64, 256), jnp.bfloat16),  # No layer stacks at all.
         "down": jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)}
  plan, said = plan_warnings(3, mlp)
  assert len(said) == 1 and said[0].startswith(
      "stage 3 gathers the whole model at once before the loss: 2 leaves, 64.00 KiB (down "
      "[256, 64] 32.00 KiB, up [64, 256] 32.00 KiB), no leaf having a 'layers' logical axis: "
      "the step's peak holds every param whole"), said
  assert zerojax.zero.whole_gather_line(plan).endswith("; no leaf has a 'layers' axis")

  lm = llama.LlamaLM(llama.LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                       n_kv_heads=2, d_ff=128))
  plan, said = plan_warnings(3, jax.eval_shape(lm.init, jax.random.key(0)),
                             logical_axes=lm.logical_axes())
  assert said == [] and {w.path for w in plan.gathered_whole} == {
      "embed_tokens/embedding", "lm_head/kernel"}


def test_mesh_resolves_rest_and_rejects_mismatch():
  assert dict(zerojax.make_mesh(2, -1).shape) == {"data": 2, "expert": 1, "fsdp": 4}
  assert dict(zerojax.make_mesh(-1, 2).shape) == {"data": 4, "expert": 1, "fsdp": 2}
  assert dict(zerojax.make_mesh(1, 2, expert=-1).shape) == {"data": 1, "expert": 4, "fsdp": 2}
  with pytest.raises(ValueError, match="cannot take the rest"):
    zerojax.make_mesh(3, -1)
  with pytest.raises(ValueError, match="available"):
    zerojax.make_mesh(2, 2)
  # 'fsdp' groups are runs of consecutive devices (inside one host when they fit).
  mesh = zerojax.make_mesh(2, 4)
  assert [d.id for d in mesh.devices[0, 0]] == [0, 1, 2, 3]
  # An 'expert' group is fsdp apart: devices 0, 2, 4, 6 hold the experts of one fsdp shard.
  assert [d.id for d in zerojax.make_mesh(1, 2, expert=4).devices[0, :, 0]] == [0, 2, 4, 6]


def test_state_is_created_sharded():
  model = MlpLM(**SMALL)
  tx = optax.adamw(1e-3)
  plan = setup(model, 3, (1, 8), tx)
  state = zerojax.init_state(plan, model.init, tx, jax.random.PRNGKey(0))
  w_in = state.params["layers"]["w_in"]
  assert w_in.sharding.spec == P(None, "fsdp", None)
  assert {s.data.shape for s in w_in.addressable_shards} == {(3, 8, 128)}
  assert state.opt_state[0].mu["embed"].sharding.spec == plan.opt_specs[0].mu["embed"]
  assert w_in.dtype == jnp.float32 and state.step.dtype == jnp.int32


# --- the step -----------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_every_stage_matches_single_device_optax_fp32(mesh_shape):
  """20 AdamW steps in fp32: every stage equals plain optax to 1e-5 (relative)."""
  model, tx, ref_losses, ref_params = fp32_reference()
  plans = {stage: setup(model, stage, mesh_shape, tx) for stage in STAGES}
  if plans[0].num_shards == 1:
    # One shard: every stage's plan is stage 0's but for its number (its behaviour is
    # stage 0's: test_stage_behaviour_names_what_each_stage_does), and the step reads
    # only the behaviour, so stages 1-3 would compile and run stage 0's program again.
    assert all(dataclasses.replace(plans[s], stage=0) == plans[0] for s in STAGES)
    plans = {0: plans[0]}
  for stage in plans:
    losses, params, _ = train(model, stage, mesh_shape, tx, 20)
    assert rel(losses, ref_losses) <= 1e-5, (stage, losses, ref_losses)
    assert rel(params, ref_params) <= 1e-5, stage


def test_bf16_stages_agree_with_each_other():
  """bf16 params and compute: every stage within bf16 noise of stage 0.

  Stages differ only in the order of fp32 sums (all-reduce vs reduce-scatter), which
  can flip the last bit of a bf16 rounding; 20 steps of that stay under 2^-8
  (one bf16 ulp) relative in params and 1e-3 in loss. The steps are the 2 x 4 programs
  the compiled-truth tests read (`compiled_small`), run as compiled.
  """
  base_losses, base_params, _ = train_compiled(0, 20)
  assert base_losses[-1] < base_losses[0] - 0.1  # It trains.
  for stage in STAGES[1:]:
    losses, params, state = train_compiled(stage, 20)
    assert state.params["embed"].dtype == jnp.bfloat16
    assert rel(losses, base_losses) <= 1e-3, stage
    assert rel(params, base_params) <= 2 ** -8, stage


def test_microbatches_equal_one_larger_batch():
  """k microbatches accumulate to the gradient of the whole batch (fp32, 1e-6)."""
  model, tx = MlpLM(**SMALL), optax.sgd(0.5)
  batches = [tokens(seed=s) for s in range(3)]
  for stage, mesh_shape in [(0, (8, 1)), (2, (2, 4)), (3, (1, 8))]:
    one, p1, _ = train(model, stage, mesh_shape, tx, 3, batches=batches)
    four, p4, _ = train(model, stage, mesh_shape, tx, 3, batches=batches, microbatches=2)
    assert rel(four, one) <= 1e-6 and rel(p4, p1) <= 1e-6, stage


def test_metrics_and_clipping():
  model, tx = MlpLM(**SMALL), optax.sgd(1.0)
  schedule = optax.linear_schedule(0.0, 1.0, 10)
  plan = setup(model, 2, (2, 4), tx)
  state = zerojax.init_state(plan, model.init, tx, jax.random.PRNGKey(0))
  step = zerojax.make_train_step(plan, model.loss, tx, max_grad_norm=0.01,
                                 learning_rate=schedule)
  state, m = step(state, tokens())
  state, m = step(state, tokens())
  assert float(m["grad_norm"]) > 0.01
  # SGD with lr 1 moves params by exactly the clipped gradient.
  np.testing.assert_allclose(float(m["update_norm"]), 0.01, rtol=1e-4)
  assert float(m["learning_rate"]) == pytest.approx(0.1)
  assert float(m["tokens"]) == 16 * 17 and int(state.step) == 2


@pytest.mark.parametrize("stage", [0, 3])
def test_eval_step_equals_plain_loss(stage):
  model, tx = MlpLM(**SMALL), optax.sgd(0.1)
  plan = setup(model, stage, (2, 4), tx)
  state = zerojax.init_state(plan, model.init, tx, jax.random.PRNGKey(0))
  batch = tokens()
  loss = zerojax.make_eval_step(plan, model.loss)(state.params, batch)["loss"]
  plain = model.loss(jax.tree.map(np.asarray, state.params), batch)
  np.testing.assert_allclose(float(loss), float(plain), rtol=1e-6)


def test_indivisible_batch_is_a_clear_error():
  """A batch the example devices x microbatches do not divide is one line naming the fix,
  given before `jax.jit` lays the batch out: 60 on 8 devices x 4 microbatches as 40 (jit's
  layout refused 60 first, with JAX's `IndivisibleError`), in the train and eval steps,
  called or lowered. Nothing is compiled: the check comes first."""
  model, tx = MlpLM(**SMALL), optax.sgd(0.1)
  plan = setup(model, 2, (2, 4), tx)
  state = zerojax.abstract_state(plan)
  step = zerojax.make_train_step(plan, model.loss, tx, microbatches=2)
  with pytest.raises(ValueError, match=r"\['tokens'\].*divisible by 16"):
    step(state, tokens(batch=8))
  step = zerojax.make_train_step(plan, model.loss, tx, microbatches=4)
  for n in (40, 60):
    with pytest.raises(ValueError, match=(
        rf"shape \({n}, 17\): .* divisible by 32 = data-parallel devices \(8\) x microbatches "
        r"\(4\): make the global batch a multiple of 32 \(32 or 64\), or use fewer "
        r"microbatches$")):
      step(state, tokens(batch=n))
    with pytest.raises(ValueError, match="divisible by 32"):
      step.lower(state, {"tokens": jax.ShapeDtypeStruct((n, 17), jnp.int32)})
  with pytest.raises(ValueError, match=r"divisible by 8 .* a multiple of 8 \(56 or 64\)$"):
    zerojax.make_eval_step(plan, model.loss)(state.params, tokens(batch=60))


def test_model_must_gather_its_shards_at_stage_3():
  model, tx = MlpLM(**SMALL), optax.sgd(0.1)

  def careless_loss(params, batch, rng):  # Uses layer shards without gather().
    return jnp.sum(params["layers"]["w_in"]) + model.loss(params, batch, rng)

  plan = setup(model, 3, (1, 8), tx)
  state = zerojax.init_state(plan, model.init, tx, jax.random.PRNGKey(0))
  with pytest.raises(TypeError, match="zerojax.gather"):
    zerojax.make_train_step(plan, careless_loss, tx)(state, tokens())


# --- compiled truth -----------------------------------------------------------------


def lower(model, stage, mesh_shape, tx, batch=16, seq=16, **kw):
  plan = setup(model, stage, mesh_shape, tx)
  step = zerojax.make_train_step(plan, model.loss, tx, **kw)
  sharding = jax.sharding.NamedSharding(plan.mesh, plan.batch_spec)
  abstract_batch = {"tokens": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32,
                                                   sharding=sharding)}
  return plan, step.lower(zerojax.abstract_state(plan), abstract_batch)


# bf16 params and compute, optax's AdamW in fp32 (`with_update_rule`): the step whose compiled
# programs the argument-bytes, reduction-dtype and collective tests read, and the bf16
# agreement test runs (one compile per stage and mesh, not one per test).
BF16_SMALL = dict(SMALL, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
SMALL_TX = zerojax.with_update_rule(optax.adamw(1e-3), "nearest")


@functools.cache
def compiled_small(stage, mesh_shape):
  """(plan, lowered, compiled) step of the bf16 SMALL model for a batch of 16 x 17 tokens:
  read-only (a run donates its state, not the program), so every test that reads or runs
  this program shares one compile."""
  plan, lowered = lower(MlpLM(**BF16_SMALL), stage, mesh_shape, SMALL_TX)
  return plan, lowered, lowered.compile()


def train_compiled(stage, steps):
  """`train` of the bf16 SMALL model on 2 x 4 devices, running `compiled_small`'s program."""
  model = MlpLM(**BF16_SMALL)
  plan, _, compiled = compiled_small(stage, (2, 4))
  state = zerojax.init_state(plan, model.init, SMALL_TX, jax.random.PRNGKey(0))
  losses = []
  for _ in range(steps):
    state, metrics = compiled(state, tokens())
    losses.append(float(metrics["loss"]))
  return np.array(losses), jax.tree.map(np.asarray, state.params), state


BIG = dict(vocab_size=256, d_model=256, d_ff=1024, n_layers=8, context=4,
           param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)


@functools.cache
def compiled_big(stage, remat="dots"):
  """(plan, compiled step) of the 8-layer bf16 model on 1 x 8, batch 8: read-only, so the
  tests that read it share one compile."""
  plan, lowered = lower(MlpLM(**BIG, remat=remat), stage, (1, 8),
                        zerojax.with_update_rule(optax.adamw(1e-3), "nearest"),
                        batch=8, seq=16)
  return plan, lowered.compile()


def tree_bytes(tree):
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def check_zero_formula(plan, compiled, batch=16, seq=16):
  """Per-device params + optimizer state: P+O, P+O/N, P+O/N, (P+O)/N within 3%, read
  from the compiled step's arguments (less its batch slice, rng and step).

  Returns:
    (compiled state bytes, the formula's bytes) per device.
  """
  n = plan.num_shards
  p_bytes, o_bytes = tree_bytes(plan.params), tree_bytes(plan.opt_state)
  formula = {0: p_bytes + o_bytes, 1: p_bytes + o_bytes / n, 2: p_bytes + o_bytes / n,
             3: (p_bytes + o_bytes) / n}[plan.stage]
  args = compiled.memory_analysis().argument_size_in_bytes
  batch_and_rng = batch * (seq + 1) * 4 // plan.num_data + 8 + 4
  assert abs(args - batch_and_rng - formula) / formula <= 0.03, (args, formula)
  return args - batch_and_rng, formula


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
@pytest.mark.parametrize("stage", STAGES)
def test_argument_bytes_equal_zero_formula(stage, mesh_shape):
  plan, _, compiled = compiled_small(stage, mesh_shape)
  check_zero_formula(plan, compiled)


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_reductions_are_fp32_with_bf16_params(stage):
  _, lowered, compiled = compiled_small(stage, (2, 4))
  # XLA:CPU upcasts every bf16 collective when it compiles, so the dtype the program
  # asks for is read before optimization; the compiled module must agree.
  for text in (lowered.as_text(dialect="hlo"), compiled.as_text()):
    # Float reductions: the pred all-reduce of the is-finite check carries no gradient.
    reductions = [c for c in hlo.collectives(text) if c.op in ("all-reduce", "reduce-scatter")
                  and c.dtypes & {"f16", "bf16", "f32", "f64"}]
    assert reductions and all(c.dtypes == {"f32"} for c in reductions), reductions
  # The check can fail: asking for bf16 reductions shows up as bf16.
  _, lowered = lower(MlpLM(**BF16_SMALL), stage, (2, 4), SMALL_TX, reduce_dtype=jnp.bfloat16)
  dtypes = {d for c in hlo.collectives(lowered.as_text(dialect="hlo"))
            if c.op in ("all-reduce", "reduce-scatter") for d in c.dtypes}
  assert "bf16" in dtypes
  if stage == 3:  # The all-gathers of params are bf16.
    gathers = [c for c in hlo.collectives(lowered.as_text(dialect="hlo"))
               if c.op == "all-gather"]
    assert gathers and all(c.dtypes == {"bf16"} for c in gathers)


@pytest.mark.parametrize("stage", STAGES)
def test_stages_1_to_3_reduce_scatter_instead_of_all_reduce(stage):
  plan, _, compiled = compiled_small(stage, (1, 8))
  found = hlo.collectives(compiled.as_text())
  grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(plan.params))
  payload = lambda op: sum(c.payload_bytes * c.trips for c in found if op == c.op)
  if stage >= 1:
    # Every gradient is reduce-scattered; the only all-reduces left are scalars.
    assert payload("reduce-scatter") == grad_bytes
    assert all(size == () for c in found if c.op == "all-reduce"
               for _, size in c.results)
  else:
    assert payload("all-reduce") >= grad_bytes and payload("reduce-scatter") == 0


def test_stage_3_gathers_and_scatters_one_layer_at_a_time():
  plan, compiled = compiled_big(3)
  found = hlo.collectives(compiled.as_text())
  one_layer = {(1024, 256), (256, 1024)}  # w_in / w_out of one layer, gathered.
  layer_gathers = [c for c in found if c.op == "all-gather"
                   and {s for _, s in c.results} & one_layer]
  # Each kernel's shard is a block of its first dimension: (1024, 256) -> (128, 256),
  # (256, 1024) -> (32, 1024).
  layer_scatters = [c for c in found if c.op == "reduce-scatter"
                    and {s for _, s in c.results} & {(128, 256), (32, 1024)}]
  # Inside the layer loops: gathered in the forward and again (remat) in the
  # backward, 8 times each; reduce-scattered in the backward, 8 times.
  assert len(layer_gathers) == 4 and all(c.trips == 8 for c in layer_gathers)
  assert len(layer_scatters) == 2 and all(c.trips == 8 for c in layer_scatters)
  # Nothing ever holds the whole stacked weights: no collective of a (8, ...) stack.
  assert not any(len(s) == 3 and s[0] == 8 for c in found for _, s in c.results)
  # Temporaries are a fraction of stage 0's, and below one whole fp32 gradient: the
  # backward never holds every layer's gathered weights or gradients.
  temp = compiled.memory_analysis().temp_size_in_bytes
  temp0 = compiled_big(0)[1].memory_analysis().temp_size_in_bytes
  whole_grad = 4 * sum(x.size for x in jax.tree.leaves(plan.params))
  assert temp < temp0 / 4 and temp < whole_grad / 1.5, (temp, temp0, whole_grad)


def test_stage_3_without_remat_keeps_gathered_layers_alive():
  """The counter-case: a scan with no remat saves every gathered layer for backward."""
  temps = {remat: compiled_big(3, remat)[1].memory_analysis().temp_size_in_bytes
           for remat in ("none", "dots")}
  gathered = 2 * sum(x.size for x in jax.tree.leaves(compiled_big(3)[0].params))
  assert temps["none"] - temps["dots"] > 0.8 * gathered, temps
