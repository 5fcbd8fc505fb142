"""Each protection, in this process where it can be: a test that fails without it.

- `--stop_after` outside the steps the run takes (after the resumed step, up to
  train.steps) is refused, exit 2, instead of training on to the end unstopped;
- the peer watch refuses a well-formed hello whose proof is wrong (real sockets on
  localhost, process 0's `_serve` in a thread);
- the hang watchdog's default timeout (train.step_timeout=0) is computed from the first
  steps and fires on a stalled one;
- the XLA:CPU dispatch guard: two train steps alternated without blocking on 8 fake CPU
  devices abort without it (a child process), and run to the end with it.
"""

import contextlib
import os
import re
import secrets
import selectors
import socket
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax.train
from zerojax.config import ConfigError
from zerojax.run import peers, watchdog
from zerojax.runtime import dispatch, exits, platform

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


class Left(Exception):
  """`peers.leave` was called, or the test is over."""


class PeerWatch:
  """Process 0's peer watch (`peers._serve`) for a run of `n` processes, in a thread of
  this process on a real localhost socket. `peers.leave` (which would end this process)
  records its message and ends the thread instead; `stop` ends it between two polls."""

  def __init__(self, n: int, monkeypatch):
    self.left: list[tuple[str, int]] = []
    self.stopping = threading.Event()
    stopping = self.stopping

    def leave(message, status):
      self.left.append((message, status))
      raise Left  # Where the process would end, the thread does.

    class Selector(selectors.DefaultSelector):
      def select(self, timeout=None):
        if stopping.is_set():
          raise Left
        return super().select(timeout)
    monkeypatch.setattr(peers, "leave", leave)
    monkeypatch.setattr(peers, "selectors", types.SimpleNamespace(
        DefaultSelector=Selector, EVENT_READ=selectors.EVENT_READ))
    self.watch = peers._Watch(0, n, secrets.token_bytes(32), {})  # pylint: disable=protected-access
    server = socket.create_server(("127.0.0.1", 0))
    self.port = server.getsockname()[1]

    def serve():
      with server, contextlib.suppress(Left):
        peers._serve(self.watch, server)  # pylint: disable=protected-access
    self.thread = threading.Thread(target=serve, daemon=True)
    self.thread.start()

  def connect(self) -> tuple[socket.socket, bytes]:
    """A connection and the nonce of process 0's greeting."""
    s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
    greeting = b""
    while not greeting.endswith(b"\n"):
      greeting += s.recv(1)
    word, nonce = greeting.split()
    assert word == b"zerojax-peer-watch" and len(nonce) == 32
    return s, nonce

  def stop(self) -> None:
    """Ends the thread (whatever the test left behind) before `peers` is itself again."""
    self.watch.leaving = True  # A link that closes now is no news.
    self.stopping.set()
    self.thread.join(10)


@pytest.fixture
def peer_watch(monkeypatch):
  """`PeerWatch(n)`, stopped after the test."""
  made = []
  yield lambda n: made.append(PeerWatch(n, monkeypatch)) or made[-1]
  for w in made:
    w.stop()


def until(condition, what: str) -> None:
  deadline = time.monotonic() + 10
  while not condition():
    assert time.monotonic() < deadline, f"no {what} within 10 s"
    time.sleep(0.01)


def hello(secret: bytes, nonce: bytes, pid: int) -> bytes:
  return b"%d %s\n" % (pid, peers._proof(secret, nonce, pid))  # pylint: disable=protected-access


def closed_by_the_watch(s: socket.socket) -> bool:
  """True once the other side closed `s` (reading to EOF); False if it stays open 10 s."""
  with s:
    try:
      while s.recv(256):
        pass
    except TimeoutError:
      return False
    except ConnectionResetError:
      pass
  return True


