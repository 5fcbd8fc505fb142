"""KV-cached generation (`zerojax.generate`): the same tokens as the uncached reference,
at stage 3 on 8 CPU devices too, sampling by seed, stop ids, the cache's layout and
bytes, and the CLI on a train.py checkpoint and its exported Hugging Face folder."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
import zerojax.train
from zerojax import generate
from zerojax.generate import cli, sampling
from zerojax.hf import export
from zerojax.models import MlpLM, llama
from zerojax.runtime import exits

V, MAX_PROMPT = 64, 40
CONFIG = llama.LlamaConfig(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           d_ff=128, rope_theta=10000.0, param_dtype=jnp.float32,
                           compute_dtype=jnp.float32, attention_block=64, loss_chunk=64)
MODEL = llama.LlamaLM(CONFIG)


PERM = np.random.default_rng(0).permutation(V)


def chains(starts: np.ndarray, length: int) -> np.ndarray:
  """int32[N, length]: t[i] = PERM[t[i-1]] from each start."""
  out = np.zeros((len(starts), length), np.int32)
  out[:, 0] = starts
  for i in range(1, length):
    out[:, i] = PERM[out[:, i - 1]]
  return out


@pytest.fixture(scope="module")
def trained():
  """Params trained on `chains` (100 Adam steps, 6 s): decisive logits (the smallest
  top-2 gap over random contexts 1.6e-3, the cached and uncached logits ~1e-7 apart), so
  an argmax near-tie, where rounding could pick either, is not what the tests compare."""
  rng = np.random.default_rng(0)
  tx = optax.adam(1e-2)
  fast = llama.LlamaLM(dataclasses.replace(CONFIG, remat="none"))  # The same params.

  @jax.jit
  def step(params, opt, tokens):
    loss, grads = jax.value_and_grad(fast.loss)(params, {"tokens": tokens})
    updates, opt = tx.update(grads, opt)
    return optax.apply_updates(params, updates), opt, loss

  params = MODEL.init(jax.random.key(0))
  opt = tx.init(params)
  for _ in range(100):
    params, opt, loss = step(params, opt, chains(rng.integers(0, V, 8), 65))
  assert float(loss) < 0.05, float(loss)
  return params


def prompts(n: int, seed: int = 1) -> list[list[int]]:
  """n prompts of random tokens, 1 to MAX_PROMPT - 1 long."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, V, int(k)).tolist() for k in rng.integers(1, MAX_PROMPT, n)]


def test_cached_greedy_is_the_uncached_greedy_for_64_prompts_x_128_tokens(trained):
  """64 right-padded prompts of 1-39 tokens, 128 new tokens each: every new token is the
  argmax of the uncached model (`model.logits`) over its prompt and the tokens before it.

  That is what `generate.greedy` computes with one rerun of the whole buffer per token
  (causal attention: position j's logits do not depend on what follows it); checked
  here with one forward pass over the final buffer (128 reruns: 64 s at -O0), and
  against `greedy` itself on 8 prompts x 16 tokens."""
  batch = prompts(64)
  assert len({len(p) for p in batch}) > 20
  out = generate.generate(MODEL, trained, batch, 128)
  assert out.tokens.shape == (64, 128) and (out.lengths == 128).all()
  lengths = np.array([len(p) for p in batch], np.int32)
  buffer = np.zeros((64, MAX_PROMPT + 128), np.int32)
  for b, p in enumerate(batch):
    buffer[b, :len(p) + 128] = p + out.tokens[b].tolist()
  argmax = np.argmax(np.asarray(jax.jit(MODEL.logits)(trained, buffer)), axis=-1)
  np.testing.assert_array_equal(
      out.tokens, np.stack([argmax[b, n - 1:n + 127] for b, n in enumerate(lengths)]))
  few = np.where(np.arange(MAX_PROMPT + 16) < lengths[:8, None], buffer[:8, :MAX_PROMPT + 16], 0)
  few = np.asarray(generate.greedy_jit(MODEL.logits, trained, few, lengths[:8], steps=16))
  np.testing.assert_array_equal(
      np.stack([few[b, n:n + 16] for b, n in enumerate(lengths[:8])]), out.tokens[:8, :16])


def test_the_cache_is_the_uncached_model_position_by_position():
  """`extend` over a prompt then one token at a time gives the logits of the whole
  sequence at once (random init: this compares logits, not argmaxes)."""
  params = MODEL.init(jax.random.key(3))
  tokens = jax.random.randint(jax.random.key(4), (3, 20), 0, V)
  cache = llama.init_cache(MODEL.config, 3, 32)
  assert cache.keys.shape == (2, 3, 32, 2, 16) and cache.window_keys is None  # No window.
  extend = jax.jit(MODEL.extend)
  got, cache = extend(params, tokens[:, :12], jnp.broadcast_to(jnp.arange(12), (3, 12)), cache)
  got = [got]
  for t in range(12, 20):
    logits, cache = extend(params, tokens[:, t:t + 1], jnp.full((3, 1), t), cache)
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, 1), MODEL.logits(params, tokens), atol=2e-6)


