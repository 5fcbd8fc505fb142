"""Gemma-3-12B (the text model) full fine-tune on one RTX 4090 24 GB: the 8B recipe on
Gemma 3's shape.

    python train.py --config configs/gemma3_12b_1x4090.py --config.init_from=/path/to/gemma-3-12b \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/gemma3_12b_1x4090.py --target rtx4090:1 --compile

`configs/8b_1x4090.py` (gradient release on one shard, the layers' parameters and the
optimizer state in pinned host memory, written back behind, Kahan AdamW with bf16
moments, remat 'full',
4096-token sequences) with Gemma 3 12B's text config (the text tower of its
`Gemma3ForConditionalGeneration` checkpoint): 11.77B parameters, 48 layers of which
every sixth is global and the others attend to the latest 1024 positions, heads of 256.

Compiled by XLA's GPU compiler for one RTX 4090 24GB (the second command, no GPU
needed, nothing allocated): 1.88 GiB of arguments + 15.00 GiB of temporaries = 16.88
GiB of the 21.84 XLA's allocator has; + 85.79 GiB of host memory (layers 20.04, moments
43.83, Kahan buffer 21.92). The planner's estimate 16.88 GiB (1.000). Attention: the
blocked loop, since cuDNN takes heads of 256 only from Hopper on (`attention_kernel`).
Its bus line: 206 GB over PCIe per step, 4.55 s at 25 GB/s against 4.68 s of compute
at 40% MFU. Not run on a GPU yet.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # The recipe, Gemma 3's architecture (`zerojax.config.families`); the 12B's sizes.
  c = family_preset(beside(__file__, "8b_1x4090.py"), "gemma3")
  c.model.vocab_size = 262208
  c.model.d_model = 3840
  c.model.d_ff = 15360
  c.model.n_layers = 48
  c.model.n_heads = 16
  c.model.n_kv_heads = 8
  c.model.head_size = 256  # Gemma 3's head_dim, not 3840 / 16 = 240.
  c.model.query_pre_attn_scalar = 256  # Scores times 256 ** -0.5.
  c.model.rope_scaling_factor = 8.0  # Global layers' RoPE, linear scaling by 8 (4B-27B).
  c.model.rope_scaling_type = "linear"
  return c