def test_the_peer_watch_believes_only_a_hello_that_proves_the_secret(peer_watch, capsys):
  """Process 0 of 3 processes, every hello well formed (an id in range, 64 hex digits):
  one under another secret, one that replays a real peer's hello to another connection's
  nonce, one that proves process 1's id but announces 2. Each is closed with one line and
  taken for no process; then the real processes 1 and 2 join, 2 leaves with a goodbye (no
  news) and 1's connection closing is news: "process 1 is gone". With `hmac.compare_digest`
  always true, the first forger is taken for process 1 and its closing ends the run."""
  w = peer_watch(3)
  secret = w.watch.secret
  forged, nonce = w.connect()
  forged.sendall(hello(secrets.token_bytes(32), nonce, 1))
  assert closed_by_the_watch(forged), "a hello under another secret was taken"
  captured, nonce = w.connect()
  replayed, _ = w.connect()
  replayed.sendall(hello(secret, nonce, 1))  # Right for the other connection's nonce.
  assert closed_by_the_watch(replayed), "a replayed hello was taken"
  borrowed, nonce = w.connect()
  borrowed.sendall(hello(secret, nonce, 1).replace(b"1 ", b"2 ", 1))
  assert closed_by_the_watch(borrowed), "a hello proving another id was taken"
  captured.close()  # Its hello was never sent.

  one, nonce = w.connect()
  one.sendall(hello(secret, nonce, 1))
  two, nonce = w.connect()
  two.sendall(hello(secret, nonce, 2))
  until(lambda: set(w.watch.links) == {1, 2}, "peers 1 and 2")
  two.sendall(b"bye\n")
  two.close()
  until(lambda: set(w.watch.links) == {1}, "goodbye of 2")
  assert not w.left
  one.close()
  w.thread.join(10)
  assert w.left == [("error: process 1 is gone (its connection closed: killed or crashed)",
                     exits.PEER_LOST)]
  refused = [line.split(": ", 2)[-1] for line in capsys.readouterr().err.splitlines()
             if line.startswith("distributed: peer watch refused a connection from 127.0.0.1:")]
  assert refused == ["announced process 1 without proving the run's secret",
                     "announced process 1 without proving the run's secret",
                     "announced process 2 without proving the run's secret",
                     "closed before its hello"], refused


def test_the_watchdog_default_is_ten_medians_of_the_first_five_steps_at_least_300_s():
  assert watchdog.derived_timeout([40, 50, 30, 60, 35]) == 400  # 10 x 40.
  assert watchdog.derived_timeout([1, 2, 3, 4, 100]) == 300  # 10 x 3 < the floor.
  assert watchdog.derived_timeout([0.1, 0.2, 0.3, 0.4, 50], floor=1) == 3
  assert watchdog.derived_timeout([1, 1, 1, 1, 1, 1000]) == 300  # Only the first five.
  with pytest.raises(ValueError, match="4 step intervals: the timeout needs 5"):
    watchdog.derived_timeout([1, 2, 3, 4])
  # train.step_timeout=0: nothing watched until five steps have been timed (six marks).
  dog = watchdog.Watchdog(0)
  try:
    for step in range(1, 7):
      assert dog.timeout is None
      dog.mark(f"step {step}", step=True)
    assert dog.timeout == 300
  finally:
    dog.close()


# train.py's loop with train.step_timeout=0, steps of 0.2 s, a floor of 0.5 s (the default,
# 300 s, is too long for a test), and process 0 stuck at the start of step 7 (the hook
# the loop calls, `watchdog.test_stall`).
STALLED_LOOP = """
import time
from zerojax.run import watchdog
dog = watchdog.Watchdog(0, floor=0.5)
for step in range(1, 10):
  dog.mark(f"step {step} (data, dispatch, or waiting on the device)", step=True)
  if step == 6:  # Five intervals timed: the timeout is known.
    print("timeout", dog.timeout, *dog._steps, flush=True)
  watchdog.test_stall(0, step)
  time.sleep(0.2)
"""


