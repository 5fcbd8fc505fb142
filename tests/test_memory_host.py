"""The memory planner's host terms (`zerojax.memory`, `zerojax.memory.bus`): parameter
offload's device and host bytes, host memory per node against `--host-memory`, the bytes
each offload moves over the host link per step and their time beside the compute.
Planner arithmetic only (no compiles): the 70B's shapes come from `jax.eval_shape`."""

import dataclasses
import json
import math
import os
import re

import jax
import pytest

import zerojax
from zerojax import memory, models, optim
from zerojax.gpu import host_link, targets
from zerojax.memory import report as memory_report
from zerojax.run import metrics

from test_memory import CONFIGS, config

GIB = 2**30
RECIPE = f"{CONFIGS}/70b_8x80gb.py"  # Lion + Kahan, release, one sequence per device.
OFFLOAD = ("--config.zero.param_offload=host", "--config.optimizer.offload=host")


def stack_shard_bytes(c, shards: int = 8) -> int:
  """Bytes of one device's shard of the layer-stacked params, from the model's init shapes
  (every stacked leaf of the 70B divides by 8 along a dimension that is not 'layers')."""
  model = models.from_config(c)
  params = jax.eval_shape(model.init, jax.random.key(0))
  stacked = [x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
             if "layers" in jax.tree_util.keystr(path)]
  assert stacked and all(x.shape[0] == c.model.n_layers for x in stacked)
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in stacked) // shards


def cli(capsys, *args: str) -> tuple[int, str]:
  status = memory_report.main(["--config", RECIPE, *args])
  return status, capsys.readouterr().out


def test_param_offload_with_release_keeps_three_layers_and_moves_3x_the_stack():
  c = config("70b_8x80gb.py", "zero.param_offload=host")
  base = memory.estimate(config("70b_8x80gb.py"), 8)
  e = memory.estimate(c, 8)
  S = stack_shard_bytes(c)
  assert 15 * GIB < S < 17 * GIB  # 2 B x 68.45B stacked params / 8.
  assert e.host == {"params": S}
  # The device keeps the non-stacked shards and 3 of the 80 layers' shards.
  assert base.components["params"] - e.components["params"] == S - S * 3 // 80
  assert base.total - e.total == S - S * 3 // 80
  # Forward reads the stack, the released backward reads it again and writes it back.
  assert e.pcie == {"params": (2 * S, S)}
  assert sum(e.pcie["params"]) == 3 * S
  # Optimizer accumulation over 2 microbatches: each has its forward, backward and write.
  two = memory.estimate(config("70b_8x80gb.py", "zero.param_offload=host",
                               "train.microbatches=2", "train.global_batch_size=16",
                               "optimizer.release_accumulation=optimizer"), 8)
  assert two.pcie == {"params": (4 * S, 2 * S)}


def test_the_planners_host_bytes_are_the_plans_pinned_host_params():
  """The plan's own memory kinds (`zero.make_plan(param_offload=True)`, abstract)."""
  c = config("70b_8x80gb.py", "zero.param_offload=host")
  model = models.from_config(c)
  tx, _ = optim.optimizer_from_config(c.optimizer, c.train.steps)
  plan = zerojax.make_plan(zerojax.make_mesh(1, 8), 3,
                           jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(),
                           min_shard_size=c.zero.min_shard_size, param_offload=True)
  state = zerojax.abstract_state(plan)
  host = sum(x.dtype.itemsize * math.prod(x.sharding.shard_shape(x.shape))
             for x in jax.tree.leaves(state.params) if x.sharding.memory_kind == "pinned_host")
  assert host == memory.estimate(c, 8).host["params"] == stack_shard_bytes(c)


