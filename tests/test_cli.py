"""Command-line and input mistakes end as one `error:` line and exit status 2.

train.py and the `python -m zerojax.config` / `zerojax.memory` CLIs: mistakes on the
command line (before JAX starts a backend too), a config that is not a Python file, a
data path that is a directory, a token file changed under a running job, a CPU step
larger than the host's memory. Real processes where the process is the point (the
script as a user runs it, a job whose data changes under it, the host's memory); the
other mistakes and `--help` call each CLI's `main` in this process
(`test_train.run_main`), whose output and exit status are the process's less the JAX
start.
"""

import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import zerojax.config
import zerojax.train
from zerojax.memory import report as memory_report
from zerojax.run import launch
from zerojax.runtime import exits
from zerojax.runtime.device_env import fake_devices_env
from zerojax.runtime.devices import fake_cpu_devices

from test_train import run_main as here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train.py")
TINY = os.path.join(REPO, "configs", "tiny.py")


def run(*args: str, devices: int = 8, timeout: float = 120) -> subprocess.CompletedProcess:
  """`python *args` on `devices` CPU devices (0: XLA's default of one)."""
  env = dict(fake_devices_env(devices), PYTHONPATH=REPO)
  return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


def assert_one_error(result: subprocess.CompletedProcess, *words: str) -> str:
  """Exit 2, the first stderr line is the only `error:` line, no traceback; returns stderr."""
  err = result.stderr
  assert result.returncode == exits.BAD_INPUT, (result.returncode, err[-3000:])
  assert err.startswith("error: ") and "Traceback" not in err and "usage:" not in err, err[-3000:]
  assert sum(line.startswith("error:") for line in err.splitlines()) == 1, err
  for word in words:
    assert word in err, (word, err)
  return err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("cli")
  (tmp / "a_file").write_text("not a directory")
  (tmp / "ds_config.json").write_text(json.dumps({
      "train_batch_size": 32, "gradient_clipping": 1.0, "wall_clock_breakdown": False,
      "fp16": {"enabled": True, "initial_scale_power": 32}, "zero_optimization": {"stage": 3}}))
  (tmp / "base.yml").write_text("train:\n  steps: 10\n")
  return tmp


# (train.py arguments, with {tmp} for the fixture's folder; words the error must hold).
MISTAKES = [
    (["--fake_devices", "abc"], ["--fake_devices", "'abc'"]),
    (["--fake_devices"], ["--fake_devices", "expected one argument"]),
    (["--fake_devices=-8"], ["--fake_devices", "-8"]),
    (["--workdir", "{tmp}/a_file"], ["workdir", "a_file is a file, not a directory"]),
    (["--workdir", "{tmp}/a_file/run"], ["a_file is a file", "would be inside it"]),
    (["--config", "{tmp}/ds_config.json"],
     ["not a Python file", "get_config()", "train_batch_size = 32: use train.global_batch_size",
      "fp16.initial_scale_power = 32: use precision.loss_scale.initial_power",
      "zero_optimization.stage = 3: use zero.stage",
      "gradient_clipping = 1.0: use optimizer.grad_clip",
      "no zerojax setting: wall_clock_breakdown"]),
    (["--config", "{tmp}/base.yml"], ["base.yml is not a Python file", "get_config()"]),
    (["configs/tiny.py"], ["'configs/tiny.py' is not an option", "write --config configs/tiny.py"]),
    (["--confg", "configs/tiny.py"], ["unknown option --confg", "did you mean --config?"]),
    (["--cofig.zero.stage=2"], ["did you mean --config.zero.stage=2?"]),
]


