"""Qwen3-8B full fine-tune on one RTX 4090 24 GB: the 8B recipe on Qwen3's shape.

    python train.py --config configs/qwen3_8b_1x4090.py --config.init_from=/path/to/Qwen3-8B \
        --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/qwen3_8b_1x4090.py --target rtx4090:1 --compile

`configs/8b_1x4090.py` (gradient release on one shard, the layers' parameters and the
optimizer state in pinned host memory, written back behind, Kahan AdamW with bf16
moments, remat 'full',
4096-token sequences) with Qwen3-8B's config.json: 8.19B parameters, heads of 128 with
q/k norms, a 152K vocabulary, untied head.

Compiled by XLA's GPU compiler for one RTX 4090 24GB (the second command, no GPU
needed, nothing allocated): 2.32 GiB of arguments (the embedding and the head, which
stay) + 12.75 GiB of temporaries = 15.07 GiB of the 21.84 XLA's allocator has; + 58.71
GiB of host memory (layers 12.94, moments 30.51, Kahan buffer 15.26). The planner's
estimate 15.07 GiB (1.000). Its
bus line: 140 GB over PCIe per step, 3.08 s at 25 GB/s against 3.04 s of compute at 40%
MFU (bus-bound, 1.0x). Not run on a GPU yet.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # The recipe, Qwen3's architecture (`zerojax.config.families`); Qwen3-8B's sizes.
  c = family_preset(beside(__file__, "8b_1x4090.py"), "qwen3")
  c.model.vocab_size = 151936
  c.model.d_model = 4096
  c.model.d_ff = 12288
  c.model.n_layers = 36
  c.model.n_heads = 32  # Heads of 4096 / 32 = 128, Qwen3's head_dim: no head_size.
  c.model.n_kv_heads = 8
  c.model.tie_embeddings = False
  return c
