"""zerojax: ZeRO for JAX.

The library: a ZeRO plan for any parameter pytree (`make_plan`), a train state created
sharded (`init_state`), and one pure, jitted train step for stages 0-3
(`make_train_step`). Models whose layers run under a scan call `gather` on each
layer's params so that stage 3 gathers one layer at a time; `from_nnx` puts a Flax NNX
module on the plan.
"""

from zerojax.mesh import make_mesh
from zerojax.stage3 import Sharded, gather
from zerojax.step import TrainState, abstract_state, init_state, make_eval_step, make_train_step
from zerojax.zero import StageBehaviour, ZeroPlan, flax_logical_axes, make_plan

__all__ = ["NnxModel", "Sharded", "StageBehaviour", "TrainState", "ZeroPlan", "abstract_state",
           "flax_logical_axes", "from_nnx", "gather", "init_state", "make_eval_step", "make_mesh",
           "make_plan", "make_train_step"]


def __getattr__(name):
  # `from_nnx` imports flax.nnx (0.2 s); only programs with an NNX model pay for it.
  if name in ("NnxModel", "from_nnx"):
    from zerojax.models import flax_nnx  # noqa: PLC0415  optional cost: flax.nnx, 0.2 s
    return getattr(flax_nnx, name)
  raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
