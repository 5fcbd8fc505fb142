"""Tests for train.py end to end (in a subprocess), zerojax.data and zerojax.optim."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import data, optim
from zerojax.config import base_config
from zerojax.mesh import make_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train.py")
TINY = os.path.join(REPO, "configs", "tiny.py")


def run_train(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
  """Runs train.py on 8 fake CPU devices; the timeout turns a hung collective into a failure."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.run([sys.executable, TRAIN, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_train_stage3_loss_falls(tmp_path):
  result = run_train("--config", TINY, "--config.train.steps=30", "--config.zero.stage=3",
                     "--config.train.log_every=10", "--config.train.eval_every=0",
                     "--config.mesh.data=2", "--config.optimizer.warmup_steps=5",
                     f"--config.workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  header = records[0]
  assert header["devices"] == 8 and header["mesh"] == {"data": 2, "fsdp": 4}
  assert header["stage"] == 3 and header["params"] > 0
  losses = [r["loss"] for r in records if "loss" in r]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert [r["step"] for r in records if "loss" in r] == [1, 10, 20, 30]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0, losses
  assert len(evals) == 2 and evals[-1] < evals[0] - 1.0, evals
  assert records[-1]["final_eval_loss"] == evals[-1]
  # The printed lines carry the same numbers.
  assert f"loss {losses[-1]:.4f}" in result.stdout and "final eval loss" in result.stdout


def test_bad_override_exits_2_without_traceback():
  result = run_train("--config", TINY, "--config.zero.stag=2", timeout=60)
  assert result.returncode == 2
  assert "zero.stag" in result.stderr and "zero.stage" in result.stderr
  assert "Traceback" not in result.stderr and result.stdout == ""


def test_stdlib_corpus_is_real_deterministic_text():
  tokens = data.stdlib_corpus(1 << 16)
  assert tokens.dtype == np.uint8 and tokens.shape == (1 << 16,)
  text = tokens.tobytes()
  assert b"def " in text and b"import " in text
  np.testing.assert_array_equal(tokens, data.stdlib_corpus(1 << 16))


def test_split_holds_out_the_tail():
  tokens = np.arange(1000)
  train, held_out = data.split(tokens, 0.05)
  assert (len(train), len(held_out)) == (950, 50)
  np.testing.assert_array_equal(np.concatenate([train, held_out]), tokens)
  with pytest.raises(ValueError):
    data.split(tokens, 0.0)


def test_batch_at_is_a_pure_function_of_seed_and_step():
  tokens = np.arange(10_000, dtype=np.uint16)
  batch = data.batch_at(tokens, 7, batch_size=4, seq_len=16, seed=3)
  assert batch.shape == (4, 17) and batch.dtype == np.int32
  # Windows of consecutive tokens: each row counts up by one.
  assert (np.diff(batch, axis=1) == 1).all()
  data.batch_at(tokens, 8, 4, 16, 3)  # Other calls in between change nothing.
  np.testing.assert_array_equal(batch, data.batch_at(tokens, 7, 4, 16, 3))
  assert not np.array_equal(batch, data.batch_at(tokens, 8, 4, 16, 3))
  assert not np.array_equal(batch, data.batch_at(tokens, 7, 4, 16, 4))
  # A corpus of exactly seq_len + 1 tokens has one window.
  np.testing.assert_array_equal(data.batch_at(tokens[:17], 0, 2, 16, 0), [np.arange(17)] * 2)


@pytest.mark.parametrize("n", [0, 16])
def test_batch_at_rejects_a_short_corpus(n):
  with pytest.raises(ValueError, match="seq_len"):
    data.batch_at(np.zeros(n, np.uint8), 0, 2, 16, 0)


def test_global_batch_assembles_process_rows():
  assert data.process_rows(16) == slice(0, 16)  # One process feeds every row.
  mesh = make_mesh(data=2, fsdp=4)
  sharding = NamedSharding(mesh, P(("data", "fsdp")))
  full = data.batch_at(np.arange(1000), 0, 16, 8, 0)
  batch = data.global_batch({"tokens": full[data.process_rows(16)]}, sharding)
  assert batch["tokens"].shape == (16, 9) and batch["tokens"].sharding == sharding
  np.testing.assert_array_equal(np.asarray(batch["tokens"]), full)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays(schedule):
  c = base_config().optimizer
  c.learning_rate, c.warmup_steps, c.min_lr_ratio, c.schedule = 1e-2, 10, 0.1, schedule
  lr = optim.learning_rate_schedule(c, total_steps=100)
  assert float(lr(0)) == 0.0
  assert float(lr(5)) == pytest.approx(5e-3)
  assert float(lr(10)) == pytest.approx(1e-2)
  end = 1e-2 if schedule == "constant" else 1e-3
  assert float(lr(100)) == pytest.approx(end)
  assert float(lr(50)) <= 1e-2


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_optimizer_from_config_updates(name):
  c = base_config().optimizer
  c.name, c.warmup_steps = name, 0
  tx, schedule = optim.optimizer_from_config(c, total_steps=10)
  params = {"w": jax.numpy.ones((3, 2))}
  updates, _ = tx.update({"w": jax.numpy.ones((3, 2))}, tx.init(params), params)
  assert float(schedule(0)) == pytest.approx(c.learning_rate)
  assert (np.asarray(updates["w"]) < 0).all()  # Against the gradient (and the decay).


def test_dry_run_compiles_70b_for_64_devices_without_allocating(tmp_path):
  """The 70B config compiles from abstract inputs on 64 fake devices and fits 40 GB."""
  result = run_train("--config", os.path.join(REPO, "configs", "70b_bf16.py"), "--dry_run",
                     "--fake_devices", "64", f"--workdir={tmp_path}", timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  header = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert header["devices"] == 64 and 68e9 <= header["params"] <= 71e9
  per_device = header["memory"]["arguments"] + header["memory"]["temporaries"]
  assert per_device <= 40e9, header["memory"]
  # The arguments are the model state: bf16 params, mu, nu and Kahan buffer, 8 bytes per
  # parameter over 64 devices; the gradient shard (fp32) lives among the temporaries.
  assert abs(header["memory"]["arguments"] / (8 * header["params"] / 64) - 1) < 0.01
  assert "final" not in result.stdout  # Nothing trained.


def test_missing_data_file_exits_2_without_traceback(tmp_path):
  result = run_train("--config", TINY, "--config.data.name=tokens",
                     f"--config.data.path={tmp_path / 'nope.bin'}", timeout=60)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "nope.bin" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_train_runs_at_every_stage_on_8_devices(stage, tmp_path):
  """Stage 3 runs in test_train_stage3_loss_falls; here the others, a few steps each."""
  result = run_train("--config", TINY, "--config.train.steps=3", "--config.optimizer.warmup_steps=1", f"--config.zero.stage={stage}",
                     "--config.train.eval_every=0", "--config.train.eval_batches=1",
                     f"--config.workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert records[0]["stage"] == stage and records[0]["devices"] == 8
  assert np.isfinite(records[-1]["final_train_loss"])


def test_train_runs_on_one_device(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  result = subprocess.run([sys.executable, TRAIN, "--config", TINY, "--config.train.steps=3", "--config.optimizer.warmup_steps=1",
                           "--config.train.eval_every=0", "--config.train.eval_batches=1",
                           f"--config.workdir={tmp_path}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  header = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert header["devices"] == 1


def test_stop_and_resume_gives_the_same_losses(tmp_path):
  """10 steps, stop, 10 more from the checkpoint == 20 steps straight (constant lr)."""
  common = ("--config", TINY, "--config.optimizer.schedule=constant",
            "--config.optimizer.warmup_steps=0", "--config.train.log_every=1",
            "--config.train.eval_every=0", "--config.train.eval_batches=1")

  def losses(workdir):
    records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}

  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  assert run_train(*common, "--config.train.steps=20", f"--workdir={straight}").returncode == 0
  first = run_train(*common, "--config.train.steps=10", f"--workdir={resumed}")
  assert first.returncode == 0, first.stderr[-2000:]
  second = run_train(*common, "--config.train.steps=20", f"--workdir={resumed}")
  assert second.returncode == 0, second.stderr[-2000:]
  assert "resumed from" in second.stdout
  a, b = losses(straight), losses(resumed)
  assert [a[s] for s in range(1, 21)] == [b[s] for s in range(1, 21)]
  # A different model shape in the same workdir is refused before anything compiles.
  clash = run_train(*common, "--config.model.d_model=64", f"--workdir={resumed}")
  assert clash.returncode == 2 and "d_model" in clash.stderr and "Traceback" not in clash.stderr
