"""Families beyond Llama as options of the one decoder (`zerojax.models.llama`): Qwen2,
Qwen3, Mistral, Gemma 3 and the text tower of Gemma 3's multimodal checkpoints.

Each family's tiny checkpoint is written here by transformers (CPU torch, the `hf-check`
extra; those tests skip without it), with random biases and norm weights (so a
mis-mapped or dropped one shows) and weights at std 0.15 (logits of a few units):
zerojax's fp32 logits are transformers' within 1e-4, export loads in transformers as
the same class with the same logits, a few steps lower the loss, the KV-cached pass is
the uncached model (a Gemma 3 prompt longer than its window included). Sliding-window
attention on every CPU path (XLA's dot_product, blocked, cached, Ulysses over the 8
devices) is a dense masked fp32 reference within 1e-5. A checkpoint with a feature the
decoder lacks is refused with one line naming the field.
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import zerojax
from zerojax import data, generate, hf, sequence
from zerojax.config import ConfigError, load_config
from zerojax.data import sft
from zerojax.models import attention, from_config, llama

from test_chat_families import family_folder
from test_train import train_here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, T = 97, 13  # Vocabulary; positions of the compared sequences (past every window).
TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.15, rms_norm_eps=1e-6)
# family -> (the transformers class written, its config's fields besides TEXT, the
# class export writes). Each one's differences from Llama at tiny size: Qwen2's q/k/v
# biases; Qwen3's q/k norms with head_dim 16 != 32 / 4, tied; Mistral's window of 5 on
# every layer, head_dim 12; Gemma 3's everything, local and global layers alternating
# (pattern 2: local, global, local) with windows of 4, their own RoPE base, linear
# scaling on the global ones.
GEMMA3 = dict(head_dim=16, sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=20,
              rope_theta=1000.0, rope_local_base_freq=100.0,
              rope_scaling={"rope_type": "linear", "factor": 4.0})
SPECS = {
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False), "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True), "Qwen3ForCausalLM"),
    "mistral": ("MistralForCausalLM", dict(head_dim=12, sliding_window=5), "MistralForCausalLM"),
    "gemma3": ("Gemma3ForCausalLM", GEMMA3, "Gemma3ForCausalLM"),
    "gemma3-vlm": ("Gemma3ForConditionalGeneration", dict(
        text_config={**TEXT, **GEMMA3}, mm_tokens_per_image=4, vision_config=dict(
            model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)),
        "Gemma3ForCausalLM"),
}
FP32 = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32)


def _torch():
  transformers = pytest.importorskip("transformers", reason="the transformers check: pip "
                                     "install -e '.[hf-check]' (transformers, CPU torch)")
  torch = pytest.importorskip("torch", reason="the transformers check: a CPU torch")
  return transformers, torch


def _their_logits(torch, model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(np.asarray(tokens))).logits.float().numpy()


@dataclasses.dataclass
class Checkpoint:
  name: str
  folder: str
  theirs: object  # The transformers model.
  model: llama.LlamaLM
  params: dict
  tokens: np.ndarray
  logits: object  # model.logits, jitted once (each test's jit would compile it again).


@pytest.fixture(scope="module")
def ckpt(request, tmp_path_factory) -> Checkpoint:
  """A family's checkpoint written by transformers, and zerojax's import of it (fp32);
  made once per family for the module (tests name their families: `indirect`)."""
  transformers, torch = _torch()
  name = request.param
  cls, fields, _ = SPECS[name]
  model_class = getattr(transformers, cls)
  torch.manual_seed(0)
  config = model_class.config_class(**({} if "text_config" in fields else TEXT), **fields)
  theirs = model_class(config).eval()
  with torch.no_grad():  # Biases and norm weights off their zero / one init.
    for p in theirs.parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn_like(p))
  folder = str(tmp_path_factory.mktemp(name))
  theirs.save_pretrained(folder)
  model = llama.LlamaLM(hf.llama_config(folder, attention="blocked", attention_block=4, **FP32))
  params = hf.load_params(folder, jax.eval_shape(model.init, jax.random.key(0)))
  tokens = np.random.default_rng(0).integers(0, V, (2, T))
  return Checkpoint(name, folder, theirs, model, params, tokens, jax.jit(model.logits))


every_family = pytest.mark.parametrize("ckpt", list(SPECS), indirect=True)


@every_family
def test_logits_are_transformers(ckpt):
  """The family's fields as config.json gives them; fp32 logits within 1e-4."""
  c = ckpt.model.config
  assert c.family == ckpt.name.split("-")[0]
  assert any(c.local_layers) == (ckpt.name != "qwen2" and ckpt.name != "qwen3")
  assert c.mixed_layers == ckpt.name.startswith("gemma3")
  _, torch = _torch()
  ours = np.asarray(ckpt.logits(ckpt.params, ckpt.tokens))
  theirs = _their_logits(torch, ckpt.theirs, ckpt.tokens)
  assert np.abs(theirs).max() > 1.0  # Logits of a few units: 1e-4 is a real bound.
  assert np.abs(ours - theirs).max() < 1e-4, np.abs(ours - theirs).max()


