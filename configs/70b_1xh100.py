"""Llama-3-70B full fine-tune on one H100 80 GB: the whole model in host memory, one layer
on the device at a time.

    python train.py --config configs/70b_1xh100.py --config.init_from=/path/to/Llama-3.1-70B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/70b_1xh100.py --target h100:1 --compile

`configs/70b_8x4090.py` (Lion + Kahan, gradient release, ZeRO-3, remat 'full', the layers'
parameters and the optimizer state in host memory) on one H100, with eight 4096-token
sequences a step (32,768 tokens): the copies then take a third of the compute's time.

Compiled by XLA's GPU compiler for one H100 (the second command, no GPU needed, nothing
allocated): 63.50 GiB on the device (40 GiB of it the saved layer inputs), where XLA's
allocator has 74.72 GiB of an H100 as train.py runs it, + 390.34 GiB of host memory. The
planner says 63.89 GiB (1.006: its layer loop is over XLA's scheduler memory limit,
56.81 GiB of temporaries, so XLA recomputes each gradient at its update). Its bus line:
975 GB over PCIe a step, 11.12 s at 50 GB/s a direction against 35.88 s of compute at
40% MFU; the copies hide from three sequences (12,288 tokens a step). None of this has
run on an H100.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x4090.py")
  c.train.global_batch_size = 8  # Eight sequences on the one device.
  # Each layer's update written in its own trip: on one device a layer carried to the
  # next trip is 5 GiB more, over the card (docs/design/offload-and-streaming.md).
  c.optimizer.release_write_behind = False
  return c
