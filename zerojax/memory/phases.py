"""Each phase of a run compiled, with its device and host bytes: the whole run's peak,
not the step's alone (issue 52).

    python -m zerojax.memory.phases --config configs/8b_1x4090.py --target h200:1

A phase is one or more jitted programs a run dispatches: `init` (`init_state`'s
programs from the model's init), `init_from` (the same from imported params:
`zerojax.hf.load_params` itself runs no program, it writes each block straight into its
leaf's memory kind), `train_step`, `eval_step`, `checksums` (a checkpoint save's and a
restore's; orbax itself reads and writes each shard straight into its target's memory
kind, on any mesh or stage), and `generate` where the run decodes
(`train.eval_exact_match`: 64 prompts of a training row's length, KV-cached). A phase's
`device` bytes are its programs' peak, run in order: each program's device arguments,
temporaries and outputs less the aliased, above the device outputs of the programs
before it (a phase's own inputs, the state the step reads, are counted as arguments).
XLA's GPU compiler for a target (`spec`), else XLA:CPU on this process's devices.

`python -m zerojax.memory --target T --compile` and `train.py --dry_run --target T` judge
a run by the largest of its phases (`whole_run`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax import build, step, streaming
from zerojax.checkpoint import checksums
from zerojax.config import load_config
from zerojax.generate import decode
from zerojax.gpu import compile as gpu_compile, targets
from zerojax.runtime.devices import fake_cpu_devices

GIB = 1 << 30

PHASES = ("init", "init_from", "train_step", "eval_step", "checksums", "generate")
# The prompts train.eval_exact_match decodes at once (`generate.exact_match`'s batch).
EXACT_MATCH_BATCH = 64


def programs(built, config) -> dict[str, list[tuple[Any, tuple]]]:
  """Per phase the run takes: its (jitted, abstract args) in the order it dispatches them."""
  plan, model = built.plan, built.model
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(built.mesh, P()))
  params = jax.tree.leaves(built.abstract_state.params)
  host = jax.tree.leaves(plan.param_offloaded)
  on_device = [x for x, h in zip(params, host) if not h]
  off = [x for x, h in zip(params, host) if h]
  kept = [step._PARAMS_AT + i for i, h in enumerate(host) if h]  # load_params' own leaves.
  leaves = jax.tree.leaves(built.abstract_state)
  return {
      "init": [(j, (key, [], [])) for j, _ in step.init_programs(
          plan, model.init, built.tx, built.loss_scaling)],
      "init_from": [(j, (key, on_device, off)) for j, _ in step.init_programs(
          plan, model.init, built.tx, built.loss_scaling, given=True, skip=kept)],
      "train_step": [(built.train_step, (built.abstract_state, built.abstract_batch))],
      "eval_step": [(zerojax.make_eval_step(plan, model.loss),
                     (built.abstract_state.params, built.abstract_batch))],
      "checksums": [(checksums.jitted(jax.tree.structure(part), tuple(
          x.sharding for x in part)), (part,)) for part in (
              [leaves[i] for i in g] for g in checksums.programs(leaves))],
      "generate": _generation(built, config),
  }


def _generation(built, config) -> list[tuple[Any, tuple]]:
  """train.eval_exact_match's KV-cached decoding, a training row's length of prompt and
  cache (`report.generation_cache` counts the same cache); none where the run does not
  decode or its model has no cache (the uncached reference decodes whole params)."""
  if not (config.train.eval_exact_match and hasattr(built.model, "extend")):
    return []
  plan, length = built.plan, decode.length_bucket(config.train.seq_len)
  rows = decode.batch_bucket(EXACT_MATCH_BATCH, plan.num_data)
  return [(decode.decoder(built.model, plan), decode.abstract_inputs(plan, rows, length,
                                                                      length))]


def compiled(jitted, args: tuple, built, spec=None, config=None) -> dict:
  """One program's per-device bytes: arguments (device), temporaries, outputs, aliased,
  host_arguments, host_outputs."""
  if spec is not None:
    return gpu_compile.compile_jitted(jitted, args, built.mesh, spec,
                                      gpu_compile.profile_options(config)).memory
  executable = jitted.lower(*args).compile()
  m = executable.memory_analysis()
  host_in, host_out = m.host_argument_size_in_bytes, m.host_output_size_in_bytes
  arguments, outputs = m.argument_size_in_bytes, m.output_size_in_bytes
  if not (host_in or host_out):  # XLA:CPU counts host parameters and results among its
    text = executable.as_text()  # arguments and outputs (a GPU reports them apart).
    host_in, host_out = streaming.host_parameter_bytes(text), streaming.host_output_bytes(text)
    arguments, outputs = arguments - host_in, outputs - host_out
  return dict(arguments=arguments, temporaries=m.temp_size_in_bytes, outputs=outputs,
              aliased=m.alias_size_in_bytes, host_arguments=host_in, host_outputs=host_out)


def phase_memory(config, spec=None, phases=PHASES, built=None, known=None
                 ) -> dict[str, dict]:
  """{phase: device (its peak bytes a device, see the module), host (the host arguments
  of its largest program or the host outputs of all, a device), temporaries (its largest
  program's), programs (how many)}, for each of `phases` the run takes: `config` built
  on this process's devices (validated for them; or `built`, its `build.build`),
  compiled for `spec` (a `TargetSpec`; None: XLA:CPU). `known`: {phase: [a `compiled`
  dict a program]} compiled already (the step a report compiled), not compiled again."""
  built = built or build.build(config)
  known, out = known or {}, {}
  for phase, progs in programs(built, config).items():
    if phase not in phases or not progs:
      continue
    held = peak = temps = host_in = host_out = 0
    for m in known.get(phase) or (compiled(j, args, built, spec, config) for j, args in progs):
      peak = max(peak, held + m["arguments"] + m["temporaries"] + m["outputs"] - m["aliased"])
      held += m["outputs"] - m["aliased"]
      temps = max(temps, m["temporaries"])
      host_in, host_out = max(host_in, m["host_arguments"]), host_out + m["host_outputs"]
    out[phase] = dict(device=peak, host=max(host_in, host_out), temporaries=temps,
                      programs=len(progs))
  return out


def beside_step(config, spec, phases, built, step: dict) -> dict[str, dict] | None:
  """`phase_memory` of `phases` with the step's compile (`step`, a `compiled` dict) reused;
  None where `phases` is the step alone (its verdict is the step's)."""
  if set(phases) <= {"train_step"}:
    return None
  return phase_memory(config, spec, phases, built=built, known=dict(train_step=[step]))


def whole_run(result: dict[str, dict]) -> tuple[str, int]:
  """(the phase that sets the run's device peak, its bytes a device) of `phase_memory`."""
  top = max(result, key=lambda p: result[p]["device"])
  return top, result[top]["device"]


def lines(result: dict[str, dict]) -> list[str]:
  """`phase_memory` as a report's lines, a phase a line, then the phase that sets the
  peak."""
  out = [f"  {phase:<11} device {m['device'] / GIB:7.2f}  temporaries "
         f"{m['temporaries'] / GIB:7.2f}  host {m['host'] / GIB:7.2f}  "
         f"({m['programs']} program{'s' * (m['programs'] > 1)})" for phase, m in result.items()]
  top, peak = whole_run(result)
  return out + [f"  peak: {top}, {peak / GIB:.2f} GiB"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--target", help="a GPU target (h200:1, rtx4090:1); none: XLA:CPU")
  ap.add_argument("--devices", type=int, default=0, help="XLA:CPU's device count")
  ap.add_argument("--phases", default=",".join(PHASES))
  args, overrides = ap.parse_known_args(argv)
  spec = targets.parse(args.target, args.devices or None) if args.target else None
  devices = spec.devices if spec else args.devices or 1
  if spec:
    gpu_compile.prepare(devices)
  else:
    fake_cpu_devices(devices)
  config = load_config(args.config, [o.removeprefix("--config.") for o in overrides],
                       num_devices=devices)
  result = phase_memory(config, spec, tuple(args.phases.split(",")))
  print(f"{args.config} on {spec or f'{devices} XLA:CPU devices'}, GiB a device:")
  print("\n".join(lines(result)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
