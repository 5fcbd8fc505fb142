"""The compiled truth beside the estimate: XLA's live buffers at the peak, attributed to
the estimate's components by their shapes."""

import collections
import functools
import re

from zerojax.memory.spec import RunSpec, _leaves, _local_shape


def attribute(s: RunSpec, buffers: list[tuple[int, str, str]]) -> dict:
  """Compiled temporaries at the peak, by estimate component, from their shapes."""
  # A device's positions: its slice of each sequence with sequence parallelism.
  V, D, L, T, b = s.vocab_size, s.d_model, s.n_layers, s.positions, s.batch
  local = functools.partial(_local_shape, s)
  leaves = _leaves(s)
  stacks = {x for x, layered, _ in leaves if layered} | {local(x, True) for x, l, _ in leaves if l}
  layer = {x[1:] for x, layered, _ in leaves if layered}
  vocab, vocab_local = {(V, D), (D, V)}, {local(x, False) for x, _, v in leaves if v}
  out, gathers = collections.Counter(), s.behaviour.shards_params
  for size, text, _ in buffers:
    m = re.match(r"(\w+)\[([\d,]*)\]", text)
    shape, f32 = tuple(int(x) for x in m.group(2).split(",") if x) if m else (), text[:3] == "f32"
    if not shape:
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
  return dict(out)

