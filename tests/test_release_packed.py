"""Gradient release on packed fine-tuning rows (several examples a row: segment ids,
restarting positions, a loss mask), 8 CPU devices, fp32: release computes what the
normal step computes, and every layer needs the batch's segment ids and positions for
it (a layer that does not read them fails the comparison)."""

import jax
import numpy as np
import pytest

import zerojax
from zerojax import optim
from zerojax.data import sft
from zerojax.models.llama import LlamaConfig, LlamaLM
from zerojax.release import make_release_step

from test_release import LLAMA, relative, run

SEQ, BATCH, STEPS = 32, 8, 5


def packed_batches(steps=STEPS, batch=BATCH, seq=SEQ, vocab=64, seed=0):
  """`steps` batches of `sft.batch_at` over random examples of 4-10 tokens packed into
  rows of seq + 1 (each example's first token untrained, the rest trained): every row
  holds at least 3 examples (asserted), so segment ids and positions matter."""
  rs = np.random.RandomState(seed)
  lengths = rs.randint(4, 11, size=400)
  ids = rs.randint(0, vocab, size=lengths.sum()).astype(np.int32)
  starts = np.r_[0, np.cumsum(lengths)[:-1]]
  mask = np.ones(lengths.sum(), bool)
  mask[starts] = False
  examples = sft.Examples(ids, mask, starts, lengths, seq + 1, True)
  out = [sft.batch_at(examples, step, batch, seed) for step in range(steps)]
  for b in out:
    assert min(len(set(row[row > 0])) for row in b["segment_ids"]) >= 3
  return out


def without(key, parts):
  """`parts` whose layers no longer see `key` of the batch (embedding and loss still do)."""
  return parts._replace(layer=lambda p, x, batch: parts.layer(
      p, x, {k: v for k, v in batch.items() if k != key}))


def test_release_on_packed_rows_equals_the_normal_step_and_needs_the_segment_ids():
  """5 steps of AdamW (stage 3, 8 shards): every param and optimizer-state leaf within
  1e-6 relative of the normal step's on the same packed batches, and the losses within
  1e-5. Layers that do not see the segment ids (attention across examples) leave some
  leaf more than 1e-3 away: the comparison sees what packing changes. (Without the
  positions, but with the segment mask, the rotary angles run on across a row's examples:
  each example's are shifted by a constant, which rotary attention does not see, up to
  rounding: 2.6e-6 measured. So they are not the negative check.)"""
  model = LlamaLM(LlamaConfig(**LLAMA, param_dtype="float32", compute_dtype="float32"))
  tx = optim.adamw(3e-3, b2=0.95, weight_decay=0.1)
  plan = zerojax.make_plan(zerojax.make_mesh(1, 8), 3,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  data = packed_batches()
  normal, m_normal = run(zerojax.make_train_step(plan, model.loss, tx), plan, model, tx, data)
  expected = jax.tree_util.tree_leaves_with_path((normal.params, normal.opt_state))

  def worst(parts):
    state, metrics = run(make_release_step(plan, parts, tx), plan, model, tx, data)
    gaps = [(relative(got, want), jax.tree_util.keystr(path)) for (path, want), got in zip(
        expected, jax.tree.leaves((state.params, state.opt_state)), strict=True)]
    return max(gaps), metrics

  (gap, where), m_release = worst(model.layered())
  assert gap <= 1e-6, (where, gap)
  assert m_release["loss"] == pytest.approx(m_normal["loss"], rel=1e-5)
  assert m_release["skipped"] == 0
  (gap, where), _ = worst(without("segment_ids", model.layered()))
  assert gap > 1e-3, (where, gap)
