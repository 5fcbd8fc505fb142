"""benchmarks/peer_step.py: the plain `jax.jit` + FSDP step (MaxText's recipe) beside
zerojax's, both compiled by XLA's GPU compiler for 8 H100s. In-process, on configs/tiny.py
(the session's 8 CPU devices are the ones the target traces over); needs JAX's CUDA
plugin, skipped with the reason otherwise."""

import importlib.util
import json
import os

import pytest

from zerojax import models
from zerojax.config import digest, load_config
from zerojax.gpu import targets
from zerojax.models import llama

pytestmark = pytest.mark.skipif(
    not targets.plugin_installed(),
    reason="XLA's GPU compiler is in JAX's CUDA plugin: pip install -e '.[gpu-compile]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
# One layer: XLA drops a loop of one trip, and each compile takes ~6 s of CPU, not ~9
# (a GPU compile's time is its kernels'); remat 'full' as the peer's, so the two steps
# run the same model.
CHEAP = ["--config.model.n_layers=1", "--config.model.remat=full"]


def _script():
  spec = importlib.util.spec_from_file_location(
      "peer_step", os.path.join(ROOT, "benchmarks", "peer_step.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_both_steps_compile_and_the_peer_holds_bf16_params_and_moments(tmp_path, capsys):
  out = tmp_path / "peer_step.json"
  record = _script().main(["--config", TINY, *CHEAP, "--target", "h100:8", "--out", str(out)])
  config = load_config(TINY, CHEAP, num_devices=8)
  peer, ours = record["steps"]

  # The peer's arguments: bf16 params, mu and nu, each leaf split over the 8 devices
  # (tiny's every leaf has a dimension 8 divides), beside a device's rows of the batch
  # (16 sequences of 129 int32 tokens) and optax's two int32 step counters (the
  # schedule's and Adam's), replicated.
  n = llama.param_count(models.from_config(config).config)
  batch = 16 * 129 * 4 // 8
  assert peer["arguments"] == 3 * 2 * n // 8 + batch + 2 * 4
  for step in (peer, ours):
    assert step["total"] == step["arguments"] + step["temporaries"] > 0
    assert step["live_at_peak"] and step["live_at_peak"][0]["bytes"] > 0
    # The compiled matmuls are at least the model's, and remat's recompute at most
    # one more forward pass of the layers.
    assert 1.0 <= step["hlo_flops"] / step["model_flops"] < 1.5
  # The same model (remat 'full' in both), the same batch: the same matmuls, whatever
  # each step's sharding (GSPMD's or zerojax's shard_map) made of them.
  assert peer["model_flops"] == ours["model_flops"]
  assert peer["hlo_flops"] == ours["hlo_flops"]

  table = capsys.readouterr().out
  assert "| jax.jit + FSDP (MaxText's recipe) |" in table and "| zerojax |" in table
  (saved,) = json.loads(out.read_text()).values()
  assert saved == record and record["digest"] == digest(config)
