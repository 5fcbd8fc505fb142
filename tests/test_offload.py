"""Optimizer-state offload (`zerojax.streaming`) on 8 CPU devices: an offloaded step
computes what the normal step computes, its state lives in the host memory space, the
update moves one layer's state at a time, and checkpoints round-trip it."""

import functools
import json
import math
import re

import jax
import numpy as np
import pytest

import zerojax
from zerojax import build, checkpoint, memory, models, optim, streaming, zero
from zerojax.config import ConfigError, base_config
from zerojax.memory import report as memory_report
from zerojax.models.mlp_lm import MlpLM
from zerojax.release import make_release_step
from zerojax.runtime import exits, units

import test_memory
from test_release import SMALL, batches, relative
from test_release_train import MLP
from test_train import train_here

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
  if kind in ("release", "release read ahead", "release write behind"):
    # On CPU read ahead (and write behind) only when asked.
    return make_release_step(plan, model.layered(), tx, read_ahead=kind != "release",
                             write_behind=kind == "release write behind")
  if kind == "release accumulation":  # 2 microbatches absorbed, per-layer clipping.
    return make_release_step(plan, model.layered(), tx, microbatches=2,
                             accumulation="optimizer", max_grad_norm=0.2, clipping="per_layer")
  return zerojax.make_train_step(plan, model.loss, tx, update_by_layer=kind == "by layer")


@functools.cache
def planned_step(kind, stage, offload):
  """(model, tx, plan, compiled step) of the Kahan AdamW MlpLM for batches of 8 rows (16
  with accumulation's 2 microbatches): compiled once, for every test that runs or reads
  the same step (the equality, the compiled module's memory spaces, the checkpoint
  round trip)."""
  tx, model = tx_and_model()
  plan = make(model, tx, stage, offload)
  inputs = abstract_inputs(plan, batch=16 if kind == "release accumulation" else 8)
  return model, tx, plan, make_step(kind, plan, model, tx).lower(*inputs).compile()


def run(kind, stage, offload, data):
  model, tx, plan, step = planned_step(kind, stage, offload)
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0))
  for batch in data:
    state, metrics = step(state, batch)
  return state, {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("stage, kind", [(1, "by layer"), (3, "by layer"), (3, "whole tree"),
                                         (3, "release"), (3, "release read ahead"),
                                         (3, "release write behind"),
                                         (3, "release accumulation")])
def test_offloaded_step_equals_the_normal_step(stage, kind):
  """3 steps of AdamW + Kahan in fp32: every param and state leaf within 1e-6 relative
  of the same step without offload, the offloaded leaves (mu, nu, Kahan buffer) in
  pinned host memory after every step and the step count on the device."""
  data = batches(3, batch=16 if kind == "release accumulation" else 8)
  normal, m_normal = run(kind, stage, False, data)
  offloaded, m_offloaded = run(kind, stage, True, data)
  plan = planned_step(kind, stage, True)[2]
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


def abstract_inputs(plan, batch=8):
  batch = jax.ShapeDtypeStruct((batch, 17), np.int32,
                               sharding=jax.sharding.NamedSharding(plan.mesh, plan.batch_spec))
  return zerojax.abstract_state(plan), {"tokens": batch}


def host_uses(jaxpr):
  """(primitives that read a host-memory value, (from, to, shape) of every move), over
  the jaxpr and every jaxpr inside it (loops, shard_map, calls)."""
  prims, moves = set(), []
  for eqn in jaxpr.eqns:
    if any(getattr(v.aval, "memory_space", None) == HOST for v in eqn.invars
           if hasattr(v, "aval")):
      prims.add(eqn.primitive.name)
    if eqn.primitive.name == "device_put":
      moves += [(a.aval.memory_space, b.aval.memory_space, a.aval.shape)
                for a, b in zip(eqn.invars, eqn.outvars)]
    for sub in _subjaxprs(eqn):
      p, m = host_uses(sub)
      prims, moves = prims | p, moves + m
  return prims, moves


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else [value]:
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jax.extend.core.Jaxpr):
        yield v


