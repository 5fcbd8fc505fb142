"""Named GPU targets: what XLA's GPU compiler is told about a GPU it compiles for.

A target is one `specs/<name>.txtpb` file: XLA's `GpuTargetConfigProto` with the
device's hardware facts (each value's source in the file's comments). `parse` reads the
spelling the command lines take:

    h100        as many H100s as the run has devices (--devices N)
    h100:8      8 H100s on one host
    h100:2x8    2 hosts of 8 H100s each (a multi-host topology: hybrid meshes compile
                across hosts as they would run)

What fits is judged as train.py would run on that GPU (`budget`): XLA's allocator takes
`XLA_PYTHON_CLIENT_MEM_FRACTION` of the memory left once the CUDA context exists (train.py
sets 0.95 with the XLA flag profile; JAX's default is 0.75), and the program's compiled
bytes must fit in that pool. What XLA does not allocate from its pool (NCCL's buffers,
the cuBLAS / cuDNN handles) lives in the rest.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

from zerojax.config.checks import ConfigError
from zerojax.gpu import compat, xla_flags

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")
ALIASES = {"a100": "a100_80gb", "4090": "rtx4090", "h100_sxm": "h100"}
INSTALL = 'pip install -e ".[gpu-compile]"  (or: pip install "jax[cuda12]==<your jax>")'
# Memory the CUDA context takes before XLA sizes its pool: round 1's H200 reported a pool
# (bytes_limit) of 142,606,336,000 B at fraction 0.95 of 150,754,820,096 B, which leaves
# 0.60 GiB to the context; rounded up to 1 GiB for the NCCL communicators and cuBLAS /
# cuDNN handles a multi-GPU process adds.
CONTEXT_BYTES = 1 << 30
DEFAULT_MEMORY_FRACTION = 0.75  # JAX's, where train.py sets none (xla.gpu_profile=False).


class Target(NamedTuple):
  """One GPU model: its name here, its device kind, memory bytes and the proto text."""
  name: str
  device_kind: str
  memory: int
  compute_capability: tuple[int, int]
  proto: str


class TargetSpec(NamedTuple):
  """A target and its topology: `hosts` x `per_host` devices."""
  target: Target
  hosts: int
  per_host: int

  @property
  def devices(self) -> int:
    return self.hosts * self.per_host

  @property
  def topology(self) -> str:
    """The topology string XLA's GPU client takes: slices x hosts x devices per host."""
    return f"1x{self.hosts}x{self.per_host}"

  def __str__(self) -> str:
    hosts = f"{self.hosts}x" if self.hosts > 1 else ""
    return f"{self.target.name}:{hosts}{self.per_host}"


def names() -> list[str]:
  """Every target's name."""
  return sorted(f[:-len(".txtpb")] for f in os.listdir(SPECS) if f.endswith(".txtpb"))


@functools.lru_cache(maxsize=None)
def load(name: str) -> Target:
  """The target `name` (or an alias: a100, 4090), with the installed plugin's cuDNN and
  CUDA runtime versions added to its proto (XLA's cuDNN rewrites read them)."""
  key = ALIASES.get(name.lower(), name.lower())
  path = os.path.join(SPECS, f"{key}.txtpb")
  if not os.path.exists(path):
    raise ConfigError(f"no GPU target named {name!r}.", source="the command line",
                      fix=f"one of: {', '.join(names())} (aliases: {', '.join(ALIASES)})")
  with open(path) as f:
    proto = f.read()
  field = lambda n: re.search(rf"{n}:\s*\"?([^\s\"]+)", proto).group(1)
  cc = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)\s*minor:\s*(\d+)", proto)
  return Target(key, re.search(r'device_description_str:\s*"([^"]+)"', proto).group(1),
                int(field("device_memory_size")), (int(cc.group(1)), int(cc.group(2))),
                proto + _versions())


def _versions() -> str:
  """The installed CUDA plugin's cuDNN and runtime versions as proto fields."""

  found = compat.cuda_versions()
  if found is None:
    return ""
  dnn, runtime = found
  return (f"dnn_version_info {{ major: {dnn // 10000} minor: {dnn // 100 % 100} "
          f"patch: {dnn % 100} }}\nruntime_version {{ major: {runtime // 1000} "
          f"minor: {runtime // 10 % 100} }}\n")


def parse(spec: str, devices: int | None = None) -> TargetSpec:
  """'h100', 'h100:8' or 'h100:2x8' as a `TargetSpec`; `devices` gives the count a bare
  name takes, and must agree with a spelled-out one.

  Raises:
    ConfigError: an unknown target, a malformed count, or one that contradicts `devices`.
  """
  name, _, count = spec.partition(":")
  target = load(name)
  if not count:
    if not devices:
      raise ConfigError(f"--target {spec} names no device count.", source="the command line",
                        fix=f"--target {name}:8 (8 devices), {name}:2x8 (2 hosts of 8)")
    return TargetSpec(target, 1, devices)
  shape = re.fullmatch(r"(?:(\d+)x)?(\d+)", count)
  if shape is None or int(shape.group(2)) < 1 or (shape.group(1) and int(shape.group(1)) < 1):
    raise ConfigError(f"--target {spec}: {count!r} is not a device count.",
                      source="the command line",
                      fix=f"--target {name}:8 (8 devices), {name}:2x8 (2 hosts of 8)")
  parsed = TargetSpec(target, int(shape.group(1) or 1), int(shape.group(2)))
  if devices and devices != parsed.devices:
    raise ConfigError(f"--target {spec} has {parsed.devices} devices, --devices says {devices}.",
                      source="the command line", fix="give the count once")
  return parsed


def memory_fraction(config, environ: Mapping[str, str] = os.environ) -> float:
  """The share of the GPU XLA's allocator takes when train.py runs `config`: the
  environment's XLA_PYTHON_CLIENT_MEM_FRACTION, else train.py's (xla.gpu_profile), else
  JAX's default."""
  if "XLA_PYTHON_CLIENT_MEM_FRACTION" in environ:
    return float(environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
  return float(xla_flags.MEMORY_FRACTION) if config.xla.gpu_profile else DEFAULT_MEMORY_FRACTION


def budget(target: Target, fraction: float) -> int:
  """Bytes of a device the compiled program may use: the allocator's pool."""
  return int(fraction * (target.memory - CONTEXT_BYTES))


def without_driver() -> None:
  """Lets JAX's CUDA plugin load without a GPU: at JAX's start it checks the driver and
  CUDA libraries, which fails (a logged traceback) where there is none. Call before JAX
  starts a backend; on a GPU machine it skips only those version checks."""
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


def plugin_installed() -> bool:
  """Whether JAX's CUDA plugin (which holds XLA's GPU compiler) is installed."""
  try:
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"))
  except ModuleNotFoundError:  # No jax_plugins package at all.
    return False


def require_plugin() -> None:
  """ConfigError (exit 2) naming the install command when the plugin is missing."""
  if not plugin_installed():
    raise ConfigError("--target compiles with XLA's GPU compiler, which is in JAX's CUDA "
                      "plugin, and the plugin is not installed.", source="the command line",
                      fix=f"{INSTALL} (no GPU or driver needed)")