def test_param_offload_without_release_saves_no_device_bytes_and_says_so(capsys):
  c = config("70b_bf16.py", "zero.param_offload=host", "train.global_batch_size=8")
  base = memory.estimate(config("70b_bf16.py", "train.global_batch_size=8"), 8)
  e = memory.estimate(c, 8)
  S = stack_shard_bytes(c)
  assert e.total == base.total and e.host["params"] == S
  assert e.pcie == {"params": (S, S)}  # The whole shard in once and back once a step.
  status = memory_report.main(["--config", f"{CONFIGS}/70b_bf16.py", "--devices", "8",
                               "--config.zero.param_offload=host",
                               "--config.train.global_batch_size=8"])
  out = capsys.readouterr().out
  assert status == 0 and "without gradient release" in out and "no device bytes saved" in out


def test_optimizer_and_activation_offload_traffic():
  c = config("70b_8x80gb.py", "optimizer.offload=host", "model.activation_offload=host",
             "train.microbatches=2", "train.global_batch_size=16",
             "optimizer.release_accumulation=optimizer")
  e = memory.estimate(c, 8)
  state = e.host["optimizer"] + e.host["update buffer"]
  A = e.host["saved activations"]
  assert e.pcie["optimizer state"] == (2 * state, 2 * state)  # Release: each microbatch.
  assert e.pcie["saved activations"] == (2 * A, 2 * A)
  normal = memory.estimate(config("70b_bf16.py", "optimizer.offload=host",
                                  "train.global_batch_size=8"), 8)
  O = normal.host["optimizer"] + normal.host["update buffer"]
  assert normal.pcie == {"optimizer state": (O, O)}  # Once per step.


def test_host_memory_per_node_refuses_a_plan_with_the_fix(capsys):
  status, out = cli(capsys, "--target", "rtx4090:8", *OFFLOAD, "--host-memory", "256GiB")
  assert status == 1
  assert "does NOT fit in 256.00 GiB (--host-memory)" in out and "offload less" in out
  assert "more nodes / devices" in out and "verdict: fits in 21.84 GiB" in out
  status, out = cli(capsys, "--target", "rtx4090:8", *OFFLOAD, "--host-memory", "1TiB",
                    "--json")
  plan = json.loads(out)
  assert status == 0 and plan["fits"] and plan["fits_host"]
  assert plan["host_per_node"] == 8 * plan["host_total"] < 2**40
  assert plan["host_memory"] == 2**40
  status, out = cli(capsys, "--target", "rtx4090:8", *OFFLOAD, "--host-memory", "256GiB",
                    "--json")
  plan = json.loads(out)
  assert status == 1 and not plan["fits"] and plan["fits_device"]
  assert plan["host_per_node"] > 256 * GIB
  # Fewer devices a node (a target's per-host count), or fewer offloads, fit.
  assert any("devices of this size" in x["change"] for x in plan["suggestions"])


def test_a_targets_devices_per_host_make_a_node():
  s = memory.RunSpec.from_config(config("70b_8x80gb.py", "zero.param_offload=host"), 8)
  e = memory.estimate(dataclasses.replace(s, per_host=4))
  assert e.setup.per_node == 4 and e.host_per_node == 4 * e.host_total
  assert memory.estimate(s).host_per_node == 8 * e.host_total
  assert targets.parse("rtx4090:2x4").per_host == 4


def test_suggestions_offload_the_params_of_the_70b_on_24gb_cards(capsys):
  status, out = cli(capsys, "--target", "rtx4090:8", "--json")
  plan = json.loads(out)
  assert status == 1 and not plan["fits"]
  found = [x for x in plan["suggestions"] if "parameters offloaded" in x["change"]]
  assert found and "zero.param_offload=host" in found[0]["overrides"]
  assert all(len(set(x["overrides"])) == len(x["overrides"]) for x in plan["suggestions"])
  assert found[0]["total"] <= targets.budget(targets.load("rtx4090"), 0.95)


