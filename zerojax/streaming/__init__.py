"""Host streaming: state that lives in pinned host memory and visits the device a layer
at a time.

The streaming room: host memory as a place for state between uses. It imports the
runtime and `zerojax.zero` only.

One mechanism for every per-layer stream between host and device:

- `memory`: the moves themselves (`to_host`, `to_device` of masked leaves; `on_device`
  for code that must compute on any leaf) and what a platform and a compiled module
  say about host memory (`has_host_memory`, `host_parameter_bytes`).
- `layers`: a stack (a pytree whose leaves have a leading layers axis) kept in host
  memory, written one layer at a time by the forward pass's scan (`outbound`) and read
  back one layer at a time (`fetch`); `forward_layers` and `backward_layers` are the
  loops over the layers (in order, in reverse) that read the next layer during a
  layer's trip, so its copy is in flight while the layer computes; `read_ahead` orders
  such a read before the trip's write for a stack the loop also writes.
- `optimizer`: `streamed`, an optimizer update with its offloaded state brought to the
  device before it and sent back after.
- `schedule`: the compiled module's host copies, the compute scheduled under them, the
  bytes they move a step and the schedule timed at a FLOP rate and a link (`host_moves`,
  `overlap_line`, `host_traffic`, `timed_step`: train.py's lines on a GPU or a GPU
  target).

Its users: the parameter offload (`zero.param_offload='host'`: stage 3's layer shards
live in host memory; gradient release reads layer i+1's during layer i's forward trip
and layer i-1's during layer i's backward trip, and writes each updated shard straight
back; the normal step brings them over whole, the stage-3 gather one layer at a time
for evaluation), the optimizer-state offload (`optimizer.offload='host'`: the update by layer
and gradient release's per-layer update bring one layer's moments over and send them
back, `streamed` around `updates.LayerViews`' slices; release reads them one layer ahead
on a GPU, `read_ahead`), and the activation offload (`model.activation_offload='host'`:
the layer inputs and what a remat policy saves go to host memory as each layer's forward
pass ends, `stage3.scan_layers` and release's layer loop, and come back one layer ahead
in the backward pass).

Every computation runs on device values; a host value is only sliced, written and
moved. XLA:GPU and TPU turn the moves into DMA copies (`jax.device_put` to a memory
space lowers to `annotate_device_placement` custom calls; XLA's host offloader makes
the stacked host buffer and the slices' copies); XLA:CPU keeps host and device in the
same RAM and lowers the moves to nothing, so on CPU a streamed step computes exactly
what the step without streaming computes.
"""

from zerojax.streaming import schedule
from zerojax.streaming.into_host import made_in_host
from zerojax.streaming.layers import (
    backward_layers,
    fetch,
    forward_layers,
    outbound,
    read_ahead,
)
from zerojax.streaming.memory import (
    has_host_memory,
    host_groups,
    host_output_bytes,
    host_parameter_bytes,
    in_host_memory,
    memory_kinds,
    on_device,
    to_device,
    to_host,
)
from zerojax.streaming.optimizer import streamed

__all__ = ["backward_layers", "fetch", "forward_layers", "has_host_memory", "host_groups",
           "host_output_bytes", "host_parameter_bytes", "in_host_memory", "made_in_host",
           "memory_kinds", "on_device", "outbound", "read_ahead", "schedule", "streamed",
           "to_device", "to_host"]
