"""Qwen3-235B-A22B full fine-tune on one 8 x H200 node: 128 experts, 8 a token, the
optimizer state in host memory.

    python train.py --config configs/qwen3_235b_a22b_8xh200.py \
        --config.init_from=/path/to/Qwen3-235B-A22B --config.data.name=tokens --config.data.path=...
    python train.py --config configs/qwen3_235b_a22b_8xh200.py --dry_run --target h200:8

`configs/qwen3_30b_a3b_8x80gb.py` (the 70B recipe: Lion + a bf16 Kahan buffer, gradient
release, ZeRO-3, remat 'full', one 4096-token sequence per device; Qwen3's attention and
experts) with Qwen3-235B-A22B's config.json: 235B
parameters of which 22B a token (94 layers of 128 experts of width 1536, 8 a token,
renormalized), Qwen3's attention (64 query heads of 128, 4 KV heads, q/k norms), untied
head, the load-balancing loss at 0.001. The experts are split over the 8 devices by
expert (`mesh.expert=8`: 16 a device, tokens to them by all-to-all); everything else is
ZeRO-sharded over all 8. The bf16 params stay on the devices (54.74 GiB a device); Lion's
moment and the Kahan buffer (4 bytes a parameter, 875.79 GiB a node) live in host memory
and come to the device a layer at a time inside release's backward loop.

Compiled by XLA's GPU compiler for 8 x H200 (`python -m zerojax.memory --config
configs/qwen3_235b_a22b_8xh200.py --target h200:8 --compile`, no GPU needed): 66.29 GiB
a device of the 132.43 XLA's allocator has (each device sending each other at most 1.5 x
a balanced router's rows, `model.expert_capacity_factor`; 79.23 GiB dropless, at 0), plus
109.47 GiB of optimizer state a device in host memory (875.79 GiB a node); the planner's
estimate 64.60 GiB (0.974). Not run on GPUs yet.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "qwen3_30b_a3b_8x80gb.py")  # Qwen3-235B-A22B's config.json follows.
  c.optimizer.offload = "host"  # Lion's moment and the Kahan buffer: 875.79 GiB a node.
  c.model.d_model = 4096
  c.model.d_ff = 12288  # Unused: every layer's MLP is the experts (HF intermediate_size).
  c.model.n_layers = 94
  c.model.n_heads = 64
  c.model.expert_d_ff = 1536  # moe_intermediate_size
  return c
