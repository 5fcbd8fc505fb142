"""Gradient release at stage 3 (`zerojax.release`) on 8 CPU devices: it computes what
the normal step computes, holds no fp32 gradient of the layer stack, skips a layer
whose gradient is not finite, and refuses what it cannot do."""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import optim
from zerojax.models.llama import LlamaConfig, LlamaLM
from zerojax.models.mlp_lm import MlpLM
from zerojax.optim import precision
from zerojax.release import make_release_step
from zerojax.runtime import xla_dump
from zerojax.runtime.device_env import CPU_MEMORY_FLAGS

SMALL = dict(vocab_size=64, d_model=32, d_ff=64, n_layers=3, context=4)
# Two attention blocks and two loss chunks per 16-token sequence; remat 'full', so the
# normal step runs `stage3.scan_layers`.
LLAMA = dict(vocab_size=64, d_model=32, d_ff=64, n_layers=3, n_heads=4, n_kv_heads=2,
             attention_block=8, loss_chunk=8, remat="full")
MODELS = {
    "mlp_lm": lambda dtype: MlpLM(**SMALL, param_dtype=dtype, compute_dtype=dtype),
    "llama": lambda dtype: LlamaLM(LlamaConfig(**LLAMA, param_dtype=dtype,
                                               compute_dtype=dtype)),
    "llama_tied": lambda dtype: LlamaLM(LlamaConfig(**LLAMA, tie_embeddings=True,
                                                    param_dtype=dtype, compute_dtype=dtype)),
    # A mixture of experts: the router statistics ride the layer loop's carry into the
    # load-balancing loss (`llama.router_loss`), layer by layer under release.
    "llama_moe": lambda dtype: LlamaLM(LlamaConfig(**LLAMA, n_experts=4, experts_per_token=2,
                                                   expert_d_ff=16, router_aux_loss_coef=0.1,
                                                   param_dtype=dtype, compute_dtype=dtype)),
}


def make(model, tx, mesh_shape=(1, 8), stage=3):
  mesh = zerojax.make_mesh(*mesh_shape)
  return zerojax.make_plan(mesh, stage, jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)


def batches(n, batch=8, seq=16, vocab=64):
  rs = np.random.RandomState(0)
  return [{"tokens": rs.randint(0, vocab, size=(batch, seq + 1)).astype(np.int32)}
          for _ in range(n)]


def run(step, plan, model, tx, data, params=None):
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0), params=params)
  for batch in data:
    state, metrics = step(state, batch)
  return state, {k: float(v) for k, v in metrics.items()}


def relative(a, b):
  a, b = np.float64(a), np.float64(b)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# Each case a combination no other case covers: both models (Llama untied and tied, and
# with experts: Lion / Kahan in fp32 was plain Llama's case, and the Llama with experts
# runs every path of it besides), both optimizers and update rules, fp32 (1e-6) and
# bf16 (one ulp), 1 x 8 and 2 x 4.
# Two cases were dropped as covered: MlpLM / AdamW / Kahan in fp32 (by the same in bf16
# and by the fp32 Kahan cases of Llama) and Llama / AdamW / nearest in fp32 (by MlpLM /
# AdamW / nearest in fp32 and Llama's other fp32 cases).
@pytest.mark.parametrize("model_name, name, rule, mesh_shape, dtype, lr", [
    ("mlp_lm", "adamw", "nearest", (1, 8), "float32", 1e-2),
    ("mlp_lm", "lion", "nearest", (2, 4), "float32", 1e-3),
    ("mlp_lm", "adamw", "kahan", (1, 8), "bfloat16", 1e-2),
    ("llama_tied", "adamw", "kahan", (2, 4), "float32", 3e-3),
    ("llama_moe", "lion", "kahan", (1, 8), "float32", 3e-4),
    ("llama", "adamw", "kahan", (1, 8), "bfloat16", 3e-3)])
