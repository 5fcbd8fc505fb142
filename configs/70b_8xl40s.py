"""Llama-3-70B full fine-tune on one node of 8 x L40S 48 GB: optimizer offload.

    python train.py --config configs/70b_8xl40s.py --config.init_from=/path/to/Llama-3.1-70B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/70b_8xl40s.py --target l40s:8 --compile

`configs/70b_8x80gb.py` (Lion + Kahan, gradient release, ZeRO-3, remat 'full', one
4096-token sequence per device) with the Lion moment and the Kahan buffer in pinned
host memory (`optimizer.offload`), streamed to the device one layer ahead for their
update. The parameters stay on the devices: they fit, and keeping them saves two
thirds of the PCIe traffic parameter offload would add.

Each layer's state goes back behind, during the next layer's backward pass
(`optimizer.release_write_behind`), under its matmuls.

Compiled by XLA's GPU compiler for 8 x L40S 48GB (the second command, no GPU needed,
nothing allocated): 31.06 GiB a device, where XLA's allocator has 41.79 GiB of an L40S
as train.py runs it; + 32.85 GiB of host memory a device (262.83 GiB a node). The
planner's estimate 31.41 GiB (1.011); PCIe 70.6 GB per step and device, 1.41 s at 25 GB/s
(PCIe 4.0 x16) against 12.25 s of compute at 40% MFU. `configs/70b_8x4090.py`'s
parameter offload on top: 15.65 GiB a device, for cards of 24 GB.

`train.py --dry_run --target` reads the compiled schedule: 36 copies to the device in 1
loop body, 100% of their bytes with compute scheduled under them; timed along it
(matmuls at 40% of the L40S's peak, the link at 25 GB/s), all 2.74 s of the loop's
copies a step run under compute (each layer written in its own trip: 46% of the bytes,
11% of the time; 30.56 GiB a device). A schedule, not a timing.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x80gb.py")
  c.optimizer.offload = "host"  # Lion's moment and the Kahan buffer: 16 GiB a device.
  c.optimizer.release_write_behind = True  # The copies back under the next layer: +0.8 GiB.
  return c
