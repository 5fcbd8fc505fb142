"""XLA's GPU performance flags: the profile train.py applies on a GPU, and why.

XLA reads `XLA_FLAGS` once, when JAX starts its first backend, and it aborts the process
on a flag it does not know (`Unknown flags in XLA_FLAGS`). Flags come and go between
XLA versions (the per-collective pipelining booleans replaced one
`xla_gpu_enable_pipelined_collectives`; the while-loop double-buffering boolean became
the `xla_gpu_enable_while_loop_unrolling` enum), so each entry of the profile lists its
forms, newest first, and the first form the installed XLA parses is used: `known_flags`
asks it, in a child process, before this process starts a backend.

A flag the user already put in `XLA_FLAGS` (any value, any of its forms) wins over the
profile, and so does `XLA_PYTHON_CLIENT_MEM_FRACTION`; `xla.gpu_profile=False` turns the
profile off. What the profile chose is printed in the run's log.

    python -m zerojax.gpu.xla_flags --config configs/8b_bf16.py   # the profile and why
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from typing import NamedTuple

from zerojax import models
from zerojax.config import load_config

# XLA's allocator takes 75% of a GPU by default; the rest sits unused by a training
# step (the 8B step needs ~100 GB of an H200's 141). cuDNN and NCCL's own buffers live
# in what remains, so not 1.0 (NVIDIA's JAX-Toolbox recommends 0.8-0.9 for that reason).
MEMORY_FRACTION = "0.95"
# {flag name: whether this XLA parses it}, as JSON: `known_flags`' answers for children.
ASKED_VAR = "ZEROJAX_XLA_FLAGS_ASKED"


class Flag(NamedTuple):
  """One profile entry: `forms` ("--name=value", newest XLA's first) and why it is set."""
  forms: tuple[str, ...]
  why: str


def flag_name(flag: str) -> str:
  """'--xla_foo=1' -> 'xla_foo'."""
  return flag.lstrip("-").split("=", 1)[0]


def layer_bytes(config) -> int:
  """Bytes of one layer's parameters in float32 (the widest dtype the step reduces them
  in): the leaves stacked under 'layers'; 0 for a model without a layer stack."""
  shapes = models.from_config(config).param_shapes()
  return 4 * sum(math.prod(shape[1:]) for path, (shape, _) in shapes.items()
                 if path[0] == "layers")


# Host copies XLA may keep in flight when release writes behind: a layer's reads ahead
# (params and every state buffer, 9-27 leaves) under its recompute and its writes under
# the backward matmuls. At XLA's default of 2 they queue behind each other: the 70B on
# 8 x RTX 4090 then puts 25% of the copies' bytes under compute, at 32 all of them
# (docs/design/offload-and-streaming.md).
HOST_COPIES = 32
# XLA's GPU scheduler keeps a step's temporaries within (80% of the device - the step's
# arguments) x the slop factor, 95% by default (`GetSchedulerMemoryLimit`); over it, it
# keeps each host copy's start and done together. Where the arguments take most of the
# device (the 405B on 8 H200s: 94.50 of 140 GiB) that limit (16.9 GiB) is below what the
# step holds anyway (26 GiB), and written behind it put 6% of the copies' time under
# compute; at 200% all but 4%, for 0.6 GiB more (122.38 GiB of its 132.43 pool). The
# compiled bytes, not this limit, are what each recipe is checked against.
WRITE_BEHIND_SLOP = 200
DEFAULT_SLOP = 95  # XLA's own.


def scheduler_slop(write_behind: bool) -> int:
  """The slop factor, in percent, XLA's scheduler memory limit runs at under the profile
  (`for_config`): what the planner reads XLA's one-device schedule against."""
  return WRITE_BEHIND_SLOP if write_behind else DEFAULT_SLOP


def for_config(config) -> list[Flag]:
  """The profile for `config`: its layer's bytes (`layer_bytes`) and whether release
  writes its updates behind (`optimizer.release_write_behind`)."""
  behind = config.optimizer.release_write_behind
  slop = scheduler_slop(behind)
  return gpu_profile(layer_bytes(config), HOST_COPIES if behind else 0,
                     slop if slop != DEFAULT_SLOP else 0)


def gpu_profile(layer_size: int, host_copies: int = 0, slop: int = 0) -> list[Flag]:
  """The profile for a model whose layer holds `layer_size` bytes (`layer_bytes`), with
  `host_copies` asynchronous host copies in flight (0: XLA's default, 2) and XLA's
  scheduler memory limit at `slop` percent (0: XLA's default, 95).

  Stage 3 gathers each layer's parameters in the layer loop and reduce-scatters its
  gradients in the backward loop; stages 1-2 reduce-scatter gradients and all-gather
  the updated parameters once a step. These flags let those collectives run under the
  neighbouring layer's matmuls instead of between them.
  """
  flags = [
      Flag(("--xla_gpu_enable_latency_hiding_scheduler=true",),
           "schedules asynchronous collectives to overlap compute (XLA's default scheduler "
           "starts each just before its use)"),
      Flag(("--xla_gpu_enable_pipelined_all_gather=true",
            "--xla_gpu_enable_pipelined_collectives=true"),
           "stage 3: layer i+1's parameter gather is issued in layer i's loop iteration"),
      Flag(("--xla_gpu_enable_pipelined_reduce_scatter=true",
            "--xla_gpu_enable_pipelined_collectives=true"),
           "stage 3: layer i's gradient reduce-scatter completes in iteration i-1 of the "
           "backward loop"),
      Flag(("--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER",
            "--xla_gpu_enable_while_loop_double_buffering=true"),
           "unrolls the layer loop by two, so a pipelined collective writes the buffer the "
           "current iteration is not reading (no copy per layer)"),
  ]
  if layer_size:
    # A power of two at least one layer's float32 bytes: each layer's gathers (and its
    # gradient reductions) combine into one collective, never split mid-layer.
    threshold = 1 << max(layer_size - 1, 1).bit_length()
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
      flags.append(Flag((f"--xla_gpu_{op}_combine_threshold_bytes={threshold}",),
                        f"one layer's {op.replace('_', '-')}s ({layer_size / 2**20:.0f} MiB in "
                        f"float32) combine into one collective"))
  if host_copies:
    flags.append(Flag(
        (f"--xla_gpu_experimental_parallel_async_compute_limit={host_copies}",),
        f"release writes behind: up to {host_copies} host copies in flight (XLA's default 2 "
        "queues a layer's copies behind each other, outside the matmuls)"))
  if slop:
    flags.append(Flag(
        (f"--xla_gpu_memory_limit_slop_factor={slop}",),
        f"release writes behind: XLA's scheduler memory limit at {slop}%, not 95%, of 80% "
        "of the device less the arguments, which a step whose arguments fill most of the "
        "device exceeds anyway (it then keeps every host copy's start and done together)"))
  return flags


def known_flags(flags: Iterable[str], python: str = sys.executable,
                environ: MutableMapping[str, str] | None = None) -> set[str]:
  """The subset of `flags` that the installed XLA parses.

  Asks a child process (JAX on CPU, which parses every XLA flag, GPU ones included):
  an unknown flag aborts it with the list of unknown ones, which are dropped, and the
  rest are asked again. With `environ`, the answers (by flag name) are kept in its
  `ASKED_VAR` and read from there next time, by this process or its children (each of
  `benchmarks/gpu.py`'s measurements would otherwise pay a JAX start to ask).
  """
  flags = list(dict.fromkeys(flags))
  asked = json.loads((environ or {}).get(ASKED_VAR, "{}"))
  pending = [f for f in flags if flag_name(f) not in asked]
  if pending:
    known = _ask(pending, python)
    asked.update({flag_name(f): f in known for f in pending})
    if environ is not None:
      environ[ASKED_VAR] = json.dumps(asked, sort_keys=True)
  return {f for f in flags if asked[flag_name(f)]}


def _ask(pending: list[str], python: str) -> set[str]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  while pending:
    env["XLA_FLAGS"] = " ".join(pending)
    run = subprocess.run([python, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    if run.returncode == 0:
      return set(pending)
    unknown = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", run.stderr)
    if unknown is None:
      raise RuntimeError(f"could not ask XLA which flags it knows:\n{run.stderr[-2000:]}")
    pending = [f for f in pending if f not in unknown.group(1).split()]
  return set()


def forms(profile: list[Flag]) -> list[str]:
  """Every form of every entry of `profile`, what `known_flags` is asked about."""
  return [f for entry in profile for f in entry.forms]


def resolve(profile: list[Flag], user_flags: str, known: set[str]) -> tuple[list[str], list[str]]:
  """(flags to add, lines for the log): per entry, nothing if the user set any of its
  forms' names, else its first known form (none known: a line says so)."""
  users = {flag_name(f) for f in user_flags.split()}
  chosen, lines = [], []
  for entry in profile:
    names = {flag_name(form) for form in entry.forms}
    if names & users:
      lines.append(f"  {' / '.join(sorted(names & users))}: as XLA_FLAGS sets it")
      continue
    form = next((f for f in entry.forms if f in known), None)
    if form is None:
      lines.append(f"  not in this XLA: {' / '.join(entry.forms)}")
    elif form not in chosen:  # Two entries may fall back to one old flag.
      chosen.append(form)
      lines.append(f"  {form}: {entry.why}")
  return chosen, lines


def on_gpu(environ: Mapping[str, str] = os.environ) -> bool:
  """Whether JAX will start on an NVIDIA GPU, decided before any backend starts.

  JAX_PLATFORMS when set (fake CPU devices set it to cpu); else a CUDA plugin installed
  and a driver present, which is what JAX's own platform choice would find.
  """
  platforms = environ.get("JAX_PLATFORMS", "")
  if platforms:
    return any(p in ("cuda", "gpu") for p in platforms.lower().split(","))
  return any(_installed(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                     "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
             ) and os.path.exists("/dev/nvidiactl")


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # Its parent package (jax_plugins) is not installed.
    return False


def apply_gpu_profile(config, environ: MutableMapping[str, str] = os.environ,
                      python: str = sys.executable) -> list[str]:
  """Adds the profile's flags to `environ`'s XLA_FLAGS (and the memory fraction) when
  `config.xla.gpu_profile` is on and JAX will run on a GPU; returns the log's lines.

  Call before JAX starts a backend (train.py does, right after reading the config).
  """
  if not config.xla.gpu_profile or not on_gpu(environ):
    return []
  profile = for_config(config)
  user = environ.get("XLA_FLAGS", "")
  chosen, lines = resolve(profile, user, known_flags(forms(profile), python, environ))
  environ["XLA_FLAGS"] = " ".join([*user.split(), *chosen])
  lines.append("  XLA_PYTHON_CLIENT_MEM_FRACTION="
               + environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEMORY_FRACTION))
  return ["xla: the GPU profile (zerojax.gpu.xla_flags; xla.gpu_profile=False turns it off):",
          *lines]


def main(argv: list[str] | None = None) -> int:
  """Prints the profile for a config, resolved against the installed XLA."""
  parser = argparse.ArgumentParser(prog="python -m zerojax.gpu.xla_flags", description=__doc__
                                   .split("\n")[0])
  parser.add_argument("--config", required=True, help="a config file (configs/*.py)")
  args = parser.parse_args(argv)
  config = load_config(args.config, [])
  profile = for_config(config)
  chosen, lines = resolve(profile, os.environ.get("XLA_FLAGS", ""), known_flags(forms(profile)))
  print("\n".join(lines))
  print(f"XLA_FLAGS='{' '.join(chosen)}'")
  return 0


if __name__ == "__main__":
  sys.exit(main())
