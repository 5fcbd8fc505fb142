"""Quick start for Qwen2 / Qwen2.5: `configs/tiny.py`'s run with Qwen2's differences.

    python train.py --config configs/qwen2_tiny.py
    python -m zerojax.hf.export --workdir runs/q2 --out q2_hf   # after --workdir runs/q2:
                                                                # a Qwen2ForCausalLM folder

From a Hugging Face Qwen2 / Qwen2.5 folder: add `--config.init_from=DIR`; its error lists
the `--config.model.*` overrides the folder's shapes need (configs for the real sizes
are not written yet). Hardware: any CPU (as tiny.py). Data: embedded, nothing downloaded.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # Shapes, data and schedule: the Llama quick start's; Qwen2's architecture (q/k/v
  # biases, RoPE base 1e6, eps 1e-6: `zerojax.config.families`).
  c = family_preset(beside(__file__, "tiny.py"), "qwen2")
  c.model.tie_embeddings = True  # As Qwen2.5-0.5B to 3B (7B and up: untied).
  return c
