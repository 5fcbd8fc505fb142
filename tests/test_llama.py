"""The Llama model: a float64 numpy reference, blocked attention and chunked loss,
memory at long context, ZeRO stage 3 vs stage 0, and the 70B shape."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import testing
from zerojax.models import llama, remat as remat_policies
from zerojax.models.mlp_lm import MlpLM
from zerojax.testing import hlo

LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       # Small, so T=24 positions reach the scaled frequencies.
                       original_max_position_embeddings=64)
SMALL = llama.LlamaConfig(
    vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
    rope_theta=500000.0, rope_scaling=LLAMA31_SCALING, norm_eps=1e-5,
    param_dtype=jnp.float32, compute_dtype=jnp.float32, attention_block=8, loss_chunk=8)


# One-to-one with Hugging Face's Llama tensors (kernels transposed, layers stacked).
HF_NAMES = {"embed_tokens/embedding", "norm/scale", "lm_head/kernel"} | {
    f"layers/{name}" for name in [
        "input_layernorm/scale", "post_attention_layernorm/scale",
        *(f"self_attn/{p}_proj/kernel" for p in "qkvo"),
        *(f"mlp/{p}_proj/kernel" for p in ("gate", "up", "down"))]}


def random_params(config, seed=0):
  """Params with O(1) activations: kernels ~ N(0, 1/fan_in), norms 1 + N(0, 0.3)."""
  rs = np.random.RandomState(seed)
  shapes = jax.eval_shape(llama.LlamaLM(config).init, jax.random.key(0))

  def leaf(path, x):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      v = 1.0 + 0.3 * rs.randn(*x.shape)
    elif "embedding" in name:
      v = rs.randn(*x.shape)
    else:
      v = rs.randn(*x.shape) / math.sqrt(x.shape[-2])
    return jnp.asarray(v, x.dtype)
  return jax.tree_util.tree_map_with_path(leaf, shapes)


# ------------------------------------------------------------- numpy reference (f64)


def ref_inv_freq(c):
  """Hugging Face's `_compute_default_rope_parameters` + `_compute_llama3_parameters`."""
  d = c.head_dim
  inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, d, 2) / d))
  if c.rope_scaling is None:
    return inv_freq
  s = c.rope_scaling
  low_freq_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
  high_freq_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
  wavelen = 2 * math.pi / inv_freq
  inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / s["factor"], inv_freq)
  smooth = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
            / (s["high_freq_factor"] - s["low_freq_factor"]))
  smoothed = (1 - smooth) * inv_freq_llama / s["factor"] + smooth * inv_freq_llama
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, inv_freq_llama)


