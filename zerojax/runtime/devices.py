"""Fake CPU devices: this process's (`fake_cpu_devices`); a child's environment is
`device_env.fake_devices_env`, the one writer of XLA's device-count flag.

`train.py --fake_devices N`, `python -m zerojax.memory --compile`, `python -m
zerojax.run.launch --devices_per_process M`, the tests and the benchmarks all get their
devices from these two.
"""

import os

import jax

from zerojax.runtime import jax_internals
from zerojax.runtime.device_env import CPU_MEMORY_FLAGS, fake_devices_env


def _parsed(flags: list[str]) -> dict[str, str]:
  """{flag: value} of XLA flags as XLA reads them (the last of a repeated flag wins)."""
  return dict((f.split("=", 1) + [""])[:2] for f in flags)


def fake_cpu_devices(n: int, *flags: str, memory_flags: bool = True) -> None:
  """Runs this process's JAX on `n` fake CPU devices (see `fake_devices_env`).

  Args:
    n: the device count.
    *flags: more XLA flags.
    memory_flags: also set `CPU_MEMORY_FLAGS`, so compiled memory is what the planner
      expects (train.py and the planner); the tests compile faster without them.

  XLA reads XLA_FLAGS once, when JAX first starts a backend: call this before any
  device or compile work (importing jax is fine; `jax.devices()` is too late). Once a
  backend runs, a call it already satisfies (a CPU backend of `n` devices, every flag
  asked for already in XLA_FLAGS with its value) returns quietly: one process may run
  several `zerojax.memory` or `train.py` mains with the same devices.

  Raises:
    RuntimeError: a JAX backend already runs with other devices or flags.
  """
  wanted = [*(CPU_MEMORY_FLAGS if memory_flags else ()), *flags]
  if jax_internals.backends_started():
    running = _parsed(os.environ.get("XLA_FLAGS", "").split())
    missing = sorted(f for f, v in _parsed(wanted).items() if running.get(f) != v)
    if jax.default_backend() != "cpu" or jax.local_device_count() != max(n, 1) or missing:
      raise RuntimeError(
          f"fake_cpu_devices({n}) must run before JAX starts a backend (before "
          f"jax.devices() or any computation): JAX already runs {jax.local_device_count()} "
          f"{jax.default_backend()} device(s)"
          + (f" without the XLA flags {missing}" if missing else ""))
    return
  os.environ.update(fake_devices_env(n, *wanted))
  jax.config.update("jax_platforms", "cpu")  # JAX read JAX_PLATFORMS at its import.
