"""From a validated config to the compiled-ready pieces of a run: one place for both
`train.py` and the memory planner (`zerojax.memory`), so the step the planner compiles
is the step that trains.

`build(config)` makes the mesh, the model, the optimizer and its schedule, the ZeRO
plan and the jitted train step, plus abstract (sharded `jax.ShapeDtypeStruct`) inputs
to lower that step with: nothing is allocated. `compile_step` compiles it (and can dump
what XLA made of it, for `zerojax.runtime.xla_dump`).
"""

import contextlib
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import zerojax
from zerojax import models, optim, streaming, vocab
from zerojax.config import ConfigError
from zerojax.data import sft
from zerojax.mesh import mesh_from_config, processes_per_group
from zerojax.optim import precision
from zerojax.release import make_release_step
from zerojax.runtime import xla_dump


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


def build(config, devices=None) -> Built:
  """The run's mesh, model, optimizer, ZeRO plan, train step and abstract inputs.

  Args:
    config: a config validated for `jax.device_count()` devices
      (`zerojax.config.load_config(..., num_devices=jax.device_count())`), or for
      `len(devices)`.
    devices: the devices of the mesh (default: all).

  Returns:
    A `Built`; `built.train_step.lower(built.abstract_state, built.abstract_batch)`
    compiles the step without allocating anything.
  """


  c, t = config, config.train
  mesh = mesh_from_config(c, devices)
  if c.mesh.sequence_parallel and processes_per_group(mesh) > 1:
    # Each process reads its own rows (`data.process_rows`); a sequence split over
    # processes would need the same rows on all of them.
    raise ConfigError(f"an fsdp group spans {processes_per_group(mesh)} processes, and a "
                      "sequence split over processes is not supported yet.",
                      key="mesh.sequence_parallel",
                      fix="keep each fsdp group in one host: mesh.data = the number of hosts")
  model = models.from_config(c)
  shapes, axes = abstract_params(model)
  tx, schedule = optim.optimizer_from_config(
      c.optimizer, t.steps, mask=optim.decay_mask(axes), seed=c.seed)
  loss_scaling = precision.loss_scaling_from_config(c.precision)
  check_offload(c, mesh.devices.flat[0])
  plan = zerojax.make_plan(mesh, c.zero.stage, shapes, tx, logical_axes=axes,
                           min_shard_size=c.zero.min_shard_size,
                           offload=c.optimizer.offload == "host",
                           param_offload=c.zero.param_offload == "host",
                           sequence_axes=("fsdp",) if c.mesh.sequence_parallel else (),
                           vocab_parallel=c.zero.vocab_parallel and getattr(
                               model, "vocab_parallel", False) and vocab.pays(
                                   gathered_tokens(c, mesh), c.model.vocab_size))
  # zerojax's models cast each weight to the compute dtype where they use it, so they
  # may see their params in fp32: those weight gradients then stay fp32 to the reduction.
  upcast = c.precision.upcast_params
  if c.optimizer.release:
    train_step = make_release_step(
        plan, model.layered(), tx, microbatches=t.microbatches,
        accumulation=c.optimizer.release_accumulation, max_grad_norm=c.optimizer.grad_clip,
        clipping=c.optimizer.release_clipping, learning_rate=schedule,
        reduce_dtype=c.precision.reduce_dtype, loss_scaling=loss_scaling, upcast_params=upcast,
        write_behind=c.optimizer.release_write_behind,
        writes_first=c.optimizer.release_writes_first)
  else:
    train_step = zerojax.make_train_step(
        plan, model.loss, tx, microbatches=t.microbatches, max_grad_norm=c.optimizer.grad_clip,
        learning_rate=schedule, reduce_dtype=c.precision.reduce_dtype,
        accum_dtype=c.precision.accum_dtype, loss_scaling=loss_scaling, upcast_params=upcast)
  batch_sharding = NamedSharding(mesh, plan.batch_spec)
  shapes = ({"tokens": ((t.global_batch_size, t.seq_len + 1), jnp.int32)}
            if c.data.name != "sft" else sft.batch_shapes(t.global_batch_size, t.seq_len))
  abstract_batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)
                    for k, (shape, dtype) in shapes.items()}
  return Built(mesh, model, tx, schedule, loss_scaling, plan, train_step, batch_sharding,
               zerojax.abstract_state(plan), abstract_batch)


