"""Llama-3-70B full fine-tune on one node of 8 x 80 GB: Lion + Kahan, gradient release.

    python train.py --config configs/70b_8x80gb.py --config.init_from=/path/to/Llama-3.1-70B \
        --config.data.name=tokens --config.data.path=...
    python train.py --config configs/70b_8x80gb.py --dry_run --target h100:8   # compile only

`configs/70b_bf16.py` (shapes, bf16, ZeRO-3, remat 'full', seq 4096) with what differs:

* Lion (one bf16 moment) + a bf16 Kahan buffer: 2 + 2 + 2 = 6 bytes per parameter of
  state (AdamW + Kahan is 8: 65.7 GiB a device before any activation);
* gradient release (`optimizer.release`): each layer is updated inside the backward
  pass, so no fp32 gradient of the layer stack (4 bytes per parameter) ever exists.
  It runs one microbatch a step and without global-norm clipping (`grad_clip=0`);
* one 4096-token sequence per device: a global batch of 8.

Compiled by XLA's GPU compiler for 8 x H100 80GB (`--dry_run --target h100:8`, no GPU
needed, nothing allocated; the `gpu-compile` extra): 49.28 GiB of state + 12.81 GiB of
temporaries = 62.09 GiB a device, where XLA's allocator has 74.72 GiB of an H100 as
train.py runs it; the planner's estimate 63.98 GiB (1.030).
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_bf16.py")
  c.optimizer.name = "lion"
  c.optimizer.learning_rate = 5e-5  # Lion: ~3x below AdamW's, ...
  c.optimizer.weight_decay = 0.3  # ... and its decay ~3x above, as the Lion paper does.
  c.optimizer.b2 = 0.99
  c.optimizer.release = True
  c.optimizer.grad_clip = 0.0  # Release has no global norm to clip by.
  c.optimizer.warmup_steps = 100
  c.train.global_batch_size = 8  # One sequence per device; microbatches must be 1.
  c.train.steps = 2000
  c.train.eval_every = 200
  return c