# Reading a host value is allowed only to slice it and move it; reshapes (a layer's
# squeeze, its expansion before the write back, release's stacks as rows), control flow
# and the barrier that orders a read ahead before a write (`streaming.read_ahead`) pass
# values through.
MOVE_ONLY = {"device_put", "dynamic_slice", "dynamic_update_slice", "squeeze", "reshape",
             "broadcast_in_dim", "jit", "scan", "while", "shard_map", "optimization_barrier"}


@pytest.mark.parametrize("kind", ["by layer", "release", "release read ahead", "whole tree"])
def test_the_update_moves_one_layer_of_state_at_a_time(kind):
  """In the traced step (avals carry their memory space), host values are only sliced
  and moved, never computed on; each state leaf goes to the device and back once (read
  ahead, release reads its stacked leaves once more); the stacked leaves one layer at a
  time (the whole-tree update moves whole stacks: the contrast). The same step lowered
  for CUDA carries the moves as XLA's annotate_device_placement calls, one layer's shape
  each."""
  tx, model = tx_and_model()
  plan = make(model, tx, 3, offload=True)
  step = make_step(kind, plan, model, tx)
  traced = step.trace(*abstract_inputs(plan))
  prims, moves = host_uses(traced.jaxpr.jaxpr)
  assert prims <= MOVE_ONLY, prims - MOVE_ONLY
  device, host = jax.memory.Space.Device, HOST
  to_device = sorted(s for a, b, s in moves if (a, b) == (host, device))
  to_host = sorted(s for a, b, s in moves if (a, b) == (device, host))
  # Shapes as the update sees them: global under GSPMD, one device's shard in release.
  per_device = kind.startswith("release")
  local = lambda x, d: zero.local_shape(x.shape, d, plan.num_shards if per_device else 1)
  shapes = jax.tree.map(local, plan.params, plan.param_dims, is_leaf=lambda d: d is None)
  shapes = jax.tree.leaves(shapes, is_leaf=lambda s: isinstance(s, tuple))
  layered = jax.tree.leaves(plan.per_layer)
  by_layer = kind != "whole tree"
  want = sorted(3 * [s[1:] if m and by_layer else s for s, m in zip(shapes, layered)])
  assert to_host == want  # mu, nu and the Kahan buffer of every leaf, moved once.
  if kind == "release read ahead":  # The last layer's state before the backward loop,
    # then the next one's a trip (`streaming.read_ahead`).
    want = sorted(want + 3 * [s[1:] for s, m in zip(shapes, layered) if m])
  assert to_device == want
  if kind == "by layer":
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    placed = re.findall(r'annotate_device_placement\(%\w+\) .*?_xla_buffer_placement = '
                        r'"(\w+)".*?: \(tensor<((?:\d+x)*)f32>\)', text)
    for shape in {s[1:] for s, m in zip(shapes, layered) if m}:
      dims = "".join(f"{n}x" for n in shape)
      assert ("device", dims) in placed and ("pinned_host", dims) in placed, dims


