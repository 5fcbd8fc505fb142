"""Starts N processes of one command on this machine, as a multi-host run would.

    python -m zerojax.launch --nproc 2 --devices_per_process 4 -- python train.py --config configs/tiny.py

Each process gets `JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>`, `ZEROJAX_NUM_PROCESSES`
and `ZEROJAX_PROCESS_ID` (what `zerojax.distributed` reads); `--devices_per_process M`
also gives each M fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=M`,
`JAX_PLATFORMS=cpu`). Every output line is prefixed with `[rank]`. A SIGINT (Ctrl-C) or
SIGTERM reaches every process as SIGTERM (train.py saves and stops, all at the same step);
a second one kills them. When one exits non-zero the others get SIGTERM, then
SIGKILL after `--grace` seconds, and the launcher exits with that first status (128 + the
signal for a process killed by one); otherwise with 0 once all have finished.
"""

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from zerojax.devices import fake_devices_env


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


def status(code: int) -> int:
  """A shell-style exit status: 128 + N for a process killed by signal N."""
  return 128 - code if code < 0 else code


def launch(command: list[str], nproc: int, devices: int = 0, port: int = 0,
           grace: float = 10.0) -> int:
  """Runs `command` as `nproc` processes; returns the launcher's exit status."""
  port = port or free_port()
  procs, lock, log = [], threading.Lock(), lambda msg: print(f"[launch] {msg}", file=sys.stderr,
                                                              flush=True)
  # Each in its own session: a Ctrl-C on the terminal reaches them once, through us.
  for rank in range(nproc):
    procs.append(subprocess.Popen(command, env=child_env(rank, nproc, port, devices),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True, preexec_fn=_die_with_parent))
  threads = [threading.Thread(target=_pipe, args=(stream, out, f"[{rank}] ", lock), daemon=True)
             for rank, p in enumerate(procs)
             for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
  for t in threads:
    t.start()

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
  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    failed = None
    while failed is None and any(p.poll() is None for p in procs):
      failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
      time.sleep(0.1)
    failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), failed)
    if failed is not None:
      code = procs[failed].returncode
      what = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
      log(f"process {failed} exited with {what}; stopping the others")
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
      return status(code)
    for t in threads:
      t.join(timeout=5)
    return 0
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" not in argv:
    print("usage: python -m zerojax.launch --nproc N [--devices_per_process M] -- COMMAND ...",
          file=sys.stderr)
    return 2
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="python -m zerojax.launch", description=__doc__.split("\n")[0])
  parser.add_argument("--nproc", type=int, required=True, help="processes to start")
  parser.add_argument("--devices_per_process", type=int, default=0,
                      help="fake CPU devices per process (0: leave the platform alone)")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  parser.add_argument("--grace", type=float, default=10.0,
                      help="seconds between SIGTERM and SIGKILL when one process failed")
  args = parser.parse_args(argv[:split])
  command = argv[split + 1:]
  if args.nproc < 1 or not command:
    parser.error("need --nproc >= 1 and a command after --")
  return launch(command, args.nproc, args.devices_per_process, args.port, args.grace)


if __name__ == "__main__":
  sys.exit(main())
