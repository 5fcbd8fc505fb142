"""Starts N processes of one command on this machine, as a multi-host run would.

    python -m zerojax.run.launch --nproc 2 --devices_per_process 4 -- python train.py

Each process gets `JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>`, `ZEROJAX_NUM_PROCESSES`
and `ZEROJAX_PROCESS_ID` (what `zerojax.run.distributed` reads); `--devices_per_process M`
also gives each M fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=M`,
`JAX_PLATFORMS=cpu`). Every output line is prefixed with `[rank]`. A SIGINT (Ctrl-C) or
SIGTERM reaches every process as SIGTERM (train.py saves and stops, all at the same step);
a second one kills them (then, as when one fails while stopping, the launcher lists every
process's status and exits with the first that did not stop cleanly: 137 for SIGKILL).
When one exits non-zero the others get SIGTERM, then SIGKILL after `--grace` seconds;
the launcher names the first process to fail (one that exited with `exits.PEER_LOST` saw
another die first, so that other one counts), lists every process's status and exits
with the first failure's (128 + the signal for a process killed by one). Status 75
(`exits.STOPPED`: saved, stopped early, e.g. on SIGTERM) is not a failure: the launcher
waits for the others (train.py's processes all stop at the same step, and may still be
saving). Once all have ended without a failure it exits with 75 if any stopped early
(after listing every process's status), else 0.
"""

import argparse
import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from zerojax.runtime import exits
from zerojax.runtime.device_env import fake_devices_env


def free_port() -> int:
  """A TCP port nothing listens on right now (the OS picks it)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(rank: int, nproc: int, port: int, devices: int,
              base: dict[str, str] | None = None) -> dict[str, str]:
  """The environment of process `rank`."""
  env = dict(os.environ if base is None else base, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
             ZEROJAX_NUM_PROCESSES=str(nproc), ZEROJAX_PROCESS_ID=str(rank),
             PYTHONUNBUFFERED="1")
  return fake_devices_env(devices, base=env) if devices else env


def _die_with_parent() -> None:
  """Linux: the child gets SIGKILL if the launcher dies (even by SIGKILL); else no-op."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _pipe(stream, out, prefix: str, lock: threading.Lock) -> None:
  for line in iter(stream.readline, b""):
    with lock:
      out.buffer.write(prefix.encode() + line)
      out.flush()
  stream.close()


def describe(code: int) -> str:
  """A returncode in words: "status 5 (PEER_LOST)", "signal SIGKILL"."""
  if code < 0:
    return f"signal {signal.Signals(-code).name}"
  names = {v: k for k, v in vars(exits).items() if k.isupper() and isinstance(v, int)}
  return f"status {code}" + (f" ({names[code]})" if code in names else "")


def status(code: int) -> int:
  """A shell-style exit status: 128 + N for a process killed by signal N."""
  return 128 - code if code < 0 else code


def launch(command: list[str], nproc: int, devices: int = 0, port: int = 0,
           grace: float = 10.0) -> int:
  """Runs `command` as `nproc` processes; returns the launcher's exit status."""
  port = port or free_port()
  procs, lock, log = [], threading.Lock(), lambda msg: print(f"[launch] {msg}", file=sys.stderr,
                                                              flush=True)
  signals = []

  def forward(signum, frame):
    # The first SIGINT / SIGTERM reaches every process as SIGTERM (train.py: all save at
    # the same step and stop); a second one kills them.
    del frame
    signals.append(signum)
    log(f"{signal.Signals(signum).name}: " + ("SIGTERM to every process (again: SIGKILL)"
                                               if len(signals) == 1 else "SIGKILL"))
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM if len(signals) == 1 else signal.SIGKILL)
  # Before the first process starts: a signal that comes while they start reaches
  # those started, and no more start (without it, the default action ended the launcher).
  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  # Each in its own session: a Ctrl-C on the terminal reaches them once, through us.
  for rank in range(nproc):
    if signals:
      break
    procs.append(subprocess.Popen(command, env=child_env(rank, nproc, port, devices),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True, preexec_fn=_die_with_parent))
  nproc = len(procs)
  if not procs:  # Stopped before anything started.
    for s, handler in previous.items():
      signal.signal(s, handler)
    return status(-signals[0])
  threads = [threading.Thread(target=_pipe, args=(stream, out, f"[{rank}] ", lock), daemon=True)
             for rank, p in enumerate(procs)
             for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
  for t in threads:
    t.start()
  # Exits in the order they happen (a thread per process), so the first failure is the
  # cause and the others' (PEER_LOST, or our SIGTERM) its consequences.
  exited = queue.Queue()
  for rank, p in enumerate(procs):
    threading.Thread(target=lambda r=rank, q=p: (q.wait(), exited.put(r)), daemon=True).start()
  fine = (exits.DONE, exits.STOPPED)  # Finished, or saved and stopped early: not failures.
  statuses = lambda: "exit statuses: " + ", ".join(f"process {r}: {describe(p.returncode)}"
                                                   for r, p in enumerate(procs))
  failed = lambda r: procs[r].returncode not in fine
  try:
    order = []
    while len(order) < nproc and not any(failed(r) for r in order):
      order.append(exited.get())
    # A PEER_LOST is a consequence: give the process it saw die a moment to be reaped.
    with contextlib.suppress(queue.Empty):
      while len(order) < nproc and all(procs[r].returncode in (*fine, exits.PEER_LOST)
                                       for r in order):
        order.append(exited.get(timeout=1))
    failures = [r for r in order if failed(r)]
    if failures and signals:  # Stopped by the user: every process is on its way out.
      for p in procs:
        p.wait()
      for t in threads:
        t.join(timeout=5)
      log(statuses())
      # Not 75 (saved): one was killed (the second signal) or failed while stopping.
      return status(procs[failures[0]].returncode)
    if failures:
      # A process that exited PEER_LOST saw another die: that one is the cause.
      first = next((r for r in failures if procs[r].returncode != exits.PEER_LOST), failures[0])
      log(f"process {first} exited with {describe(procs[first].returncode)} (the first to "
          "fail); stopping the others")
      for p in procs:
        if p.poll() is None:
          p.terminate()
      deadline = time.monotonic() + grace
      while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
      for rank, p in enumerate(procs):
        if p.poll() is None:
          log(f"process {rank} still running after {grace:g} s: SIGKILL")
          p.kill()
          p.wait()
      for t in threads:
        t.join(timeout=5)
      log(statuses())
      return status(procs[first].returncode)
    for t in threads:
      t.join(timeout=5)
    if any(p.returncode for p in procs):  # Some stopped early: which, and whether all did.
      log(statuses())
    return exits.STOPPED if exits.STOPPED in [p.returncode for p in procs] else exits.DONE
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  split = argv.index("--") if "--" in argv else len(argv)
  parser = argparse.ArgumentParser(prog="python -m zerojax.run.launch",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--nproc", type=int, required=True, help="processes to start")
  parser.add_argument("--devices_per_process", type=int, default=0,
                      help="fake CPU devices per process (0: leave the platform alone)")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  parser.add_argument("--grace", type=float, default=10.0,
                      help="seconds between SIGTERM and SIGKILL when one process failed")
  parser.usage = "python -m zerojax.run.launch --nproc N [--devices_per_process M] -- COMMAND ..."
  args = parser.parse_args(argv[:split])  # --help prints the usage and exits 0.
  command = argv[split + 1:]
  if args.nproc < 1 or not command:
    parser.error("need --nproc >= 1 and a command after --")
  return launch(command, args.nproc, args.devices_per_process, args.port, args.grace)


if __name__ == "__main__":
  sys.exit(main())