@every_family
def test_export_loads_as_the_same_class_with_the_same_logits(ckpt, tmp_path):
  """save_params -> transformers' Auto class loads the family's class (the text model of a
  multimodal Gemma 3) -> logits within 1e-4 of zerojax's; config.json reads back the same."""
  transformers, torch = _torch()
  hf.save_params(ckpt.params, ckpt.model.config, str(tmp_path))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                           dtype=torch.float32).eval()
  assert type(back).__name__ == SPECS[ckpt.name][2]
  ours = np.asarray(ckpt.logits(ckpt.params, ckpt.tokens))
  assert np.abs(_their_logits(torch, back, ckpt.tokens) - ours).max() < 1e-4
  assert hf.config_overrides(str(tmp_path)) == hf.config_overrides(ckpt.folder)


@pytest.mark.parametrize("ckpt", ["gemma3"], indirect=True)
def test_a_few_steps_lower_the_loss(ckpt):
  """SGD on one batch through the remat layer loop (`scan_layers`), as the train step
  runs it. Gemma 3's stack mixes local and global layers (its carry holds the layer
  index): the first gradient is also the unrematerialized loop's (nn.scan) within 1e-5
  of each leaf's norm, and `layered()` (gradient release's layer-by-layer form) composes
  to the same loss. Every family's loss falling under train.py itself:
  `test_train_py_trains_each_family_quick_start_from_its_imported_checkpoint`."""
  batch = {"tokens": jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 17)))}
  model, params = ckpt.model, ckpt.params
  grad = jax.jit(jax.value_and_grad(model.loss))
  losses = []
  for i in range(4):
    loss, grads = grad(params, batch)
    losses.append(float(loss))
    if i == 0 and model.config.mixed_layers:
      plain = llama.LlamaLM(dataclasses.replace(model.config, remat="none"))
      want = jax.jit(jax.grad(plain.loss))(params, batch)
      for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w) + 1e-12
      parts, rest = model.layered(), {k: v for k, v in params.items() if k != "layers"}

      def layered(params):
        x = parts.embed(rest, batch)
        for j in range(model.config.n_layers):
          x = parts.layer(jax.tree.map(lambda a: a[j], params["layers"]), x, batch)
        return parts.head_loss(rest, x, batch)

      assert abs(float(jax.jit(layered)(params)) - losses[0]) < 1e-5
    params = jax.tree.map(lambda p, g: p - 0.3 * g, params, grads)
  assert losses[-1] < losses[0] - 0.05, losses


