"""Quick start for Gemma 3: `configs/tiny.py`'s run with Gemma 3's differences.

    python train.py --config configs/gemma3_tiny.py
    python -m zerojax.hf.export --workdir runs/g3 --out g3_hf   # after --workdir runs/g3:
                                                                # a Gemma3ForCausalLM folder

Local (sliding-window) and global layers alternate here (pattern 2 over 4 layers: local,
global, local, global; Gemma 3's own pattern is 6: five local, one global). From a
Hugging Face Gemma3ForCausalLM folder, or the text tower of a
Gemma3ForConditionalGeneration one (4B-27B): add `--config.init_from=DIR`; its error
lists the `--config.model.*` overrides the folder's shapes need (configs for the real
sizes are not written yet). Hardware: any CPU (as tiny.py). Data: embedded.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # Shapes, data and schedule: the Llama quick start's; Gemma 3's architecture (norms
  # times (1 + w), scaled embeddings, GeGLU, post-norms, q/k norms, local and global
  # layers with their own RoPE bases, tied head: `zerojax.config.families`).
  c = family_preset(beside(__file__, "tiny.py"), "gemma3")
  c.model.n_kv_heads = 1  # One key/value head, as Gemma 3 1B.
  c.model.head_size = 64  # Heads of 64, not d_model / n_heads = 32 (Gemma's head_dim).
  c.model.query_pre_attn_scalar = 64  # Scores times 64 ** -0.5 (Gemma 3: its head_dim).
  c.model.sliding_window = 32  # Local layers attend to the 32 latest positions.
  c.model.sliding_window_pattern = 2  # Layer i global when (i + 1) % 2 == 0.
  return c
