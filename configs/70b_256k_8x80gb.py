"""Llama-3-70B full fine-tune on 262,144-token sequences, one node of 8 x 80 GB.

    python train.py --config configs/70b_256k_8x80gb.py --config.init_from=/path/to/Llama-3.1-70B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/70b_256k_8x80gb.py --target h100:8 --compile

`configs/70b_8x80gb.py` (Lion + Kahan, gradient release, ZeRO-3, remat 'full') with what
differs:

* one sequence of 262,144 tokens a step, split by position over the 8 devices
  (`mesh.sequence_parallel`: 32,768 positions a device; Ulysses attention over the whole
  sequence for 8 of the 64 query heads and 1 of the 8 KV heads a device);
* the layer inputs remat saves (80 x [32768, 8192] bf16 = 40 GiB a device) live in
  pinned host memory between the passes, back one layer ahead in the backward pass
  (`model.activation_offload`): 320 GiB of host memory per node.

Compiled by XLA's GPU compiler for 8 x H100 80GB (the second command, no GPU needed):
49.28 GiB of state + 17.10 GiB of temporaries = 66.38 GiB a device, where XLA's
allocator has 74.72 GiB of an H100 as train.py runs it; + 40.00 GiB of saved activations
in host memory a device. With `--config.optimizer.offload=host` as well (the Lion moment
and the Kahan buffer in host memory too): 36.75 GiB a device + 72.85 GiB of host memory
a device (583 GiB a node), and 524,288 tokens fit: 49.30 GiB + 112.85 GiB of host memory
a device (903 GiB a node); with `--config.model.mlp_chunk=16384` too, 1,048,576 tokens:
50.34 GiB + 192.85 GiB of host memory a device (1.51 TiB a node).

Plain token sequences: attention 'auto' is cuDNN's flash attention on a GPU, which takes
no mask for causal rows of one document. Packed rows (several examples a row) need
`model.attention=blocked`: cuDNN's segment mask would be a [T, T] bias.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x80gb.py")
  c.train.seq_len = 262_144
  c.train.global_batch_size = 1  # One sequence a step, over all 8 devices.
  c.mesh.data = 1  # Every device holds a slice of the one sequence.
  c.mesh.sequence_parallel = True
  c.model.activation_offload = "host"
  return c