def test_stage_3_on_8_devices_gives_the_replicated_tokens_with_the_cache_on_the_mesh(trained):
  mesh = zerojax.make_mesh(1, 8)
  tx = optax.sgd(0.1)
  plan = zerojax.make_plan(mesh, 3, jax.eval_shape(MODEL.init, jax.random.key(0)), tx,
                           logical_axes=MODEL.logical_axes(), min_shard_size=64)
  state = zerojax.init_state(plan, lambda _: trained, tx, jax.random.key(0))
  kernel = state.params["layers"]["mlp"]["up_proj"]["kernel"]
  assert kernel.sharding.spec != P() and (
      kernel.addressable_shards[0].data.shape[1] == kernel.shape[1] // 8)
  # CPU devices report no memory limit: 'auto' gathers whole params once.
  assert generate.decode.choose_gather(plan, "auto") == "whole"
  batch = prompts(12, seed=2)
  want = generate.generate(MODEL, trained, batch, 24).tokens
  for gather in ("whole", "layer"):
    got = generate.generate(MODEL, state.params, batch, 24, plan=plan, gather=gather)
    np.testing.assert_array_equal(got.tokens, want, err_msg=gather)
  # The cache as the decoder leaves it, in the program `generate` ran (12 prompts: 16
  # rows of 64 positions): batch over both mesh axes, 2 rows a device.
  tokens = np.zeros((16, 64), np.int32)
  lengths = np.zeros(16, np.int32)
  lengths[:3], tokens[:3, :5] = 5, np.arange(5)
  _, count, kv = generate.decoder(MODEL, plan, "layer")(
      state.params, tokens, lengths, np.full(8, -1, np.int32), np.int32(4), np.int32(0),
      sampling.as_arrays(generate.Sampling()), 64)
  assert count.tolist() == [4] * 3 + [0] * 13
  assert kv.window_keys is None and kv.held is None  # Llama: no local layers.
  for x in kv[:2]:
    assert x.shape == (2, 16, 64, 2, 16)
    assert tuple(x.sharding.spec) == (None, ("data", "expert", "fsdp"), None, None, None)
    assert len(x.sharding.device_set) == 8
    assert {s.data.nbytes for s in x.addressable_shards} == {x.nbytes // 8}
  assert generate.cache_bytes(CONFIG, 16, 64, 8) == sum(x.nbytes for x in kv[:2]) // 8
  assert generate.cache_bytes(CONFIG, 16, 64) == 2 * 2 * 16 * 64 * 2 * 16 * 4


def test_sampling_is_reproducible_by_seed_and_top_k_1_is_greedy(trained):
  batch = prompts(8, seed=3)
  greedy = generate.generate(MODEL, trained, batch, 16).tokens
  hot = generate.Sampling(temperature=2.0, top_p=0.95)
  a, b, c = (generate.generate(MODEL, trained, batch, 16, sampling=hot, seed=s).tokens
             for s in (1, 1, 2))
  np.testing.assert_array_equal(a, b)
  assert (a != c).any() and (a != greedy).any()
  top1 = generate.generate(MODEL, trained, batch, 16, seed=5,
                           sampling=generate.Sampling(temperature=1.5, top_k=1))
  np.testing.assert_array_equal(top1.tokens, greedy)


@pytest.mark.parametrize("s", [generate.Sampling(0.7, 0, 0.8), generate.Sampling(1.3, 3, 1.0),
                               generate.Sampling(1.0, 0, 1.0)], ids=["top_p", "top_k", "plain"])
def test_sampled_frequencies_are_the_filtered_softmax(s):
  """20,000 draws (one per row) against HF's filters computed here in numpy: each
  frequency within 0.015 (over 4 standard deviations of a frequency at n = 20,000)."""
  logits = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0], np.float32)
  z = logits / s.temperature
  order = np.argsort(-z)
  p = np.exp(z[order] - z.max())
  if s.top_k:
    p[s.top_k:] = 0
  p /= p.sum()
  keep = np.cumsum(p) - p < s.top_p
  want = np.zeros(len(z))
  want[order[keep]] = p[keep] / p[keep].sum()
  n = 20000
  draws = jax.jit(lambda z: sampling.next_token(
      jnp.broadcast_to(z, (n, len(logits))), sampling.as_arrays(s), jax.random.key(0),
      jnp.arange(n), jnp.int32(0)))(logits)
  got = np.bincount(np.asarray(draws), minlength=len(z)) / n
  np.testing.assert_allclose(got, want, atol=0.015)
  assert (got[want == 0] == 0).all()


