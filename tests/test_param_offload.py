"""Parameter offload (`zero.param_offload='host'`, `zerojax.streaming`): stage 3's layer
shards live in pinned host memory and come to the device a layer at a time.

On 8 CPU devices (XLA:CPU's host and device are one RAM, so the moves lower to nothing
and an offloaded step must compute exactly what the step without offload computes):
5 steps bit for bit equal, fp32 and bf16, the normal stage-3 step and gradient release
(each layer read in its own trip, and read one layer ahead; with optimizer accumulation
over 2 microbatches), with optimizer-state offload too, over 8 shards and over one; the
stacked params in host memory after every step, the rest on the device; in the traced
step host values are only moved and sliced; an orbax checkpoint round-trips between a
run with offload and one without. Compiled by XLA's GPU compiler (no GPU needed): the
stacked params are the module's host arguments, the device's fall by as much, every
copy in is asynchronous and most of their bytes have a layer's compute under them.
"""

import functools
import math

import jax
import numpy as np
import pytest

import zerojax
from zerojax import build, checkpoint, optim, testing, zero
from zerojax.config import ConfigError, load_config
from zerojax.gpu import compile as gpu_compile, targets, xla_flags
from zerojax.models.llama import LlamaConfig, LlamaLM
from zerojax.models.mlp_lm import MlpLM
from zerojax.release import make_release_step
from zerojax.streaming import schedule
from zerojax.testing import hlo

from test_offload import MOVE_ONLY, NoHostMemory, abstract_inputs, host_uses
from test_release import LLAMA, SMALL, batches

STEPS = 5


def model_and_tx(name, dtype):
  model = (MlpLM(**SMALL, param_dtype=dtype, compute_dtype=dtype) if name == "mlp_lm" else
           LlamaLM(LlamaConfig(**LLAMA, param_dtype=dtype, compute_dtype=dtype)))
  rule = "kahan" if dtype == "bfloat16" else "nearest"
  return model, optim.adamw(1e-2, b2=0.95, weight_decay=0.1, update_rule=rule,
                            state_dtype="float32")


def make(model, tx, *, params=False, state=False, mesh=(1, 8)):
  return zerojax.make_plan(zerojax.make_mesh(*mesh), 3,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0,
                           offload=state, param_offload=params)


def make_step(kind, plan, model, tx):
  if kind == "normal":
    return zerojax.make_train_step(plan, model.loss, tx)
  if kind.startswith("release accumulation"):  # 2 microbatches absorbed, per-layer clipping.
    return make_release_step(plan, model.layered(), tx, microbatches=2, read_ahead=True,
                             accumulation="optimizer", max_grad_norm=0.2, clipping="per_layer",
                             write_behind=kind.endswith("behind"))
  if kind in ("release behind", "release first"):  # Read ahead, each layer's update
    # written in the next trip: after its reads, or first.
    return make_release_step(plan, model.layered(), tx, read_ahead=True, write_behind=True,
                             writes_first=kind == "release first")
  return make_release_step(plan, model.layered(), tx, read_ahead=kind == "release ahead")


@functools.cache
def planned_step(kind, name, dtype, params=False, state=False, mesh=(1, 8)):
  """(model, tx, plan, jitted step): one jitted function per configuration, so the tests
  that run the same step (the bit-for-bit cases, the checkpoint round trip) share its
  compile through jit's cache."""
  model, tx = model_and_tx(name, dtype)
  plan = make(model, tx, params=params, state=state, mesh=mesh)
  return model, tx, plan, make_step(kind, plan, model, tx)


