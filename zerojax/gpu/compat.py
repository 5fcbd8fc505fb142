"""The JAX internals a deviceless GPU compile needs, each in one place and guarded.

JAX has no public call that compiles a lowered module for another backend's devices, so
`compile_for` does what `jax.stages.Lowered.compile` does inside (jax/_src/compiler.py
and interpreters/pxla.py, jax 0.10.2) with the compile-only client of a GPU topology.
Where JAX moves these internals, the error names this module and the tested version
instead of failing deep inside XLA.
"""

from __future__ import annotations

from typing import Any

TESTED_JAX = "0.10.2"


class UnsupportedJax(RuntimeError):
  """This JAX lacks an internal the GPU-target compile uses."""


def _internal(what: str, err: Exception) -> UnsupportedJax:
  import jax  # noqa: PLC0415

  return UnsupportedJax(f"the GPU-target compile needs {what}, which jax {jax.__version__} "
                        f"does not have as jax {TESTED_JAX} does ({err}); zerojax/gpu/compat.py "
                        "is the one place to adapt")


def compile_for(lowered, devices: list, options: dict[str, Any]):
  """Compiles `lowered` (traced over CPU devices, lowered for CUDA) for `devices` (a GPU
  topology's compile-only devices, partition k on devices[k]) with XLA debug `options`;
  returns the unloaded executable (memory stats and optimized HLO)."""
  import numpy as np  # noqa: PLC0415

  try:
    from jax._src import compiler  # noqa: PLC0415
    from jax._src.lib import xla_client  # noqa: PLC0415

    args = lowered._lowering.compile_args  # noqa: SLF001
    unspecified = lambda shardings: [type(s).__name__ == "UnspecifiedValue" for s in shardings]
    inputs, outputs = unspecified(args["in_shardings"]), unspecified(args["out_shardings"])
    tuple_args = args["tuple_args"]
  except (ImportError, AttributeError, KeyError) as err:
    raise _internal("jax._src.compiler and Lowered._lowering.compile_args", err) from err
  n = len(devices)
  compile_options = compiler.get_compile_options(
      num_replicas=1, num_partitions=n, device_assignment=np.array(devices).reshape(1, n),
      env_options_overrides=options)
  compile_options.parameter_is_tupled_arguments = tuple_args
  build = compile_options.executable_build_options
  build.allow_spmd_sharding_propagation_to_parameters = inputs
  build.allow_spmd_sharding_propagation_to_output = outputs
  client = devices[0].client
  return client.compile(lowered.compiler_ir("stablehlo"),
                        executable_devices=xla_client.DeviceList(tuple(devices)),
                        compile_options=compile_options)


def cuda_versions() -> tuple[int, int] | None:
  """(cuDNN, CUDA runtime) versions of the installed plugin as integers (92800 = 9.28.0,
  12090 = 12.9), or None where JAX cannot say."""
  try:
    from jax._src.lib import cuda_versions as versions  # noqa: PLC0415
  except ImportError:
    return None
  if versions is None:
    return None
  return versions.cudnn_get_version(), versions.cuda_runtime_get_version()