def test_the_default_watchdog_timeout_fires_on_a_stalled_step():
  """Five steps set the timeout (10 x 0.2 s: about 2 s, above the floor); the stalled
  step ends the process with status 7 (HUNG) after about that long, with its phase and
  the stack of the stuck thread. Without the derived timeout nothing is watched and the
  process waits forever (here: 60 s, then a failure)."""
  proc = subprocess.Popen([sys.executable, "-c", STALLED_LOOP], cwd=REPO, text=True,
                          env=dict(os.environ, ZEROJAX_TEST_STALL="0:7"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    out, err = proc.communicate(timeout=60)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
  assert proc.returncode == exits.HUNG, (out, err[-3000:])
  (line,) = [x for x in out.splitlines() if x.startswith("timeout ")]
  timeout, *intervals = map(float, line.split()[1:])
  assert timeout == watchdog.derived_timeout(intervals, 0.5) > 1.9, (timeout, intervals)
  waited = int(re.search(r"error: process 0 made no progress for (\d+) s in step 7 ", err)[1])
  # Checked every second; a loaded machine adds a little.
  assert timeout - 0.5 <= waited <= timeout + 1 + 3, (waited, timeout)
  assert ("in step 7 (data, dispatch, or waiting on the device) (train.step_timeout: "
          f"{timeout:.0f} s); every thread's stack:") in err, err[-3000:]
  assert "in test_stall" in err
  assert err.rstrip().endswith("error: process 0 is hung (step 7 (data, dispatch, or waiting "
                               "on the device)): the run stops; the last committed checkpoint "
                               "resumes"), err[-3000:]


def test_the_dispatch_guard_bounds_the_queue_on_xla_cpu_and_is_the_jitted_function_otherwise(
    monkeypatch):
  """`dispatch.guarded`: on these 8 CPU devices each call records its smallest output; a
  function called again waits for its own calls but the last, another function for all
  of them; donated arguments and outputs deleted since are fine; a trace inside another
  function records nothing; `lower`, `trace`, `eval_shape`, `clear_cache` are the jitted
  function's; for a GPU target, or with ZEROJAX_CPU_DISPATCH_GUARD=0, it only calls."""
  mesh = jax.sharding.Mesh(jax.devices(), ("x",))
  jitted = jax.jit(lambda x: (x * 2, jnp.sum(x)), donate_argnums=0)
  step, other = dispatch.guarded(jitted), dispatch.guarded(jax.jit(lambda x: x + 1))
  assert dispatch.guarded(step) is step and step.__name__ == jitted.__name__
  x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x")))
  assert step.lower(x).as_text() == jitted.lower(x).as_text()
  assert step.trace(x).jaxpr == jitted.trace(x).jaxpr
  assert step.eval_shape(x)[0].shape == (64,)
  dispatch.wait_until()
  assert dispatch.enabled() and dispatch.SAME_IN_FLIGHT == 2
  y, first = step(x)
  assert x.is_deleted() and list(dispatch._in_flight) == [(step, [first])]  # Not y.
  z, second = step(y)  # Back to back: no wait, two in flight.
  assert y.is_deleted() and [w for _, w in dispatch._in_flight] == [[first], [second]]
  z, third = step(z)  # Waits for the first.
  assert [w for _, w in dispatch._in_flight] == [[second], [third]]
  out = other(z)  # Waits for both.
  assert [f for f, _ in dispatch._in_flight] == [other] and third.is_ready()
  assert float(out[1]) == 9.0
  (_, (witness,)), = dispatch._in_flight
  witness.delete()  # As if donated to a function that is not guarded: skipped.
  dispatch.wait_until()
  assert not dispatch._in_flight
  jax.jit(lambda v: step(v)[0] + 1)(z)  # Traced inside another jit: tracers, not recorded.
  assert not dispatch._in_flight
  step.clear_cache()
  with platform.targeting("gpu"):
    assert not dispatch.enabled()
  monkeypatch.setenv(dispatch.ENV, "0")
  assert not dispatch.enabled()
  step(jax.device_put(jnp.ones(8), NamedSharding(mesh, P("x"))))
  assert not dispatch._in_flight


def test_two_train_steps_alternated_without_blocking_do_not_abort_on_fake_cpu_devices():
  """Issue 51: stage 3 and stage 2 of one linen CNN, 120 steps each, called alternately
  without blocking on 8 fake CPU devices (benchmarks/cpu_dispatch.py's loop, in a child:
  an abort must not end pytest). Guarded, it runs to the end; without the guard
  (ZEROJAX_CPU_DISPATCH_GUARD=0, collectives' timeout cut to 10 s) jaxlib 0.10.2
  deadlocks and aborts (SIGABRT: 5 of 5 runs at 120 steps, 2 of 5 at 40)."""
  script = os.path.join(REPO, "benchmarks", "cpu_dispatch.py")
  runs = {}
  for guard in ("1", "0"):  # Guarded first: it compiles, the unguarded run reads the cache.
    runs[guard] = subprocess.run(
        [sys.executable, script, "--child", "alternate", "--steps", "120"], cwd=REPO,
        env=dict(os.environ, ZEROJAX_CPU_DISPATCH_GUARD=guard), capture_output=True,
        text=True, timeout=150, check=False)
  guarded, unguarded = runs["1"], runs["0"]
  assert guarded.returncode == 0, guarded.stderr[-3000:]
  assert guarded.stdout.startswith("done: 120 steps of each"), guarded.stdout
  assert unguarded.returncode == -6, (unguarded.returncode, unguarded.stdout,
                                      unguarded.stderr[-2000:])
  # A collective's rendezvous timed out: an all-gather or all-reduce mostly, a reduce-
  # scatter once (whichever collective the devices' threads were split over).
  assert re.search(r"Termination timeout for `(all|reduce)", unguarded.stderr), (
      unguarded.stderr[-2000:])