@functools.cache
def trained(kind, name, dtype, params=False, state=False, mesh=(1, 8), batch=8,
            default_emitters=False):
  """`planned_step`'s step trained on `batches(STEPS, batch)`: (state, memory kinds,
  plan), once a session; the bit-for-bit and written-behind tests compare some of the
  same runs (the read-ahead step offloading both, the accumulation case's offloaded
  step). `default_emitters`: compiled with XLA's default emitters
  (`testing.DEFAULT_EMITTERS`)."""
  model, tx, plan, step = planned_step(kind, name, dtype, params=params, state=state, mesh=mesh)
  options = testing.DEFAULT_EMITTERS if default_emitters else None
  got, kinds = train(kind, plan, model, tx, batches(STEPS, batch=batch), step, options)
  return got, kinds, plan


def train(kind, plan, model, tx, data, step=None, options=None):
  """The state after a step per batch, and each step's params' memory kinds; the step
  compiled with XLA debug `options` beside the suite's (conftest.FAST_COMPILE)."""
  step = step or make_step(kind, plan, model, tx)
  state = zerojax.init_state(plan, model.init, tx, jax.random.key(0))
  step = step.lower(state, data[0]).compile(options)
  kinds = []
  for batch in data:
    state, _ = step(state, batch)
    kinds.append([x.sharding.memory_kind for x in jax.tree.leaves(state.params)])
  return state, kinds


# Llama, bf16, read ahead with state offload over 8 shards is the accumulation case's
# step less its microbatches and clipping (that case reads ahead too). Each case compiles
# both steps under the suite's XLA:CPU code generation (its legacy fusion emitters), where
# all but the one-shard case are equal bit for bit; that one (measured: 1 bf16 Kahan
# element of 384 one ulp apart there) compiles with XLA's default emitters, train.py's,
# where every case is equal (the suite ran all seven so until 2026-12-05: 80 s of CPU,
# now 44).
@pytest.mark.parametrize("name, dtype, kind, state, mesh", [
    ("llama", "float32", "normal", False, (1, 8)),
    ("llama", "bfloat16", "normal", True, (1, 8)),
    ("llama", "float32", "release", True, (1, 8)),
    ("llama", "bfloat16", "release ahead", False, (1, 8)),
    ("mlp_lm", "bfloat16", "release", False, (2, 4)),
    ("mlp_lm", "bfloat16", "release ahead", True, (8, 1)),  # One shard: nothing gathered.
    ("llama", "bfloat16", "release accumulation", True, (1, 8)),
])
def test_offloaded_params_train_bit_for_bit_as_params_on_the_device(name, dtype, kind, state,
                                                                    mesh):
  run = functools.partial(trained, kind, name, dtype, state=state, mesh=mesh,
                          batch=16 if kind == "release accumulation" else 8,
                          default_emitters=mesh == (8, 1))
  want, _, _ = run()
  got, kinds, plan = run(params=True)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                          jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                  err_msg=jax.tree_util.keystr(path))
  layered = jax.tree.leaves(plan.per_layer)
  assert 0 < sum(layered) < len(layered)
  assert kinds == [["pinned_host" if m else "device" for m in layered]] * STEPS


@pytest.mark.parametrize("kind", ["release behind", "release first",
                                  "release accumulation behind"])
def test_written_behind_is_the_same_step_bit_for_bit(kind):
  """Release with the params and optimizer state in host memory, read ahead and written
  behind (each layer's update goes back during the next layer's trip, after its
  recompute or, writes first, before the trip's reads; each layer's state read in its
  own trip; the first trip writes the last layer back unchanged, layer 0 goes back
  after the loop; with optimizer accumulation, in each microbatch's loop): 5 bf16 Kahan
  steps equal bit for bit to the same step writing each layer back in its own trip, the
  offloaded leaves in host memory after every step."""
  accumulation = kind.startswith("release accumulation")
  ahead = "release accumulation" if accumulation else "release ahead"
  run = lambda kind: trained(kind, "llama", "bfloat16", params=True, state=True,  # noqa: E731
                             batch=16 if accumulation else 8)
  want, _, _ = run(ahead)  # Accumulation's: the bit-for-bit case's offloaded run.
  got, kinds, plan = run(kind)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                          jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                  err_msg=jax.tree_util.keystr(path))
  layered = jax.tree.leaves(plan.per_layer)
  assert kinds == [["pinned_host" if m else "device" for m in layered]] * STEPS
  assert [x.sharding.memory_kind for x in jax.tree.leaves(got.opt_state)] == [
      "pinned_host" if m else "device" for m in jax.tree.leaves(plan.opt_offloaded)]


