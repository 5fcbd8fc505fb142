"""Sequence parallelism (`zerojax.sequence`): each sequence split over the 8 fsdp devices,
Ulysses attention, fp32. The sequence-parallel step computes the step without it, on
packed rows whose examples cross the slices' boundaries: at stages 1 and 3, with
gradient release; and the gradients of every leaf agree to 1e-5 of the leaf's norm."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
import zerojax.train
from zerojax import build, sequence
from zerojax.config import ConfigError, load_config
from zerojax.models.attention import causal_attention
from zerojax.testing import hlo

from test_release import relative
from test_release_packed import packed_batches

SEQ, BATCH = 64, 8  # Slices of 8 positions: the 4-10 token examples cross them.
TINY = ["model.d_model=64", "model.n_heads=8", "model.n_layers=2", "model.d_ff=128",
        f"train.seq_len={SEQ}", f"train.global_batch_size={BATCH}", "model.attention_block=16",
        "model.loss_chunk=32", "model.remat=full", "precision.param_dtype=float32",
        "precision.compute_dtype=float32", "optimizer.name=sgd", "optimizer.momentum=0.0",
        "optimizer.weight_decay=0.0", "optimizer.grad_clip=0.0", "optimizer.learning_rate=1.0",
        "optimizer.schedule=constant", "optimizer.warmup_steps=0",
        "optimizer.update_rule=nearest", "optimizer.state_dtype=float32", "train.steps=2"]


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_ulysses_attention_is_attention_of_the_whole_sequence(kv_heads):
  """Over 8 devices: KV heads split (8), repeated 4 and 8 times (2, 1); packed segment ids
  crossing the slices; values and the gradients of q, k and v, under jit."""
  mesh = zerojax.make_mesh(1, 8)
  rs = np.random.RandomState(kv_heads)
  B, T, H, Dh = 2, 64, 8, 4
  q = jnp.asarray(rs.normal(size=(B, T, H, Dh)), jnp.float32)
  k, v = (jnp.asarray(rs.normal(size=(B, T, kv_heads, Dh)), jnp.float32) for _ in range(2))
  seg = jnp.asarray(np.cumsum(rs.rand(B, T) < 0.12, axis=1), jnp.int32)
  kernel = functools.partial(causal_attention, "blocked", 16)
  spec = P(None, "fsdp")
  split = jax.shard_map(
      lambda q, k, v, s: sequence.attention(q, k, v, s, "fsdp", kernel), mesh=mesh,
      in_specs=(spec,) * 4, out_specs=spec, check_vma=False)
  cotangent = jnp.asarray(rs.normal(size=q.shape), jnp.float32)
  run = lambda f: jax.jit(lambda q, k, v: jax.vjp(lambda *a: f(*a, seg), q, k, v))
  (whole, vjp), (got, got_vjp) = run(kernel)(q, k, v), run(split)(q, k, v)
  assert relative(got, whole) < 1e-6
  for g, want in zip(got_vjp(cotangent), vjp(cotangent)):
    assert relative(g, want) < 1e-5


def test_kv_heads_that_do_not_split_are_refused():
  with pytest.raises(ValueError, match="n_kv_heads \\(3\\) divisible by 8, or a divisor"):
    sequence.kv_repeats(24, 3, 8)
  with pytest.raises(ConfigError, match="model.n_heads=4 is not divisible by mesh.fsdp=8"):
    load_config("configs/tiny.py", ["mesh.sequence_parallel=True"], num_devices=8)
  with pytest.raises(ConfigError, match="train.global_batch_size.*example-parallel size"):
    load_config("configs/tiny.py", [*TINY, "mesh.sequence_parallel=True", "mesh.data=2",
                                    "train.global_batch_size=3"], num_devices=8)


def grads_of_one_step(overrides, batch):
  """Loss and every param's gradient (SGD with rate 1: params before - after) of one
  step of the tiny Llama built by train.py's `build`, on 8 devices."""
  config = load_config("configs/tiny.py", [*TINY, *overrides], num_devices=8)
  built = build.build(config)
  state = zerojax.init_state(built.plan, built.model.init, built.tx, jax.random.key(0))
  before = jax.device_get(state.params)
  batch = jax.device_put(batch, built.batch_sharding)
  state, metrics = built.train_step(state, batch)
  after = jax.device_get(state.params)
  return float(metrics["loss"]), jax.tree.map(lambda b, a: b - a, before, after)


def row_batch(packed: bool) -> dict:
  """The cases' one batch: packed rows, or their tokens alone."""
  (batch,) = packed_batches(steps=1, batch=BATCH, seq=SEQ, vocab=256)
  return batch if packed else {"tokens": batch["tokens"]}


@functools.cache
def reference(packed: bool):
  """`grads_of_one_step` of the stage-3 normal step without sequence parallelism."""
  return grads_of_one_step(("zero.stage=3",), row_batch(packed))