def _qwen3_chats(tmp_path) -> list[str]:
  """Chat SFT data for Qwen3's tiny checkpoint: 40 two-turn sums in Qwen3's format
  (`test_chat_families.family_folder`: a tokenizer of 79 ids, under its 97), reasoning on
  every other first turn, so each conversation is split into one example a turn."""
  rng = np.random.default_rng(2)
  lines = []
  for i in range(40):
    (a, b), (c, d) = rng.integers(0, 50, (2, 2))
    first = f"<think>\n{a} plus {b}\n</think>\n\n{a + b}." if i % 2 else f"{a + b}."
    lines.append(json.dumps({"messages": [
        {"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": first},
        {"role": "user", "content": f"And {c}+{d}?"},
        {"role": "assistant", "content": f"{c + d}."}]}) + "\n")
  (tmp_path / "chat.jsonl").write_text("".join(lines))
  return ["--config.data.name=sft", f"--config.data.path={tmp_path / 'chat.jsonl'}",
          f"--config.data.tokenizer={family_folder(tmp_path / 'tok', 'qwen3')}",
          "--config.train.seq_len=64"]


# Not Mistral: Llama's block with a window (the kernels' tests), the import and the
# config check as the others'. Qwen3's on chat SFT in its format, the others pretraining.
@pytest.mark.parametrize("ckpt", ["qwen2", "qwen3", "gemma3"], indirect=True)
def test_train_py_trains_each_family_quick_start_from_its_imported_checkpoint(ckpt, tmp_path):
  """`train.py --config configs/<family>_tiny.py --config.init_from=<transformers' folder>`
  with the `--config.model.*` overrides the folder's shapes need (`hf.config_overrides`,
  what the init_from error lists), in fp32 on the 8 devices at stage 3 (`zerojax.train.main`
  in this process): its first loss is the imported params' loss on train.py's first batch
  (relative 1e-5: the import reached the trainer's state), and four steps lower it.
  Qwen3's fine-tunes on chat data rendered with Qwen3's template (`_qwen3_chats`: packed
  rows of 64 with the turns' masks), the others pretrain on tokens."""
  ids = tmp_path / "ids.npy"  # Python's bytes folded into the checkpoint's 97 ids.
  np.save(ids, (data.stdlib_corpus(1 << 16) % V).astype(np.uint16))
  args = ["--config", os.path.join(REPO, "configs", f"{ckpt.name}_tiny.py"),
          *(f"--config.model.{k}={v}" for k, v in hf.config_overrides(ckpt.folder).items()),
          "--config.data.name=tokens", f"--config.data.path={ids}",
          "--config.precision.param_dtype=float32", "--config.precision.compute_dtype=float32",
          "--config.optimizer.update_rule=nearest", "--config.optimizer.state_dtype=float32",
          "--config.optimizer.learning_rate=1e-2", "--config.optimizer.warmup_steps=1",
          "--config.train.steps=4", "--config.train.global_batch_size=8",
          "--config.train.seq_len=16", "--config.model.attention_block=16",
          "--config.model.loss_chunk=16", "--config.train.log_every=1",
          "--config.train.eval_every=0", "--config.train.eval_batches=1",
          f"--config.init_from={ckpt.folder}", f"--config.workdir={tmp_path / 'run'}"]
  if ckpt.name == "qwen3":
    args += _qwen3_chats(tmp_path)
  result = train_here(*args)
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in records if "loss" in r]
  config = load_config(args[1], args[2:])
  if ckpt.name == "qwen3":
    assert "80 examples" in result.stdout and "40 conversations split" in result.stdout
    train_examples, _, _ = sft.load(config.data, V, 64)
    batch = jax.tree.map(jnp.asarray, sft.batch_at(train_examples, 0, 8, 0))
  else:
    train_tokens, _ = data.load_tokens(config.data, V, 16)
    batch = {"tokens": jnp.asarray(data.batch_at(train_tokens, 0, 8, 16, 0))}
  expected = float(jax.jit(ckpt.model.loss)(ckpt.params, batch))
  assert losses[0] == pytest.approx(expected, rel=1e-5), (losses, expected)
  assert len(losses) == 4 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("ckpt", ["qwen2", "qwen3", "mistral", "gemma3"], indirect=True)
