"""Qwen3-30B-A3B full fine-tune on one 8 x 80 GB node: a mixture of 128 experts, 8 a token.

    python train.py --config configs/qwen3_30b_a3b_8x80gb.py \
        --config.init_from=/path/to/Qwen3-30B-A3B --config.data.name=tokens --config.data.path=...
    python train.py --config configs/qwen3_30b_a3b_8x80gb.py --dry_run --target h100:8

`configs/qwen3_32b_4x80gb.py` (the 70B recipe: Lion + a bf16 Kahan buffer, gradient
release, ZeRO-3, remat 'full', one 4096-token sequence per device) on 8 devices with
Qwen3-30B-A3B's config.json: 30.5B
parameters of which 3.3B a token (48 layers of 128 experts of width 768, 8 a token,
renormalized), Qwen3's attention (32 query heads of 128, 4 KV heads, q/k norms), untied
head, the load-balancing loss at 0.001 (its `router_aux_loss_coef`). The experts are
split over the 8 devices by expert (`mesh.expert=8`: 16 a device, tokens to them by
all-to-all); everything else is ZeRO-sharded over all 8.

Compiled by XLA's GPU compiler for 8 x H100 80GB (`python -m zerojax.memory --config
configs/qwen3_30b_a3b_8x80gb.py --target h100:8 --compile`, no GPU needed): 21.33 GiB of
state + 4.05 GiB of temporaries = 25.38 GiB a device of the 74.72 XLA's allocator has;
the planner's estimate 25.37 GiB (1.000). Each device sends each other at most 1.5 x what
a balanced router sends it (`model.expert_capacity_factor`, the rest dropped and
counted: `moe/dropped_tokens`); dropless (`--config.model.expert_capacity_factor=0`),
the exchange's buffers hold the worst case, every row to one device: 10.55 GiB of
temporaries, 31.88 GiB a device. Not run on GPUs yet.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  # The recipe with Qwen3's vocabulary and attention (heads of 128, q/k norms, RoPE base
  # 1e6, untied head); Qwen3-30B-A3B's config.json follows.
  c = beside(__file__, "qwen3_32b_4x80gb.py")
  c.mesh.expert = 8  # Each device holds 16 of each layer's 128 experts.
  # Each device sends each other at most 1.5 x what a balanced router sends it; the rows
  # past that are dropped and counted (moe/dropped_tokens). 0: dropless, worst-case buffers.
  c.model.expert_capacity_factor = 1.5
  c.mesh.fsdp = 1
  c.train.global_batch_size = 8  # One sequence per device.
  c.model.family = "qwen3_moe"  # Export writes Qwen3MoeForCausalLM.
  c.model.d_model = 2048
  c.model.d_ff = 6144  # Unused: every layer's MLP is the experts (HF intermediate_size).
  c.model.n_layers = 48
  c.model.n_heads = 32
  c.model.n_kv_heads = 4
  c.model.n_experts = 128  # num_experts
  c.model.experts_per_token = 8  # num_experts_per_tok
  c.model.expert_d_ff = 768  # moe_intermediate_size
  c.model.norm_topk_prob = True
  c.model.router_aux_loss_coef = 0.001
  return c
