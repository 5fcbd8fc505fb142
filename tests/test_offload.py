"""Optimizer-state offload (`zerojax.offload`) on 8 CPU devices: an offloaded step
computes what the normal step computes, its state lives in the host memory space, the
update moves one layer's state at a time, and checkpoints round-trip it."""

import re

import jax
import numpy as np
import pytest
from test_release import SMALL, batches, relative

import zerojax
from zerojax import optim, zero
from zerojax.models.mlp_lm import MlpLM
from zerojax.release import make_release_step

HOST = jax.memory.Space.Host


def tx_and_model():
  model = MlpLM(**SMALL)
  return optim.adamw(1e-2, b2=0.95, weight_decay=0.1, update_rule="kahan",
                     state_dtype="float32"), model


def make(model, tx, stage=3, offload=False, mesh_shape=(1, 8)):
  return zerojax.make_plan(zerojax.make_mesh(*mesh_shape), stage,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0,
                           offload=offload)


def make_step(kind, plan, model, tx):
  if kind == "release":
    return make_release_step(plan, model.layered(), tx)
  return zerojax.make_train_step(plan, model.loss, tx, update_by_layer=kind == "by layer")


def run(kind, plan, model, tx, data):
  step = make_step(kind, plan, model, tx)
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0))
  for batch in data:
    state, metrics = step(state, batch)
  return state, {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("stage, kind", [(1, "by layer"), (3, "by layer"), (3, "whole tree"),
                                         (3, "release")])
def test_offloaded_step_equals_the_normal_step(stage, kind):
  """3 steps of AdamW + Kahan in fp32: every param and state leaf within 1e-6 relative
  of the same step without offload, the offloaded leaves (mu, nu, Kahan buffer) in
  pinned host memory after every step and the step count on the device."""
  tx, model = tx_and_model()
  data = batches(3)
  normal, m_normal = run(kind, make(model, tx, stage), model, tx, data)
  plan = make(model, tx, stage, offload=True)
  offloaded, m_offloaded = run(kind, plan, model, tx, data)
  want = jax.tree_util.tree_leaves_with_path((normal.params, normal.opt_state))
  for (path, a), b in zip(want, jax.tree.leaves((offloaded.params, offloaded.opt_state)),
                          strict=True):
    assert relative(b, a) <= 1e-6, (jax.tree_util.keystr(path), relative(b, a))
  kinds = [x.sharding.memory_kind for x in jax.tree.leaves(offloaded.opt_state)]
  host = jax.tree.leaves(plan.opt_offloaded)
  assert sum(host) == 3 * len(jax.tree.leaves(plan.params))  # mu, nu, Kahan.
  assert kinds == ["pinned_host" if h else "device" for h in host]
  assert all(x.sharding.memory_kind == "device" for x in jax.tree.leaves(offloaded.params))
  for key in ("loss", "grad_norm", "update_norm"):
    assert m_offloaded[key] == pytest.approx(m_normal[key], rel=1e-6), key