def gathered_tokens(config, mesh) -> int:
  """The tokens a microbatch has over the ZeRO shard axes: every device's but the data
  axis' replicas' (what `zerojax.vocab` gathers to keep the vocabulary sharded)."""
  t = config.train
  return t.global_batch_size // t.microbatches // mesh.shape.get("data", 1) * t.seq_len


@functools.lru_cache(maxsize=64)
def abstract_params(model) -> tuple[Any, Any]:
  """`model`'s params as `jax.ShapeDtypeStruct`s and their logical axes: two traces of
  its init (~0.045 s of CPU each for the quick start's Llama), kept per model (its
  config: `models.from_config`'s `LlamaLM` and `MlpLM` are frozen dataclasses, hashable)
  for the process's next build of it (a resume, the planner's suggestions, a test's next
  run). The shapes do not depend on the init's key. Shared between builds: read them, do
  not change them."""
  return jax.eval_shape(model.init, jax.random.key(0)), model.logical_axes()


def check_offload(config, device) -> None:
  """ConfigError (exit 2) for an offload to host memory (`optimizer.offload`,
  `zero.param_offload`, `model.activation_offload`) on a `device` that cannot address
  pinned host memory (validate.py's checks run before JAX is started; this one needs it)."""
  for key, value in (("optimizer.offload", config.optimizer.offload),
                     ("zero.param_offload", config.zero.get("param_offload")),
                     ("model.activation_offload", config.model.get("activation_offload"))):
    if value == "host" and not streaming.has_host_memory(device):
      kinds = ", ".join(streaming.memory_kinds(device)) or "none"
      raise ConfigError(
          f"is 'host', but {device.platform} device {device.id} has no pinned_host memory "
          f"(its memory kinds: {kinds}).", key=key,
          fix=f"use {key}='none' (the planner's suggestions list other ways to fit)")


def compile_step(built: Built, dump_to: str | None = None) -> tuple[Any, dict]:
  """Compiles the step from abstract inputs: (the executable, XLA's per-device bytes
  (arguments in device memory, temporaries, outputs, aliased, host_arguments: the state
  offloaded to host memory) and the compile time in seconds).

  The executable runs the step on real inputs laid out like the abstract ones, so a
  trainer that reports memory compiles once. `dump_to`: also dump the compiled module
  and its buffer assignment there.
  """
  options = {} if dump_to is None else dict(
      xla_dump_to=dump_to, xla_dump_hlo_as_text=True, xla_dump_hlo_module_re="jit_step")
  start = time.perf_counter()
  with xla_dump.compiled_afresh() if dump_to else contextlib.nullcontext():
    compiled = built.train_step.lower(built.abstract_state, built.abstract_batch).compile(
        compiler_options=options)
  mem = compiled.memory_analysis()
  arguments, host = mem.argument_size_in_bytes, mem.host_argument_size_in_bytes
  # XLA:CPU counts host parameters among the arguments.
  if (built.plan.offload or built.plan.param_offload) and not host:
    host = streaming.host_parameter_bytes(compiled.as_text())
    arguments -= host
  return compiled, dict(arguments=arguments, temporaries=mem.temp_size_in_bytes,
                        outputs=mem.output_size_in_bytes, aliased=mem.alias_size_in_bytes,
                        host_arguments=host, host_temporaries=mem.host_temp_size_in_bytes,
                        seconds=time.perf_counter() - start)


def compiled_memory(built: Built, dump_to: str | None = None) -> dict:
  """`compile_step`'s bytes and seconds alone."""
  return compile_step(built, dump_to)[1]
