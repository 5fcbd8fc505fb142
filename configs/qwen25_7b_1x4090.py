"""Qwen2.5-7B full fine-tune on one RTX 4090 24 GB: the 8B recipe on Qwen2.5's shape.

    python train.py --config configs/qwen25_7b_1x4090.py --config.init_from=/path/to/Qwen2.5-7B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/qwen25_7b_1x4090.py --target rtx4090:1 --compile

`configs/8b_1x4090.py` (gradient release on one shard, the layers' parameters and the
optimizer state in pinned host memory, written back behind, Kahan AdamW with bf16
moments, remat 'full',
4096-token sequences) with Qwen2.5-7B's config.json: 7.62B parameters, q/k/v biases,
heads of 128, a 152K vocabulary, untied head.

Compiled by XLA's GPU compiler for one RTX 4090 24GB (the second command, no GPU
needed, nothing allocated): 2.03 GiB of arguments (the embedding and the head, which
stay) + 11.17 GiB of temporaries = 13.20 GiB of the 21.84 XLA's allocator has; + 54.71
GiB of host memory (layers 12.15, moments 28.37, Kahan buffer 14.19). The planner's
estimate 13.20 GiB (1.000). Its bus line: 130.5 GB over PCIe per step,
2.87 s at 25 GB/s against 2.78 s of compute at 40% MFU (bus-bound, 1.0x). Not run on a
GPU yet.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # The recipe, Qwen2's architecture (`zerojax.config.families`); Qwen2.5-7B's sizes.
  c = family_preset(beside(__file__, "8b_1x4090.py"), "qwen2")
  c.model.vocab_size = 152064
  c.model.d_model = 3584
  c.model.d_ff = 18944
  c.model.n_layers = 28
  c.model.n_heads = 28
  c.model.n_kv_heads = 4
  c.model.tie_embeddings = False
  return c