def test_release_on_one_shard_is_the_normal_step():
  """Release over a mesh of 8 replicas and one shard (what one GPU runs): 3 fp32 steps
  within 1e-6 of the normal step's params, every leaf reduced over the 8 replicas."""
  model, tx = model_and_tx("llama", "float32")
  plan = make(model, tx, mesh=(8, 1))
  assert plan.num_shards == 1 and plan.behaviour.stage == 0
  data = batches(3)
  # XLA's default emitters, with which the tolerance was measured (the legacy ones: 3 of
  # 2048 elements 2.4e-7 apart).
  normal, _ = train("normal", plan, model, tx, data, options=testing.DEFAULT_EMITTERS)
  released, _ = train("release", plan, model, tx, data, options=testing.DEFAULT_EMITTERS)
  for a, b in zip(jax.tree.leaves(normal.params), jax.tree.leaves(released.params),
                  strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["release", "release ahead", "release behind", "normal"])
def test_host_params_are_only_moved_and_each_layer_comes_once_a_pass(kind):
  """In the traced step host values are only sliced, moved and written, never computed
  on. Release moves one layer's shard of each stacked leaf to the device per forward and
  backward trip (read ahead: once more before each loop, the first layer) and the
  updated shard back once (written behind: in the loop and once after it, layer 0); the
  normal step moves the whole shards, each way once."""
  model, tx = model_and_tx("llama", "bfloat16")
  plan = make(model, tx, params=True)
  traced = make_step(kind, plan, model, tx).trace(*abstract_inputs(plan))
  prims, moves = host_uses(traced.jaxpr.jaxpr)
  assert prims <= MOVE_ONLY, prims - MOVE_ONLY
  shards = [zero.local_shape(x.shape, d, 8) for x, d, m in zip(
      jax.tree.leaves(plan.params), jax.tree.leaves(plan.param_dims, is_leaf=lambda d: d is None),
      jax.tree.leaves(plan.per_layer)) if m]
  host, device = jax.memory.Space.Host, jax.memory.Space.Device
  inbound = sorted(s for a, b, s in moves if (a, b) == (host, device))
  outbound = sorted(s for a, b, s in moves if (a, b) == (device, host))
  if kind == "normal":  # Under GSPMD: global shapes, whole.
    whole = sorted(x.shape for x, m in zip(jax.tree.leaves(plan.params),
                                           jax.tree.leaves(plan.per_layer)) if m)
    assert inbound == outbound == whole
    return
  layer = sorted(s[1:] for s in shards)
  assert outbound == sorted(layer * (2 if kind == "release behind" else 1))
  assert inbound == sorted(layer * (2 if kind == "release" else 4))


