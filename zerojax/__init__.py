"""zerojax: ZeRO for JAX.

The library: a ZeRO plan for any parameter pytree (`make_plan`), a train state created
sharded (`init_state`), and one pure, jitted train step for stages 0-3
(`make_train_step`). Models whose layers run under a scan call `gather` on each
layer's params so that stage 3 gathers one layer at a time.
"""

from zerojax.mesh import make_mesh
from zerojax.stage3 import Sharded, gather
from zerojax.step import TrainState, abstract_state, init_state, make_eval_step, make_train_step
from zerojax.zero import StageBehaviour, ZeroPlan, flax_logical_axes, make_plan

__all__ = ["Sharded", "StageBehaviour", "TrainState", "ZeroPlan", "abstract_state",
           "flax_logical_axes", "gather", "init_state", "make_eval_step", "make_mesh",
           "make_plan", "make_train_step"]
