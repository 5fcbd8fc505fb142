"""Mistral-Small-24B (2501) full fine-tune on 4 x 80 GB: the 70B recipe on its shape.

    python train.py --config configs/mistral_small_24b_4x80gb.py \
        --config.init_from=/path/to/Mistral-Small-24B-Base-2501 \
        --config.data.name=tokens --config.data.path=...
    python train.py --config configs/mistral_small_24b_4x80gb.py --dry_run --target h100:4

`configs/70b_8x80gb.py` (Lion + a bf16 Kahan buffer, gradient release, ZeRO-3, remat
'full', one 4096-token sequence per device) on 4 devices with Mistral-Small-24B's
config.json: 23.57B parameters, heads of 128 (not 5120 / 32 = 160), no sliding window,
rope_theta 1e8, untied head.

Compiled by XLA's GPU compiler for 4 x H100 80GB (`python -m zerojax.memory --config
configs/mistral_small_24b_4x80gb.py --target h100:4 --compile`, no GPU needed; the
`gpu-compile` extra): 32.93 GiB of state + 7.54 GiB of temporaries = 40.47 GiB a device
of the 74.72 XLA's allocator has; the planner's estimate 41.94 GiB (1.036). On 2 cards
(`--config.mesh.fsdp=2 --config.train.global_batch_size=2 --target h100:2`) it compiles
to 74.65 GiB, 67 MiB under the limit: no working margin; on 3 nothing shards. Not run
on GPUs yet.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # The recipe, Mistral's architecture (`zerojax.config.families`); Mistral-Small-24B's sizes.
  c = family_preset(beside(__file__, "70b_8x80gb.py"), "mistral")
  c.mesh.fsdp = 4
  c.train.global_batch_size = 4  # One sequence per device.
  c.model.vocab_size = 131072
  c.model.d_model = 5120
  c.model.d_ff = 32768
  c.model.n_layers = 40
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.head_size = 128  # Its head_dim.
  c.model.rope_theta = 100000000.0
  return c
