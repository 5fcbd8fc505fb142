"""Qwen3-32B full fine-tune on 4 x 80 GB: the 70B recipe on Qwen3's shape.

    python train.py --config configs/qwen3_32b_4x80gb.py --config.init_from=/path/to/Qwen3-32B \
        --config.data.name=tokens --config.data.path=...
    python train.py --config configs/qwen3_32b_4x80gb.py --dry_run --target h100:4   # compile only

`configs/70b_8x80gb.py` (Lion + a bf16 Kahan buffer, gradient release, ZeRO-3, remat
'full', one 4096-token sequence per device) on 4 devices with Qwen3-32B's config.json:
32.76B parameters, heads of 128 (not 5120 / 64 = 80) with q/k norms, untied head.

Compiled by XLA's GPU compiler for 4 x H100 80GB (`python -m zerojax.memory --config
configs/qwen3_32b_4x80gb.py --target h100:4 --compile`, no GPU needed; the `gpu-compile`
extra): 45.77 GiB of state + 8.73 GiB of temporaries = 54.50 GiB a device of the 74.72
XLA's allocator has; the planner's estimate 56.55 GiB (1.038). The fewest cards: 4 (on
3 no dimension of most leaves divides, so nothing shards: 194 GiB; on 2 the state alone
is 91.5 GiB). Not run on GPUs yet.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # The recipe, Qwen3's architecture (`zerojax.config.families`); Qwen3-32B's sizes.
  c = family_preset(beside(__file__, "70b_8x80gb.py"), "qwen3")
  c.mesh.fsdp = 4
  c.train.global_batch_size = 4  # One sequence per device.
  c.model.vocab_size = 151936
  c.model.d_model = 5120
  c.model.d_ff = 25600
  c.model.n_layers = 64
  c.model.n_heads = 64
  c.model.n_kv_heads = 8
  c.model.head_size = 128  # Qwen3's head_dim.
  c.model.tie_embeddings = False
  return c
