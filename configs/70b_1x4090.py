"""Llama-3-70B full fine-tune on one RTX 4090 24 GB: the whole model in host memory, one
layer on the device at a time.

    python train.py --config configs/70b_1x4090.py --config.init_from=/path/to/Llama-3.1-70B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/70b_1x4090.py --target rtx4090:1 --compile

`configs/70b_8x4090.py` (Lion + Kahan, gradient release, ZeRO-3, remat 'full', the layers'
parameters and the optimizer state in host memory, each layer's update written back
behind, during the next layer's trip) on one card, with what differs:

* one 4096-token sequence a step;
* the layers' saved inputs in host memory too (`model.activation_offload`): 5 GiB that
  the card does not have beside the rest;
* the carried update is written first in each trip, under the layer's recompute, and the
  trip's reads after it (`optimizer.release_writes_first`): it leaves the card before the
  backward pass (written after the reads it sits beside it: 20.60 GiB, and XLA's schedule
  puts 66% of the copies' time under compute, not 89%).

Compiled by XLA's GPU compiler for one RTX 4090 (the second command, no GPU needed,
nothing allocated): 19.70 GiB on the device, where XLA's allocator has 21.84 GiB of a
4090 as train.py runs it, + 395.34 GiB of host memory (layers 127.50, Lion moment and
Kahan buffer 131.42 each, saved inputs 5.00). The planner says 19.57 GiB (0.994; both
peaks at the embedding and head's update). Its bus line: 986 GB over PCIe a step,
22.46 s at 25 GB/s (PCIe 4.0 x16) a direction against 26.85 s of compute at 40% MFU:
the copies hide from one sequence (4,096 tokens a step). `train.py --dry_run --target
rtx4090:1` times the compiled schedule (the matmuls at 40% of the peak, 25 GB/s): 89% of
the layer loops' 38.76 s of copies a step (both directions) under compute, the step
waiting 4.41 s on them (each layer written in its own trip: 9%, 35.30 s, at 18.72 GiB).
None of this has run on a 4090.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x4090.py")
  c.train.global_batch_size = 1  # One sequence on the one card.
  c.model.activation_offload = "host"  # The layers' saved inputs: 5 GiB of host memory.
  # The carried update written first in the trip, under the recompute: gone from the
  # card before the backward pass; 89% of the copies' time under compute, not 66%.
  c.optimizer.release_writes_first = True
  return c
