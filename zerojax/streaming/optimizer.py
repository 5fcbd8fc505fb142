"""Optimizer-state offload: moments and Kahan / master buffers live in host memory.

With `make_plan(..., offload=True)` (config `optimizer.offload='host'`) the optimizer
state's param-shaped leaves have `memory_kind='pinned_host'` shardings
(`ZeroPlan.opt_shardings`): between steps, and through the forward and backward
passes, they take no device memory. The update brings them to the device, updates
them there and sends them back (`streamed`). Run one layer at a time
(`updates.update_by_layer`, and gradient release's per-layer update), only one layer's
state is on the device at once; the whole-tree update (optimizers that are not
leafwise) brings the whole state over for the update.
"""

from collections.abc import Callable

from zerojax import zero
from zerojax.streaming.memory import to_device, to_host


def streamed(update: Callable, plan: zero.ZeroPlan) -> Callable:
  """`update(grads, opt_state, params, **kw)` with the offloaded state moved around it.

  The state `update` is given (the whole tree, or one layer's slices of it as
  `updates.LayerViews` cuts them: the same tree structure) comes to the device first;
  the new state goes back to host memory. Without offload, `update` itself.

  Returns:
    A function of the same arguments returning (new params, new optimizer state with
    the offloaded leaves in host memory, sum of squared updates).
  """
  if not plan.offload:
    return update
  mask = plan.opt_offloaded

  def run(grads, opt_state, params, **kwargs):
    new_params, new_state, squares = update(grads, to_device(opt_state, mask), params,
                                            **kwargs)
    return new_params, to_host(new_state, mask), squares

  return run
