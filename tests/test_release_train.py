"""`optimizer.release` through train.py: it trains as the normal step does, and what it
cannot do exits 2 naming the keys."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import zerojax.train
from zerojax import build
from zerojax.config import load_config
from zerojax.runtime import exits
from zerojax.runtime.device_env import fake_devices_env

from test_train import REPO, SMALL, TINY, TRAIN, train_here

BASE = os.path.join(REPO, "configs", "base.py")
MLP = ("--config", BASE, "--config.model.name=mlp_lm", "--config.optimizer.warmup_steps=1",
       "--config.train.seq_len=32", "--config.train.eval_every=0",
       "--config.train.log_every=1")
# The quick start's Llama (remat 'dots'; release saves only each layer's input) at 2
# layers of width 32: release against the normal step does not depend on the width. A
# larger learning rate than the quick start's so that 8 steps move the loss by a nat.
LLAMA = ("--config", TINY, "--config.model.n_layers=2", *SMALL[1:],
         "--config.optimizer.learning_rate=1e-2",
         "--config.optimizer.warmup_steps=1", "--config.zero.stage=3",
         "--config.train.eval_every=0", "--config.train.log_every=1")


def test_release_trains_like_the_normal_step(tmp_path):
  """The quick start's Llama at 2 layers, bf16 params, Kahan AdamW with bf16 moments (the
  defaults), 8 steps at stage 3: the same losses as without release, within bf16 noise,
  and no skipped layer. In this process (`train_here`): the runs' numbers are the point,
  not the process. One model: train.py builds the release step the same way for each
  (the mlp_lm case ran until 2026-12-05); release = the normal step for each model is
  test_release.py's, and the mlp_lm's release run learning through train.py is
  test_release_resumes_with_the_carried_norm's."""
  losses = {}
  for release in (False, True):
    workdir = tmp_path / str(release)
    result = train_here(*LLAMA, "--config.train.steps=8", "--config.optimizer.grad_clip=0",
                        f"--config.optimizer.release={release}", f"--config.workdir={workdir}")
    assert result.returncode == exits.DONE, result.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    losses[release] = np.array([r["loss"] for r in steps])
    assert all(r.get("skipped_layers", 0) == 0 for r in steps)
  assert "skipped_layers" in steps[-1]
  assert losses[True][-1] < losses[True][0] - 1.0, losses[True]
  np.testing.assert_allclose(losses[True], losses[False], rtol=1e-3)


def test_release_resumes_with_the_carried_norm(tmp_path):
  """Clipping by the previous norm (kept in the optimizer state) and optimizer
  accumulation: resumed from the straight run's save of step 3 (copied to a new workdir,
  as a crash leaves it), a run gives the losses of the run that never stopped, bit for
  bit (the norm came back with the state: a lost norm would leave step 4 unclipped).
  Until 2026-12-05 the resume was from a stop's own save (--stop_after 3, a third run):
  the same `save`; a stop's save and exit are test_train's SFT stop/resume's. The run
  that never stopped is also the proof that release with optimizer accumulation and
  previous-norm clipping learns through train.py (loss down by 1 nat in 6 steps, nothing
  skipped). Until 2026-12-05 a test of its own ran that at 4 microbatches and 8 steps
  (test_release_with_optimizer_accumulation_and_clipping_trains, 10 s of CPU): the
  microbatches are one `lax.scan` whatever their count, and here at 4 and 8 steps this
  test took 20 s of CPU, not 12. In this process: the resume reads the norm from disk
  into a new build."""
  args = (*MLP, "--config.train.steps=6", "--config.optimizer.release=True",
          "--config.train.microbatches=2", "--config.optimizer.release_accumulation=optimizer",
          "--config.optimizer.release_clipping=previous_norm", "--config.optimizer.grad_clip=0.1",
          "--config.checkpoint.async_save=False", "--config.checkpoint.every_steps=3")
  whole = train_here(*args, f"--config.workdir={tmp_path / 'whole'}")
  assert whole.returncode == exits.DONE, whole.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text()
             .splitlines()]
  steps = [r for r in records if "loss" in r]
  assert len(steps) == 6 and not any(r["skipped"] for r in steps)
  assert steps[-1]["loss"] < steps[0]["loss"] - 1.0, [r["loss"] for r in steps]
  assert max(r["grad_norm"] for r in steps) > 0.1  # The clipping bites.
  shutil.copytree(tmp_path / "whole" / "checkpoints" / "3",
                  tmp_path / "parts" / "checkpoints" / "3")
  resumed = train_here(*args, f"--config.workdir={tmp_path / 'parts'}")
  assert resumed.returncode == exits.DONE, resumed.stderr[-3000:]
  assert f"resumed from {tmp_path / 'parts'}/checkpoints/3" in resumed.stdout
  losses = {}
  for run in ("whole", "parts"):
    records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text()
               .splitlines()]
    losses[run] = {r["step"]: r["loss"] for r in records if "loss" in r}
  assert sorted(losses["parts"]) == [4, 5, 6]
  assert [losses["parts"][s] for s in range(4, 7)] == [losses["whole"][s] for s in range(4, 7)]


