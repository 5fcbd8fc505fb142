"""Faults of a run's lifecycle, through train.py on real files.

A checkpoint past train.steps, a rejected resume, damaged checkpoints, a full disk (a
real tmpfs), two runs in one workdir, stopping early (exit 75), the launcher's view of
it, and kill -9 at many moments. Most tests start from one 8-step run's workdir
(checkpoints 4 and 8), copied; all share the suite's JAX compilation cache (conftest).

Real processes where the process is what is tested: a kill -9, a signal, a lock held by
another process, a whole stderr (damaged checkpoints, a full disk, a refused second run:
one line, nothing printed as the interpreter exits) and the launcher. The rest (the 8-step
workdir, the kill -9 loop's uninterrupted run and its last resume, a checkpoint past
train.steps, a rejected resume, --stop_after) are `train.main` calls in this process
(`test_train.train_here`): the same flags and compilation cache as a child, each resume
reading its state from disk into a new build, and no JAX start.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from zerojax.runtime import exits

from test_train import (
  REPO,
  STALLED_TRAIN,
  TINY,
  TRAIN,
  checkpoint_files,
  checkpoint_leaves,
  run_train,
  start_train,
  step_records,
  train_env,
  train_here,
)

# A constant learning rate: the step does not depend on train.steps, so every run here
# reuses the programs the first one compiled. One layer of width 32: the shape is not
# what these tests are about (the leaves are the quick start's, one layer deep).
COMMON = ("--config", TINY, "--config.model.n_layers=1", "--config.model.d_model=32",
          "--config.model.d_ff=96", "--config.model.n_heads=2", "--config.model.n_kv_heads=1",
          "--config.optimizer.warmup_steps=1",
          "--config.optimizer.schedule=constant", "--config.train.log_every=1",
          "--config.train.eval_every=0", "--config.train.eval_batches=1",
          "--config.checkpoint.every_steps=4")
LEAKS = ("Traceback", "Exception ignored", "Event loop is closed")


@pytest.fixture(scope="module")
def env():
  return train_env()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, env):
  """A workdir after 8 steps: checkpoints 4 and 8, config.json, metrics.jsonl."""
  workdir = tmp_path_factory.mktemp("trained")
  result = train_here(*COMMON, "--config.train.steps=8", f"--workdir={workdir}")
  assert result.returncode == exits.DONE, result.stderr[-3000:]
  assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["4", "8"]
  return workdir


def copy(trained, tmp_path):
  shutil.copytree(trained, tmp_path / "w")
  return tmp_path / "w"


def one_error_line(stderr: str) -> str:
  """The error line of a failed run, asserting it is all of stderr."""
  assert not [leak for leak in LEAKS if leak in stderr], stderr[-3000:]
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
  return lines[0]


def test_a_checkpoint_past_train_steps_is_left_alone(trained, tmp_path):
  w = copy(trained, tmp_path)
  before = checkpoint_files(w)
  result = train_here(*COMMON, "--config.train.steps=6", f"--workdir={w}")
  assert result.returncode == exits.DONE, result.stderr[-3000:]
  assert (f"done: checkpoint {w}/checkpoints/8 is past train.steps=6: nothing to train or "
          "save") in result.stdout
  after = checkpoint_files(w)
  del before["metrics.jsonl"], after["metrics.jsonl"]  # The run's own lines.
  assert after == before  # No checkpoint 6 holding step 8, none rotated away, same config.json.


def test_a_rejected_resume_keeps_config_json(trained, tmp_path):
  w = copy(trained, tmp_path)
  saved = (w / "config.json").read_text()
  result = train_here(*COMMON, "--config.train.steps=8", "--config.model.d_model=64",
                      f"--workdir={w}")
  assert result.returncode == exits.BAD_INPUT
  assert "d_model" in result.stderr and "Traceback" not in result.stderr
  assert (w / "config.json").read_text() == saved


DAMAGE = {"truncated": "is truncated (",  # file state/d/... is truncated (N bytes ...)
          "no_manifest": "its file state/manifest.ocdbt is missing",
          "no_metadata": "its file state/_METADATA is missing"}


@pytest.mark.parametrize("damaged", [{"8": "truncated"}, {"8": "no_manifest", "4": "no_metadata"}],
                         ids=["8-truncated", "all-no_manifest-no_metadata"])
def test_damaged_checkpoints_are_one_line_each(trained, tmp_path, env, damaged):
  """No TensorStore spec dump, no asyncio leftovers after the error was handled. Each
  kind of damage once, in one of two runs: checkpoint 8 damaged (4 restores: done), and
  both damaged, each its own way (nothing intact: one error line)."""
  w = copy(trained, tmp_path)
  for step, damage in damaged.items():
    state = w / "checkpoints" / step / "state"
    if damage == "truncated":
      for d, _, files in os.walk(state):
        for f in files if os.path.basename(d) == "d" else ():
          os.truncate(os.path.join(d, f), os.path.getsize(os.path.join(d, f)) // 2)
    else:
      os.remove(state / {"no_manifest": "manifest.ocdbt", "no_metadata": "_METADATA"}[damage])
  # train.steps=4: once checkpoint 4 is restored there is nothing to train.
  result = run_train(*COMMON, "--config.train.steps=4", f"--workdir={w}", env=env)
  skipped = [l for l in result.stdout.splitlines() if "skipped, damaged" in l]
  assert len(skipped) == len(damaged) and all(
      any(f"checkpoint step {step} skipped" in l and DAMAGE[damage] in l for l in skipped)
      for step, damage in damaged.items()), result.stdout[-3000:]
  assert "tensorstore_spec" not in result.stdout
  if "4" in damaged:  # Both: nothing intact.
    assert result.returncode == exits.BAD_INPUT
    assert "are all damaged" in one_error_line(result.stderr)
  else:
    assert result.returncode == exits.DONE, result.stderr[-3000:]
    assert "done: already at step 4 of 4" in result.stdout
    assert not [leak for leak in LEAKS if leak in result.stderr], result.stderr[-3000:]


def test_a_full_disk_stops_the_run_at_the_next_step(trained, tmp_path, env):
  """A real tmpfs with room for one checkpoint: the save of step 20 fails, and the run
  stops at a step before the next save would have waited on it (step 40). The 19 steps
  between are the margin: orbax's write fails in a background thread, and on a loaded
  machine it failed after 5 tiny steps had run (the save 6 steps later then said so)."""
  if os.geteuid() != 0:
    pytest.skip("mounting a small tmpfs (the full disk) needs root")
  disk = tmp_path / "disk"
  disk.mkdir()
  size = sum(len(b) for b in checkpoint_files(trained / "checkpoints" / "4").values())
  mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs",
                          str(disk)], capture_output=True, text=True)
  if mount.returncode:
    pytest.skip(f"cannot mount a tmpfs: {mount.stderr.strip()}")
  try:
    w = disk / "w"
    shutil.copytree(trained / "checkpoints" / "4", w / "checkpoints" / "4")
    result = run_train(*COMMON, "--config.train.steps=40", "--config.checkpoint.every_steps=20",
                       f"--workdir={w}", env=env)
    assert result.returncode == exits.SAVE_FAILED, result.stderr[-3000:]
    assert one_error_line(result.stderr) == (
        f"error: checkpoint {w}/checkpoints/20 could not be written: No space left on device; "
        f"the last good checkpoint is {w}/checkpoints/4")
    # Reported at a step after it, not at the next save (step 40), and nothing was lost.
    assert 21 <= [r["step"] for r in step_records(w)][-1] < 40
    assert sorted(os.listdir(w / "checkpoints")) == ["20.orbax-checkpoint-tmp", "4"]
  finally:
    subprocess.run(["umount", str(disk)], check=True)


def test_a_second_run_in_a_workdir_is_refused_and_sigterm_exits_75(trained, tmp_path, env):
  w = copy(trained, tmp_path)
  first = start_train(*COMMON, "--config.train.steps=1000", f"--workdir={w}", env=env)
  try:
    for line in first.stdout:  # Training: the lock is taken.
      if "step      9/1000" in line:
        break
    owner = json.loads((w / "lock").read_text())
    assert (owner["pid"], owner["host"]) == (first.pid, socket.gethostname())
    second = run_train(*COMMON, "--config.train.steps=1000", f"--workdir={w}", env=env)
    assert second.returncode == exits.BAD_INPUT
    assert one_error_line(second.stderr) == (
        f"error: workdir {w} is in use by pid {first.pid} on host {socket.gethostname()} since "
        f"{owner['since']} (a run of train.py); wait for it or use another --workdir")
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
  finally:
    first.kill()
  assert first.returncode == exits.STOPPED, err[-3000:]
  step = re.search(r"stopped by signal SIGTERM after step (\d+): saved", out)[1]
  assert step in os.listdir(w / "checkpoints") and not (w / "lock").exists()


def test_a_lock_whose_holder_died_is_taken_over(tmp_path):
  """The OS releases a flock when its process dies, kill -9 included."""
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from zerojax.run import workdir\n"
       "with workdir.lock(sys.argv[1]):\n  print('held', flush=True); time.sleep(600)",
       str(tmp_path)], cwd=REPO, env=train_env(), stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    from zerojax.run import workdir
    with pytest.raises(workdir.WorkdirInUse, match=f"in use by pid {holder.pid} on host"):
      with workdir.lock(str(tmp_path)):
        pass
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
  finally:
    holder.kill()
  notes = []
  with workdir.lock(str(tmp_path), log=notes.append):
    assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
  assert len(notes) == 1 and f"from pid {holder.pid} on host" in notes[0]
  assert "that run has ended" in notes[0] and not (tmp_path / "lock").exists()


def test_stop_after_exits_75_and_stopping_at_the_last_step_is_done(trained, tmp_path):
  w = copy(trained, tmp_path)
  stopped = train_here(*COMMON, "--config.train.steps=10", "--stop_after=9", f"--workdir={w}")
  assert stopped.returncode == exits.STOPPED, stopped.stderr[-3000:]
  assert "stopped by --stop_after after step 9: saved" in stopped.stdout
  done = train_here(*COMMON, "--config.train.steps=10", "--stop_after=10", f"--workdir={w}")
  assert done.returncode == exits.DONE, done.stderr[-3000:]
  assert "done: 10 steps" in done.stdout and "stopped" not in done.stdout
  assert sorted(os.listdir(w / "checkpoints"), key=int) == ["8", "9", "10"]


def test_launcher_passes_75_through_without_killing_the_others():
  """Children that stop early (75) at different times: none is killed, the launcher says
  75; one that fails is still a failure."""
  script = ("import os, sys, time\n"
            "rank = int(os.environ['ZEROJAX_PROCESS_ID'])\n"
            "time.sleep(0.5 + 2 * rank)\n"  # Rank 0 ends first: the others must not die.
            "print('saved', flush=True)\n"
            "sys.exit(int(sys.argv[1].split(',')[rank]))\n")
  launch = lambda codes: subprocess.run(
      [sys.executable, "-m", "zerojax.run.launch", "--nproc", "3", "--grace", "1", "--",
       sys.executable, "-c", script, codes], cwd=REPO, capture_output=True, text=True,
      timeout=60)
  for codes, status in (("75,75,75", exits.STOPPED), ("75,0,75", exits.STOPPED)):
    result = launch(codes)
    assert result.returncode == status, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] saved", "[1] saved", "[2] saved"]
    assert "stopping the others" not in result.stderr
  failed = launch("75,3,0")
  assert failed.returncode == 3 and "process 1 exited with status 3" in failed.stderr
  assert "[2] saved" not in failed.stdout  # Stopped (SIGTERM) before it got there.


def test_launcher_passes_sigterm_to_every_process_and_a_second_one_kills():
  """A SIGTERM to the launcher reaches each child once; children that save and exit 75
  make the launcher exit 75, naming each status. A child that goes on after it is
  SIGKILLed by a second SIGTERM, and the launcher says so: exit 137, not 75 (saved)."""
  script = ("import os, signal, sys, time\n"
            "rank = int(os.environ['ZEROJAX_PROCESS_ID'])\n"
            "def stop(signum, frame):\n"
            "  print('got', signal.Signals(signum).name, flush=True)\n"
            "  if rank == 0 or sys.argv[1] == 'all':\n"
            "    sys.exit(75)\n"  # Saved and stopped; else it trains on.
            "signal.signal(signal.SIGTERM, stop)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")

  def launch(who: str, signals: int) -> tuple[int, list[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "zerojax.run.launch", "--nproc", "2", "--",
                             sys.executable, "-c", script, who], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines, changed = [], threading.Condition()

    def read():
      for line in proc.stdout:
        with changed:
          lines.append(line.strip())
          changed.notify_all()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
      for want in (["[0] ready", "[1] ready"], ["[0] got SIGTERM", "[1] got SIGTERM"])[:signals]:
        with changed:
          assert changed.wait_for(lambda w=want: set(w) <= set(lines), timeout=30), lines
        if want[0].endswith("SIGTERM"):  # Process 0's exit 75 is reaped before the SIGKILL.
          children = f"/proc/{proc.pid}/task/{proc.pid}/children"
          deadline = time.monotonic() + 30
          while len(open(children).read().split()) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
      proc.wait(timeout=30)
      reader.join(timeout=5)
      err = proc.stderr.read()
    finally:
      proc.kill()
    return proc.returncode, sorted(lines), err

  status, lines, err = launch("all", 1)
  assert status == exits.STOPPED, err
  assert lines == ["[0] got SIGTERM", "[0] ready", "[1] got SIGTERM", "[1] ready"]
  assert "[launch] SIGTERM: SIGTERM to every process (again: SIGKILL)" in err
  assert ("[launch] exit statuses: process 0: status 75 (STOPPED), process 1: status 75 "
          "(STOPPED)") in err
  status, lines, err = launch("rank 0", 2)
  assert status == 128 + signal.SIGKILL, err
  assert lines == ["[0] got SIGTERM", "[0] ready", "[1] got SIGTERM", "[1] ready"]
  assert "[launch] SIGTERM: SIGKILL" in err
  assert "[launch] exit statuses: process 0: status 75 (STOPPED), process 1: signal SIGKILL" in err


def kill_when(proc: subprocess.Popen, seen, timeout: float = 300) -> list[str]:
  """SIGKILLs `proc` once `seen(lines)` holds for its stdout lines so far (or at the
  timeout); returns the lines."""
  lines, done = [], threading.Event()

  def read():
    for line in proc.stdout:
      lines.append(line)
      if seen(lines):
        break
    done.set()

  threading.Thread(target=read, daemon=True).start()
  done.wait(timeout)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  return lines


def trained_steps(lines: list[str]) -> int:
  return sum(bool(re.match(r"step +\d+/\d+ ", line)) for line in lines)


def committed(checkpoints) -> list[int]:
  return sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit())


@pytest.mark.slow
def test_kill_9_at_many_moments_resumes_bit_identical(tmp_path, env):
  """Six SIGKILLs: after 1, 3 or 5 steps (with delays that land inside steps and
  saves), during start-up, and twice mid-save for certain (the save stalled inside
  orbax's writer: `test_train.STALLED_TRAIN`). Each restart resumes from the newest
  committed checkpoint (a kill mid-save: the one before the half-written one, read and
  never written, its temporary directory removed, nothing called damaged) and takes the
  dead run's lock over; every step, trained once or again after a kill, has the
  uninterrupted run's loss and gradient norm, and the final checkpoints are
  bit-identical."""
  common = (*COMMON, "--config.train.steps=16", "--config.checkpoint.every_steps=2")
  straight, w = tmp_path / "straight", tmp_path / "killed"
  result = train_here(*common, f"--workdir={straight}")  # The reference: in this process.
  assert result.returncode == exits.DONE, result.stderr[-3000:]
  ckpts, marker = w / "checkpoints", tmp_path / "stalled"
  kills = [(1, 0.0), ("stall", 0), (5, 0.3), ("start", 0), ("stall", 0), (3, 0.1)]
  newest_at_stall = None  # (path, files) of the checkpoint a kill mid-save leaves newest.
  for i, (when, delay) in enumerate(kills):
    before = committed(ckpts) if ckpts.exists() else []
    if when == "stall":  # The save after the newest checkpoint stalls mid-write.
      stall = (before[-1] if before else 0) + 2
      proc = start_train(*common, f"--workdir={w}", prefix=("-c", STALLED_TRAIN, TRAIN),
                         env=dict(env, STALL_STEP=str(stall), STALL_AFTER="8",
                                  STALL_MARKER=str(marker)))
      lines = kill_when(proc, lambda _: marker.exists())
      assert os.path.isdir(ckpts / f"{stall}.orbax-checkpoint-tmp"), lines[-5:]
      assert committed(ckpts) == before, committed(ckpts)  # The half-written one is not.
      if before:
        newest = ckpts / str(before[-1])
        newest_at_stall = (newest, checkpoint_files(newest))
      marker.unlink()
    else:
      proc = start_train(*common, f"--workdir={w}", env=env)
      seen = ((lambda ls: "resumed from" in ls[-1]) if when == "start" else
              (lambda ls, n=when: trained_steps(ls) >= n))
      lines = kill_when(proc, lambda ls, seen=seen: seen(ls) and (time.sleep(delay) or True))
    assert proc.returncode == -signal.SIGKILL, "".join(lines[-20:])
    on_disk = sorted(os.listdir(ckpts)) if ckpts.exists() else []
    print(f"kill {i + 1} ({when}, +{delay} s): {trained_steps(lines)} steps trained, "
          f"left {on_disk}")  # Where it landed (pytest -s).
    if before:  # Each start resumes from the newest committed checkpoint of the last kill.
      assert f"resumed from {ckpts}/{before[-1]}\n" in lines, lines[-20:]
    assert "damaged" not in "".join(lines), lines[-20:]  # Half-written is not damaged.
    if newest_at_stall and when != "stall":  # The run after a kill mid-save read it only.
      path, files = newest_at_stall
      assert not path.exists() or checkpoint_files(path) == files, path
      newest_at_stall = None
    if i:  # The lock of the run killed before.
      assert "note: took over" in "".join(lines), lines[:5]
  final = train_here(*common, f"--workdir={w}")  # The resume after the last kill.
  assert final.returncode == exits.DONE, final.stderr[-3000:]
  assert f"resumed from {ckpts}/" in final.stdout and "done: 16 steps" in final.stdout
  assert "note: took over" in final.stdout and "damaged" not in final.stdout + final.stderr
  # Every half-written save's temporary directory is gone (a later start removes them).
  assert not [n for n in os.listdir(ckpts) if n.endswith("-tmp")], os.listdir(ckpts)

  want = {r["step"]: (r["loss"], r["grad_norm"]) for r in step_records(straight)}
  got = [(r["step"], (r["loss"], r["grad_norm"])) for r in step_records(w)]
  assert len(got) > 16 and all(want[step] == values for step, values in got), got
  assert committed(ckpts) == committed(straight / "checkpoints") == [12, 14, 16]
  for step in ("12", "14", "16"):
    x, y = checkpoint_leaves(straight / "checkpoints" / step), checkpoint_leaves(ckpts / step)
    assert x.keys() == y.keys() and all(x[k].tobytes() == y[k].tobytes() for k in x), step
