"""`optimizer.release` through train.py: it trains as the normal step does, and what it
cannot do exits 2 naming the keys."""

import json
import os

import numpy as np
import pytest
from test_train import REPO, TINY, run_train

from zerojax import exits

BASE = os.path.join(REPO, "configs", "base.py")
MLP = ("--config", BASE, "--config.model.name=mlp_lm", "--config.optimizer.warmup_steps=1",
       "--config.train.seq_len=32", "--config.train.eval_every=0",
       "--config.train.log_every=1")
LLAMA = ("--config", TINY, "--config.optimizer.warmup_steps=1", "--config.zero.stage=3",
         "--config.train.eval_every=0", "--config.train.log_every=1")


@pytest.mark.parametrize("config", [MLP, LLAMA], ids=["mlp_lm", "llama"])
def test_release_trains_like_the_normal_step(tmp_path, config):
  """bf16 params, Kahan AdamW with bf16 moments (the defaults), 8 steps at stage 3: the
  same losses as without release, within bf16 noise, and no skipped layer. Llama: the
  quick start's config (remat 'dots'; release saves only each layer's input)."""
  losses = {}
  for release in (False, True):
    workdir = tmp_path / str(release)
    result = run_train(*config, "--config.train.steps=8", "--config.optimizer.grad_clip=0",
                       f"--config.optimizer.release={release}", f"--config.workdir={workdir}")
    assert result.returncode == exits.DONE, result.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    losses[release] = np.array([r["loss"] for r in steps])
    assert all(r.get("skipped_layers", 0) == 0 for r in steps)
  assert "skipped_layers" in steps[-1]
  assert losses[True][-1] < losses[True][0] - 1.0, losses[True]
  np.testing.assert_allclose(losses[True], losses[False], rtol=1e-3)


@pytest.mark.parametrize("overrides, key", [
    ((), "optimizer.grad_clip"),
    (("--config.optimizer.grad_clip=0", "--config.zero.stage=2"), "zero.stage"),
    (("--config.optimizer.grad_clip=0", "--config.train.microbatches=2"),
     "train.microbatches"),
    (("--config.optimizer.grad_clip=0", "--config.mesh.data=8"), "mesh.fsdp"),
])
def test_what_release_cannot_do_exits_2_naming_the_keys(tmp_path, overrides, key):
  result = run_train(*MLP, "--config.optimizer.release=True", *overrides,
                     f"--config.workdir={tmp_path}", timeout=120)
  assert result.returncode == exits.BAD_INPUT, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert lines[0].startswith("error: ") and key in lines[0], lines
  assert "optimizer.release" in result.stderr and "Traceback" not in result.stderr
