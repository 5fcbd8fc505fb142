"""Packing proof: a packed batch's loss and gradients equal the examples' run one by one.

Real pieces throughout: a JSONL file of the generated tasks, the byte tokenizer, the SFT
reader and packer, the fp32 Llama under jax.jit with each attention kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.config import base_config
from zerojax.data import sft, sft_demo
from zerojax.models import llama

pytest.importorskip("tokenizers")

SEQ = 63  # Rows of 64 tokens: 3-4 examples each.


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
  paths = sft_demo.write(str(tmp_path_factory.mktemp("sft")), train=40, held_out=4)
  d = base_config().data
  d.update(name="sft", path=paths["train"], tokenizer=paths["tokenizer"])
  from tokenizers import Tokenizer
  ex, _ = sft.read_examples(paths["train"], "data.path", d, Tokenizer.from_file(d.tokenizer), SEQ)
  return ex


def config(attention: str) -> llama.LlamaConfig:
  return llama.LlamaConfig(vocab_size=sft_demo.VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, d_ff=64, param_dtype=jnp.float32,
                           compute_dtype=jnp.float32, attention=attention, attention_block=16,
                           loss_chunk=20, remat="full")


@pytest.mark.parametrize("attention", ["blocked", "dot_product"])
def test_packed_loss_and_gradients_equal_the_examples_run_alone(examples, attention):
  """Packed loss = the token-weighted mean of each example's own loss (run alone, padded,
  positions from 0), gradients too, within 1e-5 relative in fp32: nothing leaks across
  examples. Without the segment mask the packed loss moves by far more (the control).

  Without the positions' reset the loss does not move: RoPE scores depend only on
  position differences, which within one example the reset leaves alone
  (docs/design/data-and-sft.md).
  """
  c = config(attention)
  params = llama.LlamaLM(c).init(jax.random.key(0))
  batch = sft.batch_at(examples, 0, 2, seed=0)
  row_examples = np.concatenate(sft.rows_at(examples, 0, 2, seed=0))
  assert (batch["segment_ids"].max(axis=1) >= 3).all()  # Several examples per row.
  grad = jax.jit(jax.value_and_grad(lambda p, b: llama.loss(c, p, b)))

  packed_loss, packed_grads = grad(params, batch)
  losses, grads, counts = [], [], []
  for i in row_examples:
    loss, g = grad(params, _alone(examples, i))
    losses.append(loss)
    grads.append(g)
    counts.append(examples.mask[examples.starts[i]:examples.starts[i] + examples.lengths[i]].sum())
  w = np.asarray(counts, np.float64) / np.sum(counts)
  want_loss = sum(wi * float(l) for wi, l in zip(w, losses))
  assert abs(float(packed_loss) - want_loss) <= 1e-5 * abs(want_loss)
  want_grads = jax.tree.map(lambda *g: sum(wi * np.asarray(x, np.float64) for wi, x in zip(w, g)),
                            *grads)
  for path, got in jax.tree_util.tree_leaves_with_path(packed_grads):
    ref = want_grads
    for k in path:
      ref = ref[k.key]
    err = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
    assert err <= 1e-5, (jax.tree_util.keystr(path), err)

  # The control: the same batch attending across examples misses by 20x the tolerance
  # (7e-4 relative measured: the initial model's attention is nearly uniform).
  leaky = {k: v for k, v in batch.items() if k != "segment_ids"}
  assert abs(float(grad(params, leaky)[0]) - want_loss) > 2e-4 * want_loss


def _alone(examples: sft.Examples, i: int) -> dict:
  """Example i of `examples` alone in a padded row (one example per row)."""
  one = examples.subset(np.array([i]))
  one.pack = False
  return sft.batch_at(one, 0, 1, seed=0)


def test_the_step_over_devices_and_microbatches_is_the_mean_over_trained_tokens(examples):
  """Stage 3 on 8 devices, 2 microbatches: the step's loss and gradient norm are those of
  the global batch's mean over its trained tokens, computed whole on one device (the
  loader's weights make each device's mean over positions add up to it)."""
  import optax

  import zerojax
  c = config("blocked")
  model = llama.LlamaLM(c)
  batch = sft.batch_at(examples, 0, 16, seed=0)
  tx = optax.sgd(0.0)
  plan = zerojax.make_plan(zerojax.make_mesh(1, 8), 3,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0))
  params = jax.device_get(state.params)  # Whole, on the host.
  want_loss, want_grads = jax.jit(jax.value_and_grad(lambda p: llama.loss(c, p, batch)))(params)
  _, metrics = zerojax.make_train_step(plan, model.loss, tx, microbatches=2)(state, batch)
  assert abs(float(metrics["loss"]) - float(want_loss)) <= 1e-5 * float(want_loss)
  want_norm = float(optax.tree.norm(want_grads))
  assert abs(float(metrics["grad_norm"]) - want_norm) <= 1e-5 * want_norm


def test_greedy_decoding_and_exact_match(examples):
  """`greedy` on a padded buffer = appending the argmax of the logits of each prompt alone,
  one token at a time; exact match counts an answer right only if every token is."""
  from zerojax import generate
  c = config("blocked")
  model = llama.LlamaLM(c)
  params = model.init(jax.random.key(1))
  pairs = generate.prompts_and_answers(examples, 3)
  steps, width = 4, max(len(p) for p, _ in pairs) + 4
  tokens = np.zeros((3, width), np.int32)
  for b, (p, _) in enumerate(pairs):
    tokens[b, :len(p)] = p
  lengths = np.array([len(p) for p, _ in pairs], np.int32)
  out = np.asarray(jax.jit(lambda t, n: generate.greedy(model.logits, params, t, n, steps))(
      tokens, lengths))
  alone = jax.jit(model.logits)  # One program a length: op by op took 3 s more CPU.
  for b, (p, _) in enumerate(pairs):
    seq = list(p)
    for _ in range(steps):
      seq.append(int(np.argmax(alone(params, np.array([seq], np.int32))[0, -1])))
    assert out[b, :len(seq)].tolist() == seq
  # Examples whose answers are what the model says (right) or one token off (wrong).
  said = [out[b, len(p):len(p) + steps] for b, (p, _) in enumerate(pairs)]
  wrong = said[1].copy()
  wrong[-1] = (wrong[-1] + 1) % c.vocab_size
  rows = [(pairs[0][0], said[0]), (pairs[1][0], wrong), (pairs[2][0], said[2])]
  ids = np.concatenate([np.concatenate([p, a]) for p, a in rows]).astype(np.int32)
  mask = np.concatenate([np.r_[np.zeros(len(p), bool), np.ones(len(a), bool)] for p, a in rows])
  lengths = np.array([len(p) + len(a) for p, a in rows])
  rigged = sft.Examples(ids, mask, np.r_[0, np.cumsum(lengths)[:-1]], lengths, 64, True)
  assert generate.exact_match(model.logits, params, rigged, 3, batch_size=2) == 2 / 3
