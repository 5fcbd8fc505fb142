"""Quick start for Qwen2 / Qwen2.5: `configs/tiny.py`'s run with Qwen2's differences.

    python train.py --config configs/qwen2_tiny.py
    python -m zerojax.hf.export --workdir runs/q2 --out q2_hf   # after --workdir runs/q2:
                                                                # a Qwen2ForCausalLM folder

From a Hugging Face Qwen2 / Qwen2.5 folder: add `--config.init_from=DIR`; its error lists
the `--config.model.*` overrides the folder's shapes need (configs for the real sizes
are not written yet). Hardware: any CPU (as tiny.py). Data: embedded, nothing downloaded.
"""

import ml_collections

from zerojax.config import beside


def get_config() -> ml_collections.ConfigDict:
  c = beside(__file__, "tiny.py")  # Shapes, data and schedule: the Llama quick start's.
  c.model.family = "qwen2"  # Export writes Qwen2ForCausalLM (model_type qwen2).
  c.model.qkv_bias = True  # q, k and v projections with biases (o_proj without).
  c.model.rope_theta = 1000000.0  # Qwen2.5's rotary base.
  c.model.norm_eps = 1e-6  # Qwen2.5's rms_norm_eps.
  c.model.tie_embeddings = True  # As Qwen2.5-0.5B to 3B (7B and up: untied).
  return c
