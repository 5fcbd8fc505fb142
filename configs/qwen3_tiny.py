"""Quick start for Qwen3: `configs/tiny.py`'s run with Qwen3's differences.

    python train.py --config configs/qwen3_tiny.py
    python -m zerojax.hf.export --workdir runs/q3 --out q3_hf   # after --workdir runs/q3:
                                                                # a Qwen3ForCausalLM folder

From a Hugging Face Qwen3 folder: add `--config.init_from=DIR`; its error lists the
`--config.model.*` overrides the folder's shapes need (configs for the real sizes are
not written yet). Hardware: any CPU (as tiny.py). Data: embedded, nothing downloaded.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # Shapes, data and schedule: the Llama quick start's; Qwen3's architecture (q/k norms,
  # RoPE base 1e6, eps 1e-6: `zerojax.config.families`).
  c = family_preset(beside(__file__, "tiny.py"), "qwen3")
  c.model.head_size = 64  # Heads of 64, not d_model / n_heads = 32 (Qwen3's head_dim).
  c.model.tie_embeddings = True  # As Qwen3-0.6B to 4B (8B and up: untied).
  return c