@pytest.mark.parametrize("args, words", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_train_command_line_mistake_is_one_error_line(files, args, words):
  args = [a.format(tmp=files) for a in args]
  if args == MISTAKES[0][0]:  # One as a user meets it: the script, a new process.
    result = run(TRAIN, *args, "--dry_run", timeout=60)
  else:
    result = here(zerojax.train.main, *args, "--dry_run")
  assert_one_error(result, *words)
  assert result.stdout == ""  # Nothing ran: not even the config was printed.


def test_config_and_memory_clis_treat_mistakes_alike(files):
  assert_one_error(here(zerojax.config.main, "--confg", TINY), "did you mean --config?")
  assert_one_error(here(zerojax.config.main, "--config", str(files / "ds_config.json")),
                   "use train.global_batch_size")
  assert_one_error(here(memory_report.main, "--config", TINY, "--devices", "8", "tiny.py"),
                   "write --config tiny.py")
  assert_one_error(here(memory_report.main, "--config", TINY, "--devices", "eight"),
                   "--devices", "'eight'")


def test_data_error_is_printed_before_the_config(tmp_path):
  # A directory given as the data path is called a directory, and the error is the first
  # (and only) thing printed: the config is printed once config and data are good.
  result = here(zerojax.train.main, "--config", TINY, "--config.data.name=tokens",
                f"--config.data.path={tmp_path}")
  assert_one_error(result, str(tmp_path), "is a directory, not a file")
  assert result.stdout == ""


def test_token_file_changed_while_training_exits_2(tmp_path):
  path = tmp_path / "tokens.bin"
  np.random.default_rng(0).integers(0, 256, 1 << 18, dtype=np.uint16).tofile(path)
  env = fake_devices_env(8)
  proc = subprocess.Popen(
      [sys.executable, TRAIN, "--config", TINY, "--config.data.name=tokens",
       f"--config.data.path={path}",
       "--config.train.steps=100000", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.train.eval_batches=1"],
      cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    for line in proc.stdout:  # Training is under way once step 2 is reported.
      if line.startswith("step      2/"):
        break
    else:
      pytest.fail(proc.stderr.read()[-3000:])
    # Each progress line comes just before the next batch is read; the step after it then
    # runs for most of a second. Truncated in place mid-step, the next batch read from the
    # memory map would be a SIGBUS (exit -7, no message) without the check before it.
    time.sleep(0.2)
    with open(path, "r+b") as f:
      f.truncate(4096)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
  assert_one_error(result,
                   f"{path} (data.path): changed while training (size {2 << 18} -> 4096 bytes)")
  assert "done:" not in out


@pytest.mark.slow
def test_cpu_step_larger_than_host_memory_is_refused_before_allocating():
  # configs/8b_bf16.py on one CPU device: ~122 GiB compiled per device (measured). A
  # --dry_run allocates nothing and is not checked (test_train's 70B dry run).
  if memory_report.host_memory_available() > 160 * 2**30:
    pytest.skip("this host has the memory to run 8B on its CPU: nothing to refuse")
  result = run(TRAIN, "--config", os.path.join(REPO, "configs", "8b_bf16.py"), devices=0,
               timeout=300)
  err = assert_one_error(result, "GiB of host memory", "available", "the memory plan above")
  needs, has = re.search(r"the step needs ([\d.]+) GiB of host memory .* ([\d.]+) GiB available",
                         err).groups()
  assert 100 < float(needs) < 140 and float(has) < float(needs), err
  assert "verdict: does NOT fit" in result.stdout and "changes that make it fit" in result.stdout


@pytest.mark.parametrize("main", [zerojax.train.main, zerojax.config.main, memory_report.main,
                                  launch.main], ids=["train", "config", "memory", "launch"])
def test_help_prints_usage_and_exits_0(main):
  result = here(main, "--help")  # Installed scripts as processes: test_config's install test.
  assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr[-2000:]
  if main is not launch.main:  # The launcher takes no config; the others say how.
    assert "--config PATH" in result.stdout and "--config.KEY VALUE" in result.stdout


def test_fake_devices_asked_again_once_jax_runs_are_kept_or_refused():
  """This process runs JAX on 8 fake CPU devices (conftest, without the memory flags):
  asking for them again returns quietly and writes nothing (one process may run several
  `zerojax.memory` or train.py mains); other devices, or flags the running backend lacks
  (train.py's memory flags), are refused, naming what runs."""
  assert jax.device_count() == 8  # A backend runs.
  flags = os.environ["XLA_FLAGS"]
  fake_cpu_devices(8, memory_flags=False)
  assert os.environ["XLA_FLAGS"] == flags
  with pytest.raises(RuntimeError, match="JAX already runs 8 cpu device"):
    fake_cpu_devices(4, memory_flags=False)
  with pytest.raises(RuntimeError, match="without the XLA flags .*xla_cpu_scheduler_type"):
    fake_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == flags