def test_the_cache_is_the_uncached_model_and_greedy_decoding_agrees(ckpt):
  """`extend` over an 8-token prompt (past Gemma's window of 4 and Mistral's 5), then one
  token at a time, gives the whole sequence's logits (1e-5), the local layers keeping
  only their window (a ring of 4 or 5 slots, not 16). Gemma 3's (the mixed stack):
  `generate`'s greedy tokens after right-padded prompts of 9, 3 and 6 tokens (longer
  and shorter than the window) are the uncached model's argmax over each final buffer
  (the decoder's program is test_generate.py's)."""
  model, params, tokens = ckpt.model, ckpt.params, jnp.asarray(ckpt.tokens)
  c = model.config
  cache = llama.init_cache(c, 2, 16)
  local = sum(c.local_layers)
  assert (cache.window_keys is None) == (local == 0)
  if local:
    assert cache.window_keys.shape == (local, 2, c.sliding_window, c.n_kv_heads, c.head_dim)
  assert (cache.keys is None) == (local == c.n_layers)
  extend = jax.jit(model.extend)
  got, cache = extend(params, tokens[:, :8], jnp.broadcast_to(jnp.arange(8), (2, 8)), cache)
  got = [got]
  for t in range(8, T):
    logits, cache = extend(params, tokens[:, t:t + 1], jnp.full((2, 1), t), cache)
    got.append(logits)
  whole = ckpt.logits(params, tokens)
  assert np.abs(np.concatenate(got, 1) - whole).max() < 1e-5
  if not c.mixed_layers:
    return
  prompts = [ckpt.tokens[0, :9].tolist(), ckpt.tokens[1, :3].tolist(), ckpt.tokens[1, 2:8].tolist()]
  outs = generate.generate(model, params, prompts, 6).tokens
  for prompt, out in zip(prompts, outs):
    buffer = jnp.asarray([prompt + out.tolist()])
    argmax = np.argmax(np.asarray(jax.jit(model.logits)(params, buffer)), axis=-1)[0]
    np.testing.assert_array_equal(out, argmax[len(prompt) - 1:-1])


# ------------------------------------------------------------- sliding-window kernels


def _reference(q, k, v, window, scale, segment_ids=None):
  """Dense masked attention in fp32 (numpy float64 inside): q [B, T, H, Dh], k, v
  [B, T, K, Dh]; query i sees keys i - window < j <= i (of its segment)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  G = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  i, j = np.arange(q.shape[1])[:, None], np.arange(q.shape[1])[None, :]
  visible = (j <= i) & (i - j < window)
  if segment_ids is not None:
    seg = np.asarray(segment_ids)
    visible = visible & (seg[:, :, None] == seg[:, None, :])[:, None]
  s = np.where(visible, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@pytest.fixture(scope="module")
def qkv():
  rs = np.random.RandomState(0)
  B, S, H, K, Dh = 2, 32, 8, 2, 8
  q = jnp.asarray(rs.normal(size=(B, S, H, Dh)), jnp.float32)
  k, v = (jnp.asarray(rs.normal(size=(B, S, K, Dh)), jnp.float32) for _ in range(2))
  seg = jnp.asarray(np.cumsum(rs.rand(B, S) < 0.1, axis=1), jnp.int32)
  return q, k, v, seg


@pytest.mark.parametrize("kernel", ["dot_product", "blocked"])
def test_windowed_attention_is_the_dense_masked_reference(qkv, kernel):
  """Window 5, scale 0.3, packed segments: XLA's dot_product (local_window_size) and the
  blocked loop (blocks of 7: not a divisor), values within 1e-5; the blocked loop's
  custom backward is its forward's gradient (jax.test_util)."""
  q, k, v, seg = qkv
  mask = attention.Mask(window=5, scale=0.3)
  run = jax.jit(lambda q, k, v: attention.causal_attention(kernel, 7, q, k, v, seg, mask))
  np.testing.assert_allclose(run(q, k, v), _reference(q, k, v, 5, 0.3, seg), atol=1e-5)
  if kernel == "blocked":
    dense = lambda q, k, v: attention.dot_product_attention(q, k, v, seg, mask)
    ct = jnp.asarray(np.random.RandomState(1).normal(size=q.shape), jnp.float32)
    got = jax.jit(lambda *a: jax.vjp(run, *a)[1](ct))(q, k, v)
    want = jax.jit(lambda *a: jax.vjp(dense, *a)[1](ct))(q, k, v)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, atol=1e-5)