def test_release_stops_with_status_3_when_gradients_stay_non_finite(tmp_path):
  """A learning rate of 1e30 overflows the params at step 1, so every later gradient is
  NaN: layers (and the rest) are skipped, each step counts, and the third in a row
  stops the run with exit 3 and one error line. In this process."""
  result = train_here(*MLP, "--config.optimizer.release=True", "--config.optimizer.grad_clip=0",
                     "--config.optimizer.learning_rate=1e30", "--config.optimizer.warmup_steps=0",
                     "--config.precision.max_consecutive_skips=3", "--config.train.steps=20",
                     f"--config.workdir={tmp_path}")
  assert result.returncode == exits.NON_FINITE, (result.returncode, result.stderr[-3000:])
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "3 consecutive steps" in errors[0], result.stderr[-3000:]
  assert "optimizer.release_clipping=" in errors[0]  # Clipping advice that release takes.
  assert "Traceback" not in result.stderr
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  skipped = [r for r in records if r.get("skipped") and "skipped_layers" in r]
  assert skipped and all(r["skipped_layers"] > 0 for r in skipped), records


def test_release_on_2_processes_matches_1_process(tmp_path):
  """fp32, optimizer accumulation over 2 microbatches, clipping by the previous norm:
  `zerojax.run.launch` 2 processes x 4 CPU devices (gloo collectives between them) give the
  losses of 1 process x 8 devices (this one: `train.main`), step by step, within fp32
  reduction-order noise."""
  args = (*MLP, "--config.train.steps=6", "--config.optimizer.release=True",
          "--config.train.microbatches=2", "--config.optimizer.release_accumulation=optimizer",
          "--config.optimizer.release_clipping=previous_norm", "--config.optimizer.grad_clip=0.5",
          "--config.optimizer.schedule=constant", "--config.precision.param_dtype=float32",
          "--config.precision.compute_dtype=float32", "--config.optimizer.state_dtype=float32",
          "--config.optimizer.update_rule=nearest")
  one = train_here(*args, f"--config.workdir={tmp_path / 'one'}")
  assert one.returncode == exits.DONE, one.stderr[-3000:]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROJAX_", "JAX_COORD"))}
  two = subprocess.run(
      [sys.executable, "-m", "zerojax.run.launch", "--nproc", "2", "--devices_per_process", "4",
       "--", sys.executable, TRAIN, *args, f"--config.workdir={tmp_path / 'two'}"],
      cwd=REPO, env=fake_devices_env(1, base=env), capture_output=True, text=True,
      timeout=300)
  assert two.returncode == exits.DONE, two.stderr[-3000:]
  losses = {}
  for run, processes in (("one", 1), ("two", 2)):
    records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text()
               .splitlines()]
    assert records[0]["processes"] == processes and records[0]["devices"] == 8
    losses[run] = [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]
  assert [s for s, *_ in losses["two"]] == list(range(1, 7))
  np.testing.assert_allclose(np.array(losses["two"]), np.array(losses["one"]), rtol=1e-5)