def ref_logits(c, params, tokens):
  """The Llama forward pass from the math, in float64: [B, T] -> [B, T, V]."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  B, T = tokens.shape
  H, K, Dh = c.n_heads, c.n_kv_heads, c.d_model // c.n_heads

  def rms(x, w):
    return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + c.norm_eps) * w

  freqs = np.arange(T)[:, None] * ref_inv_freq(c)[None, :]
  emb = np.concatenate([freqs, freqs], axis=-1)
  cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]

  def rope(x):  # [B, T, N, Dh]
    x1, x2 = x[..., :Dh // 2], x[..., Dh // 2:]
    return x * cos + np.concatenate([-x2, x1], axis=-1) * sin

  x = p["embed_tokens"]["embedding"][tokens]
  mask = np.tril(np.ones((T, T), bool))
  for i in range(c.n_layers):
    lp = jax.tree.map(lambda a: a[i], p["layers"])
    at = lp["self_attn"]
    h = rms(x, lp["input_layernorm"]["scale"])
    q = rope((h @ at["q_proj"]["kernel"]).reshape(B, T, H, Dh))
    k = rope((h @ at["k_proj"]["kernel"]).reshape(B, T, K, Dh))
    v = (h @ at["v_proj"]["kernel"]).reshape(B, T, K, Dh)
    k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)  # HF's repeat_kv.
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(Dh)
    s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(B, T, H * Dh)
    x = x + o @ at["o_proj"]["kernel"]
    h = rms(x, lp["post_attention_layernorm"]["scale"])
    mlp = lp["mlp"]
    g = h @ mlp["gate_proj"]["kernel"]
    x = x + ((g / (1 + np.exp(-g))) * (h @ mlp["up_proj"]["kernel"])) @ mlp["down_proj"]["kernel"]
  x = rms(x, p["norm"]["scale"])
  head = p["embed_tokens"]["embedding"].T if c.tie_embeddings else p["lm_head"]["kernel"]
  return x @ head


@pytest.mark.parametrize("attention,tied", [("blocked", False), ("dot_product", True)])
def test_logits_match_numpy_reference(attention, tied):
  c = dataclasses.replace(SMALL, attention=attention, tie_embeddings=tied)
  params = random_params(c)
  assert ("lm_head" in params) != tied
  tokens = np.random.RandomState(1).randint(0, c.vocab_size, (2, 24)).astype(np.int32)
  with jax.default_matmul_precision("highest"):
    got = np.asarray(jax.jit(lambda p, t: llama.logits(c, p, t))(params, tokens))
  want = ref_logits(c, params, tokens)
  assert got.dtype == np.float32 and got.shape == (2, 24, c.vocab_size)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  # The reference sees the rope scaling: without it the logits differ far beyond 1e-4.
  unscaled = ref_logits(dataclasses.replace(c, rope_scaling=None), params, tokens)
  assert np.abs(unscaled - want).max() > 1e-2


def test_rope_frequencies_match_hf_formula():
  c = dataclasses.replace(SMALL, d_model=256, n_heads=4)  # Dh = 64: 32 frequencies.
  got, want = llama.rope_frequencies(c), ref_inv_freq(c)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  wavelen = 2 * math.pi / ref_inv_freq(dataclasses.replace(c, rope_scaling=None))
  # All three regimes present: kept, interpolated, divided by the factor.
  assert (wavelen < 16).any() and ((wavelen > 16) & (wavelen < 64)).any() and (wavelen > 64).any()


# -------------------------------------------------- blocked attention, chunked loss


def test_blocked_attention_and_chunked_loss_equal_the_plain_computation():
  # T = 20 is not a multiple of the block (8) or the chunk (8): padding is exercised.
  params = random_params(SMALL)
  tokens = np.random.RandomState(2).randint(0, SMALL.vocab_size, (2, 21)).astype(np.int32)
  plain = dataclasses.replace(SMALL, attention="dot_product", remat="none")

  def plain_loss(p):  # Whole scores, whole logits, nothing rematerialized.
    z = llama.logits(plain, p, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(z, tokens[:, 1:]).mean()

  with jax.default_matmul_precision("highest"):
    want, want_grads = jax.jit(jax.value_and_grad(plain_loss))(params)
    # Recomputation changes no arithmetic: each remat code path (no checkpoint, JAX's
    # named policies, the by-name path saving projections and saving attention's output;
    # the other by-name policies save subsets of those names on the same path).
    for remat in ("none", "dots", "full", "minimal", "save_attention_out"):
      assert remat in remat_policies.POLICIES
      c = dataclasses.replace(SMALL, remat=remat)
      got, grads = jax.jit(jax.value_and_grad(
          lambda p: llama.loss(c, p, {"tokens": tokens})))(params)
      np.testing.assert_allclose(got, want, rtol=1e-6)
      for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _temp_bytes(config, seq_len):
  params = jax.eval_shape(llama.LlamaLM(config).init, jax.random.key(0))
  batch = {"tokens": jax.ShapeDtypeStruct((1, seq_len + 1), jnp.int32)}
  step = jax.jit(jax.value_and_grad(lambda p, b: llama.loss(config, p, b)))
  return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_long_context_never_materialises_scores_or_all_logits():
  T, V = 2048, 8192
  c = dataclasses.replace(SMALL, vocab_size=V, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                          d_ff=64, attention_block=128, loss_chunk=128)
  scores = c.n_heads * T * T * 4  # One fp32 (heads, T, T) array: 64 MiB.
  all_logits = T * V * 4  # The fp32 logits of the whole sequence: 64 MiB.
  blocked = _temp_bytes(c, T)  # Measured: 23 MiB, whatever the remat policy.
  full_scores = _temp_bytes(dataclasses.replace(c, attention_block=T), T)  # 258 MiB.
  full_logits = _temp_bytes(dataclasses.replace(c, loss_chunk=T), T)  # 198 MiB.
  assert full_scores > scores and full_logits > all_logits  # The controls do materialise.
  assert blocked < scores / 2 and blocked < all_logits / 2, (blocked, scores, all_logits)


# ---------------------------------------------------------------------------- ZeRO


def test_zero_stage_3_trains_like_stage_0_gathering_one_layer_at_a_time():
  c = dataclasses.replace(SMALL, n_layers=3, d_ff=128)  # No layer shape is (V, D) or (D, V).
  model = llama.LlamaLM(c)
  batch = {"tokens": np.random.RandomState(4).randint(0, c.vocab_size, (16, 17)).astype(np.int32)}
  tx = optax.adamw(1e-3)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  axes = model.logical_axes()
  assert axes["layers"]["self_attn"]["k_proj"]["kernel"] == ("layers", "embed", "kv_heads")
  layer_shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(shapes["layers"])
                  if x.ndim == 3}
  results = {}
  for stage in (0, 3):
    plan = zerojax.make_plan(zerojax.make_mesh(1, 8), stage, shapes, tx,
                             logical_axes=axes, min_shard_size=0)
    state = zerojax.init_state(plan, model.init, tx, jax.random.key(0))
    step = zerojax.make_train_step(plan, model.loss, tx).lower(state, batch).compile(
        testing.DEFAULT_EMITTERS)  # The tolerances below were measured with them.
    for _ in range(4):
      state, metrics = step(state, batch)
    results[stage] = (float(metrics["loss"]), jax.tree.map(np.asarray, state.params))
    if stage == 3:
      gathers = [g for g in hlo.collectives(step.as_text()) if g.op == "all-gather"
                 and {s for _, s in g.results} & layer_shapes]
      assert {s for g in gathers for _, s in g.results} >= layer_shapes
      assert all(g.trips == c.n_layers for g in gathers), [
          (g.results, g.trips) for g in gathers if g.trips != c.n_layers]
  np.testing.assert_allclose(results[3][0], results[0][0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[3][1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ 70B and helpers


def test_70b_shape_param_count():
  c = llama.LlamaConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                        n_kv_heads=8, d_ff=28672, rope_scaling=dict(
                            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192))
  shapes = jax.eval_shape(llama.LlamaLM(c).init, jax.random.key(0))
  names = {jax.tree_util.keystr(path, simple=True, separator="/")
           for path, _ in jax.tree_util.tree_leaves_with_path(shapes)}
  assert names == HF_NAMES
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  assert 68e9 <= total <= 71e9 and total == llama.param_count(c) == 70_553_706_496
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(shapes))
  assert shapes["layers"]["self_attn"]["k_proj"]["kernel"].shape == (80, 8192, 1024)
  # ~6 N: 6 x 70.55e9 less the embedding lookup, plus causal attention at 4096 tokens.
  assert 4.2e11 < llama.flops_per_token(c, 4096) < 4.4e11


def test_param_count_tied_and_config_errors():
  c = dataclasses.replace(SMALL, tie_embeddings=True)
  shapes = jax.eval_shape(llama.LlamaLM(c).init, jax.random.key(0))
  assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == llama.param_count(c)
  with pytest.raises(ValueError, match="n_kv_heads"):
    dataclasses.replace(SMALL, n_kv_heads=3)
  with pytest.raises(ValueError, match="attention"):
    dataclasses.replace(SMALL, attention="flash")
  with pytest.raises(ValueError, match="rope_scaling"):
    dataclasses.replace(SMALL, rope_scaling={"factor": 8.0})
  hash(SMALL)  # Usable as a static argument / Flax attribute.


@pytest.mark.parametrize("model", [
    llama.LlamaLM(SMALL), llama.LlamaLM(dataclasses.replace(SMALL, tie_embeddings=True)),
    MlpLM(vocab_size=64, d_model=32, d_ff=48, n_layers=3, context=4)], ids=["llama", "tied",
                                                                            "mlp_lm"])
def test_param_shapes_are_what_init_makes(model):
  """The one written-out copy of the shapes (planner, HF mapping, param_count) is the
  model's: same leaves, shapes and logical axes as `jax.eval_shape` of its init."""
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  made = {tuple(k.key for k in path): (x.shape, names) for (path, x), names in zip(
      jax.tree_util.tree_leaves_with_path(shapes),
      jax.tree.leaves(model.logical_axes(), is_leaf=lambda x: isinstance(x, tuple)))}
  assert model.param_shapes() == made
  if isinstance(model, llama.LlamaLM):
    assert llama.param_count(model.config) == sum(math.prod(s) for s, _ in made.values())


