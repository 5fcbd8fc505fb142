"""The train step compiled by XLA's GPU compiler for a GPU target, on a machine without one.

How, and why this way: JAX can describe a GPU topology without a GPU
(`jax.experimental.topologies`, the CUDA plugin's compile-only client), but the devices
it returns have no memory spaces, and JAX drops a sharding's `memory_kind` on such
devices: the optimizer-state offload would silently compile as if nothing were
offloaded. So the step is traced over a mesh of as many CPU devices (which do have
`pinned_host`), lowered for CUDA (`lowering_platforms=('cuda',)`: CUDA's lowering rules,
cuDNN's attention custom calls, the host moves as `annotate_device_placement`), and that
module is compiled by the topology's compile-only client for the target's devices, with
the compile options train.py's XLA flag profile gives. Partition k of the CPU mesh is
device k of the topology in (host, id) order, as `mesh.make_mesh` lays out real devices.

Call `prepare(n)` before JAX starts a backend: it makes the n CPU devices and lets the
CUDA plugin load without a driver.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.experimental import topologies

from zerojax.gpu import compat, xla_flags
from zerojax.gpu.targets import TargetSpec, require_plugin, without_driver
from zerojax.runtime import jax_internals
from zerojax.runtime.devices import fake_cpu_devices
from zerojax.runtime.platform import targeting


class GpuCompiled(NamedTuple):
  """What XLA's GPU compiler made: the optimized module's text and its per-device bytes.

  `memory` has build.compile_step's keys: arguments (device memory), temporaries,
  outputs, aliased, host_arguments (the offloaded state), seconds; plus host_outputs.
  """
  hlo: str
  memory: dict
  flags: dict  # The XLA debug options given (the flag profile), by name.


def prepare(num_devices: int) -> None:
  """Before JAX starts a backend: `num_devices` CPU devices to trace over, and the CUDA
  plugin allowed to load without a GPU (its driver and version checks need one).

  Raises:
    ConfigError: the CUDA plugin is not installed (the `gpu-compile` extra).
  """
  require_plugin()
  if jax_internals.backends_started():  # Started (a test, a REPL):
    if jax.default_backend() != "cpu" or jax.device_count() != num_devices:
      raise RuntimeError(f"a GPU-target compile of {num_devices} devices traces over as many "
                         "CPU devices, and JAX already started with "
                         f"{jax.device_count()} {jax.default_backend()} device(s): call "
                         "zerojax.gpu.compile.prepare() before JAX starts a backend")
    return
  without_driver()
  fake_cpu_devices(num_devices, memory_flags=False)


def devices(spec: TargetSpec) -> list:
  """The target's devices (compile-only), in (host, id) order."""
  try:
    topology = topologies.get_topology_desc(platform="cuda", target_config=spec.target.proto,
                                            topology=spec.topology)
  except Exception as err:  # noqa: BLE001  (the plugin's errors are plain RuntimeErrors)
    raise RuntimeError(f"XLA's GPU client could not make the topology {spec}: {err}. "
                       "zerojax.gpu.compile.prepare() must run before JAX starts a "
                       "backend") from err
  return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def profile_options(config) -> dict[str, Any]:
  """train.py's XLA flag profile for `config` on a GPU as compile options (an empty dict
  with xla.gpu_profile=False); the user's XLA_FLAGS win, as in train.py."""
  if not config.xla.gpu_profile:
    return {}
  profile = xla_flags.for_config(config)
  chosen, _ = xla_flags.resolve(profile, os.environ.get("XLA_FLAGS", ""), xla_flags.known_flags(
      xla_flags.forms(profile), environ=os.environ))
  return dict(_option(f) for f in chosen)


def _option(flag: str) -> tuple[str, Any]:
  name, _, value = flag.lstrip("-").partition("=")
  if value.lower() in ("true", "false"):
    return name, value.lower() == "true"
  return name, int(value) if value.isdigit() else value


def lower(jitted, args: Sequence[Any], spec: TargetSpec | None = None):
  """`jitted(*args)` traced as for a GPU (`spec`'s: its compute capability; None: a GPU
  not known) and lowered for CUDA (a `jax.stages.Lowered`).

  The choices `backend()` and `compute_capability()` answer (cuDNN attention, its head
  sizes) are made while tracing, and JAX's trace cache does not know them: a trace for
  the target neither reuses one made for this process's CPU nor is reused by it.
  """
  jitted.clear_cache()
  try:
    with targeting("gpu", spec and spec.target.compute_capability):
      return jitted.trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    jitted.clear_cache()


