"""From a validated config to the compiled-ready pieces of a run: one place for both
`train.py` and the memory planner (`zerojax.memory`), so the step the planner compiles
is the step that trains.

`build(config)` makes the mesh, the model, the optimizer and its schedule, the ZeRO
plan and the jitted train step, plus abstract (sharded `jax.ShapeDtypeStruct`) inputs
to lower that step with: nothing is allocated. `cpu_memory_flags` / `fake_cpu_devices`
set XLA:CPU's environment and must run before JAX starts its backend.
"""

import collections
import glob
import os
import re
import sys
import time
from typing import Any, NamedTuple

# XLA:CPU flags that make compiled memory resemble a GPU's (DESIGN.md): the memory-
# optimizing scheduler, and no hoisting of whole-stack f32 copies out of the layer loop.
CPU_MEMORY_FLAGS = ("--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                    "--xla_disable_hlo_passes=while-loop-invariant-code-motion")


def fake_cpu_devices(n: int, *extra_flags: str) -> None:
  """Runs JAX on `n` fake CPU devices with `CPU_MEMORY_FLAGS` (and `extra_flags`).

  XLA reads XLA_FLAGS once, when JAX first starts a backend: call this before any
  device or compile work (importing jax is fine; `jax.devices()` is too late).

  Raises:
    RuntimeError: a JAX backend is already running.
  """
  bridge = sys.modules.get("jax._src.xla_bridge")
  if bridge is not None and getattr(bridge, "_backends", None):
    raise RuntimeError("fake_cpu_devices must run before JAX starts a backend "
                       "(before jax.devices() or any computation)")
  os.environ["XLA_FLAGS"] = " ".join([
      os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={n}",
      *CPU_MEMORY_FLAGS, *extra_flags]).strip()
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:  # JAX_PLATFORMS is read when jax is imported.
    sys.modules["jax"].config.update("jax_platforms", "cpu")


class Built(NamedTuple):
  """Everything `build` makes; see there."""
  mesh: Any
  model: Any
  tx: Any
  schedule: Any
  loss_scaling: Any
  plan: Any
  train_step: Any
  batch_sharding: Any
  abstract_state: Any
  abstract_batch: Any


def build(config) -> Built:
  """The run's mesh, model, optimizer, ZeRO plan, train step and abstract inputs.

  Args:
    config: a config validated for `jax.device_count()` devices
      (`zerojax.config.load_config(..., num_devices=jax.device_count())`).

  Returns:
    A `Built`; `built.train_step.lower(built.abstract_state, built.abstract_batch)`
    compiles the step without allocating anything.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel

  import zerojax  # pylint: disable=import-outside-toplevel
  from zerojax import models, optim, precision  # pylint: disable=import-outside-toplevel
  from zerojax.mesh import mesh_from_config  # pylint: disable=import-outside-toplevel

  c, t = config, config.train
  mesh = mesh_from_config(c)
  model = models.from_config(c)
  tx, schedule = optim.optimizer_from_config(
      c.optimizer, t.steps, mask=optim.decay_mask(model.logical_axes()), seed=c.seed)
  loss_scaling = precision.loss_scaling_from_config(c.precision)
  plan = zerojax.make_plan(mesh, c.zero.stage, jax.eval_shape(model.init, jax.random.key(c.seed)),
                           tx, logical_axes=model.logical_axes(),
                           min_shard_size=c.zero.min_shard_size)
  train_step = zerojax.make_train_step(
      plan, model.loss, tx, microbatches=t.microbatches, max_grad_norm=c.optimizer.grad_clip,
      learning_rate=schedule, reduce_dtype=c.precision.reduce_dtype,
      accum_dtype=c.precision.accum_dtype, loss_scaling=loss_scaling)
  batch_sharding = NamedSharding(mesh, plan.batch_spec)
  abstract_batch = {"tokens": jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len + 1),
                                                   jnp.int32, sharding=batch_sharding)}
  return Built(mesh, model, tx, schedule, loss_scaling, plan, train_step, batch_sharding,
               zerojax.abstract_state(plan), abstract_batch)


def compile_step(built: Built, dump_to: str | None = None) -> tuple[Any, dict]:
  """Compiles the step from abstract inputs: (the executable, XLA's per-device bytes
  (arguments, temporaries, outputs, aliased) and the compile time in seconds).

  The executable runs the step on real inputs laid out like the abstract ones, so a
  trainer that reports memory compiles once. `dump_to`: also dump the compiled module
  and its buffer assignment there.
  """
  options = {} if dump_to is None else dict(
      xla_dump_to=dump_to, xla_dump_hlo_as_text=True, xla_dump_hlo_module_re="jit_step")
  start = time.perf_counter()
  compiled = built.train_step.lower(built.abstract_state, built.abstract_batch).compile(
      compiler_options=options)
  mem = compiled.memory_analysis()
  return compiled, dict(arguments=mem.argument_size_in_bytes, temporaries=mem.temp_size_in_bytes,
                        outputs=mem.output_size_in_bytes, aliased=mem.alias_size_in_bytes,
                        seconds=time.perf_counter() - start)


def compiled_memory(built: Built, dump_to: str | None = None) -> dict:
  """`compile_step`'s bytes and seconds alone."""
  return compile_step(built, dump_to)[1]


def live_at_peak(dump_dir: str) -> list[tuple[int, str, str]]:
  """(bytes, shape, HLO value name) of the step's temporaries alive at their peak,
  largest first, from an XLA dump
  (`compiled_memory(..., dump_to=DIR)`): the buffer assignment's temporaries,
  replayed over the live ranges; values sharing an (offset, size) slot count once."""
  found = glob.glob(os.path.join(dump_dir, "*jit_step*after_optimizations-live-range.txt"))
  if not found:
    return []
  base = found[0][:-len("-live-range.txt")]
  with open(base + "-buffer-assignment.txt") as f:
    temp = f.read().split("preallocated-temp:")[1].split("\nallocation")[0]
  with open(base + "-live-range.txt") as f:
    live = {n: (int(a), int(b)) for n, a, b in re.findall(r"^    (\S+\{\S*\}):(\d+)-(\d+)",
                                                         f.read(), re.M)}
  slots = collections.defaultdict(list)  # (offset, size) -> [(start, end, shape, name)]
  for name, size, offset, shape in re.findall(
      r"value: <\d+ (\S+)(?: \(phi\))? @\S+> \(size=(\d+),offset=(\d+)\): (\S+)", temp):
    name = name if "{" in name else name + "{}"
    if name in live:
      slots[(int(offset), int(size))].append((*live[name], shape.split("{")[0], name))
  events = collections.Counter()
  for (_, size), spans in slots.items():
    end = -1
    for start, stop, *_ in sorted(spans):  # A slot's overlapping spans count once.
      start = max(start, end + 1)
      if stop >= start:
        events[start], events[stop + 1], end = events[start] + size, events[stop + 1] - size, stop
  total, peak, when = 0, 0, 0
  for t in sorted(events):
    total += events[t]
    if total > peak:
      peak, when = total, t
  return sorted(((size, *next((sh, n) for a, b, sh, n in spans if a <= when <= b))
                 for (_, size), spans in slots.items()
                 if any(a <= when <= b for a, b, *_ in spans)), reverse=True)