def test_release_is_suggested_on_one_device():
  """Release runs on one shard now (stage 3 over fsdp=1): suggested there too, and its
  estimate holds no stacked layer gradients."""
  c = config("8b_bf16.py", "train.global_batch_size=1", devices=1)
  e = memory.estimate(c, 1, 40 * GIB)
  found = memory.suggestions(e.setup, device_memory=40 * GIB)
  changes = [x.change for x in found]
  assert any(x.startswith("gradient release") for x in changes), changes
  released = memory.estimate(config("8b_bf16.py", "train.global_batch_size=1",
                                    "optimizer.release=True", "optimizer.grad_clip=0",
                                    devices=1), 1)
  assert "layer gradients" not in released.components


def test_the_bus_line_is_pcie_time_over_compute_time(capsys):
  _, out = cli(capsys, "--target", "rtx4090:8", *OFFLOAD, "--json")
  pcie = json.loads(out)["pcie"]
  link = host_link.of("rtx4090")
  assert link.bandwidth == 25e9 and host_link.of("h200").bandwidth == 50e9
  assert pcie["seconds"] == max(pcie["h2d"], pcie["d2h"]) / 25e9
  # The model's FLOPs for one 4096-token sequence a device, at the 4090's peak x 40%.
  c = config("70b_8x80gb.py")
  assert pcie["flops"] == pytest.approx(models.from_config(c).flops_per_token(4096) * 4096)
  peak = metrics.PEAK_FLOPS["RTX 4090"]
  assert pcie["compute_seconds"] == pytest.approx(pcie["flops"] / (peak * 0.4))
  assert pcie["ratio"] == pytest.approx(pcie["seconds"] / pcie["compute_seconds"])
  assert pcie["ratio"] < 1
  # 256-token sequences: 16x less compute, the same bytes: bus-bound.
  _, out = cli(capsys, "--target", "rtx4090:8", *OFFLOAD, "--config.train.seq_len=256",
               "--config.model.loss_chunk=256", "--mfu", "0.5")
  line = next(x for x in out.splitlines() if x.startswith("PCIe "))
  found = re.search(r"\): ([\d.]+) s at 25 GB/s .*; compute ([\d.]+) s at 50% MFU: "
                    r"bus-bound by ([\d.]+)x", line)
  assert found, line
  bus, compute, ratio = map(float, found.groups())
  assert ratio > 1 and ratio == pytest.approx(bus / compute, rel=0.05)


@pytest.mark.parametrize("name, target, hiding", [
    ("8b_1x4090.py", "rtx4090:1", 2), ("70b_1xh100.py", "h100:1", 3),
    ("405b_1xh200.py", "h200:1", 2)])
def test_the_copies_hide_from_the_stated_batch_and_not_one_sequence_less(
    name, target, hiding, capsys):
  """The bus line's "hidden from N tokens a step": the planner rerun at the global batch it
  suggests is hidden behind compute (ratio <= 1), one sequence a device fewer is not; the
  model's and state's bytes stay, the FLOPs grow with the sequences."""
  def pcie(*extra):
    memory_report.main(["--config", os.path.join(CONFIGS, name), "--target", target,
                        "--json", *extra])
    return json.loads(capsys.readouterr().out)["pcie"]

  now = pcie()
  assert now["hiding_sequences"] == hiding and now["hiding_global_batch"] == hiding
  at = pcie(f"--config.train.global_batch_size={hiding}")
  below = pcie(f"--config.train.global_batch_size={hiding - 1}")
  assert at["ratio"] <= 1 < below["ratio"], (at["ratio"], below["ratio"])
  assert at["h2d"] == below["h2d"] or "saved activations" in at["traffic"]
  assert at["hiding_sequences"] == below["hiding_sequences"] == hiding


def test_without_a_known_link_the_line_says_so(capsys):
  _, out = cli(capsys, "--devices", "8", *OFFLOAD)
  assert "host link unknown" in out
  _, out = cli(capsys, "--devices", "8", *OFFLOAD, "--host-bandwidth", "25GB")
  assert "at 25 GB/s a direction" in out and "compute unknown" in out
