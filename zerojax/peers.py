"""The peer watch: a dead process of a multi-process run ends the others at once, with a reason.

Process 0 listens on a port of its own (published in JAX's key-value store) and every
other process holds one TCP connection to it. The kernel closes a dead process's
connections, so process 0 learns of a death at once, tells the others and exits; the
others learn of process 0's death the same way. Each prints "error: process N is gone
(...)" and exits with `exits.PEER_LOST`, even with its main thread blocked in a
collective. A process that leaves deliberately (finished, stopped, failed with its own
message) says goodbye first and is not reported.

Why not JAX's coordination service: it only counts missing heartbeats
(`distributed.heartbeat_timeout`), and its abort cannot be caught (a Python
`missed_heartbeat_callback` fails with `std::bad_cast` in jaxlib 0.10.2). It stays the
backstop for a host that vanishes without closing its connections.

`zerojax.distributed.initialize` starts the watch once the processes have joined; the
program wraps its body in `exit_on_lost_peer()`.
"""

import contextlib
import dataclasses
import os
import selectors
import socket
import sys
import threading
import time

import jax

from zerojax import exits, jax_internals


def leave(message: str, status: int) -> None:
  """Prints `message` and ends the process now, from any thread.

  `os._exit`: the main thread may be blocked in a collective or in the checkpointer, and
  a normal exit runs `jax.distributed.shutdown`, whose barrier waits for every process.
  """
  try:
    sys.stdout.flush()
  except (OSError, ValueError):
    pass
  os.write(2, (message.rstrip("\n") + "\n").encode())
  os._exit(status)  # pylint: disable=protected-access


# The wire format, one line each: a process's id when it connects; "bye" when a process
# leaves deliberately; from process 0, "lost <id> <cause>".
_WATCH_KEY = "zerojax/peer_watch_port"
_BYE = b"bye"


@dataclasses.dataclass
class _Watch:
  process_id: int
  links: dict[int, socket.socket]  # Process 0: one per peer; the others: {0: the link}.
  lost: threading.Event = dataclasses.field(default_factory=threading.Event)
  leaving: bool = False  # Said goodbye: what happens to the others is no longer news.


_watch: _Watch | None = None


def start(process_id: int, coordinator_host: str) -> None:
  """Starts the watch for this process (after `jax.distributed.initialize`)."""
  global _watch
  client = jax_internals.distributed_client()
  watch = _Watch(process_id, {})
  try:
    if process_id == 0:
      dual = socket.has_dualstack_ipv6()
      server = socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                    dualstack_ipv6=dual)
      client.key_value_set(_WATCH_KEY, str(server.getsockname()[1]))
      target, args = _serve, (watch, server)
    else:
      port = int(client.blocking_key_value_get(_WATCH_KEY, 60_000))
      link = socket.create_connection((coordinator_host, port), timeout=30)
      link.settimeout(None)
      link.sendall(b"%d\n" % process_id)
      watch.links[0] = link
      target, args = _follow, (watch, link)
  except Exception as e:  # pylint: disable=broad-except  (the run can go on without it)
    print(f"distributed: no peer watch ({e}); a process that dies is noticed by JAX's "
          "heartbeat after distributed.heartbeat_timeout seconds", file=sys.stderr, flush=True)
    return
  _watch = watch
  threading.Thread(target=target, args=args, daemon=True, name="zerojax-peer-watch").start()


def _lost(watch: _Watch, pid: int, cause: str) -> None:
  """A peer died: tell the others (process 0), print, exit `PEER_LOST`."""
  if watch.leaving:
    return
  watch.lost.set()
  message = f"error: process {pid} is gone ({cause})"
  others = [s for p, s in watch.links.items() if p != pid]
  for s in others:
    with contextlib.suppress(OSError):
      s.sendall(f"lost {pid} {cause}\n".encode())
  # Wait (briefly) for the others to leave first: when process 0 exits, its coordinator
  # goes, and JAX would abort them before they read why.
  deadline = time.monotonic() + 2
  for s in others:
    with contextlib.suppress(OSError):
      s.settimeout(max(0.01, deadline - time.monotonic()))
      while s.recv(64):
        pass
  leave(message, exits.PEER_LOST)


def _serve(watch: _Watch, server: socket.socket) -> None:
  """Process 0: accept each peer's link and watch them all."""
  selector = selectors.DefaultSelector()
  selector.register(server, selectors.EVENT_READ)
  pending: dict[socket.socket, bytes] = {}  # Links whose id has not arrived yet.
  ids: dict[socket.socket, int] = {}
  while True:
    for key, _ in selector.select():
      sock = key.fileobj
      if sock is server:
        conn, _ = server.accept()
        pending[conn] = b""
        selector.register(conn, selectors.EVENT_READ)
        continue
      try:
        data = sock.recv(64)
      except OSError:
        data = b""
      closed = not data
      if sock in pending:  # The peer's first line is its id.
        pending[sock] += data
        if b"\n" not in pending[sock] and not closed:
          continue
        line, _, data = pending.pop(sock).partition(b"\n")
        if not line.isdigit():  # Not one of ours.
          selector.unregister(sock)
          sock.close()
          continue
        ids[sock] = int(line)
        watch.links[ids[sock]] = sock
      if _BYE in data.split():
        selector.unregister(sock)  # Left deliberately; its own status says how.
        watch.links.pop(ids.pop(sock), None)
      elif closed:
        _lost(watch, ids[sock], "its connection closed: killed or crashed")


def _follow(watch: _Watch, link: socket.socket) -> None:
  """Processes 1..n-1: read process 0's news; its link closing is its death."""
  try:
    for line in link.makefile("rb"):
      if line.strip() == _BYE:
        return
      if line.startswith(b"lost "):
        _, pid, cause = line.decode().strip().split(" ", 2)
        _lost(watch, int(pid), f"{cause}; seen by process 0")
  except OSError:
    pass
  _lost(watch, 0, "its connection closed: killed or crashed")


def goodbye() -> None:
  """Tells the other processes this one leaves deliberately (no-op for a single process)."""
  if _watch is None or _watch.leaving:
    return
  _watch.leaving = True
  for s in list(_watch.links.values()):
    with contextlib.suppress(OSError):
      s.sendall(_BYE + b"\n")


# Words in the runtime errors of a collective that failed for want of a peer.
_COLLECTIVE_FAILURE = ("Gloo", "NCCL", "Connection reset", "Connection closed",
                       "Connection refused", "DEADLINE_EXCEEDED", "UNAVAILABLE")


@contextlib.contextmanager
def exit_on_lost_peer(grace: float = 2.0):
  """Wraps a multi-process program: a lost peer or a failed collective ends it cleanly.

  Enter it inside any cleanup that could wait on a dead peer (a checkpointer's close),
  so that such a failure leaves with one line and `exits.PEER_LOST` before it. Any other
  way out (a return, an exception, `sys.exit`) tells the others this process leaves
  deliberately. A single-process run passes everything through.

  Args:
    grace: seconds a failed collective waits for the peer watch to name the lost process.
  """
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if _watch is None or _watch.leaving:
      raise
    if _watch.lost.wait(grace):
      time.sleep(grace)  # The watch is printing and exiting: let it.
    if any(word in str(e) for word in _COLLECTIVE_FAILURE):
      first = str(e).strip().splitlines()[0][:300]
      leave(f"error: a collective failed, so a peer is lost or unreachable ({first})",
             exits.PEER_LOST)
    goodbye()
    raise
  except BaseException:
    goodbye()
    raise
  goodbye()
