"""Llama-3-70B full fine-tune on one H100 80 GB: the whole model in host memory, one layer
on the device at a time.

    python train.py --config configs/70b_1xh100.py --config.init_from=/path/to/Llama-3.1-70B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/70b_1xh100.py --target h100:1 --compile

`configs/70b_8x4090.py` (Lion + Kahan, gradient release, ZeRO-3, remat 'full', the layers'
parameters and the optimizer state in host memory, each layer's update written back
behind, during the next layer's backward pass) on one H100, with six 4096-token
sequences a step (24,576 tokens): the copies take less than half the compute's time.

Compiled by XLA's GPU compiler for one H100 (the second command, no GPU needed, nothing
allocated): 65.07 GiB on the device (30 GiB of it the saved layer inputs), where XLA's
allocator has 74.72 GiB of an H100 as train.py runs it, + 390.34 GiB of host memory. The
planner says 63.98 GiB (0.983: written behind, the next layer's params and this one's
state sit beside the layer's whole backward and the carried update). Its bus line: 975 GB
over PCIe a step, 11.12 s at 50 GB/s a direction against 26.91 s of compute at 40% MFU;
the copies hide from three sequences (12,288 tokens a step). `train.py --dry_run
--target h100:1` times the compiled schedule (the matmuls at 40% of the peak, 50 GB/s):
79% of the layer loops' 19.17 s of copies a step (both directions) under compute, the
step waiting 4.00 s on them. By that timing the neighbours train no faster: eight
sequences written behind do not fit (80.45 GiB); eight written first
(`optimizer.release_writes_first`, 66.00 GiB) wait 5.94 s against 35.88 s of compute
(~1.5% fewer tokens a second); eight written in their own trip (63.50 GiB) 15.49 s (~20%
fewer); seven written behind (72.67 GiB, 2 GiB from the pool) 3.07 s (~5% more). None of
this has run on an H100.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x4090.py")
  c.train.global_batch_size = 6  # Six sequences on the one device, written behind.
  return c
