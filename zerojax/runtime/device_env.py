"""A child process's environment for fake CPU devices; imports no JAX.

The one place that writes XLA's device-count flag (`fake_devices_env`). The launcher
(`zerojax.run.launch`), which only starts processes, imports it and so loads no JAX
(1.1 s of CPU a start); this process's own devices are `runtime.devices`'.
"""

import os
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
