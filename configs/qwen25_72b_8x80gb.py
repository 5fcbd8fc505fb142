"""Qwen2.5-72B full fine-tune on one node of 8 x 80 GB: the 70B recipe on Qwen2.5's shape.

    python train.py --config configs/qwen25_72b_8x80gb.py --config.init_from=/path/to/Qwen2.5-72B \
        --config.data.name=tokens --config.data.path=...
    python train.py --config configs/qwen25_72b_8x80gb.py --dry_run --target h100:8   # compile only

`configs/70b_8x80gb.py` (Lion + a bf16 Kahan buffer, gradient release, ZeRO-3, remat
'full', one 4096-token sequence per device) with Qwen2.5-72B's config.json: 72.71B
parameters (Llama-3-70B: 70.55B; the 152K vocabulary and d_ff 29568 are most of it),
q/k/v biases, rope_theta 1e6, untied head.

Compiled by XLA's GPU compiler for 8 x H100 80GB (`python -m zerojax.memory --config
configs/qwen25_72b_8x80gb.py --target h100:8 --compile`, no GPU needed; the `gpu-compile`
extra): 50.78 GiB of state + 13.98 GiB of temporaries = 64.77 GiB a device (the Llama
70B recipe: 62.09), where XLA's allocator has 74.72 GiB of an H100 as train.py runs it;
the planner's estimate 67.21 GiB (1.038). Not run on GPUs yet.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # The recipe, Qwen2's architecture (`zerojax.config.families`); Qwen2.5-72B's sizes.
  c = family_preset(beside(__file__, "70b_8x80gb.py"), "qwen2")
  c.model.vocab_size = 152064
  c.model.d_model = 8192
  c.model.d_ff = 29568
  c.model.n_layers = 80
  c.model.n_heads = 64
  c.model.n_kv_heads = 8
  c.model.tie_embeddings = False
  return c
