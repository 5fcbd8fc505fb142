"""Multi-host runs: `jax.distributed.initialize` from the config, the environment or the cluster.

`initialize(config.distributed)` runs before anything touches a device. Each of the
coordinator address, the process count and this process's id comes from the first of:

1. the config: `distributed.coordinator_address`, `.num_processes`, `.process_id`;
2. the environment: `JAX_COORDINATOR_ADDRESS` (JAX's own name), `ZEROJAX_NUM_PROCESSES`,
   `ZEROJAX_PROCESS_ID` (what `python -m zerojax.run.launch` sets);
3. the cluster, as JAX detects it: SLURM (inside `srun`), Open MPI (`mpirun`),
   Kubernetes (a JobSet / indexed Job; needs the `kubernetes` package).

With none of them, or one process, nothing is initialized: a single-process run.

Failures, bounded in time and explained on every process (statuses: `zerojax.runtime.exits`):

- a coordinator address that cannot work: a host name that does not resolve (every
  process), or, on process 0, a port it cannot bind or an address that is not this
  host's: one line at once, `INIT_FAILED`;
- a coordinator or peer that does not show up: a line every `distributed.wait_report_every`
  seconds says what is awaited; after `distributed.initialization_timeout` seconds one
  message names the address, the process count, this process and whether anything listens
  at the address; `INIT_FAILED`;
- a process that dies later (killed, crashed): every other process prints "error: process
  N is gone (...)" and exits with `PEER_LOST` within moments (`zerojax.run.peers`), even
  one blocked in a collective. JAX's coordination service is the backstop for a host that
  vanishes without closing its connections: it aborts the others after
  `distributed.heartbeat_timeout` seconds (SIGABRT, status 134, its own message).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax

from zerojax.config import ConfigError
from zerojax.run import peers
from zerojax.runtime import exits, jax_internals

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"  # JAX reads this one itself, too.
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"
# JAX's own connect timeout is longer than ours, so our message (and exit status) comes
# first; JAX's abort is the backstop.
_JAX_TIMEOUT_MARGIN_S = 15


@dataclasses.dataclass(frozen=True)
class Setup:
  """A resolved multi-process setup; `sources` says where each value came from."""
  coordinator_address: str
  num_processes: int
  process_id: int
  local_device_ids: list[int] | None  # None: JAX's choice.
  sources: Mapping[str, str]

  def describe(self) -> str:
    src = ", ".join(f"{k} from {v}" for k, v in self.sources.items())
    return (f"process {self.process_id} of {self.num_processes}, coordinator "
            f"{self.coordinator_address} ({src})")


def validate(section: Any) -> list[str]:
  """Problems with a `distributed` config section (values only; [] if none).

  The config loader checks types and ranges; this checks the combinations.
  """
  s, problems = section, []
  if s.num_processes > 0 and s.process_id >= s.num_processes:
    problems.append(f"distributed.process_id={s.process_id} is not below "
                    f"distributed.num_processes={s.num_processes}")
  if s.coordinator_address and not _split_address(s.coordinator_address):
    problems.append(f"distributed.coordinator_address must be host:port, got "
                    f"{s.coordinator_address!r}")
  try:
    _device_ids(s.local_device_ids)
  except ValueError:
    problems.append("distributed.local_device_ids must be '', 'all' or ids like '0,1,2,3', "
                    f"got {s.local_device_ids!r}")
  return problems


def _split_address(address: str) -> tuple[str, int] | None:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    return None
  return host.strip("[]"), int(port)


def _device_ids(text: str) -> list[int] | None:
  if not text:
    return None  # JAX's choice: the local rank under SLURM / Open MPI, else all.
  if text == "all":
    return []  # JAX sets no visible-device restriction for an empty list.
  return [int(x) for x in text.split(",")]


def _int_env(environ: Mapping[str, str], name: str) -> int | None:
  value = environ.get(name, "")
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ConfigError(f"is {value!r}, not an integer.", key=name,
                      source="the environment", fix=f"set {name} to a number, or unset it")


def _detect_cluster():
  """The first cluster environment JAX would auto-detect (SLURM, Open MPI, k8s, TPU)."""
  for env in jax_internals.cluster_types():  # None known: detection is left to JAX.
    if getattr(env, "opt_in_only_method", False):
      continue
    try:
      if env.is_env_present():
        return env
    except Exception:  # pylint: disable=broad-except  (a probe that fails = absent)
      continue
  return None


def resolve(section: Any, environ: Mapping[str, str] | None = None) -> Setup | None:
  """The setup this process would join, or None for a single-process run.

  Raises:
    ConfigError: a bad `distributed` value, or a multi-process setup with a piece
      missing (e.g. a process count but no coordinator address).
  """
  problems = validate(section)
  if problems:
    raise ConfigError("; ".join(problems) + ".", key="distributed", source="the config")
  environ = os.environ if environ is None else environ
  sources = {}

  def pick(key, config_value, unset, env_name, env_value):
    if config_value != unset:
      sources[key] = f"distributed.{key}"
      return config_value
    if env_value is not None:
      sources[key] = f"${env_name}"
      return env_value
    return None

  address = pick("coordinator_address", section.coordinator_address, "", ENV_ADDRESS,
                 environ.get(ENV_ADDRESS) or None)
  count = pick("num_processes", section.num_processes, 0, ENV_NUM_PROCESSES,
               _int_env(environ, ENV_NUM_PROCESSES))
  pid = pick("process_id", section.process_id, -1, ENV_PROCESS_ID,
             _int_env(environ, ENV_PROCESS_ID))
  if (count != 1 and None in (address, count, pid)
      and (env := _detect_cluster()) is not None):
    name = getattr(env, "name", "") or env.__name__
    try:
      if count is None:
        count, sources["num_processes"] = env.get_process_count(), name
      if pid is None:
        pid, sources["process_id"] = env.get_process_id(), name
      if address is None and count > 1:
        address = env.get_coordinator_address(
            timeout_secs=section.initialization_timeout,
            override_coordinator_port=environ.get("JAX_COORDINATOR_PORT"))
        sources["coordinator_address"] = name
    except Exception as e:  # pylint: disable=broad-except
      raise ConfigError(f"the {name} cluster environment was detected, but reading it failed: "
                        f"{e}", key="distributed", source=name,
                        fix="set distributed.coordinator_address, .num_processes and "
                            ".process_id explicitly") from e
  if count is None or count == 1:
    if count is None and (address is not None or (pid or 0) > 0):
      given = ", ".join(f"{k} from {v}" for k, v in sources.items())
      raise ConfigError(f"a multi-process setup is half given ({given}) but the number of "
                        "processes is not.", key="distributed.num_processes",
                        source="the config and the environment",
                        fix=f"set distributed.num_processes or ${ENV_NUM_PROCESSES}, or "
                            "unset the other values for a single-process run")
    return None
  missing = [k for k, v in (("coordinator_address", address), ("process_id", pid)) if v is None]
  if missing:
    env_names = {"coordinator_address": ENV_ADDRESS, "process_id": ENV_PROCESS_ID}
    raise ConfigError(f"{count} processes are expected ({sources['num_processes']}), but "
                      f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set.",
                      key="distributed", source="the config and the environment",
                      fix="set " + " and ".join(f"distributed.{k} (or ${env_names[k]})"
                                                for k in missing))
  if not 0 <= pid < count:
    raise ConfigError(f"process id {pid} ({sources['process_id']}) is not in [0, {count}) "
                      f"({sources['num_processes']}).", key="distributed.process_id",
                      source=sources["process_id"], fix=f"give each process an id 0..{count - 1}")
  if not _split_address(address):
    raise ConfigError(f"coordinator address {address!r} ({sources['coordinator_address']}) "
                      "is not host:port.", key="distributed.coordinator_address",
                      source=sources["coordinator_address"], fix="e.g. 10.0.0.1:1234")
  return Setup(address, count, pid, _device_ids(section.local_device_ids), sources)


def _probe(address: str) -> str:
  """What is at the coordinator address, for the messages while waiting and at the timeout."""
  host, port = _split_address(address)
  try:
    with socket.create_connection((host, port), timeout=2):
      return ""  # Something listens: the coordinator (process 0) is up.
  except socket.gaierror as e:
    return f"the host name {host!r} does not resolve ({e})"
  except OSError as e:
    return f"nothing accepts connections at {address} ({e.strerror or e})"


def _is_local(ip: str, family: int) -> bool:
  with socket.socket(family, socket.SOCK_STREAM) as s:
    try:
      s.bind((ip, 0))  # Only an address of this host can be bound.
      return True
    except OSError:
      return False


def _this_host() -> str:
  name = socket.gethostname()
  try:
    ips = sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
  except OSError:
    return name
  return f"{name}: {', '.join(ips)}"


def address_problem(setup: Setup) -> str | None:
  """Why the coordinator address cannot work, found before joining; None if no reason is seen.

  On every process the host name must resolve. On process 0, which runs the coordinator,
  the port must be free, and the address must lead to this host: one of its own, or one
  forwarded to it (a container's published port, a Kubernetes service), which is tried.
  """
  host, port = _split_address(setup.coordinator_address)
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except socket.gaierror as e:
    return f"the coordinator host {host!r} does not resolve ({e.strerror})"
  if setup.process_id != 0:
    return None  # Refused or unreachable may mean "process 0 is not up yet": wait.
  head = f"process 0 could not start the coordinator at {setup.coordinator_address}"
  dual = socket.has_dualstack_ipv6()
  # JAX's coordinator binds the port on every interface ([::]:port); so does this, briefly.
  with socket.socket(socket.AF_INET6 if dual else socket.AF_INET) as server:
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # As gRPC: TIME_WAIT is fine.
    try:
      server.bind(("", port))
    except OSError as e:
      why = "another process listens there" if e.errno == errno.EADDRINUSE else e.strerror
      return f"{head}: port {port} cannot be bound ({why})"
    if any(_is_local(info[4][0], info[0]) for info in infos):
      return None
    server.listen()
    try:
      socket.create_connection((host, port), timeout=3).close()
      return None  # Forwarded here.
    except OSError as e:
      ips = ", ".join(sorted({info[4][0] for info in infos}))
      return (f"{head}: {host} ({ips}) is not an address of this host ({_this_host()}), "
              f"and connecting to it does not reach this host ({e.strerror or e})")


def waiting_message(setup: Setup, waited: float, timeout: float) -> str:
  """The line every process prints every `wait_report_every` seconds while they join."""
  n, pid, addr = setup.num_processes, setup.process_id, setup.coordinator_address
  head = f"distributed: process {pid} of {n} has waited {waited:.0f} s"
  tail = f"giving up after {timeout:g} s (distributed.initialization_timeout)"
  if pid == 0:
    return (f"{head} for the other processes to connect to its coordinator at {addr} (JAX "
            f"does not say which until all have); {tail}")
  probe = _probe(addr)
  if probe:
    return f"{head} for the coordinator (process 0) at {addr}: {probe}; retrying, {tail}"
  return (f"{head}: the coordinator at {addr} is up, some of processes 0..{n - 1} have not "
          f"joined; {tail}")


def timeout_message(setup: Setup, timeout: float) -> str:
  """The message every process prints when the processes did not all join in time."""
  n, pid, addr = setup.num_processes, setup.process_id, setup.coordinator_address
  head = (f"error: distributed: process {pid} of {n} waited {timeout:g} s at the coordinator "
          f"{addr}, and not all {n} processes joined.")
  if pid == 0:
    detail = (f"This process runs the coordinator; at least one of processes 1..{n - 1} "
              "never connected (JAX does not say which before all have joined).")
  else:
    probe = _probe(addr)
    if not probe:
      detail = (f"The coordinator at {addr} is up (process 0 runs it), so another process "
                f"(0..{n - 1} but {pid}) is missing, or two processes share an id.")
    else:
      detail = (f"The coordinator is not there: {probe}. Process 0, which runs it, has not "
                "started or has died, or the address is wrong (it must be process 0's host).")
  fix = (f"Start all {n} processes with the same coordinator address and process count "
         f"and the ids 0..{n - 1}, each once (sources: "
         f"{', '.join(f'{k} from {v}' for k, v in setup.sources.items())}); if they start "
         "slowly, raise distributed.initialization_timeout.")
  return f"{head}\n  {detail}\n  fix: {fix}"


def initialize(section: Any, *, exit_code: int = exits.INIT_FAILED) -> Setup | None:
  """Joins the multi-process run that the config, environment or cluster describes.

  Call it before anything touches a device (`jax.devices()` included). On CPU the
  cross-process collectives are gloo's (JAX's default on CPU; set if unset). Once joined,
  the peer watch runs (`zerojax.run.peers`); wrap the program in `peers.exit_on_lost_peer`.

  Args:
    section: the config's `distributed` section.
    exit_code: the exit status when the coordinator address cannot work, or the processes
      do not all join within `section.initialization_timeout` seconds; the message goes
      to stderr first.

  Returns:
    The `Setup` joined, or None for a single-process run (nothing initialized).

  Raises:
    ConfigError: a bad or incomplete setup (see `resolve`), or JAX already started.
  """
  setup = resolve(section)
  if setup is None or jax.distributed.is_initialized():  # E.g. a notebook did it already.
    return setup
  if jax_internals.backends_started():
    raise ConfigError("JAX was used before distributed.initialize, so this process cannot join "
                      f"the {setup.num_processes}-process run.", key="distributed",
                      source="the program", fix="call zerojax.run.distributed.initialize first")
  if problem := address_problem(setup):
    src = setup.sources["coordinator_address"]
    peers.leave(f"error: distributed: {problem}.\n  fix: the coordinator address ({src}) must be "
           "process 0's host and a free port there.", exit_code)
  if jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeout, every = section.initialization_timeout, section.wait_report_every
  joined = threading.Event()

  def report_while_waiting():  # The main thread is stuck inside JAX's connect.
    start = time.monotonic()
    while not joined.wait(max(0.0, min(every, start + timeout - time.monotonic()))):
      waited = time.monotonic() - start
      if waited >= timeout:
        peers.leave(timeout_message(setup, timeout), exit_code)
      print(waiting_message(setup, waited, timeout), file=sys.stderr, flush=True)

  threading.Thread(target=report_while_waiting, daemon=True).start()
  try:
    jax.distributed.initialize(
        setup.coordinator_address, setup.num_processes, setup.process_id,
        local_device_ids=setup.local_device_ids,
        initialization_timeout=int(timeout) + _JAX_TIMEOUT_MARGIN_S,
        heartbeat_timeout_seconds=section.heartbeat_timeout,
        shutdown_timeout_seconds=section.shutdown_timeout)
  finally:
    joined.set()
  peers.start(setup.process_id, _split_address(setup.coordinator_address)[0],
              setup.num_processes)
  return setup


def meet(name: str, timeout: float) -> None:
  """Waits until every process has reached `meet(name)` (no-op in one process).

  Why: the first collective over a set of devices creates its gloo context (CPU) or NCCL
  communicator, and gloo waits a fixed 30 s for every process to arrive (XLA does not
  expose the timeout). Processes that compile on a loaded host drift apart by more than
  that, so they meet at the coordination service first, whose wait is ours to set.

  Args:
    name: unique in the run: the coordination service's barrier id.
    timeout: seconds to wait (`distributed.initialization_timeout`); then JAX raises.
  """
  if jax.process_count() > 1:
    client = jax_internals.distributed_client()
    client.wait_at_barrier(f"zerojax:{name}", int(timeout * 1000))


def together(fn: Any, name: str, timeout: float) -> Any:
  """`fn` (jitted), compiled on its first call, run only once every process has compiled
  it (`meet`); later calls run that executable (the same shapes and shardings)."""
  if jax.process_count() == 1:
    return fn
  compiled = None

  def call(*args):
    nonlocal compiled
    if compiled is None:
      compiled = fn.lower(*args).compile()
      meet(name, timeout)
    return compiled(*args)

  return call