def test_release_step_equals_the_normal_step(model_name, name, rule, mesh_shape, dtype, lr):
  """5 steps: every leaf of the params and optimizer state within 1e-6 in fp32; in bf16
  (params, compute, moments) within one bf16 ulp (2^-8), the bar the bf16 stages meet
  against each other (fp32 sums in another order can flip a last bit).

  Llama: Flax layers under `nn.scan`, rotary tables made inside each layer, the chunked
  loss as the head; tied, the embedding's gradient is the sum of two reduce-scatters
  (embed, head) where the normal step reduce-scatters their sum. Its learning rate is
  the quick start's (3e-3): at 1e-2 five steps amplify those fp32 rounding
  differences to 1.3e-6 in some moments (measured)."""
  model = MODELS[model_name](dtype)
  factory = {"adamw": optim.adamw, "lion": optim.lion}[name]
  tx = factory(lr, weight_decay=0.1, update_rule=rule,
               state_dtype=dtype, **(dict(b2=0.95) if name == "adamw" else {}))
  tolerance = 1e-6 if dtype == "float32" else 2 ** -8
  plan = make(model, tx, mesh_shape)
  data = batches(5)
  normal, m_normal = run(zerojax.make_train_step(plan, model.loss, tx), plan, model, tx,
                         data)
  release, m_release = run(make_release_step(plan, model.layered(), tx), plan, model,
                           tx, data)
  expected = jax.tree_util.tree_leaves_with_path((normal.params, normal.opt_state))
  for (path, want), got in zip(expected, jax.tree.leaves((release.params,
                                                          release.opt_state))):
    assert relative(got, want) <= tolerance, (jax.tree_util.keystr(path),
                                              relative(got, want))
  for key in ("loss", "grad_norm", "update_norm"):
    assert m_release[key] == pytest.approx(m_normal[key], rel=1e-5), key
  # The routers' metrics (experts only): the same under release.
  routers = [k for k in m_normal if k.startswith(("router_", "expert_load/"))]
  assert bool(routers) == (model_name == "llama_moe"), routers
  for key in routers:
    assert m_release[key] == pytest.approx(m_normal[key], rel=1e-5, abs=1e-7), key
  assert m_release["skipped_layers"] == 0 and m_release["skipped"] == 0
  assert int(release.step) == 5


def test_release_with_stochastic_rounding_keeps_copies_equal_and_trains():
  """bf16 Llama, AdamW with stochastic rounding, 2 x 4 devices (data x fsdp), norms too
  small to shard: 5 release steps. Each layer and shard draws its own bits (the stream
  is the layer and the shard's index, `update_rules`), so every copy of a param block
  (the data replicas, and the devices holding a whole norm) must still be bit-identical:
  a stream of the device's own would make them drift apart. The loss is the normal
  step's with stochastic rounding within 2% (another draw of the same rounding)."""
  model = MODELS["llama"]("bfloat16")
  tx = optim.adamw(3e-3, b2=0.95, weight_decay=0.1, update_rule="stochastic",
                   state_dtype="bfloat16")
  plan = zerojax.make_plan(zerojax.make_mesh(2, 4), 3,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=256)
  dims = jax.tree.leaves(plan.param_dims, is_leaf=lambda d: d is None)
  assert None in dims and any(d is not None for d in dims)
  data = batches(5)
  release, m_release = run(make_release_step(plan, model.layered(), tx), plan, model, tx, data)
  _, m_normal = run(zerojax.make_train_step(plan, model.loss, tx), plan, model, tx, data)
  for path, leaf in jax.tree_util.tree_leaves_with_path(release.params):
    copies = {}
    for shard in leaf.addressable_shards:
      block = np.asarray(shard.data.astype(jnp.float32))
      seen = copies.setdefault(str(shard.index), block)
      np.testing.assert_array_equal(seen, block, err_msg=jax.tree_util.keystr(path))
  assert m_release["loss"] == pytest.approx(m_normal["loss"], rel=0.02)
  assert m_release["skipped"] == 0 and int(release.step) == 5


_MLP_BF16 = MlpLM(vocab_size=64, d_model=128, d_ff=512, n_layers=5, context=4,
                  param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16, remat="full")


@pytest.mark.parametrize("model, shrink, microbatches", [
    (_MLP_BF16, 1.0, 1),
    (_MLP_BF16, 1.0, 2),
    (LlamaLM(LlamaConfig(vocab_size=64, d_model=128, d_ff=512, n_layers=16, n_heads=4,
                         n_kv_heads=2, attention_block=8, loss_chunk=8, remat="full")), 0.65, 1)],
    ids=["mlp_lm", "mlp_lm-2-microbatches", "llama"])
