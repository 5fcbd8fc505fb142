"""Llama-3-8B full fine-tune on 4,194,304-token sequences, one node of 8 x 80 GB.

    python train.py --config configs/8b_4m_8x80gb.py --config.init_from=/path/to/Llama-3.1-8B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/8b_4m_8x80gb.py --target h100:8 --compile

`configs/8b_bf16.py` (AdamW + Kahan, bf16 state, ZeRO-3, remat 'full') with what differs:

* one sequence of 4,194,304 tokens a step, split by position over the 8 devices
  (`mesh.sequence_parallel`: 524,288 positions a device; Ulysses attention over the whole
  sequence for 4 of the 32 query heads and 1 of the 8 KV heads a device);
* the layer inputs remat saves (32 x [524288, 4096] bf16 = 128 GiB a device) live in
  pinned host memory between the passes, back one layer ahead in the backward pass
  (`model.activation_offload`): 1 TiB of host memory per node;
* the MLP runs 32,768 positions at a time (`model.mlp_chunk`): untiled, its [524288,
  14336] bf16 temporaries are 14 GiB each, four alive at once.

Compiled by XLA's GPU compiler for 8 x H100 80GB (the second command, no GPU needed):
7.49 GiB of state + 53.34 GiB of temporaries = 60.84 GiB a device (XLA's allocator has
74.72 GiB of an H100 as train.py runs it); + 128.00 GiB of saved activations in host
memory a device. Untiled (measured with `optimizer.offload=host`) the temporaries alone
are 100.30 GiB.

Plain token sequences: attention 'auto' is cuDNN's flash attention on a GPU. Packed rows
need `model.attention=blocked`, whose scores at this length are [block, 4M] per head.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "8b_bf16.py")
  c.train.seq_len = 4_194_304
  c.train.global_batch_size = 1  # One sequence a step, over all 8 devices.
  c.mesh.data = 1  # Every device holds a slice of the one sequence.
  c.mesh.sequence_parallel = True
  c.model.activation_offload = "host"
  c.model.mlp_chunk = 32_768  # 16 tiles of the 524,288 positions a device holds.
  return c
