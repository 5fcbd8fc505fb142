"""Quick start for a mixture of experts (Qwen3-MoE): `configs/qwen3_tiny.py`'s run with
every layer's MLP a mixture of 8 experts, 2 per token.

    python train.py --config configs/qwen3_moe_tiny.py
    python -m zerojax.hf.export --workdir runs/moe --out moe_hf   # after --workdir runs/moe:
                                                                  # a Qwen3MoeForCausalLM folder

Dropless routing (each token's 2 experts, by grouped matmuls: `zerojax.models.moe`), the
load-balancing loss in the training loss at 0.01. The experts are ZeRO-sharded like any
other leaf; `--config.mesh.expert=2` (or 4, 8) splits them over the devices instead, the
tokens travelling to their experts by all-to-all (expert parallelism). From a Hugging
Face Qwen3-MoE folder: add `--config.init_from=DIR` (its error lists the overrides the
folder's shapes need). Hardware: any CPU (as tiny.py). Data: embedded.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "qwen3_tiny.py")  # Qwen3's attention, tiny.py's shapes and schedule.
  c.model.family = "qwen3_moe"  # Export writes Qwen3MoeForCausalLM (model_type qwen3_moe).
  c.model.tie_embeddings = False  # As every Qwen3-MoE.
  c.model.n_experts = 8  # Each layer's feed-forward block: 8 experts...
  c.model.experts_per_token = 2  # ... of which each token uses 2.
  c.model.expert_d_ff = 96  # Each expert's hidden width (a quarter of tiny.py's d_ff).
  c.model.norm_topk_prob = True  # The 2 routing weights sum to 1 (as Qwen3-30B-A3B).
  c.model.router_aux_loss_coef = 0.01  # The load-balancing loss's weight.
  return c
