"""The offloaded state is made straight into host memory (issue 52): `init_state` runs
one program per group of offloaded leaves (`streaming.host_groups`), each writing only
host memory, so the device never holds every offloaded leaf at once (one program made
the 8B's 57.87 GiB of host state through 21.00 GiB of device temporaries); a
checkpoint's checksums read host leaves one group at a time; a restore reads each shard
straight into its memory kind (orbax) and runs no program but those checksums. The
state and its checksums are bit for bit those of the plan without offload. XLA's GPU
compiler: each program's device temporaries stay within a layer or two of its group.
"""

import logging
import math
import os
import re

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


def programs(plan, model, tx, given=False):
  """(jitted, abstract args, the state leaves it makes, their bytes) of each init program;
  `given`: from imported params (an HF import: the offloaded ones kept as loaded)."""
  key = jax.ShapeDtypeStruct((2,), np.uint32)
  leaves = jax.tree.leaves(zerojax.abstract_state(plan))
  sizes = [streaming.memory.nbytes(x) for x in leaves]
  host = jax.tree.leaves(plan.param_offloaded)
  params = leaves[step._PARAMS_AT:step._PARAMS_AT + len(host)]
  args = (key, [x for x, h in zip(params, host) if not h], [x for x, h in zip(params, host) if h]
          ) if given else (key, [], [])
  skip = [step._PARAMS_AT + i for i, h in enumerate(host) if h] if given else ()
  return [(j, args, picks, sum(sizes[i] for i in picks))
          for j, picks in step.init_programs(plan, model.init, tx, given=given, skip=skip)]


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


def test_a_restore_reads_offloaded_leaves_into_host_memory_and_runs_only_checksums(
    one_leaf_a_group, tmp_path, caplog):
  """A checkpoint of the plan without offload restored onto the offloaded plan (a memory
  kind change, as a stage or mesh change reshards): orbax reads each shard straight into
  its target's memory kind; the programs the restore compiles are the checksums' (one
  over the device leaves, one a host group, each reading host memory only), nothing that
  makes an offloaded leaf on the device. Bit for bit the saved state."""
  model, tx, plain, offloaded = plans()
  saved = zerojax.init_state(plain, model.init, tx, jax.random.key(5))
  ckpt = zerojax.Checkpointer(str(tmp_path), save_every_steps=1, async_save=False)
  ckpt.save(0, saved, {})
  jax.clear_caches()
  checksums.jitted.cache_clear()  # Compiled anew: each one the restore runs is logged.
  with caplog.at_level(logging.WARNING), jax.log_compiles(True):
    got, _ = ckpt.restore(0, offloaded)
  ckpt.close()
  compiled = {tuple(re.findall(r"ShapedArray\((\w+(?:<host>)?)\[([\d,]*)\]", m.split(
      "Argument mapping")[0])) for r in caplog.records if (m := r.getMessage()).startswith(
          "Compiling")}
  leaves, host = jax.tree.leaves(got), jax.tree.leaves(step.host_leaves(offloaded))
  # The log writes each argument as dtype<host>[shape]: one program over the device
  # leaves, the others over host leaves only, at most the largest host leaf's bytes each
  # (`streaming.host_groups`), every host leaf read by one of them.
  size = lambda arg: math.prod(int(n) for n in arg[1].split(",") if n) * np.dtype(  # noqa: E731
      arg[0].removesuffix("<host>")).itemsize
  on_host = [p for p in compiled if all(a[0].endswith("<host>") for a in p)]
  assert len(on_host) == len(compiled) - 1 > 2
  assert not any(a[0].endswith("<host>") for p in compiled - set(on_host) for a in p)
  assert max(sum(map(size, p)) for p in on_host) == max(
      streaming.memory.nbytes(x) for x, h in zip(leaves, host) if h)
  assert {a for p in on_host for a in p} == {
      (f"{x.dtype}<host>", ",".join(map(str, x.shape))) for x, h in zip(leaves, host) if h}
  for x, y, h in zip(jax.tree.leaves(saved), leaves, host):
    assert y.sharding.memory_kind == ("pinned_host" if h else "device")
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.skipif(not targets.plugin_installed(), reason="XLA's GPU compiler is in JAX's "
                    "CUDA plugin: pip install -e '.[gpu-compile]'")
def test_on_a_gpu_init_import_and_checksums_hold_one_layer_of_their_stacks(one_leaf_a_group):
  """Each program an offloaded one-device plan runs to make its state (from the model's
  init, or from imported params: an HF import) or to checksum it (a save, a restore), by
  XLA's GPU compiler: its offloaded leaves in host memory (the init's outputs, the
  checksums' arguments), on the device no more than two layers of its stacks (the one on
  its way, the next) and its other leaves whole."""
  model, tx, _, offloaded = plans()
  spec, mesh = targets.parse("h200:1"), offloaded.mesh
  leaves = jax.tree.leaves(zerojax.abstract_state(offloaded))
  stacked = [False] + jax.tree.leaves(offloaded.per_layer) + jax.tree.leaves(
      offloaded.opt_per_layer)  # By state leaf: the step, the params, the optimizer state.
  layers = LLAMA["n_layers"]
  # A layer of each stacked leaf, a non-stacked one whole.
  layer = lambda picks: sum(streaming.memory.nbytes(leaves[i]) // (  # noqa: E731
      layers if stacked[i] else 1) for i in picks)
  host = jax.tree.leaves(step.host_leaves(offloaded))
  for given in (False, True):
    made = programs(offloaded, model, tx, given)
    for jitted, args, picks, nbytes in made[:-1]:
      m = gpu_compile.compile_jitted(jitted, args, mesh, spec).memory
      assert m["host_outputs"] == nbytes and m["outputs"] < 1024  # The output tuple's table.
      assert m["temporaries"] <= 2 * layer(picks) + (4 << 10)  # + keys and bits: KiB.
    offloaded_params = sum(streaming.memory.nbytes(x) for x in made[0][1][2]) if given else 0
    assert sum(n for *_, n in made[:-1]) + offloaded_params == sum(
        streaming.memory.nbytes(x) for x, h in zip(leaves, host) if h)
  groups = checksums.programs(leaves)
  for picks in groups[1:]:
    part = [leaves[i] for i in picks]
    m = gpu_compile.compile_jitted(checksums.jitted(jax.tree.structure(part), tuple(
        x.sharding for x in part)), (part,), mesh, spec).memory
    assert m["host_arguments"] == sum(streaming.memory.nbytes(x) for x in part)
    assert m["arguments"] == 0 and m["temporaries"] <= 2 * layer(picks) + (4 << 10)


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