def test_stop_ids_end_rows(trained):
  batch = prompts(8, seed=4)
  free = generate.generate(MODEL, trained, batch, 20).tokens
  stop = int(free[0, 5])
  out = generate.generate(MODEL, trained, batch, 20, stop_ids={stop, V + 1})
  for row, said, n in zip(free, out.tokens, out.lengths):
    hits = np.flatnonzero(row == stop)
    want = hits[0] + 1 if len(hits) else 20
    assert n == want and said[:n].tolist() == row[:n].tolist() and not said[n:].any()
  assert out.lengths[0] <= 6


def test_a_model_without_a_cache_is_a_clear_error():
  model = MlpLM(vocab_size=V, d_model=32, n_layers=1, d_ff=64)
  with pytest.raises(TypeError, match="MlpLM has no KV-cached pass"):
    generate.generate(model, model.init(jax.random.key(0)), [[1, 2]], 4)


SFT_TINY = "configs/sft_tiny.py"


def test_cli_answers_from_a_checkpoint_and_its_hf_folder_with_the_same_ids(tmp_path, capsys):
  """train.py (in this process, exact match evaluated on the stage-3 params with the
  cache), then the CLI on its checkpoint and on the exported folder: the same ids."""
  work, folder = tmp_path / "run", tmp_path / "hf"
  assert zerojax.train.main([
      "--config", SFT_TINY, "--config.zero.stage=3", "--config.train.steps=2",
      "--config.optimizer.warmup_steps=1", "--config.train.eval_every=2",
      "--config.train.eval_batches=1", "--config.train.eval_exact_match=16",
      f"--config.workdir={work}"]) == exits.DONE
  assert '"exact_match"' in (work / "metrics.jsonl").read_text()
  assert export.main(["--workdir", str(work), "--out", str(folder)]) == exits.DONE
  asked = ["--prompt", "12+30=", "--prompt", "sort dcba:", "--max_new", "6", "--json"]
  said = {}
  for source in (["--workdir", str(work)], ["--hf", str(folder)]):
    capsys.readouterr()
    assert cli.main([*source, *asked]) == exits.DONE
    lines = capsys.readouterr().out.splitlines()
    said[source[0]] = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in said[source[0]]] == ["12+30=", "sort dcba:"]
  assert [r["ids"] for r in said["--workdir"]] == [r["ids"] for r in said["--hf"]]
  assert all(1 <= len(r["ids"]) <= 6 for r in said["--hf"])
  capsys.readouterr()
  assert cli.main(["--hf", str(folder), "--chat", "--prompt", "12+30=", "--max_new", "3"]) == 0
  assert len(capsys.readouterr().out.splitlines()) == 1
  (folder / "tokenizer.json").unlink()
  for bad, words in [(["--hf", str(folder)], "no tokenizer.json in this folder"),
                     (["--hf", str(tmp_path / "nothing")], "no such folder"),
                     (["--workdir", str(tmp_path)], "no checkpoints directory"),
                     (["--workdir", str(work), "--top_p", "1.5"], "top_p 1.5 must be in (0, 1]"),
                     (["--workdir", str(work), "--max_new", "0"], "--max_new 0"),
                     (["--workdir", str(work), "--top_k", "x"], "invalid int value")]:
    capsys.readouterr()
    assert cli.main([*bad, "--prompt", "1+1="]) == exits.BAD_INPUT, bad
    err = capsys.readouterr().err
    # One error line (and the project's indented `fix:` line under it), no traceback.
    first, *rest = err.splitlines()
    assert first.startswith("error: ") and words in first, err
    assert all(line.startswith("  fix: ") for line in rest) and "Traceback" not in err, err


def test_the_planner_shows_the_cache_of_a_generation(capsys):
  from zerojax.memory import report as memory_report
  assert memory_report.main(["--config", "configs/tiny.py", "--devices", "8",
                             "--generate", "12x100"]) == 0
  # 12 prompts -> 16 rows, 2 a device; 100 tokens -> 128: 2 x 4 x 2 x 128 x 2 x 32 x 2 B.
  assert ("generation (--generate 12x100): KV cache 256.00 KiB per device for 16 rows x 128 "
          "tokens") in capsys.readouterr().out
  assert generate.cache_bytes(llama.LlamaConfig(), 16, 128, 8) == 256 << 10
  with pytest.raises(SystemExit) as end:
    memory_report.main(["--config", "configs/tiny.py", "--devices", "8", "--generate", "12"])
  assert end.value.code == exits.BAD_INPUT and "expected BATCHxLEN" in capsys.readouterr().err
