"""The metrics writers (zerojax.run.metrics): W&B offline across a resume, and its config error.

TensorBoard through train.py, stopped and resumed:
tests/test_train.py::test_stop_and_resume_is_exact.
"""

import importlib.util
import os
import sys

import pytest

from zerojax import config as zc
from zerojax.config import ConfigError, base_config, validate
from zerojax.run import metrics
from zerojax.runtime import exits
from zerojax.testing import run_logs


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason='the wandb extra is not installed (pip install -e ".[wandb]")')
def test_wandb_offline_resume_appends_to_the_same_run(tmp_path):
  """Two runs in one workdir (as before and after a stop): one W&B run id, each step once;
  the second ends by an error, and W&B records its exit code as 1 (a failed run)."""
  config = base_config()
  config.logging.tensorboard = False
  config.logging.wandb.project, config.logging.wandb.mode = "zerojax-test", "offline"
  for start, stop in ((0, 3), (3, 5)):
    report = metrics.Reporter(str(tmp_path))
    report.open_writers(config, start)
    for step in range(start + 1, stop + 1):
      report(step=step, loss=10.0 - step, learning_rate=0.1 * step, tokens=4.0)
    report(step=stop, eval_loss=float(stop))
    report.close(failed=start > 0)
  # W&B's service process writes the run files after finish() returns; at the exit of
  # train.py it is waited for, here in pytest's process it is stopped by hand.
  import wandb
  wandb.teardown()
  run_id = (tmp_path / "wandb_run_id").read_text().strip()
  assert len(os.listdir(tmp_path / "wandb")) >= 2  # An offline run directory per start.
  rows = run_logs.wandb_history(str(tmp_path / "wandb"))
  assert {r for r, _, _ in rows} == {run_id}
  assert run_logs.wandb_exit_codes(str(tmp_path / "wandb")) == [(run_id, 0), (run_id, 1)]
  history = {}
  for _, step, values in rows:
    for tag, value in values.items():
      history.setdefault(tag, []).append((step, value))
  assert history == {
      "train/loss": [(s, 10.0 - s) for s in range(1, 6)],
      "train/learning_rate": [(s, pytest.approx(0.1 * s)) for s in range(1, 6)],
      "eval/loss": [(3, 3.0), (5, 5.0)]}  # `tokens` is not one of metrics.SCALARS.


def test_wandb_without_the_extra_is_a_config_error_naming_the_install(monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "wandb", None)  # Its import fails, as if not installed.
  tiny = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "tiny.py")
  with pytest.raises(SystemExit) as stop:  # train.py's way out too (exit_on_config_error).
    zc.main(["--config", tiny, "--config.logging.wandb.project=p"])
  assert stop.value.code == exits.BAD_INPUT
  error = capsys.readouterr().err
  assert error.startswith("error: config key logging.wandb.project") and "[wandb]" in error
  config = base_config()
  config.logging.wandb.project = "p"
  with pytest.raises(ConfigError, match=r'pip install -e "\.\[wandb\]"') as e:
    validate(config, source="test")
  assert e.value.key == "logging.wandb.project"
  config.logging.wandb.project, config.logging.wandb.entity = "", "team"
  with pytest.raises(ConfigError, match="logging.wandb.project is empty") as e:
    validate(config, source="test")
  assert e.value.key == "logging.wandb.entity"


def test_tensorboard_resume_after_a_kill_drops_the_orphaned_steps(tmp_path):
  """A run killed at step 5 after its checkpoint at 3: the resumed run's event file
  starts at 4, and TensorBoard shows steps 4 and 5 from it only."""
  config = base_config()
  for start, stop, loss in ((0, 5, 1.0), (3, 6, 2.0)):
    writer = metrics.tensorboard(str(tmp_path), config, start)
    for step in range(start + 1, stop + 1):
      writer.scalars(step, {"train/loss": loss})
    writer.close(False)
  written = run_logs.tensorboard_scalars(str(tmp_path), purge=False)["train/loss"]
  assert [s for s, _ in written] == [1, 2, 3, 4, 5, 4, 5, 6]  # Both files hold 4 and 5.
  shown = run_logs.tensorboard_scalars(str(tmp_path))["train/loss"]
  assert shown == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]