def test_the_compiled_step_keeps_the_state_in_host_memory_space():
  """XLA:CPU's compiled module puts exactly the offloaded leaves (21: mu, nu, Kahan of 7
  params) in memory space S(5) among its parameters and results; without offload none.
  XLA:CPU shows no more: its memory_analysis has no host bytes (host_* fields 0) and
  counts the host parameters among the device arguments, the same total with or without
  offload (the GPU benchmark measures the fall in device bytes)."""
  stats = {}
  for offload in (False, True):
    # The program test_offloaded_step_equals_the_normal_step[3-by layer] ran.
    _, _, plan, compiled = planned_step("by layer", 3, offload)
    layout = re.search(r"entry_computation_layout=\{(.*?)\}, allow_spmd", compiled.as_text())
    params, results = (re.findall(r"\w+\[[\d,]*\]\{[\d,]*(?::S\(5\))?\}", g)
                       for g in layout.group(1).split(")->("))
    host = lambda xs: [x.split("{")[0] for x in xs if "S(5)" in x]
    state_leaves = jax.tree.leaves(plan.opt_state)
    want = [f"f32[{','.join(map(str, zero.local_shape(x.shape, d, plan.num_shards)))}]"
            for x, d, h in zip(state_leaves, jax.tree.leaves(plan.opt_dims,
                                                             is_leaf=lambda d: d is None),
                               jax.tree.leaves(plan.opt_offloaded)) if h]
    assert host(params) == want and host(results) == want
    assert len(want) == (21 if offload else 0)
    m = compiled.memory_analysis()
    stats[offload] = (m.argument_size_in_bytes, m.host_argument_size_in_bytes,
                      m.host_temp_size_in_bytes)
    # What build.compile_step reports as host memory (and takes off the arguments).
    assert streaming.host_parameter_bytes(compiled.as_text()) == sum(
        4 * math.prod(int(n) for n in x[4:-1].split(",")) for x in want)
  assert stats[True] == stats[False] and stats[True][1:] == (0, 0)