def test_a_checkpoint_moves_between_host_and_device_params(tmp_path):
  """Saved with the params in host memory, restored into a plan without offload (device
  memory) and into one with it: 2 more steps from each equal 4 uninterrupted steps bit
  for bit; and saved from the device, restored into host memory, the same."""
  data = batches(4)
  # The steps of the bit-for-bit case (llama, bf16, release ahead, no state offload):
  # compiled once for both tests.
  planned = {h: planned_step("release ahead", "llama", "bfloat16", params=h) for h in (True, False)}
  model, tx = planned[True][:2]
  plans = {h: p[2] for h, p in planned.items()}
  steps = {h: p[3] for h, p in planned.items()}
  for saved_from in (True, False):
    state = zerojax.init_state(plans[saved_from], model.init, tx, jax.random.key(0))
    for batch in data[:2]:
      state, _ = steps[saved_from](state, batch)
    with checkpoint.Checkpointer(tmp_path / str(saved_from), save_every_steps=1) as ckpt:
      ckpt.save(2, state)
      ckpt.wait()
      restored = {h: ckpt.restore(2, plans[h])[0] for h in (True, False)}
    for batch in data[2:]:
      state, _ = steps[saved_from](state, batch)
    for host, resumed in restored.items():
      assert [x.sharding for x in jax.tree.leaves(resumed.params)] == jax.tree.leaves(
          plans[host].param_shardings)
      for batch in data[2:]:
        resumed, _ = steps[host](resumed, batch)
      for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_param_offload_needs_stage_3_and_host_memory():
  with pytest.raises(ConfigError, match="zero.param_offload.*zero.stage=2"):
    load_config("configs/tiny.py", ["zero.param_offload=host", "zero.stage=2"], num_devices=8)
  config = load_config("configs/tiny.py", ["zero.param_offload=host"], num_devices=8)
  with pytest.raises(ConfigError, match="zero.param_offload.*no pinned_host memory"):
    build.check_offload(config, NoHostMemory())
  build.check_offload(config, jax.devices()[0])
  with pytest.raises(ValueError, match="stage 3's layers"):
    model, tx = model_and_tx("mlp_lm", "float32")
    zerojax.make_plan(zerojax.make_mesh(1, 8), 2, jax.eval_shape(model.init, jax.random.key(0)),
                      tx, logical_axes=model.logical_axes(), param_offload=True)


# The GPU-target tests' model: tiny.py's Llama at width 256, 6 layers, release at stage 3.
GPU_RELEASE = ["model.d_model=256", "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=512",
               "model.n_layers=6", "train.seq_len=512", "train.global_batch_size=8",
               "mesh.data=1", "zero.stage=3", "optimizer.release=True", "optimizer.grad_clip=0"]


@pytest.mark.skipif(not targets.plugin_installed(), reason="XLA's GPU compiler is in JAX's "
                    "CUDA plugin: pip install -e '.[gpu-compile]'")
def test_on_a_gpu_the_layers_live_in_host_memory_and_arrive_one_layer_ahead():
  """XLA's GPU compiler, 8 x RTX 4090, gradient release, 6 bf16 layers: the module's
  host arguments are exactly each device's shards of the stacked params, and its device
  arguments exactly the shards of the rest of the state and the batch: the device bytes
  fall by the stacks (the step without param offload holds every shard's bytes, 4,091,948
  measured; that it has no host arguments: test_gpu_targets.py's offload test). Each copy
  in is asynchronous (a dynamic-slice fusion's start and done): one per stacked leaf
  before each layer loop (the first layer) and one per leaf per trip inside it (the next
  layer, carried), and in both loops most of their bytes have a layer's compute
  scheduled between start and done (measured: 60% in the forward loop, 80% in the
  backward; 89% and 80% before stage 3 sharded a leaf along its first dimension, which
  reordered this small layer's forward; XLA keeps at most two host copies in flight, and
  a few land between two compute ops)."""
  config = load_config("configs/tiny.py", [*GPU_RELEASE, "zero.param_offload=host"],
                       num_devices=8)
  built = build.build(config)
  out = gpu_compile.compile_step(built, config, targets.parse("rtx4090:8"))
  plan = built.plan
  stack = sum(x.dtype.itemsize * math.prod(zero.local_shape(x.shape, d, 8)) for x, d, m in zip(
      jax.tree.leaves(plan.params), jax.tree.leaves(plan.param_dims, is_leaf=lambda d: d is None),
      jax.tree.leaves(plan.per_layer)) if m)
  on = out.memory
  shard = lambda x: x.dtype.itemsize * math.prod(x.sharding.shard_shape(x.shape))
  args = jax.tree.leaves((built.abstract_state, built.abstract_batch))
  assert on["host_arguments"] == stack == sum(
      shard(x) for x in args if x.sharding.memory_kind == "pinned_host")
  assert on["arguments"] == sum(shard(x) for x in args if x.sharding.memory_kind != "pinned_host")
  leaves = sum(jax.tree.leaves(plan.per_layer))
  by_place = {}
  for move in hlo.host_moves(out.hlo):
    if not move.to_host:
      by_place.setdefault(move.computation, []).append(move)
  entry = [c for c in by_place if c.startswith("main")]
  loops = [c for c in by_place if c not in entry]
  assert len(entry) == 1 and len(by_place[entry[0]]) == 2 * leaves  # Forward's, backward's.
  assert len(loops) == 2  # The forward and the backward layer loop.
  size = lambda m: math.prod(m.shape[1])
  for name in loops:
    reads = by_place[name]
    # XLA may unroll a loop by two (double buffering): two trips' reads in one body.
    assert len(reads) in (leaves, 2 * leaves), (name, reads)
    hidden = sum(size(m) for m in reads if m.overlaps) / sum(size(m) for m in reads)
    assert hidden > 0.55, (name, hidden)
  # train.py's line: the same reads, both loops together.
  reads = [m for name in loops for m in by_place[name]]
  hidden = sum(size(m) for m in reads if m.overlaps) / sum(size(m) for m in reads)
  assert schedule.overlap_line(out.hlo) == (
      f"host copies in the layer loops: {len(reads)} to the device in 2 loop bodies, "
      f"{hidden:.0%} of their bytes with compute scheduled under them (the compiled "
      "schedule, not a measurement)")