def test_config_from_model_keys_takes_fields_by_name():
  from zerojax.config.schema import base_config
  m = base_config().model
  m.update(d_model=64, n_heads=8, rope_scaling_factor=8.0, rope_original_context=64, context=3)
  c = llama.LlamaConfig.from_keys(m, param_dtype=jnp.float32)
  assert (c.d_model, c.n_heads, c.remat, c.param_dtype) == (64, 8, m.remat, jnp.float32)
  assert dict(c.rope_scaling) == dict(factor=8.0, low_freq_factor=m.rope_low_freq_factor,
                                      high_freq_factor=m.rope_high_freq_factor,
                                      original_max_position_embeddings=64)
  m.rope_scaling_factor = 0.0  # Off: no scaling, whatever the other three say.
  assert llama.LlamaConfig.from_keys(m).rope_scaling is None


def test_auto_attention_picks_cudnn_only_on_gpu_in_16_bit():
  from zerojax.models.attention import attention_kernel
  assert attention_kernel("auto", jnp.bfloat16) == "blocked"  # This machine: CPU.
  assert attention_kernel("auto", jnp.bfloat16, backend="gpu") == "dot_product"
  assert attention_kernel("auto", jnp.float32, backend="gpu") == "blocked"
  assert attention_kernel("dot_product", jnp.float32) == "dot_product"
