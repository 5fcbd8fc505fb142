"""Gemma-3-27B (the text model) full fine-tune on 4 x 80 GB: the 70B recipe on Gemma 3's shape.

    python train.py --config configs/gemma3_27b_4x80gb.py --config.init_from=/path/to/gemma-3-27b \
        --config.data.name=tokens --config.data.path=...
    python train.py --config configs/gemma3_27b_4x80gb.py --dry_run --target h100:4   # compile only

`configs/70b_8x80gb.py` (Lion + a bf16 Kahan buffer, gradient release, ZeRO-3, remat
'full', one 4096-token sequence per device) on 4 devices with Gemma 3 27B's text
config (the text tower of its `Gemma3ForConditionalGeneration` checkpoint; export
writes a `Gemma3ForCausalLM`): 27.01B parameters, 62 layers of which every sixth is
global and the others attend to the latest 1024 positions (each layer's kernel chosen
by `lax.cond` inside the layer loop), heads of 128 scored at 168 ** -0.5.

Compiled by XLA's GPU compiler for 4 x H100 80GB (`python -m zerojax.memory --config
configs/gemma3_27b_4x80gb.py --target h100:4 --compile`, no GPU needed; the
`gpu-compile` extra): 37.73 GiB of state + 14.21 GiB of temporaries = 51.94 GiB a
device of the 74.72 XLA's allocator has; the planner's estimate 53.47 GiB (1.030). The
fewest cards: 3 (`--config.mesh.fsdp=3 --config.train.global_batch_size=3 --target
h100:3`: 63.52 GiB compiled, planner 1.049); on 2 the state alone is 75.5 GiB. Not run
on GPUs yet.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # The recipe, Gemma 3's architecture (`zerojax.config.families`); the 27B's sizes.
  c = family_preset(beside(__file__, "70b_8x80gb.py"), "gemma3")
  c.mesh.fsdp = 4
  c.train.global_batch_size = 4  # One sequence per device.
  c.model.vocab_size = 262208
  c.model.d_model = 5376
  c.model.d_ff = 21504
  c.model.n_layers = 62
  c.model.n_heads = 32
  c.model.n_kv_heads = 16
  c.model.head_size = 128  # Not d_model / n_heads = 168.
  c.model.query_pre_attn_scalar = 168  # Scores times 168 ** -0.5.
  c.model.rope_scaling_factor = 8.0  # Global layers' RoPE, linear scaling by 8 (4B-27B).
  c.model.rope_scaling_type = "linear"
  return c
