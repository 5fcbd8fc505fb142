"""The peer watch: a dead process of a multi-process run ends the others at once, with a reason.

Process 0 listens on a port of its own (published in JAX's key-value store) and every
other process holds one TCP connection to it. The kernel closes a dead process's
connections, so process 0 learns of a death at once, tells the others and exits; the
others learn of process 0's death the same way. Each prints "error: process N is gone
(...)" and exits with `exits.PEER_LOST`, even with its main thread blocked in a
collective. A process that leaves deliberately (finished, stopped, failed with its own
message) says goodbye first and is not reported.

The watch listens on the interface the others reach process 0 on (the coordinator
address's), and only a process of this run is believed: process 0 makes a random secret
(shared through JAX's key-value store, never printed) and greets each connection with a
fresh nonce; a peer answers with its id and HMAC-SHA256(secret, nonce + id). A
challenge, not a token: what crosses the wire proves the secret for that one connection
and that one id, so a captured hello cannot be replayed. A connection that does not
prove it, sends garbage, announces an id out of range or already connected, or sends
nothing for `HELLO_SECONDS` is closed, with one line on process 0, and no effect on the
run. (JAX's coordinator itself is not authenticated: whoever reaches it can read the
secret. README, Multi-host, says what to firewall.)

Why not JAX's coordination service: it only counts missing heartbeats
(`distributed.heartbeat_timeout`), and its abort cannot be caught (a Python
`missed_heartbeat_callback` fails with `std::bad_cast` in jaxlib 0.10.2). It stays the
backstop for a host that vanishes without closing its connections.

`zerojax.run.distributed.initialize` starts the watch once the processes have joined; the
program wraps its body in `exit_on_lost_peer()`.
"""

import contextlib
import dataclasses
import faulthandler
import hashlib
import hmac
import os
import secrets
import selectors
import socket
import sys
import threading
import time

import jax

from zerojax.runtime import exits, jax_internals


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


# The wire format, one line each: from process 0 on accepting, "zerojax-peer-watch
# <nonce>"; the peer's hello, "<id> <proof>" (`_proof`); "bye" when a process leaves
# deliberately; from process 0, "lost <id> <cause>"; "hung <what>" from a process whose
# watchdog fired (`zerojax.run.watchdog`), passed on by process 0.
_WATCH_KEY = "zerojax/peer_watch_port"
_SECRET_KEY = "zerojax/peer_watch_secret"
_GREETING = b"zerojax-peer-watch"
_BYE = b"bye"
HELLO_SECONDS = 5.0  # A connection's hello must arrive within this.
_HELLO_BYTES = 256  # A longer first line is not a hello.


def _proof(secret: bytes, nonce: bytes, pid: int) -> bytes:
  """The hello's proof: HMAC-SHA256 of the nonce and the id under the run's secret, hex."""
  return hmac.new(secret, nonce + b" %d" % pid, hashlib.sha256).hexdigest().encode()


def _listen(host: str) -> socket.socket:
  """A listening socket on `host`'s address when it is one of this machine's (the one the
  others use to reach process 0), else on every interface (a name that resolves to an
  address held elsewhere: a load balancer's, a container's service)."""
  for family, _, _, _, address in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM):
    with contextlib.suppress(OSError):
      return socket.create_server(address[:2], family=family)
  print(f"distributed: peer watch: {host} is not an address of this machine; listening on "
        "every interface (hellos are still checked)", file=sys.stderr, flush=True)
  dual = socket.has_dualstack_ipv6()
  return socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                              dualstack_ipv6=dual)


@dataclasses.dataclass
class _Watch:
  process_id: int
  num_processes: int
  secret: bytes
  links: dict[int, socket.socket]  # Process 0: one per peer; the others: {0: the link}.
  lost: threading.Event = dataclasses.field(default_factory=threading.Event)
  leaving: bool = False  # Said goodbye: what happens to the others is no longer news.


_watch: _Watch | None = None


def start(process_id: int, coordinator_host: str, num_processes: int) -> None:
  """Starts the watch for this process (after `jax.distributed.initialize`)."""
  global _watch
  client = jax_internals.distributed_client()
  try:
    if process_id == 0:
      watch = _Watch(process_id, num_processes, secrets.token_bytes(32), {})
      server = _listen(coordinator_host)
      client.key_value_set(_SECRET_KEY, watch.secret.hex())
      client.key_value_set(_WATCH_KEY, str(server.getsockname()[1]))
      host, port = server.getsockname()[:2]
      print(f"distributed: peer watch listening on {host}:{port} (a peer proves the run's "
            "secret)", file=sys.stderr, flush=True)
      target, args = _serve, (watch, server)
    else:
      secret = bytes.fromhex(client.blocking_key_value_get(_SECRET_KEY, 60_000))
      watch = _Watch(process_id, num_processes, secret, {})
      port = int(client.blocking_key_value_get(_WATCH_KEY, 60_000))
      link = socket.create_connection((coordinator_host, port), timeout=30)
      greeting, _, nonce = link.makefile("rb").readline(_HELLO_BYTES).strip().partition(b" ")
      if greeting != _GREETING or not nonce:
        raise OSError(f"{coordinator_host}:{port} is not process 0's peer watch")
      link.sendall(b"%d %s\n" % (process_id, _proof(secret, nonce, process_id)))
      link.settimeout(None)
      watch.links[0] = link
      target, args = _follow, (watch, link)
  except Exception as e:  # pylint: disable=broad-except  (the run can go on without it)
    print(f"distributed: no peer watch ({e}); a process that dies is noticed by JAX's "
          "heartbeat after distributed.heartbeat_timeout seconds", file=sys.stderr, flush=True)
    return
  _watch = watch
  threading.Thread(target=target, args=args, daemon=True, name="zerojax-peer-watch").start()


