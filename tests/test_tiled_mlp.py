"""The tiled MLP (`model.mlp_chunk`, `zerojax.models.tiled`): the same params, the same
loss and gradients as the untiled Llama (fp32, under jit; packed rows; sequence parallel
at stage 3), the config's check, and the [T, d_ff] buffers gone from the compiled step."""

import dataclasses

import jax
import numpy as np
import pytest

from zerojax import checkpoint
from zerojax.config import ConfigError, load_config
from zerojax.models import llama

from test_llama import SMALL, _temp_bytes, random_params
from test_release import relative
from test_release_packed import packed_batches
from test_sequence import TINY, grads_of_one_step, reference, row_batch

T = 32


def loss_and_grads(config, params, batch):
  return jax.jit(jax.value_and_grad(lambda p: llama.loss(config, p, batch)))(params)


def assert_same(got, want):
  """Loss within 1e-6 relative, every gradient leaf within 1e-5 of its norm."""
  (loss, grads), (want_loss, want_grads) = got, want
  assert abs(loss - want_loss) <= 1e-6 * abs(want_loss), (loss, want_loss)
  worst = max(jax.tree.leaves(jax.tree.map(relative, grads, want_grads)))
  assert worst < 1e-5, worst


def test_the_tiled_layer_has_the_untiled_params():
  """Init makes the same tree with the same values: HF names, checkpoints, by-name remat."""
  want = llama.LlamaLM(SMALL).init(jax.random.key(0))
  got = llama.LlamaLM(dataclasses.replace(SMALL, mlp_chunk=8)).init(jax.random.key(0))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("chunk, remat", [
    (8, "full"), (12, "full"), (64, "full"),  # Every tiling under layer remat.
    (8, "none"), (12, "minimal")],  # Without remat, and a policy that names MLP values.
    ids=["4_tiles-full", "padded-full", "one_tile-full", "4_tiles-none", "padded-minimal"])
def test_tiled_loss_and_gradients_are_the_untiled_ones(chunk, remat):
  """T = 32 in tiles of 8, of 12 (3 tiles, the last padded: a prompt's length) and of 64
  (one tile of T), under layer remat; tiles without layer remat, and padded tiles under a
  policy that names MLP values (the tiling and the remat policy are separate code:
  each tiling once, each policy with a multi-tile case; 5 cases of the 9 pairs)."""
  params = random_params(SMALL)
  tokens = np.random.RandomState(1).randint(0, SMALL.vocab_size, (2, T + 1)).astype(np.int32)
  c = dataclasses.replace(SMALL, remat=remat)
  assert_same(loss_and_grads(dataclasses.replace(c, mlp_chunk=chunk), params, {"tokens": tokens}),
              loss_and_grads(c, params, {"tokens": tokens}))


def test_generation_tiles_a_prompt_and_a_decode_step():
  """The KV-cached pass: a 7-token prompt in tiles of 4 (padded), then one position."""
  c, tiled = SMALL, dataclasses.replace(SMALL, mlp_chunk=4)
  params = random_params(c)
  tokens = np.random.RandomState(3).randint(0, c.vocab_size, (2, 8)).astype(np.int32)
  positions = np.broadcast_to(np.arange(8, dtype=np.int32), (2, 8))
  empty = llama.init_cache(c, 2, 8)

  def generate(config):
    run = jax.jit(lambda t, pos, cache: llama.extend(config, params, t, pos, cache))
    prompt, cache = run(tokens[:, :7], positions[:, :7], empty)
    return prompt, run(tokens[:, 7:], positions[:, 7:], cache)[0]

  for got, want in zip(generate(tiled), generate(c)):
    assert relative(got, want) < 1e-6


def test_tiled_packed_rows_are_the_untiled_ones():
  """Packed examples (segment ids, restarting positions, a loss mask) crossing tiles."""
  (batch,) = packed_batches(steps=1, batch=4, seq=T, vocab=SMALL.vocab_size)
  params = random_params(SMALL)
  assert_same(loss_and_grads(dataclasses.replace(SMALL, mlp_chunk=8), params, batch),
              loss_and_grads(SMALL, params, batch))