def test_auto_attention_takes_cudnn_for_the_heads_the_gpu_runs_it_on():
  """cuDNN's fused kernel takes heads of 256 only from Hopper (compute capability 9.0) on,
  so 'auto' gives Gemma 3's heads of 256 cuDNN on an H100 / H200 and the blocked loop on
  an RTX 4090 (8.9) or a GPU not known; 128 (Gemma 3 27B) keeps cuDNN everywhere. The
  GPU-target compile: tests/test_gpu_targets.py."""
  pick = functools.partial(attention.attention_kernel, "auto", jnp.bfloat16, backend="gpu")
  assert pick(head_dim=128) == "dot_product" and pick(head_dim=256) == "blocked"
  assert pick(head_dim=256, compute_capability=(9, 0)) == "dot_product"
  assert pick(head_dim=256, compute_capability=(8, 9)) == "blocked"
  assert pick(head_dim=512, compute_capability=(10, 0)) == "blocked"
  assert pick() == "dot_product"  # Unknown width: as before.
  assert attention.attention_kernel("auto", jnp.bfloat16, head_dim=256) == "blocked"  # CPU.


def test_windowed_ulysses_over_8_devices_is_the_reference(qkv):
  """The sequence split over 8 devices (slices of 4 positions, window 6 crosses them):
  Ulysses' all-to-alls around the windowed blocked kernel."""
  q, k, v, seg = qkv
  kernel = functools.partial(attention.causal_attention, "blocked", 8,
                             mask=attention.Mask(window=6))
  spec = P(None, "fsdp")
  split = jax.jit(jax.shard_map(
      lambda q, k, v, s: sequence.attention(q, k, v, s, "fsdp", kernel),
      mesh=zerojax.make_mesh(1, 8), in_specs=(spec,) * 4, out_specs=spec, check_vma=False))
  np.testing.assert_allclose(split(q, k, v, seg), _reference(q, k, v, 6, 8 ** -0.5, seg),
                             atol=1e-5)


def test_windowed_cached_attention_reads_only_the_window(qkv):
  """Decoding: queries at positions 20..23 against a 32-slot cache, window 5."""
  q, k, v, _ = qkv
  positions = jnp.broadcast_to(jnp.arange(20, 24), (2, 4))
  got = attention.cached_attention(q[:, 20:24], k, v, positions, attention.Mask(window=5))
  np.testing.assert_allclose(got, _reference(q, k, v, 5, 8 ** -0.5)[:, 20:24], atol=1e-5)


def test_a_ring_of_the_window_is_the_dense_windowed_reference(qkv):
  """A local layer's cache kept as a ring of W = 5 slots (`attention.ring_sources`,
  `ring_write`, `ring_attention`): 32 positions fed as chunks of 7 (longer than the ring),
  1, 1, 3, 20, the first chunk's last 2 tokens padding (not valid: they must not evict the
  row's last tokens, and the next chunk starts at their positions again), equal the dense
  windowed reference at every real position (1e-5)."""
  q, k, v, _ = qkv
  B, W = q.shape[0], 5
  ring_k = jnp.zeros((B, W, *k.shape[2:]), k.dtype)
  ring_v, held = jnp.zeros_like(ring_k), jnp.full((B, W), -1, jnp.int32)
  want = _reference(q, k, v, W, 8 ** -0.5)

  @jax.jit
  def chunk(q, k, v, ring_k, ring_v, held, positions, valid):
    out = attention.ring_attention(q, k, v, ring_k, ring_v, held, positions,
                                   attention.Mask(window=W))
    sources, held = attention.ring_sources(held, positions, valid)
    return out, attention.ring_write(ring_k, k, sources), attention.ring_write(
        ring_v, v, sources), held

  start, got = 0, []
  for size, pad in [(7, 2), (1, 0), (1, 0), (3, 0), (20, 0)]:
    at = slice(start, start + size)
    positions = jnp.broadcast_to(jnp.arange(start, start + size), (B, size))
    valid = jnp.broadcast_to(jnp.arange(size) < size - pad, (B, size))
    junk = lambda x: jnp.where(valid[..., None, None], x[:, at], 50.0)  # noqa: E731 (padding)
    out, ring_k, ring_v, held = chunk(q[:, at], junk(k), junk(v), ring_k, ring_v, held,
                                      positions, valid)
    got.append(out[:, :size - pad])
    start += size - pad
  assert start == 30
  np.testing.assert_allclose(jnp.concatenate(got, 1), want[:, :start], atol=1e-5)


