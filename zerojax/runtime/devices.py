"""Fake CPU devices: the one place that writes XLA's device-count flag.

`train.py --fake_devices N`, `python -m zerojax.memory --compile`, `python -m
zerojax.run.launch --devices_per_process M`, the tests and the benchmarks all get their
devices from here: `fake_cpu_devices(n)` for this process, `fake_devices_env(n)` for a
child's environment.
"""

import os
import sys
from collections.abc import Mapping

_COUNT_FLAG = "--xla_force_host_platform_device_count"

# XLA:CPU flags that make compiled memory resemble a GPU's: the memory-optimizing
# scheduler (the default one keeps more alive), and no hoisting of whole-stack f32
# copies out of the layer loop. The planner (`zerojax.memory`) is calibrated with them.
CPU_MEMORY_FLAGS = ("--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                    "--xla_disable_hlo_passes=while-loop-invariant-code-motion")


def fake_devices_env(n: int, *flags: str,
                     base: Mapping[str, str] | None = None) -> dict[str, str]:
  """An environment (a copy of `base`, default `os.environ`) that runs JAX on `n` CPU
  devices.

  Any device count already in XLA_FLAGS is replaced (n=0: removed, so XLA's default of
  one device); its other flags are kept and `flags` are appended. JAX_PLATFORMS is
  `cpu`: fake devices are CPU devices, also on a machine with an accelerator.
  """
  env = dict(os.environ if base is None else base)
  kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT_FLAG)]
  env["XLA_FLAGS"] = " ".join([*kept, *([f"{_COUNT_FLAG}={n}"] if n else []), *flags])
  env["JAX_PLATFORMS"] = "cpu"
  return env


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
  # Imported here: the launcher imports this module for `fake_devices_env` and starts
  # processes only; JAX's import would be 1.1 s of its CPU a start.
  from zerojax.runtime import jax_internals  # noqa: PLC0415  JAX's import off the launcher
  wanted = [*(CPU_MEMORY_FLAGS if memory_flags else ()), *flags]
  if jax_internals.backends_started():
    jax = sys.modules["jax"]
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
  if "jax" in sys.modules:  # JAX_PLATFORMS is read when jax is imported.
    sys.modules["jax"].config.update("jax_platforms", "cpu")
