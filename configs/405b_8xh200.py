"""Llama-3.1-405B full fine-tune on one node of 8 x H200 141 GB: Lion + Kahan, gradient
release, the optimizer state and the saved layer inputs in host memory.

    python train.py --config configs/405b_8xh200.py --config.init_from=/path/to/Llama-3.1-405B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/405b_8xh200.py --target h200:8 --compile

`configs/70b_8x80gb.py` (Lion + Kahan, release, ZeRO-3, remat 'full', one 4096-token
sequence per device) at the 405B's shape (126 layers, d_model 16384, d_ff 53248, 128
heads, 8 KV heads), with what differs:

* the Lion moment and the Kahan buffer live in host memory (`optimizer.offload`): 189 GiB
  a device, which no H200 holds beside the 94.5 GiB parameter shard;
* so do the layers' saved inputs (`model.activation_offload`): 15.75 GiB a device;
* each layer's state goes back behind, during the next layer's backward pass
  (`optimizer.release_write_behind`), and the GPU profile lets XLA's scheduler plan for
  twice its memory limit, which the 94.5 GiB of arguments leave below what the step
  holds anyway (`gpu.xla_flags.WRITE_BEHIND_SLOP`).

The parameter shards stay on the device (ZeRO-3 over 8: 94.5 GiB), so only the optimizer
state and the saved inputs cross PCIe. Compiled by XLA's GPU compiler for 8 x H200 (the
second command, no GPU needed, nothing allocated): 122.64 GiB a device, where XLA's
allocator has 132.43 GiB of an H200 as train.py runs it; + 204.74 GiB of host memory a
device (1.60 TiB a node). The planner's estimate is 119.18 GiB (0.972). Its bus line: 440 GB
over PCIe a step and device, 4.40 s at 50 GB/s against 25.61 s of compute at 40% MFU:
the copies hide from one sequence a device (32,768 tokens a step). `train.py --dry_run
--target h200:8` times the compiled schedule (the matmuls at 40% of the peak, 50 GB/s):
96% of the layer loop's 8.70 s of copies a step (both directions) under compute, the
step waiting 0.34 s on them (each layer written in its own trip: 4%, 8.36 s, at 120.59
GiB). None of this has run on an H200: these are compiled bytes and the planner's
arithmetic.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x80gb.py")
  c.model.d_model = 16384
  c.model.n_layers = 126
  c.model.n_heads = 128
  c.model.n_kv_heads = 8
  c.model.d_ff = 53248
  c.optimizer.offload = "host"  # Lion's moment and the Kahan buffer: 189 GiB a device.
  c.model.activation_offload = "host"  # The layers' saved inputs: 15.75 GiB a device.
  c.optimizer.release_write_behind = True  # The copies back under the next layer: +1.9 GiB.
  return c