@pytest.mark.parametrize("overrides, packed", [
    (("zero.stage=3",), True), (("zero.stage=1",), True),
    (("zero.stage=3", "optimizer.release=True"), True),
    # Plain token rows: the positions come from `sequence.shard_batch`'s split, which the
    # normal step (any stage: stage 1's is stage 3's) and release each call.
    (("zero.stage=3",), False), (("zero.stage=3", "optimizer.release=True"), False)],
    ids=["stage3-packed", "stage1-packed", "stage3_release-packed", "stage3-tokens",
         "stage3_release-tokens"])
def test_the_sequence_parallel_step_is_the_step(overrides, packed):
  """Packed rows (segment ids, restarting positions, a loss mask) and plain token rows
  (the positions 0..T-1 that each slice gets from the split). Against one step without
  sequence parallelism per kind of row, the stage-3 normal step's (`reference`): stage 1
  and release compute it within fp32 reduction order (test_zero: stages agree with
  optax to 1e-5; test_release: release = the normal step to 1e-6), far inside 1e-5 of a
  leaf's norm. Until 2026-12-05 each case ran its own stage's step as the reference (5
  references, not 2)."""
  batch = row_batch(packed)
  loss, grads = reference(packed)
  sp_loss, sp_grads = grads_of_one_step((*overrides, "mesh.sequence_parallel=True"), batch)
  assert abs(sp_loss - loss) <= 1e-6 * abs(loss)
  worst = max(jax.tree.leaves(jax.tree.map(relative, sp_grads, grads)))
  assert worst < 1e-5, worst


@pytest.mark.parametrize("remat,kv_heads", [("full", 8), ("none", 2)])
def test_all_to_all_bytes_per_layer_are_the_formula(remat, kv_heads):
  """The compiled stage-3 step (bf16 activations, 3 layers) moves what
  `ulysses.all_to_all_bytes` says per layer: 12 all-to-alls a layer under remat (8
  without), KV heads repeated to one a device."""
  layers = 3
  config = load_config("configs/tiny.py", [
      *TINY, "mesh.sequence_parallel=True", "zero.stage=3", f"model.remat={remat}",
      f"model.n_kv_heads={kv_heads}", "precision.compute_dtype=bfloat16",
      f"model.n_layers={layers}"], num_devices=8)
  built = build.build(config)
  _, text = hlo.compile_partitioned(built.train_step.lower(built.abstract_state,
                                                           built.abstract_batch))
  found = [c for c in hlo.collectives(text) if c.op == "all-to-all"]
  assert sum(c.trips for c in found) == layers * (8 if remat == "none" else 12)
  m = config.model
  want = sequence.ulysses.all_to_all_bytes(BATCH, SEQ, 8, m.n_heads, m.n_kv_heads,
                                           m.d_model // m.n_heads, 2, remat)
  assert sum(c.operand_bytes * c.trips for c in found) == layers * want


@pytest.mark.slow
def test_train_py_trains_1024_token_sequences_split_over_8_devices_and_resumes_exactly(
    tmp_path):
  """train.py (this process: `zerojax.train.main`), one sequence of 1024 tokens a step
  over the 8 devices, activation offload and the tiled MLP on: the held-out loss falls,
  and 2 steps, a stop, 2 more = 4 straight (every step's metrics, and the last
  checkpoint bit for bit)."""
  from test_train import checkpoint_leaves, step_records
  common = ["--config", "configs/tiny.py", *(f"--config.{o}" for o in (
      "mesh.sequence_parallel=True", "model.n_heads=8", "model.n_layers=1", "model.d_model=32",
      "model.d_ff=96", "train.seq_len=1024", "train.global_batch_size=1",
      "model.attention_block=256", "model.loss_chunk=512", "train.steps=4",
      "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
      "optimizer.warmup_steps=1", "checkpoint.every_steps=2", "logging.tensorboard=False",
      # The long-context recipe's other two parts: on CPU the moves lower to nothing, so
      # this runs their loops (the saved inputs read back one ahead, MLP tiles) end to end.
      "model.activation_offload=host", "model.mlp_chunk=64"))]
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  assert zerojax.train.main([*common, f"--workdir={straight}"]) == 0
  assert zerojax.train.main([*common, "--stop_after=2", f"--workdir={resumed}"]) == 75
  assert zerojax.train.main([*common, f"--workdir={resumed}"]) == 0
  timing = ("tokens_per_s", "eta_s", "mfu")
  a, b = ([{k: v for k, v in r.items() if k not in timing} for r in step_records(w)]
          for w in (straight, resumed))
  assert [r["step"] for r in b] == list(range(1, 5)) and a == b
  evals = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
  held_out = [r["eval_loss"] for r in evals if "eval_loss" in r]
  assert len(held_out) == 3 and held_out[-1] < held_out[0] - 0.1, held_out
  leaves = [checkpoint_leaves(w / "checkpoints" / "4") for w in (straight, resumed)]
  assert leaves[0].keys() == leaves[1].keys()
  for k in leaves[0]:
    np.testing.assert_array_equal(leaves[0][k], leaves[1][k], err_msg=k)