def compile_jitted(jitted, args: Sequence[Any], mesh, spec: TargetSpec,
                   options: dict[str, Any] | None = None,
                   dump_to: str | None = None, kernel_cache: bool = True) -> GpuCompiled:
  """`jitted(*args)` (abstract args sharded over `mesh`, a mesh of CPU devices) compiled
  by XLA's GPU compiler for `spec`'s devices.

  Args:
    jitted: a `jax.jit` function.
    args: its arguments (`jax.ShapeDtypeStruct`s with shardings are enough).
    mesh: the CPU mesh the args are sharded over; `spec.devices` devices.
    spec: the GPU target and topology.
    options: XLA debug options (`profile_options`).
    dump_to: also dump the optimized module and its buffer assignment there.
    kernel_cache: reuse the kernels earlier compiles in this process made for the same
      compute capability (`_kernel_cache`); the module and its bytes are the same either way.
  """

  if mesh.devices.size != spec.devices:
    raise ValueError(f"the mesh has {mesh.devices.size} devices, the target {spec.devices}")
  options = dict(options or {})
  start = time.perf_counter()
  lowered = lower(jitted, args, spec)
  key = hashlib.sha256(f"{lowered.as_text()}{spec}{sorted(options.items())}{kernel_cache}"
                       .encode()).digest()
  if dump_to is None and key in _COMPILED:
    return _COMPILED[key]
  targets = devices(spec)
  dump = {} if dump_to is None else dict(xla_dump_to=dump_to, xla_dump_hlo_as_text=True,
                                           xla_dump_hlo_module_re="jit_step")
  cache = _kernel_cache(spec) if kernel_cache else {}
  executable = compat.compile_for(lowered, targets, {**options, **dump, **cache})
  stats = executable.get_compiled_memory_stats()
  memory = dict(arguments=stats.argument_size_in_bytes, temporaries=stats.temp_size_in_bytes,
                outputs=stats.output_size_in_bytes, aliased=stats.alias_size_in_bytes,
                host_arguments=stats.host_argument_size_in_bytes,
                host_outputs=stats.host_output_size_in_bytes,
                host_temporaries=stats.host_temp_size_in_bytes,
                seconds=time.perf_counter() - start)
  _COMPILED[key] = GpuCompiled(executable.hlo_modules()[0].to_string(), memory, options)
  while len(_COMPILED) > _KEEP:
    del _COMPILED[next(iter(_COMPILED))]
  return _COMPILED[key]


# What XLA's GPU compiler made, by (lowered module, target, options): a program met twice
# in a process (`memory.fit`'s candidates, two configs that lower alike) compiles once, as
# JAX's own cache does for the programs it runs; none is kept for a compile that dumps
# (the dump is what it is for). GpuCompiled is immutable; its `seconds` are the compile's.
_COMPILED: dict[bytes, GpuCompiled] = {}
_KEEP = 64


def _kernel_cache(spec: TargetSpec) -> dict[str, Any]:
  """XLA's kernel cache file for `spec`'s compute capability, for this process's compiles.

  Why: most of a GPU compile's CPU is code generation, LLVM and ptxas (~190 runs a
  compile) for each fusion's kernel, and the compiles of one process (the planner's
  `memory.fit` candidates, a test session's matrix) share most fusions: XLA reuses a
  kernel it compiled before for the same fused computation (its fingerprint) and
  compiles only the new ones. One file per compute capability, not per GPU model: a
  kernel is machine code for one capability, which GPUs share (sm_89: the L40S and the
  RTX 4090; sm_90: the H100 and the H200), so the L40S's 70B recipe reuses most of the
  RTX 4090's kernels (XLA's GPU compiler on 2 cores: 9.1 -> 4.2 s of CPU). The
  optimized module and its buffer assignment are made before any kernel is, and are the
  same with or without the file, another model's kernels in it included
  (tests/test_gpu_targets.py: an H200 step compiled with the H100s' kernels), so every
  figure read from them is. In a folder removed at exit; none where the user's XLA_FLAGS
  name their own.
  """
  if "xla_gpu_kernel_cache_file" in os.environ.get("XLA_FLAGS", ""):
    return {}
  major, minor = spec.target.compute_capability
  return {"xla_gpu_kernel_cache_file": os.path.join(_kernel_folder(), f"sm_{major}{minor}.bin")}


@functools.cache
def _kernel_folder() -> str:
  """The folder of this process's kernel cache files, made at the first compile."""
  folder = tempfile.mkdtemp(prefix="zerojax-gpu-kernels-")
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  return folder


def compile_step(built, config, spec: TargetSpec, dump_to: str | None = None) -> GpuCompiled:
  """`build.build(config)`'s train step compiled for `spec` with train.py's flags."""
  return compile_jitted(built.train_step, (built.abstract_state, built.abstract_batch),
                        built.mesh, spec, profile_options(config), dump_to)