def _wait_for_others(links: list[socket.socket]) -> None:
  """Waits (briefly) for the others to close their links first: when process 0 exits,
  its coordinator goes, and JAX would abort them before they read why."""
  deadline = time.monotonic() + 2
  for s in links:
    with contextlib.suppress(OSError):
      s.settimeout(max(0.01, deadline - time.monotonic()))
      while s.recv(64):
        pass


def report_hang(what: str) -> None:
  """This process is hung (its watchdog fired): tell the others, which exit `HUNG`."""
  if _watch is None:
    return
  _watch.leaving = True  # From here a closed link is news no longer.
  for s in list(_watch.links.values()):
    with contextlib.suppress(OSError):
      s.sendall(f"hung {what}\n".encode())
  _wait_for_others(list(_watch.links.values()))


def _hung(watch: _Watch, what: str, sender: int | None = None) -> None:
  """Another process is hung: pass it on (process 0), print this process's stacks too
  (which of them is stuck where, whoever's watchdog fired first), exit `HUNG`."""
  watch.leaving = True
  print(f"error: told that {what} is hung; process {watch.process_id}'s threads:",
        file=sys.stderr, flush=True)
  faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
  if watch.process_id == 0:
    others = [s for p, s in watch.links.items() if p != sender]
    for s in others:
      with contextlib.suppress(OSError):
        s.sendall(f"hung {what}\n".encode())
    _wait_for_others(others)
  leave(f"error: {what} is hung (no progress within train.step_timeout): the run stops; "
        "the last committed checkpoint resumes", exits.HUNG)


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
  _wait_for_others(others)
  leave(message, exits.PEER_LOST)


def _refuse(selector, sock: socket.socket, why: str) -> None:
  """Closes a connection that is not a peer's, with one line; the run goes on."""
  where = "an address it no longer has"
  with contextlib.suppress(OSError, ValueError):
    where = "%s:%s" % sock.getpeername()[:2]
  selector.unregister(sock)
  sock.close()
  print(f"distributed: peer watch refused a connection from {where}: {why}", file=sys.stderr,
        flush=True)


def _hello(watch: _Watch, line: bytes, nonce: bytes) -> tuple[int | None, str]:
  """(the peer's id, "") for a hello that proves the secret, else (None, why not)."""
  pid, _, proof = line.strip().partition(b" ")
  if not pid.isdigit() or len(proof) != 64:
    return None, "not a peer's hello"
  pid, n = int(pid), watch.num_processes
  if not hmac.compare_digest(proof, _proof(watch.secret, nonce, pid)):
    return None, f"announced process {pid} without proving the run's secret"
  if not 0 < pid < n:
    return None, f"announced process {pid}, not one of 1..{n - 1}"
  if pid in watch.links:
    return None, f"announced process {pid}, which is already connected"
  return pid, ""


def _serve(watch: _Watch, server: socket.socket) -> None:
  """Process 0: greet each connection, accept the peers' hellos, watch their links."""
  selector = selectors.DefaultSelector()
  selector.register(server, selectors.EVENT_READ)
  pending: dict[socket.socket, tuple[bytes, bytes, float]] = {}  # (nonce, bytes, deadline).
  ids: dict[socket.socket, int] = {}
  while True:
    for key, _ in selector.select(timeout=1.0):
      sock = key.fileobj
      if sock is server:
        conn, _ = server.accept()
        nonce = secrets.token_hex(16).encode()
        with contextlib.suppress(OSError):
          conn.sendall(_GREETING + b" " + nonce + b"\n")
        pending[conn] = (nonce, b"", time.monotonic() + HELLO_SECONDS)
        selector.register(conn, selectors.EVENT_READ)
        continue
      try:
        data = sock.recv(_HELLO_BYTES)
      except OSError:
        data = b""
      closed = not data
      if sock in pending:  # The first line is the hello.
        nonce, got, deadline = pending[sock]
        got += data
        if b"\n" not in got:
          if closed or len(got) >= _HELLO_BYTES:
            del pending[sock]
            _refuse(selector, sock, "closed before its hello" if closed else "not a hello")
          else:
            pending[sock] = (nonce, got, deadline)
          continue
        del pending[sock]
        line, _, data = got.partition(b"\n")
        pid, why = _hello(watch, line, nonce)
        if pid is None:
          _refuse(selector, sock, why)
          continue
        ids[sock] = pid
        watch.links[pid] = sock
      hung = [line[5:] for line in data.splitlines() if line.startswith(b"hung ")]
      if hung:
        _hung(watch, hung[0].decode(errors="replace"), ids[sock])
      if _BYE in data.split():
        selector.unregister(sock)  # Left deliberately; its own status says how.
        watch.links.pop(ids.pop(sock), None)
      elif closed:
        _lost(watch, ids[sock], "its connection closed: killed or crashed")
    now = time.monotonic()
    for sock in [s for s, (_, _, deadline) in pending.items() if deadline < now]:
      del pending[sock]
      _refuse(selector, sock, f"no hello within {HELLO_SECONDS:g} s")


def _follow(watch: _Watch, link: socket.socket) -> None:
  """Processes 1..n-1: read process 0's news; its link closing is its death."""
  try:
    for line in link.makefile("rb"):
      if line.strip() == _BYE:
        return
      if line.startswith(b"hung "):
        _hung(watch, line[5:].decode(errors="replace").strip())
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