def test_release_holds_no_fp32_gradient_of_the_layer_stack(model, shrink, microbatches):
  """bf16 params, Kahan AdamW: the normal step's buffers include fp32 arrays the shape
  of the layer stacks' local shards (their gradients, and with microbatches their
  accumulator); the release step's include none (with optimizer accumulation: no
  accumulator either), nor a copy of the stack in its bits, its temporaries shrink by
  at least `shrink` x that gradient, and its largest fp32 temporaries alive at the peak
  are one layer's. MlpLM's normal step holds the fp32 stack twice (params made for
  differentiation and gradient); Llama's once (`stage3.scan_layers` writes the gradient
  over it), while release holds one layer's fp32 shard and gradient: at 16 layers over
  8 devices the temporaries shrink by 0.69 of it (measured; 0.79 before stage 3 sharded a
  leaf along its first dimension, which took 0.21 MB off the normal step, not release's).
  Compiled as train.py and the planner compile (`device_env.CPU_MEMORY_FLAGS`): without
  them XLA:CPU hoists the fp32 upcast of the stack for its gathers out of the forward
  loop."""
  tx = optim.adamw(1e-3, b2=0.95, state_dtype=jnp.bfloat16, update_rule="kahan")
  plan = make(model, tx)
  sharding = jax.sharding.NamedSharding(plan.mesh, plan.batch_spec)
  batch = {"tokens": jax.ShapeDtypeStruct((8 * microbatches, 17), jnp.int32,
                                          sharding=sharding)}
  stack = jax.tree.leaves(plan.params["layers"])
  dims = jax.tree.leaves(plan.param_dims["layers"], is_leaf=lambda d: d is None)
  shard_shapes = {",".join(map(str, zerojax.zero.local_shape(x.shape, d, plan.num_shards)))
                  for x, d in zip(stack, dims, strict=True)}
  stack_grad = 4 * sum(x.size for x in stack) // plan.num_shards
  one_layer = 4 * max(x.size // x.shape[0] for x in stack)

  def compile_step(step):
    """(compiled, its buffer assignment, its temporaries alive at the peak)."""
    with tempfile.TemporaryDirectory() as dump, xla_dump.compiled_afresh():
      compiled = step.lower(zerojax.abstract_state(plan), batch).compile(compiler_options=dict(
          xla_dump_to=dump, xla_dump_hlo_as_text=True, xla_dump_hlo_module_re="jit_step",
          **dict(flag[2:].split("=") for flag in CPU_MEMORY_FLAGS)))
      with open(xla_dump.step_files(dump) + "-buffer-assignment.txt") as f:
        return compiled, f.read(), xla_dump.live_at_peak(dump)

  fp32_stacks = lambda buffers: {s for s in shard_shapes if f"f32[{s}]" in buffers}
  normal, normal_buffers, _ = compile_step(zerojax.make_train_step(
      plan, model.loss, tx, microbatches=microbatches))
  release, release_buffers, at_peak = compile_step(make_release_step(
      plan, model.layered(), tx, microbatches=microbatches, accumulation="optimizer"))
  assert fp32_stacks(normal_buffers) == shard_shapes  # The check sees the gradients.
  assert not fp32_stacks(release_buffers)
  assert not any(f"u16[{s}]" in release_buffers for s in shard_shapes)
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  assert temp(release) <= temp(normal) - shrink * stack_grad, (temp(release), temp(normal))
  fp32_at_peak = [size for size, shape, _ in at_peak if shape.startswith("f32")]
  assert fp32_at_peak and max(fp32_at_peak) <= one_layer, (at_peak[:4], one_layer)


def test_a_layer_with_a_non_finite_gradient_is_not_updated():
  """Layer 1's gradient is NaN (d sqrt(w)/dw at w = 0), the others are finite: layer 1
  keeps its params and moments, layers 0 and 2 and the rest are updated, and the step
  reports one skipped layer (and counts as skipped)."""
  model = MlpLM(**SMALL)
  tx = optim.adamw(1e-2)
  plan = make(model, tx)
  parts = model.layered()
  poisoned = parts._replace(layer=lambda p, x, b: parts.layer(p, x, b) + 0 * jnp.sum(
      jnp.sqrt(p["norm"])))
  params = model.init(jax.random.split(jax.random.key(0))[0])
  params["layers"]["norm"] = params["layers"]["norm"].at[1, 0].set(0.0)
  params = jax.device_put(params, plan.shardings(plan.param_specs))
  before = jax.tree.map(np.asarray, params)
  state, metrics = run(make_release_step(plan, poisoned, tx, donate=False), plan, model,
                       tx, batches(1), params=params)
  assert metrics["skipped_layers"] == 1 and metrics["skipped"] == 1
  assert metrics["consecutive_skips"] == 1
  w_in, was = np.asarray(state.params["layers"]["w_in"]), before["layers"]["w_in"]
  np.testing.assert_array_equal(w_in[1], was[1])
  assert not np.array_equal(w_in[0], was[0]) and not np.array_equal(w_in[2], was[2])
  assert not np.allclose(np.asarray(state.params["head"]), before["head"])
  mu = np.asarray(state.opt_state[0].mu["layers"]["w_in"])
  assert not mu[1].any() and mu[0].any() and mu[2].any()


@pytest.mark.parametrize("change, message", [
    (dict(microbatches=2), "accumulation='optimizer'"),
    (dict(microbatches=2, accumulation="optimizer", tx=optim.sgd(1e-3, momentum=0.9)),
     "adamw or lion"),
    (dict(max_grad_norm=1.0), "clipping='previous_norm'"),
    (dict(max_grad_norm=1.0, clipping="previous_norm"), "carry_grad_norm"),
    (dict(loss_scaling=precision.LossScaling()), "dynamic loss scaling"),
    (dict(stage=2), "this plan is stage 2"),
    (dict(tx=optax.adamw(1e-3)), "LeafwiseTransformation"),
])
def test_what_release_cannot_do_is_refused(change, message):
  model = MlpLM(**SMALL)
  tx = change.pop("tx", optim.adamw(1e-3))
  plan = make(model, tx, stage=change.pop("stage", 3))
  with pytest.raises(ValueError, match=message):
    make_release_step(plan, model.layered(), tx, **change)
