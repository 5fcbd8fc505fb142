"""The memory planner: will a config fit on these devices, and if not, what to change.

The planner room: the estimate (`spec`, `activations`, `bus`, `step`, `search`,
`compiled`), its report and CLI (`report`, `zerojax-memory`) and `fit` (which GPUs can
run a config). The highest room below `zerojax.train`: its report compiles the real step
(`zerojax.build`, `zerojax.gpu`).

    python -m zerojax.memory --config configs/70b_bf16.py --devices 64 --device-memory 80GiB
    python -m zerojax.memory --config configs/1b_bf16.py --devices 8 --compile   # + XLA's numbers

`estimate(config, devices)` is arithmetic on the config (no JAX work, milliseconds):
per-device bytes of every component of a train step, in two views.

* **Model state as users count it** (the ZeRO paper's count): bytes per parameter
  of params + gradients + optimizer state, gradients in the param dtype (in fp32 with
  fp32 master weights, as DeepSpeed's bf16 mode keeps them), each sharded by its stage:
  70B with bf16 params, bf16 AdamW moments and a Kahan buffer is 10 B/param.
* **What the zerojax step holds per device**: the state (params, optimizer moments,
  Kahan / master buffers), plus the step's temporaries: gradients in the reduce dtype
  (fp32) -- at stage 3 one fp32 gradient per local param, reduce-scattered layer by
  layer -- an fp32 accumulator with microbatches, the activations saved for the
  backward pass (by remat policy), one layer's recompute working set, stage 3's
  gathered layer / embedding / head, the loss chunk's fp32 logits. Their peak is the
  largest of three phases (layer backward, loss backward, end of the backward).

The temporaries are calibrated against XLA:CPU with `device_env.CPU_MEMORY_FLAGS` (the only
compiler this project can check; `--compile` shows it beside the estimate): the total
within 2% for the 8B and 70B configs (also at 32768 tokens a device), 2-4% low for the
1B, 5% high for the tiny one (exceptions: the tiny config with remat 'full', 0.88,
whose small layers XLA keeps whole; with 2 microbatches, 1.20). What is XLA:CPU's own:
collectives run in fp32, so a gathered layer costs 4 B/param (a GPU gathers bf16);
at stages 0-2 it keeps a copy of the embedding. At stages 0-2 the scan's layer
gradients come out stacked in the param dtype and are upcast and reduced after the
backward pass (stage 2 reduce-scatters them leaf by leaf), so stage 2 holds a whole
gradient for a while. Where estimate and compiler differ by more than 10%,
`--compile` says which component the difference is in, from XLA's buffer assignment.
A by-name remat policy (`zerojax.models.remat`) saves the layer input and its named
values: XLA's saved bytes exactly; the 1B at stage 3 within 0.90-1.02 (docs/design/planner.md).
On one H200 (XLA:GPU, jax 0.11.2) the estimate was 1.003 (1B, 8 sequences of 4096) and
1.035 (8B, 2 sequences) of both the compiled bytes and the measured peak
(`memory_stats()['peak_bytes_in_use']`); multi-GPU stage 3 is not measured yet.

`suggestions(config, devices, device_memory)` re-estimates modified setups (one code
path) and ranks the changes that make it fit, cheapest first: Kahan instead of fp32
master weights, a higher stage, bf16 optimizer state, more remat, smaller
micro-batches, optimizer-state offload, param offload with release, Lion, and the fewest
devices of this size that fit (with the host memory short: each offload undone first).

With `optimizer.offload='host'` the moments and Kahan / master buffers move from the
device's bytes to the host's (`Estimate.host`: per device, and per node of
`DEVICES_PER_NODE`); the device holds, during the update, the gradients and the state
streamed in (one layer's, or the embedding's and head's, whichever is more; all of it
for an update that is not leafwise). Not checked against a compiler: XLA:CPU has no
separate host memory space to report (`zerojax.streaming`).

With sequence parallelism (`mesh.sequence_parallel`) a device holds T / fsdp positions of
each of its examples (batch / data of them) for the saved activations, the MLP and the
loss chunk; attention's working set is the whole sequence for H / fsdp query heads and
the KV heads the all-to-all gives the device; `Estimate.all_to_all` is the bytes a device
puts into the all-to-alls per layer and step (`sequence.ulysses.all_to_all_bytes`).
`model.mlp_chunk` bounds the MLP's [.., d_ff] temporaries to a chunk of positions;
`model.activation_offload='host'` moves the layers' saved residuals to the host's bytes,
two layers of them left on the device. `longest_sequence(config, devices, memory)` is the
longest `train.seq_len` (a multiple of `sequence_unit`) that fits. Calibrated against
XLA:CPU and XLA's GPU compiler on the 8B and 70B configs and the tiny Llama
(docs/design/long-context.md).

With `zero.param_offload='host'` (stage 3) the layer-stack's param shards are host bytes
(`Estimate.host['params']`); with gradient release the device keeps 3 layers' shards of
it (in use, arriving, written back), without release all of it (the step brings the
shard in: no device bytes saved). `Estimate.host_per_node` is the host bytes of a node's
devices (`RunSpec.per_node`: a target's per-host count, else up to `DEVICES_PER_NODE`),
judged against `host_memory`; `Estimate.pcie` the bytes each offload moves over the host
link per step (`bus`: their time at the target's link beside the step's compute).

Modules: `spec` (what is read of a config: `RunSpec`, parameter counts), `activations`
(saved activations, a layer's working set, the loss chunk), `step` (`estimate`,
`Estimate`), `bus` (PCIe bytes per step, `Bus`), `search` (`suggestions`,
`fewest_devices`), `compiled` (XLA's buffers at the peak, attributed to the estimate's
components).
"""

from zerojax.memory import bus
from zerojax.memory.bus import Bus
from zerojax.memory.compiled import attribute
from zerojax.memory.search import (
  Suggestion,
  fewest_devices,
  longest_sequence,
  sequence_unit,
  suggestions,
)
from zerojax.memory.spec import (
  DEVICES_PER_NODE,
  DTYPE_BYTES,
  Counts,
  RunSpec,
  active_params,
  param_counts,
)
from zerojax.memory.step import Estimate, estimate

__all__ = ["DEVICES_PER_NODE", "DTYPE_BYTES", "Bus", "Counts", "Estimate", "RunSpec",
           "Suggestion", "active_params", "attribute", "bus", "estimate", "fewest_devices",
           "longest_sequence", "param_counts", "sequence_unit", "suggestions"]