@pytest.mark.skipif(not targets.plugin_installed(), reason="XLA's GPU compiler is in JAX's "
                    "CUDA plugin: pip install -e '.[gpu-compile]'")
def test_on_a_gpu_written_behind_the_copies_run_under_the_matmuls():
  """XLA's GPU compiler, 8 x RTX 4090, release with the params and optimizer state in host
  memory, 6 layers of width 256: each layer's update written in its own trip, XLA puts
  the backward loop's writes and most reads after the layer's matmuls; written behind
  (`optimizer.release_write_behind`, with the GPU profile's 32 host copies in flight),
  the reads land under the recompute and the writes under the next layer's backward
  matmuls. Timed along the schedule (`streaming.schedule.timed_step`) at 1 TFLOP/s, a
  rate at which this small layer's matmuls outlast its copies: measured 13% of the
  copies' time under compute in their own trip, 74% written behind (19% and 91% before
  stage 3 sharded a leaf along its first dimension; the 70B on 8 x RTX 4090 stays at
  100%, `configs/70b_8x4090.py`). Written first (`optimizer.release_writes_first`), the
  carried update leaves before the backward: measured 50% of the time, and the fewest
  temporaries of the three (11.42 MB against 11.83 in their own trip and 13.59 written
  after the reads)."""
  overrides = [*GPU_RELEASE, "zero.param_offload=host", "optimizer.offload=host"]
  hidden, temps = {}, {}
  for mode in ("own trip", "behind", "first"):
    config = load_config("configs/tiny.py", [
        *overrides, f"optimizer.release_write_behind={mode != 'own trip'}",
        f"optimizer.release_writes_first={mode == 'first'}"], num_devices=8)
    out = gpu_compile.compile_step(build.build(config), config, targets.parse("rtx4090:8"))
    copies, waits = schedule.timed_step(out.hlo, 1e12, 25e9)
    hidden[mode], temps[mode] = 1 - waits / copies, out.memory["temporaries"]
    assert ("parallel_async_compute_limit=32" in " ".join(
        f for entry in xla_flags.for_config(config) for f in entry.forms)) == (
            mode != "own trip")
  assert hidden["own trip"] < 0.3 and hidden["behind"] > 0.7, hidden
  assert hidden["first"] > hidden["own trip"] + 0.2, hidden
  assert temps["first"] < min(temps["own trip"], temps["behind"]), temps
