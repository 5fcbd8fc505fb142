"""Llama-3-70B full fine-tune on one node of 8 x RTX 4090 24 GB: parameter and optimizer
offload.

    python train.py --config configs/70b_8x4090.py --config.init_from=/path/to/Llama-3.1-70B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/70b_8x4090.py --target rtx4090:8 --compile

`configs/70b_8x80gb.py` (Lion + Kahan, gradient release, ZeRO-3, remat 'full', one
4096-token sequence per device) with what differs:

* the layers' parameter shards live in pinned host memory (`zero.param_offload`): each
  layer comes to the device one layer ahead of its use in the forward and the backward
  pass, and gradient release sends its updated shard straight back;
* so do the Lion moment and the Kahan buffer (`optimizer.offload`);
* each layer's update is written back behind, during the next layer's backward pass
  (`optimizer.release_write_behind`): the copies back run under its matmuls, the reads
  ahead under its recompute.

Compiled by XLA's GPU compiler for 8 x RTX 4090 24GB (the second command, no GPU
needed, nothing allocated): 501.02 MiB of arguments + 15.16 GiB of temporaries = 15.65
GiB a device, where XLA's allocator has 21.84 GiB of a 4090 as train.py runs it; + 48.79
GiB of host memory a device (layer shards 15.94, Lion moment 16.43, Kahan buffer 16.43):
390.34 GiB a node. The planner's estimate 16.07 GiB (1.027), and its bus line: 121.9 GB
over PCIe per step and device, 2.78 s at 25 GB/s (PCIe 4.0 x16) against 26.85 s of
compute at 40% MFU, so the copies can hide behind compute (none of this has run on a
4090: these are compiled bytes and the planner's arithmetic).

`train.py --dry_run --target` reads the compiled schedule: 72 copies to the device in 2
loop bodies, 100% of their bytes with compute scheduled under them; timed along it
(matmuls at 40% of the 4090's peak, the link at 25 GB/s), all 4.79 s of the loops' copies
a step run under compute (each layer written in its own trip: 34% of the bytes, 9% of
the time, the step waiting 4.36 s; 14.29 GiB a device). A schedule, not a timing.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x80gb.py")
  c.zero.param_offload = "host"  # 16 GiB of layer shards a device, in host memory.
  c.optimizer.offload = "host"  # Lion's moment and the Kahan buffer: 16 GiB a device more.
  c.optimizer.release_write_behind = True  # The copies back under the next layer: +0.8 GiB.
  return c