def test_checkpoint_round_trip_of_host_state_resumes_exactly(tmp_path):
  """orbax saves the host-memory state (checksums included) and restores it into host
  memory, and onto a plan without offload (device memory): 2 steps, save, 2 more from
  each restore equal 4 uninterrupted steps bit for bit."""
  model, tx, plan, step = planned_step("by layer", 3, True)
  data = batches(4)
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0))
  for batch in data[:2]:
    state, _ = step(state, batch)
  with checkpoint.Checkpointer(tmp_path, save_every_steps=1) as ckpt:
    ckpt.save(2, state)
    ckpt.wait()
    restored = {offload: ckpt.restore(2, make(model, tx, 3, offload=offload))[0]
                for offload in (True, False)}
  for leaf, want in zip(jax.tree.leaves(restored[True].opt_state),
                        jax.tree.leaves(plan.opt_shardings)):
    assert leaf.sharding == want  # In host memory again, on the same shards.
  assert {x.sharding.memory_kind for x in jax.tree.leaves(restored[False].opt_state)} == {
      "device"}
  for batch in data[2:]:
    state, _ = step(state, batch)
  steps = {True: step, False: planned_step("by layer", 3, False)[3]}
  for offload, resumed in restored.items():
    for batch in data[2:]:
      resumed, _ = steps[offload](resumed, batch)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_py_offloads_stops_and_resumes_like_the_normal_step(tmp_path):
  """train.py, mlp_lm with the defaults (bf16, Kahan AdamW, stage 3): 6 steps with
  optimizer.offload='host', stopped after 3 (exit 75) and resumed from the checkpoint,
  give the losses of 6 uninterrupted steps without offload. train.py's main in this
  process: the resume reads the host-memory state from disk into a new build."""
  common = (*MLP, "--config.train.steps=6", "--config.checkpoint.every_steps=3")
  normal = train_here(*common, f"--workdir={tmp_path / 'normal'}")
  assert normal.returncode == exits.DONE, normal.stderr[-3000:]
  args = (*common, "--config.optimizer.offload=host", f"--workdir={tmp_path / 'offload'}")
  stopped = train_here(*args, "--stop_after=3")
  assert stopped.returncode == exits.STOPPED, stopped.stderr[-3000:]
  resumed = train_here(*args)
  assert resumed.returncode == exits.DONE, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stdout
  losses = lambda name: [r["loss"] for r in map(json.loads, (
      tmp_path / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
  assert len(losses("normal")) == 6
  np.testing.assert_allclose(losses("offload"), losses("normal"), rtol=1e-6)


class NoHostMemory:
  """A device whose platform has no pinned host memory (every platform this project runs
  on has one, so the refusal is tested on this stand-in)."""
  platform, id = "metal", 0

  def addressable_memories(self):
    return [type("Memory", (), {"kind": "device"})()]


def test_offload_without_host_memory_is_a_config_error():
  config = base_config()
  config.optimizer.offload = "host"
  with pytest.raises(ConfigError) as e:
    build.check_offload(config, NoHostMemory())
  assert e.value.key == "optimizer.offload" and "no pinned_host memory" in str(e.value)
  build.check_offload(config, jax.devices()[0])  # XLA:CPU has one.
  config.optimizer.offload = "none"
  build.check_offload(config, NoHostMemory())


def test_planner_moves_the_optimizer_state_to_host_bytes():
  """The 70B recipe (bf16 params, bf16 AdamW moments, Kahan buffer) on 8 x 80 GiB at one
  sequence per device: does not fit (short by ~33 GiB); offload is a suggestion that
  fits. With it, the device keeps 2 B/param / 8 of state and the host 6 B/param / 8
  (per node: 8 devices' worth); the update adds the streamed state (the largest of the
  embedding's and head's, and one layer's) to the device's temporaries."""
  gib = 2 ** 30
  overrides = ["train.global_batch_size=8"]
  base = memory.estimate(test_memory.config("70b_bf16.py", *overrides), 8, 80 * gib)
  assert not base.fits and base.host == {}
  found = memory.suggestions(base.setup, device_memory=80 * gib)
  offloaded = next(x for x in found if x.overrides == ("optimizer.offload=host",))
  e = memory.estimate(test_memory.config("70b_bf16.py", *overrides, "optimizer.offload=host"),
                      8, 80 * gib)
  assert e.total == offloaded.estimate.total and e.fits
  params = e.params
  assert e.state - e.components["batch"] == pytest.approx(2 * params / 8, rel=1e-3)
  assert e.host_total == pytest.approx(6 * params / 8, rel=1e-3)
  assert e.host_per_node == 8 * e.host_total
  # The peak stays in the backward pass: the device saves exactly the host's bytes.
  assert e.peak_phase == base.peak_phase and base.total - e.total == e.host_total
  # Streamed in: embedding + head + final norm (8 devices' shards) at 6 B/param, more
  # than one layer's (855.7M params / 8).
  rest = (2 * 128256 * 8192 + 8192) // 8
  assert e.components["streamed state"] == 6 * rest > 6 * 855_654_400 // 8
  text = memory_report.format_table(e)
  assert f"{units.fmt_bytes(e.host_per_node)} per node of 8 device(s)" in text


@pytest.mark.parametrize("stage, name", [(1, "tiny.py"), (3, "1b_bf16.py")])
def test_planner_host_and_device_bytes_match_the_plans_memory_kinds(stage, name):
  """Bytes of the offloaded plan's state by memory kind (its abstract state's shardings)
  = the planner's device state and host bytes, to a few bytes (step counts)."""
  c = test_memory.config(name, f"zero.stage={stage}", "optimizer.offload=host")
  model = models.from_config(c)
  tx, _ = optim.optimizer_from_config(c.optimizer, c.train.steps)
  plan = zerojax.make_plan(zerojax.make_mesh(1, 8), c.zero.stage,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(),
                           min_shard_size=c.zero.min_shard_size, offload=True)
  state = zerojax.abstract_state(plan)
  by_kind = {"device": 0, "pinned_host": 0}
  for x in jax.tree.leaves((state.params, state.opt_state)):
    by_kind[x.sharding.memory_kind] += x.dtype.itemsize * math.prod(
        x.sharding.shard_shape(x.shape))
  e = memory.estimate(c, 8)
  assert by_kind["pinned_host"] == e.host_total > 0
  assert 0 <= by_kind["device"] - (e.state - e.components["batch"]) <= 64
