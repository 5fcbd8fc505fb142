"""`LayeredLoss`: a model's loss cut at its layer loop, the interface models implement.

Gradient release (`zerojax.release`) and the streaming paths run a model one layer at a
time; a model says how by returning a `LayeredLoss` from `layered()`. It lives below
both the models (`zerojax.models`) and the algorithms that use it, so that neither
imports the other.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

PyTree = Any


class LayeredLoss(NamedTuple):
  """A loss cut at its layer loop: what gradient release needs from a model.

  `loss(params, batch) = head_loss(rest, layer(params[stack][L-1], ... layer(
  params[stack][0], embed(rest, batch), batch) ..., batch), batch)`, where `rest` is
  `params` without the `stack` key. Every function sees plain arrays (gathered, in the
  param dtype). Every layer gets the (microbatch's) batch: what each layer reads of it
  besides the carry (packed examples' positions and segment ids) is an input of the
  step, the same for every layer, so it is passed, never carried or differentiated.

  Attributes:
    embed: `(rest, batch) -> carry`, the input of the first layer (any pytree).
    layer: `(layer_params, carry, batch) -> carry`, one layer.
    head_loss: `(rest, carry, batch) -> loss`, a scalar: the mean over the examples.
    stack: the top-level key of the params dict that holds the layer stack (every
      leaf below it has a leading layers axis; no other leaf has one).
    offload: keep the layer inputs the backward pass needs in pinned host memory
      between the passes (activation offload, `zerojax.streaming`).
    metrics: optional `(carry, batch) -> {name: scalar}`, what the model reports of the
      last layer's output besides the loss (a mixture of experts' routers), means over
      the examples as the loss is; the step reports their means over the devices.
  """
  embed: Callable[[PyTree, PyTree], PyTree]
  layer: Callable[[PyTree, PyTree], PyTree]
  head_loss: Callable[[PyTree, PyTree, PyTree], jax.Array]
  stack: str
  offload: bool = False
  metrics: Callable[[PyTree, PyTree], dict] | None = None
