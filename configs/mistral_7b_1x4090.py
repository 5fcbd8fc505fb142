"""Mistral-7B (v0.3) full fine-tune on one RTX 4090 24 GB: the 8B recipe on Mistral's shape.

    python train.py --config configs/mistral_7b_1x4090.py \
        --config.init_from=/path/to/Mistral-7B-v0.3 --config.data.name=tokens --config.data.path=...
    python -m zerojax.memory --config configs/mistral_7b_1x4090.py --target rtx4090:1 --compile

`configs/8b_1x4090.py` (gradient release on one shard, the layers' parameters and the
optimizer state in pinned host memory, written back behind, Kahan AdamW with bf16
moments, remat 'full',
4096-token sequences) with Mistral-7B-v0.3's config.json: 7.25B parameters, a 32K
vocabulary, rope_theta 1e6, no sliding window (v0.1's 4096-token window is
`--config.model.sliding_window=4096`), untied head.

Compiled by XLA's GPU compiler for one RTX 4090 24GB (the second command, no GPU
needed, nothing allocated): 0.50 GiB of arguments (the embedding and the head, which
stay) + 6.22 GiB of temporaries = 6.72 GiB of the 21.84 XLA's allocator has; + 53.50
GiB of host memory (layers 13.00, moments 27.00, Kahan buffer 13.50). The planner's
estimate 6.91 GiB (1.028). Its bus line: 128.9 GB over PCIe per step, 2.86 s at 25 GB/s
against 2.85 s of compute at 40% MFU (bus-bound, 1.0x). Not run on a GPU yet.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # The recipe, Mistral's architecture (`zerojax.config.families`); Mistral-7B-v0.3's sizes.
  c = family_preset(beside(__file__, "8b_1x4090.py"), "mistral")
  c.model.vocab_size = 32768
  c.model.d_model = 4096
  c.model.d_ff = 14336
  c.model.n_layers = 32
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.rope_theta = 1000000.0
  return c
