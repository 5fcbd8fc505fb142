"""The compiled truth beside the estimate: XLA's live buffers at the peak, attributed to
the estimate's components by their shapes."""

import collections
import math
import re

from zerojax.memory.spec import DTYPE_BYTES, RunSpec, _leaves


def attribute(s: RunSpec, buffers: list[tuple[int, str, str]], one_device: bool = False
              ) -> dict:
  """Compiled temporaries at the peak, by estimate component, from their shapes;
  `one_device`: by the components of `memory.step._one_device`'s plan."""
  # A device's positions: its slice of each sequence with sequence parallelism.
  V, D, L, T, b = s.vocab_size, s.d_model, s.n_layers, s.positions, s.batch
  leaves = _leaves(s)
  stacks = {x for x, layered, _, _ in leaves if layered} | {
      shard for _, layered, _, shard in leaves if layered}
  layer = {x[1:] for x, layered, _, _ in leaves if layered}
  vocab, vocab_local = {(V, D), (D, V)}, {shard for _, _, v, shard in leaves if v}
  # A layer's slice of a host stack arrives flat ([1, n]) or in its own shape.
  layer_sizes = {math.prod(x) for x in layer}
  out, gathers = collections.Counter(), s.behaviour.shards_params
  for size, text, _ in buffers:
    m = re.match(r"(\w+)\[([\d,]*)\]", text)
    shape, f32 = tuple(int(x) for x in m.group(2).split(",") if x) if m else (), text[:3] == "f32"
    if one_device:
      n = math.prod(shape)
      key = ("vocab copies" if shape in vocab else
             "saved activations" if len(shape) >= 3 and shape[0] == L else
             "streamed layers" if n in layer_sizes and len(shape) <= 2 else
             "update activations")
    elif not shape:
      key = "working set"
    elif shape in stacks:
      key = "gradients" if f32 else "layer gradients"
    elif shape in vocab:
      key = (("head gradient" if f32 else "gathered head") if gathers
             else "gradients" if f32 else "embedding copy")
    elif shape in vocab_local and f32:
      key = "gradients"
    elif len(shape) >= 3 and shape[0] == L and (b * T in shape or shape[1:3] == (b, T)):
      key = "saved activations"
    elif shape in layer:
      key = "gathered layer" if gathers else "working set"
    elif V in shape:
      key = "loss chunk"
    else:
      key = "working set"
    out[key] += size
  # Past the gathered head and XLA's copy of it (the estimate's 'gathered head'): the
  # zero-initialized gradient buffers the normal step makes at its start.
  extra = out["gathered head"] - 2 * V * D * DTYPE_BYTES[s.param_dtype]
  if gathers and not one_device and extra > 0:
    out["gathered head"] -= extra
    out["vocab gradient buffers"] = extra
  return dict(out)

