"""The offloaded state is made straight into host memory (issue 52): `init_state` runs
one program per group of offloaded leaves (`streaming.host_groups`), each writing only
host memory, so the device never holds every offloaded leaf at once (one program made
the 8B's 57.87 GiB of host state through 21.00 GiB of device temporaries); a
checkpoint's checksums read host leaves one group at a time. The state and its
checksums are bit for bit those of the plan without offload. XLA's GPU compiler: each
program's device temporaries stay within its group's bytes.
"""

import math
import os

import jax
import numpy as np
import pytest

import zerojax
from zerojax import build, step, streaming
from zerojax.checkpoint import checksums
from zerojax.config import load_config
from zerojax.gpu import compile as gpu_compile, targets
from zerojax.memory import phases

from test_param_offload import model_and_tx
from test_release import LLAMA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = (1, 1)  # One device: every leaf whole, as the one-card recipes hold them.


def plans(dtype="bfloat16"):
  model, tx = model_and_tx("llama", dtype)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  mesh = zerojax.make_mesh(*ONE, devices=jax.devices()[:1])
  make = lambda off: zerojax.make_plan(  # noqa: E731
      mesh, 3, shapes, tx, logical_axes=model.logical_axes(), min_shard_size=0, offload=off,
      param_offload=off)
  return model, tx, make(False), make(True)


def programs(plan, model, tx):
  """(jitted, abstract args, the state leaves it makes, their bytes) of each init program."""
  key = jax.ShapeDtypeStruct((2,), np.uint32)
  sizes = [streaming.memory.nbytes(x) for x in jax.tree.leaves(zerojax.abstract_state(plan))]
  return [(j, (key, [], []), picks, sum(sizes[i] for i in picks))
          for j, picks in step.init_programs(plan, model.init, tx)]


@pytest.fixture
def one_leaf_a_group(monkeypatch):
  monkeypatch.setattr(streaming.memory, "GROUP_BYTES", 0)


def test_each_offloaded_leaf_is_made_in_host_memory_one_group_at_a_time(one_leaf_a_group):
  model, tx, plain, offloaded = plans()
  made = programs(offloaded, model, tx)
  host = jax.tree.leaves(step.host_leaves(offloaded))
  largest = max(streaming.memory.nbytes(x) for x, h in zip(
      jax.tree.leaves(zerojax.abstract_state(offloaded)), host) if h)
  assert len(made) > 2 and [all(host[i] for i in picks) for _, _, picks, _ in made] == [
      True] * (len(made) - 1) + [False]
  for jitted, args, picks, nbytes in made[:-1]:
    text = jitted.lower(*args).compile().as_text()
    assert streaming.host_output_bytes(text) == nbytes <= largest  # Host outputs only.
  assert streaming.host_output_bytes(made[-1][0].lower(*made[-1][1]).compile().as_text()) == 0

  # Bit for bit the plan's without offload; the checksums too, read a group at a time.
  a = zerojax.init_state(plain, model.init, tx, jax.random.key(3))
  b = zerojax.init_state(offloaded, model.init, tx, jax.random.key(3))
  for x, y, h in zip(jax.tree.leaves(a), jax.tree.leaves(b), host):
    assert y.sharding.memory_kind == ("pinned_host" if h else "device")
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert len(checksums.programs(jax.tree.leaves(b))) > 2
  assert checksums.describe(a) == checksums.describe(b)

  # From given params (an HF import): the offloaded ones are the state's own arrays.
  given = jax.device_put(b.params, offloaded.param_shardings)
  c = zerojax.init_state(offloaded, model.init, tx, jax.random.key(4), params=given)
  d = zerojax.init_state(plain, model.init, tx, jax.random.key(4),
                         params=jax.device_put(a.params, plain.param_shardings))
  assert [x is y for x, y, h in zip(jax.tree.leaves(given), jax.tree.leaves(c.params), host[
      1:]) if h] == [True] * sum(jax.tree.leaves(offloaded.param_offloaded))
  for x, y in zip(jax.tree.leaves(c), jax.tree.leaves(d)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.skipif(not targets.plugin_installed(), reason="XLA's GPU compiler is in JAX's "
                    "CUDA plugin: pip install -e '.[gpu-compile]'")
def test_on_a_gpu_each_init_program_holds_one_layer_of_its_stacks(one_leaf_a_group):
  model, tx, _, offloaded = plans()
  spec, mesh = targets.parse("h200:1"), offloaded.mesh
  leaves = jax.tree.leaves(zerojax.abstract_state(offloaded))
  stacked = [False] + jax.tree.leaves(offloaded.per_layer) + jax.tree.leaves(
      offloaded.opt_per_layer)  # By state leaf: the step, the params, the optimizer state.
  layers = LLAMA["n_layers"]
  made = programs(offloaded, model, tx)
  for jitted, args, picks, nbytes in made[:-1]:
    m = gpu_compile.compile_jitted(jitted, args, mesh, spec).memory
    assert m["host_outputs"] == nbytes and m["outputs"] < 1024  # The output tuple's table.
    # A layer of each stacked leaf (two: the one on its way out, the next), a non-stacked
    # one whole, and a few KiB of keys and bits: not the whole stacks.
    layer = sum(streaming.memory.nbytes(leaves[i]) // (layers if stacked[i] else 1)
                for i in picks)
    assert m["temporaries"] <= 2 * layer + (4 << 10)
  host = jax.tree.leaves(step.host_leaves(offloaded))
  assert sum(n for *_, n in made[:-1]) == sum(streaming.memory.nbytes(x) for x, h in zip(
      jax.tree.leaves(zerojax.abstract_state(offloaded)), host) if h)


def test_the_phases_report_reads_the_init_and_checksums_from_their_programs():
  config = load_config(os.path.join(ROOT, "configs/tiny.py"), [
      "zero.param_offload=host", "optimizer.offload=host", "optimizer.release=True",
      "optimizer.grad_clip=0"], num_devices=jax.device_count())
  got = phases.phase_memory(config, phases=("init", "checksums"))
  assert sorted(got) == ["checksums", "init"] and got["init"]["programs"] == 2
  host = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(zerojax.abstract_state(build.build(config).plan))
             if x.sharding.memory_kind == "pinned_host")
  assert got["init"]["host"] == host > got["init"]["device"] > 0  # Host outputs, per device.
