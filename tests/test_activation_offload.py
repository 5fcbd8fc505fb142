"""Activation offload (`model.activation_offload='host'`, `zerojax.streaming`): what remat
saves per layer lives in host memory between the passes and comes back one layer ahead.

On 8 CPU devices, fp32: the offloaded step computes the step without it (XLA:CPU's host
and device are one RAM, so the moves lower to nothing), with sequence parallelism on
packed rows, at stage 3 and with gradient release; in the traced step the saved layer
inputs are host values that are only moved and sliced. Compiled by XLA's GPU compiler
for 8 x H100 (no GPU needed): the host temporaries are exactly the saved layer inputs,
the device's temporaries fall by all but a few layers of them, and every read back is in
flight while the previous layer's backward pass computes.
"""

import json

import jax
import pytest

from zerojax import build
from zerojax.config import ConfigError, load_config
from zerojax.gpu import compile as gpu_compile, targets
from zerojax.memory import report as memory_report
from zerojax.testing import hlo

from test_offload import MOVE_ONLY, NoHostMemory, host_uses
from test_release import relative
from test_sequence import BATCH, SEQ, TINY, grads_of_one_step, reference, row_batch

SP, OFFLOAD = "mesh.sequence_parallel=True", "model.activation_offload=host"
RELEASE = ("zero.stage=3", "optimizer.release=True")


@pytest.mark.parametrize("overrides", [
    ("zero.stage=3", SP), (*RELEASE, SP), ("zero.stage=1",), ("zero.stage=3", SP,
                                                              "model.remat=save_qkv_proj")],
    ids=["stage3_sp", "release_sp", "stage1", "stage3_sp_named_policy"])
def test_the_offloaded_step_is_the_step_without_offload_or_sequence_parallelism(overrides):
  """Packed rows whose examples cross the slices' boundaries; compared with the plain
  step (no sequence parallelism, nothing offloaded: test_sequence's `reference`, the
  stage-3 normal step, which stage 1, release and the named remat policy compute within
  fp32 reduction order): loss 1e-6, every gradient leaf 1e-5 of its norm. Until
  2026-12-05 each case ran its own plain step; each worst leaf is the same against
  either (9.0e-6 with sequence parallelism, 0 at stage 1)."""
  loss, grads = reference(True)
  got_loss, got = grads_of_one_step((*overrides, OFFLOAD), row_batch(True))
  assert abs(got_loss - loss) <= 1e-6 * abs(loss)
  worst = max(jax.tree.leaves(jax.tree.map(relative, got, grads)))
  assert worst < 1e-5, worst


@pytest.mark.parametrize("overrides", [("zero.stage=3",), RELEASE], ids=["stage3", "release"])
def test_the_saved_layer_inputs_are_host_values_only_moved(overrides):
  """In the traced step (avals carry their memory space) the layer inputs go to host
  memory once a layer in the forward pass and come back in the backward pass: each a
  move of one layer's [examples, positions of the slice, d_model], nothing computed on
  a host value; without offload no move at all."""
  def moves(extra):
    config = load_config("configs/tiny.py", [*TINY, *overrides, SP, *extra], num_devices=8)
    built = build.build(config)
    traced = built.train_step.trace(built.abstract_state, built.abstract_batch)
    return host_uses(traced.jaxpr.jaxpr), config

  (prims, found), config = moves([OFFLOAD])
  assert prims <= MOVE_ONLY, prims - MOVE_ONLY
  layer = (BATCH, SEQ // 8, config.model.d_model)
  host, device = jax.memory.Space.Host, jax.memory.Space.Device
  assert [m for m in found if m[1] == host] == [(device, host, layer)]
  # Fetched before the backward loop (the last layer) and once a trip (the next one).
  assert [m for m in found if m[1] == device] == [(host, device, layer)] * 2
  assert moves([])[0][1] == []


def test_activation_offload_needs_remat_and_host_memory():
  with pytest.raises(ConfigError, match="model.activation_offload.*remat='none'"):
    load_config("configs/tiny.py", [OFFLOAD, "model.remat=none"], num_devices=8)
  config = load_config("configs/tiny.py", [OFFLOAD], num_devices=8)
  with pytest.raises(ConfigError, match="model.activation_offload.*no pinned_host memory"):
    build.check_offload(config, NoHostMemory())
  build.check_offload(config, jax.devices()[0])


@pytest.mark.skipif(not targets.plugin_installed(), reason="XLA's GPU compiler is in JAX's "
                    "CUDA plugin: pip install -e '.[gpu-compile]'")
def test_on_a_gpu_the_saved_inputs_live_in_host_memory_and_arrive_one_layer_ahead(capsys):
  """XLA's GPU compiler, 8 x H100, stage 3, sequence parallelism, 6 layers of bf16 layer
  inputs [1, 4096 / 8, 256]: its host temporaries are the 6 layers' bytes exactly; its
  device temporaries fall by at least 3 of them (it keeps the layer in use, the one
  arriving, and the forward pass's write in flight); every read back (a dynamic slice
  of the host buffer, moved) has the layer's compute between its start and its done.

  The offloaded step is compiled by `python -m zerojax.memory --target h100:8 --compile`
  (its `main`, in this process; `compile_jitted` keeps what it made, so the step read
  below is that compile): the planner's host bytes are the compiled host temporaries
  exactly, and the buffers at the peak are read from the device's temporaries (XLA
  writes the host ones as a second, color-5 allocation)."""
  layers, seq, width = 6, 4096, 256
  overrides = ["model.d_model=256", "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=512",
               f"model.n_layers={layers}", f"train.seq_len={seq}", "train.global_batch_size=1",
               "mesh.data=1", SP, "zero.stage=3", "model.remat=full"]
  layer_bytes = 1 * (seq // 8) * width * 2
  memory_report.main(["--config", "configs/tiny.py", "--target", "h100:8", "--compile", "--json",
                      "--phases", "train_step",
                      *(f"--config.{o}" for o in (*overrides, OFFLOAD))])
  r = json.loads(capsys.readouterr().out)
  assert r["host"]["saved activations"] == r["compiled"]["host_temporaries"] == layers * layer_bytes
  assert r["components"]["saved activations"] == 2 * layer_bytes
  attributed = r["attributed"]
  assert attributed["working set"] > 0 and attributed["gathered head"] > 0
  assert sum(attributed.values()) <= r["compiled"]["temporaries"]
  compiled = {}
  for offload in ("none", "host"):
    config = load_config("configs/tiny.py", [*overrides, f"model.activation_offload={offload}"],
                         num_devices=8)
    built = build.build(config)
    compiled[offload] = gpu_compile.compile_step(built, config, targets.parse("h100:8"))
  off, on = compiled["none"].memory, compiled["host"].memory
  assert off["host_temporaries"] == 0
  assert on["host_temporaries"] == layers * layer_bytes
  assert off["temporaries"] - on["temporaries"] >= (layers - 3) * layer_bytes, (off, on)
  reads = [m for m in hlo.host_moves(compiled["host"].hlo) if not m.to_host]
  assert reads and all(m.overlaps for m in reads), reads