@pytest.mark.parametrize("overrides, key, also", [
    ((), "optimizer.grad_clip", "optimizer.release_clipping"),
    (("--config.optimizer.grad_clip=0", "--config.zero.stage=2"), "zero.stage", ""),
    (("--config.optimizer.grad_clip=0", "--config.train.microbatches=2"),
     "train.microbatches", "optimizer.release_accumulation"),
    (("--config.optimizer.grad_clip=0", "--config.precision.param_dtype=float16",
      "--config.precision.compute_dtype=float16"), "precision.param_dtype",
     "precision.loss_scale"),
    (("--config.optimizer.release_clipping=per_layer", "--config.optimizer.grad_clip=0"),
     "optimizer.release_clipping", "optimizer.grad_clip"),
    (("--config.optimizer.grad_clip=0", "--config.optimizer.name=sgd",
      "--config.optimizer.release_accumulation=optimizer"), "optimizer.release_accumulation",
     "optimizer.name"),
    (("--config.optimizer.release=False", "--config.optimizer.release_accumulation=optimizer"),
     "optimizer.release_accumulation", ""),
])
def test_what_release_cannot_do_exits_2_and_each_fix_it_prints_starts(
    tmp_path, capsys, overrides, key, also):
  """train.py (in this process: `zerojax.train.main`) exits 2 with one `error:` line
  naming the keys, no traceback; then each alternative of its `fix:` line, applied as
  overrides, gives a config that loads and builds (the mesh, the model, the plan, the
  jitted step: where a refusal would be raised), and the first case's first alternative
  a run that starts (a dry run: the step compiles, as any built step does). A fix that
  is not overrides (`use x > 0`) fails here."""
  args = (*MLP, "--config.optimizer.release=True", *overrides)
  with pytest.raises(SystemExit) as exit_:
    zerojax.train.main([*args, f"--config.workdir={tmp_path}"])
  assert exit_.value.code == exits.BAD_INPUT
  errors = capsys.readouterr().err.strip().splitlines()
  assert errors[0].startswith("error: ") and key in errors[0], errors
  assert also in "\n".join(errors), errors
  assert "optimizer.release" in "\n".join(errors) and "Traceback" not in "\n".join(errors)
  (fix,) = [line.strip() for line in errors if line.strip().startswith("fix: set ")]
  alternatives = fix.removeprefix("fix: set ").split(", or ")
  assert alternatives, fix
  for alternative in alternatives:
    assignments = re.sub(r" \(.*\)$", "", alternative).split(" and ")
    assert all(re.fullmatch(r"[a-z_]+(\.[a-z_]+)+=\S+", a) for a in assignments), fix
    fixed = [*args, *(f"--config.{a}" for a in assignments)]
    if key == "optimizer.grad_clip" and alternative == alternatives[0]:
      code = zerojax.train.main([*fixed, "--dry_run"])
      assert code == exits.DONE, (alternative, capsys.readouterr().err[-2000:])
    else:
      config = load_config(BASE, [a for a in fixed if a.startswith("--config.")],
                           num_devices=jax.device_count())
      assert build.build(config).train_step is not None, alternative


SFT_TINY = os.path.join(REPO, "configs", "sft_tiny.py")


def test_release_fine_tunes_packed_rows_through_train_py(tmp_path):
  """configs/sft_tiny.py (completion loss on generated tasks) with gradient release at
  stage 3, per-layer clipping, through train.py (`zerojax.train.main`, this process's 8
  devices): 12 steps, nothing skipped, the loss falls by a third. Packed rows hold
  about 8 examples each. Two layers of width 32 (test_train.SMALL) at learning rate 2e-2:
  the last loss is 0.58 of the first (0.665 at 1e-2, too near the bound; the config's 4
  layers of width 128 at 3e-3: 0.59 and 0.64; 2 of width 128: 0.59 and 0.63, in twice
  this CPU, 11.4 against 5.8 s): release's layer loop still carries from one layer to
  the next. Padded rows (`data.pack=False`, a case until 2026-12-05)
  are the same batch (tokens, loss mask, segment ids, positions; one segment a row, the
  rest padding as at a packed row's end) through the same compiled step; release
  trains them in the stage-3 sweep."""
  code = zerojax.train.main([
      "--config", SFT_TINY, "--config.model.n_layers=2", *SMALL[1:], "--config.zero.stage=3",
      "--config.optimizer.release=True",
      "--config.optimizer.release_clipping=per_layer", "--config.data.pack=True",
      "--config.train.steps=12", "--config.optimizer.warmup_steps=3",
      "--config.optimizer.learning_rate=2e-2",
      "--config.train.eval_every=0", "--config.train.eval_exact_match=0",
      "--config.train.log_every=1", f"--config.workdir={tmp_path}"])
  assert code == exits.DONE
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in records if "loss" in r]
  assert len(steps) == 12 and not any(r["skipped"] for r in steps)
  assert steps[-1]["loss"] < 0.67 * steps[0]["loss"], [r["loss"] for r in steps]