# ------------------------------------------------------------ configs and refusals


def test_a_config_file_builds_each_family_from_its_keys():
  """The schema's keys reach the decoder (`from_config`): Gemma 3's mixed stack, its
  linear RoPE scaling and explicit head size."""
  config = load_config(os.path.join(REPO, "configs", "base.py"), [
      "model.family=gemma3", "model.head_size=16", "model.qk_norm=true",
      "model.norm_offset=1.0", "model.scale_embeddings=true", "model.hidden_act=gelu_tanh",
      "model.post_norms=true", "model.query_pre_attn_scalar=20", "model.sliding_window=4",
      "model.sliding_window_pattern=2", "model.rope_local_theta=100.0",
      "model.rope_scaling_factor=4.0", "model.rope_scaling_type=linear", "model.n_layers=3"])
  c = from_config(config).config
  assert c.head_dim == 16 and c.local_layers == (True, False, True) and c.mixed_layers
  assert dict(c.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
  np.testing.assert_allclose(llama.rope_frequencies(c), 1 / 4 / 500000.0 ** (np.arange(8) / 8),
                             rtol=1e-6)
  np.testing.assert_allclose(llama.rope_frequencies(c, local=True),
                             1 / 100.0 ** (np.arange(8) / 8), rtol=1e-6)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma3"])
def test_each_family_quick_start_config_is_its_family(tmp_path, family):
  """configs/<family>_tiny.py builds the family's decoder, and the config.json export
  writes for it reads back as the same model keys (what train.py's init_from checks)."""
  config = load_config(os.path.join(REPO, "configs", f"{family}_tiny.py"))
  c = from_config(config).config
  assert c.family == family
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf.hf_config(c, "float32"), f)
  hf.check_config(str(tmp_path), config.model)  # Raises listing any key that differs.


# Published config.json files (their keys, as the model repositories have them).
QWEN25_72B = {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 8192,
              "intermediate_size": 29568, "max_window_layers": 80, "model_type": "qwen2",
              "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
              "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064}
GEMMA3_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                              "model_type": "gemma3_text", "num_attention_heads": 32,
                              "num_hidden_layers": 62, "num_key_value_heads": 16,
                              "query_pre_attn_scalar": 168, "sliding_window": 1024,
                              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
              "vision_config": {"model_type": "siglip_vision_model"}}

QWEN3_32B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
             "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 25600,
             "max_window_layers": 64, "model_type": "qwen3", "num_attention_heads": 64,
             "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
             "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
             "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_SMALL_24B = {"architectures": ["MistralForCausalLM"], "head_dim": 128,
                     "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                     "model_type": "mistral", "num_attention_heads": 32,
                     "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                     "rope_theta": 100000000.0, "sliding_window": None,
                     "tie_word_embeddings": False, "vocab_size": 131072}

QWEN3_8B = {**QWEN3_32B, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 36,
            "num_attention_heads": 32, "num_hidden_layers": 36}
QWEN25_7B = {**QWEN25_72B, "hidden_size": 3584, "intermediate_size": 18944,
             "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28,
             "num_key_value_heads": 4}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
              "intermediate_size": 14336, "model_type": "mistral", "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
              "vocab_size": 32768}  # v0.3.
