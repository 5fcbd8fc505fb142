"""zerojax: ZeRO for JAX.

The library: a ZeRO plan for any parameter pytree (`make_plan`), a train state created
sharded (`init_state`), and one pure, jitted train step for stages 0-3
(`make_train_step`). Models whose layers run under a scan call `gather` on each
layer's params so that stage 3 gathers one layer at a time; `from_nnx` puts a Flax NNX
module on the plan. Around them: `with_update_rule` (any optax transform on bf16
params, its state kept in fp32), `Checkpointer` (orbax checkpoints of the train state)
and `fake_cpu_devices` (N CPU devices in one process, to try a plan anywhere). The
README's "Your own model" section and `examples/` show them together.

The names are imported on first use (PEP 562), as are the rooms (`zerojax.stage3`, ...):
`import zerojax.run.launch` (`zerojax-launch`, which only starts processes) and
`zerojax.runtime.exits` import no JAX (1.1 s of CPU a start); `from zerojax import
make_plan` and `zerojax.make_plan` import what they name.
"""

import importlib
import importlib.util

# Each name and the module that defines it. `from_nnx` imports flax.nnx (0.2 s): only
# programs with an NNX model pay for it.
_NAMES = {
    "make_mesh": "zerojax.mesh",
    "Sharded": "zerojax.stage3", "gather": "zerojax.stage3",
    "TrainState": "zerojax.step", "abstract_state": "zerojax.step", "init_state": "zerojax.step",
    "make_eval_step": "zerojax.step", "make_train_step": "zerojax.step",
    "StageBehaviour": "zerojax.zero", "ZeroPlan": "zerojax.zero",
    "flax_logical_axes": "zerojax.zero", "make_plan": "zerojax.zero",
    "NnxModel": "zerojax.models.flax_nnx", "from_nnx": "zerojax.models.flax_nnx",
    # What a library user's own script needs beside the step: fake CPU devices to try
    # a plan on one machine, the update rules for their own optax transform on bf16
    # params, and the checkpointer.
    "fake_cpu_devices": "zerojax.runtime.devices",
    "with_update_rule": "zerojax.optim.update_rules",
    "Checkpointer": "zerojax.checkpoint",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
  if name in _NAMES:
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value  # Looked up once.
    return value
  # A room not imported yet (`import zerojax` then `zerojax.optim.lion`), as when this
  # module imported the core eagerly.
  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module 'zerojax' has no attribute {name!r}")


def __dir__():
  return sorted({*globals(), *_NAMES})
