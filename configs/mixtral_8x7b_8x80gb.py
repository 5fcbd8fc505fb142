"""Mixtral 8x7B full fine-tune on one 8 x 80 GB node: 8 experts, 2 a token, one a device.

    python train.py --config configs/mixtral_8x7b_8x80gb.py \
        --config.init_from=/path/to/Mixtral-8x7B-v0.1 \
        --config.data.name=tokens --config.data.path=...
    python train.py --config configs/mixtral_8x7b_8x80gb.py --dry_run --target h100:8

`configs/70b_8x80gb.py` (Lion + a bf16 Kahan buffer, gradient release, ZeRO-3, remat
'full', one 4096-token sequence per device) with Mixtral-8x7B's config.json: 46.7B
parameters of which 12.9B a token (32 layers of 8 experts of width 14336, 2 a token),
32 query heads of 128 and 8 KV heads, RoPE base 1e6, untied head, the load-balancing loss
at 0.02. The experts are split over the 8 devices by expert (`mesh.expert=8`: one a
device, tokens to it by all-to-all); everything else is ZeRO-sharded over all 8.

Compiled by XLA's GPU compiler for 8 x H100 80GB (`python -m zerojax.memory --config
configs/mixtral_8x7b_8x80gb.py --target h100:8 --compile`, no GPU needed): 36.72 GiB a
device of the 74.72 XLA's allocator has (each device sending each other at most 1.5 x a
balanced router's rows; 39.46 GiB dropless, `--config.model.expert_capacity_factor=0`);
the planner's estimate 37.71 GiB (1.027).
Not run on GPUs yet.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "70b_8x80gb.py")  # The recipe; Mixtral-8x7B's config.json follows.
  c.mesh.expert = 8  # Each device holds one of each layer's 8 experts.
  # Each device sends each other at most 1.5 x what a balanced router sends it; the rows
  # past that are dropped and counted (moe/dropped_tokens). 0: dropless, worst-case buffers.
  c.model.expert_capacity_factor = 1.5
  c.mesh.fsdp = 1
  c.model.family = "mixtral"  # Export writes MixtralForCausalLM.
  c.model.vocab_size = 32000
  c.model.d_model = 4096
  c.model.d_ff = 14336  # Unused: every layer's MLP is the experts.
  c.model.n_layers = 32
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.rope_theta = 1000000.0
  c.model.rope_scaling_factor = 0.0  # No Llama 3.1 scaling (the recipe's 70B has it).
  c.model.tie_embeddings = False
  c.model.n_experts = 8  # num_local_experts
  c.model.experts_per_token = 2  # num_experts_per_tok
  c.model.expert_d_ff = 14336  # intermediate_size
  c.model.router_aux_loss_coef = 0.02
  return c