GEMMA3_12B = {**GEMMA3_27B, "text_config": {
    "hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
    "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}


@pytest.mark.parametrize("recipe,published,billions", [
    ("qwen25_72b_8x80gb.py", QWEN25_72B, 72.71), ("gemma3_27b_4x80gb.py", GEMMA3_27B, 27.01),
    ("qwen3_32b_4x80gb.py", QWEN3_32B, 32.76),
    ("mistral_small_24b_4x80gb.py", MISTRAL_SMALL_24B, 23.57),
    ("qwen3_8b_1x4090.py", QWEN3_8B, 8.19), ("gemma3_12b_1x4090.py", GEMMA3_12B, 11.77),
    ("qwen25_7b_1x4090.py", QWEN25_7B, 7.62), ("mistral_7b_1x4090.py", MISTRAL_7B, 7.25)])
def test_a_real_size_recipe_is_its_published_config_json(tmp_path, recipe, published, billions):
  """The recipe passes init_from's check against the model's config.json (a multimodal
  Gemma 3's text_config over Gemma3TextConfig's defaults) and has its parameters."""
  config = load_config(os.path.join(REPO, "configs", recipe))
  with open(tmp_path / "config.json", "w") as f:
    json.dump(published, f)
  hf.check_config(str(tmp_path), config.model)
  assert round(llama.param_count(from_config(config).config) / 1e9, 2) == billions


def test_head_size_is_checked_by_the_config_rules():
  """An explicit head size frees d_model from n_heads (Gemma 3 4B: 2560 = 8 heads of 256
  is not its split) but must be even; a family key set on mlp_lm is refused."""
  base = os.path.join(REPO, "configs", "base.py")
  load_config(base, ["model.d_model=100", "model.n_heads=3", "model.n_kv_heads=1",
                     "model.head_size=64"])
  with pytest.raises(ConfigError, match="model.head_size"):
    load_config(base, ["model.head_size=63"])
  with pytest.raises(ConfigError, match="model.d_model"):
    load_config(base, ["model.d_model=100", "model.n_heads=3", "model.n_kv_heads=1"])
  with pytest.raises(ConfigError, match="model.sliding_window"):
    load_config(base, ["model.name=mlp_lm", "model.sliding_window=8"])


def _qwen3_folder(folder, **changes):
  config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V,
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, **changes}
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f)
  return str(folder)


@pytest.mark.parametrize("changes,field", [
    (dict(attention_bias=True), "attention_bias true"),
    (dict(hidden_act="relu"), "hidden_act 'relu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "RoPE type 'yarn'"),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "layer_types"),
    (dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
          final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"),
     "DeepseekV3ForCausalLM"),
    (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
          num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[0]),
     "mlp_only_layers")])
def test_a_feature_the_decoder_lacks_is_one_line_naming_it(tmp_path, changes, field):
  with pytest.raises(hf.HFError) as error:
    hf.config_overrides(_qwen3_folder(tmp_path, **changes))
  message = str(error.value)
  assert field in message and "config.json" in message, message


@pytest.mark.parametrize("ckpt", ["gemma3-vlm"], indirect=True)
def test_the_text_tower_under_the_other_prefix(ckpt, tmp_path):
  """transformers writes a multimodal Gemma 3 as the published files are
  ('language_model.model.', the fixture's); its in-memory names ('model.language_model.')
  read the same, the vision tensors skipped."""
  tensors = load_file(os.path.join(ckpt.folder, "model.safetensors"))
  assert hf.text_prefix(tensors) == "language_model.model."
  renamed = {k.replace("language_model.model.", "model.language_model.", 1): x
             for k, x in tensors.items()}
  assert any(k.startswith("vision_tower.") for k in renamed)
  save_file(renamed, str(tmp_path / "model.safetensors"))
  with open(os.path.join(ckpt.folder, "config.json")) as f:
    config = json.load(f)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  got = hf.load_params(str(tmp_path), jax.eval_shape(ckpt.model.init, jax.random.key(0)))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ckpt.params)):
    np.testing.assert_array_equal(a, b)
