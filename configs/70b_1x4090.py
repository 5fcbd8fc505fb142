"""Llama-3-70B full fine-tune on one RTX 4090 24 GB: the whole model in host memory, one
layer on the device at a time.

    python train.py --config configs/70b_1x4090.py --config.init_from=/path/to/Llama-3.1-70B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/70b_1x4090.py --target rtx4090:1 --compile

`configs/70b_8x4090.py` (Lion + Kahan, gradient release, ZeRO-3, remat 'full', the layers'
parameters and the optimizer state in host memory) on one card, with what differs:

* one 4096-token sequence a step;
* the layers' saved inputs in host memory too (`model.activation_offload`): 5 GiB that
  the card does not have beside the rest.

Compiled by XLA's GPU compiler for one RTX 4090 (the second command, no GPU needed,
nothing allocated): 18.72 GiB on the device, where XLA's allocator has 21.84 GiB of a
4090 as train.py runs it, + 395.34 GiB of host memory (layers 127.50, Lion moment and
Kahan buffer 131.42 each, saved inputs 5.00). The planner says 18.43 GiB (0.984: its
layer loop is over XLA's scheduler memory limit, 14.51 GiB of temporaries, which XLA
meets by recomputing each gradient at its update). Its bus line: 986 GB over PCIe a
step, 22.46 s at 25 GB/s (PCIe 4.0 x16) a direction against 26.85 s of compute at 40%
MFU: the copies hide from one sequence (4,096 tokens a step). None of this has run on a
4090.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x4090.py")
  c.train.global_batch_size = 1  # One sequence on the one card.
  c.model.activation_offload = "host"  # The layers' saved inputs: 5 GiB of host memory.
  # Each layer's update written in its own trip: on one device a layer carried to the
  # next trip is 5 GiB more, over the card (docs/design/offload-and-streaming.md).
  c.optimizer.release_write_behind = False
  return c
