"""Llama-3-8B full fine-tune on one RTX 4090 24 GB: gradient release, parameter and
optimizer offload.

    python train.py --config configs/8b_1x4090.py --config.init_from=/path/to/Llama-3.1-8B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/8b_1x4090.py --target rtx4090:1 --compile

`configs/8b_bf16.py` (shapes, bf16, Kahan AdamW with bf16 moments, ZeRO-3, remat 'full',
4096-token sequences) with what differs:

* one device: stage 3 over one shard gathers nothing, but its layer loop is what
  gradient release and the offloads stream through;
* gradient release (`optimizer.release`): each layer is updated inside the backward
  pass, so no fp32 gradient of the layer stack ever exists; one sequence a step and
  no global-norm clipping (`grad_clip=0`);
* the layers' parameters (`zero.param_offload`) and the optimizer state
  (`optimizer.offload`) live in pinned host memory;
* each layer's update goes back during the next layer's trip, after its reads
  (`optimizer.release_write_behind`): its copies back under that layer's backward.

Compiled by XLA's GPU compiler for one RTX 4090 24GB (the second command, no GPU
needed, nothing allocated): 1.96 GiB of arguments (the embedding and the head, which stay)
+ 10.76 GiB of temporaries = 12.72 GiB, where XLA's allocator has 21.84 GiB of a 4090
as train.py runs it; + 57.87 GiB of host memory (layers 13.00, moments 29.92, Kahan
buffer 14.96). The planner's estimate 12.72 GiB (1.000; its peak, as the compiled
one, is the embedding's and head's update after the layer loop). Its bus line: 138.2 GB
over PCIe per step, 3.04 s at 25 GB/s against 2.99 s of compute at 40% MFU, so this one
is bus-bound (1.0x): the bytes moved are the model's, the compute is the tokens', so
more tokens hide them, from two sequences a step (more microbatches do not: under
release each moves the layers again).

`train.py --dry_run --target` reads the compiled schedule: 90 copies to the device in 2
loop bodies, 58% of their bytes with compute scheduled under them; timed along it (the
matmuls at 40% of the 4090's peak, 25 GB/s), 58% of the loops' 5.03 s of copies a step
under compute, the step waiting 2.12 s on them (each layer written in its own trip: 61%
of the bytes, 28% of the time, 3.61 s, 12.77 GiB). A schedule, not a timing.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "8b_bf16.py")
  c.optimizer.release = True
  c.optimizer.grad_clip = 0.0  # Release has no global norm to clip by.
  c.zero.param_offload = "host"  # The 32 layers' 13.0 GiB of bf16 params.
  c.optimizer.offload = "host"  # AdamW's two bf16 moments and the Kahan buffer: 45 GiB.
  c.train.global_batch_size = 1  # One sequence a step; microbatches must be 1.
  # Each layer's update goes back during the next layer's trip, after its reads: 58% of
  # the copies' time under compute, not 28%, for no more device memory.
  c.optimizer.release_write_behind = True
  return c