def test_the_sequence_parallel_stage_3_step_with_tiles_is_the_step():
  """train.py's step over 8 devices, each holding 8 of a row's 64 positions in 2 tiles of
  4, on packed rows: the untiled step without sequence parallelism's loss and gradients
  (test_sequence's `reference`, computed once a process: test_sequence and
  test_activation_offload compare with it too)."""
  want = reference(True)
  got = grads_of_one_step(("zero.stage=3", "mesh.sequence_parallel=True", "model.mlp_chunk=4"),
                          row_batch(True))
  assert_same(got, want)


def test_a_tile_that_does_not_divide_each_devices_sequence_is_refused():
  load_config("configs/tiny.py", [*TINY, "model.mlp_chunk=16"], num_devices=8)
  with pytest.raises(ConfigError, match=r"model.mlp_chunk.*48 does not divide 64, the "
                     r"positions each device's MLP sees \(train.seq_len\)"):
    load_config("configs/tiny.py", [*TINY, "model.mlp_chunk=48"], num_devices=8)
  sp = [*TINY, "mesh.sequence_parallel=True"]
  load_config("configs/tiny.py", [*sp, "model.mlp_chunk=8"], num_devices=8)
  with pytest.raises(ConfigError, match=r"(?s)16 does not divide 8.*train.seq_len / mesh.fsdp = "
                     r"64 / 8 with mesh.sequence_parallel.*fix: use a divisor of 8 \(e.g. 8\)"):
    load_config("configs/tiny.py", [*sp, "model.mlp_chunk=16"], num_devices=8)
  with pytest.raises(ConfigError, match="model.mlp_chunk.*must be >= 0"):
    load_config("configs/tiny.py", [*TINY, "model.mlp_chunk=-1"], num_devices=8)


def test_a_checkpoint_resumes_with_another_tile():
  """mlp_chunk changes how the model is computed, not the model: no contradiction (a
  checkpoint from before the key reads as its default, 0); d_ff does contradict."""
  saved = load_config("configs/tiny.py", list(TINY), num_devices=8).to_dict()
  meta = {"leaves": {}, "config": saved, "step": 2}
  checkpoint.check_compatible(meta, load_config("configs/tiny.py", [*TINY, "model.mlp_chunk=8"],
                                                num_devices=8))
  with pytest.raises(checkpoint.CheckpointError, match="model.d_ff: checkpoint 128"):
    checkpoint.check_compatible(meta, load_config("configs/tiny.py", [*TINY, "model.d_ff=64"],
                                                  num_devices=8))


def test_the_compiled_step_holds_one_tile_of_the_mlp_not_the_sequence():
  """One layer of width 32 and d_ff 2048 at 4096 positions, fp32, on XLA:CPU: one [T, F]
  buffer is 32 MiB. Measured: untiled 262.2 MiB of temporaries (8.2 buffers), tiles of
  256 45.0 MiB (1.4). With 'minimal', which saves gate_proj and up_proj by name, every
  tile's are kept: 102.5 MiB (+1.8 buffers)."""
  seq, d_ff = 4096, 2048
  tf = seq * d_ff * 4
  c = dataclasses.replace(SMALL, rope_scaling=None, d_model=32, n_layers=1, d_ff=d_ff,
                          attention_block=128, loss_chunk=128)
  untiled = _temp_bytes(c, seq)
  tiled = _temp_bytes(dataclasses.replace(c, mlp_chunk=256), seq)
  assert untiled - tiled > 6 * tf and tiled < 1.5 * tf, (untiled, tiled, tf)
  named = _temp_bytes(dataclasses.replace(c, mlp_chunk=256, remat="minimal"), seq)
  assert 1.5 * tf < named - tiled < 2.1 * tf, (named, tiled, tf)
