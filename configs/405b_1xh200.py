"""Llama-3.1-405B full fine-tune on one H200 141 GB: the whole model in host memory, one
layer on the device at a time.

    python train.py --config configs/405b_1xh200.py --config.init_from=/path/to/Llama-3.1-405B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/405b_1xh200.py --target h200:1 --compile

`configs/405b_8xh200.py` (Lion, gradient release, ZeRO-3, remat 'full', the optimizer
state and the saved layer inputs in host memory) on one device, with what differs:

* the layers' parameters live in host memory too (`zero.param_offload`): each layer comes
  to the device one layer ahead of its use, and release writes its update straight back;
* stochastic rounding instead of a Kahan buffer: the host holds params 748 GiB + the Lion
  moment 756 GiB + saved inputs 63 GiB = 1.53 TiB. A Kahan buffer (756 GiB more) or
  AdamW's second moment would pass 2 TiB;
* four 4096-token sequences a step (16,384 tokens): the copies then take less time than
  the compute (below);
* each layer's update goes back to host memory behind, during the next layer's backward
  pass (`optimizer.release_write_behind`): 4.85 GiB more on the device (a layer's params
  and Lion moment carried one trip, less the next layer's moment, then read in its own
  trip), the copies back under the next layer's matmuls.

Compiled by XLA's GPU compiler for one H200 (the second command, no GPU needed, nothing
allocated): 64.56 GiB on the device, where XLA's allocator has 132.43 GiB of an H200 as
train.py runs it, + 1.53 TiB of host memory. The planner says 66.68 GiB (1.033; both
peaks at a layer's update, beside the carried one). Its
bus line: 4,169 GB over PCIe a step, 49.72 s at 50 GB/s a direction against 102.43 s of
compute at 40% MFU; the copies hide from two sequences (8,192 tokens a step).
`train.py --dry_run --target h200:1` times the compiled schedule (the matmuls at 40% of
the peak, 50 GB/s): 78% of the layer loops' 83.04 s of copies a step (both directions)
under compute, the step waiting 18.63 s on them (each layer written in its own trip:
21%, 65.39 s, at 59.71 GiB). None of this has run on an H200.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "405b_8xh200.py")
  c.zero.param_offload = "host"  # The layer stack: 748 GiB of host memory.
  c.optimizer.update_rule = "stochastic"  # No Kahan buffer: 756 GiB of host memory less.
  c.train.global_batch_size = 4  # Four sequences on the one device.
  c.optimizer.release_write_behind = True  # The copies back under the next layer: +4.9 GiB.
  return c
