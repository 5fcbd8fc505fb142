"""Quick start for Mistral: `configs/tiny.py`'s run with Mistral 7B v0.1's differences.

    python train.py --config configs/mistral_tiny.py
    python -m zerojax.hf.export --workdir runs/m --out m_hf   # after --workdir runs/m:
                                                             # a MistralForCausalLM folder

Every layer attends to a sliding window (v0.1's 4096 of 32K; here 32 of 128 positions,
so the window binds); later Mistrals (v0.2+, Mistral-Small) have none
(`--config.model.sliding_window=0`) and Mistral-Small an explicit head size
(`--config.model.head_size=128`). From a Hugging Face folder: add
`--config.init_from=DIR`; its error lists the `--config.model.*` overrides the folder's
shapes need (configs for the real sizes are not written yet). Hardware: any CPU (as
tiny.py). Data: embedded, nothing downloaded.
"""

import ml_collections

from zerojax.config import beside, family_preset


def get_config() -> ml_collections.ConfigDict:
  # Shapes, data and schedule: the Llama quick start's; Mistral's architecture
  # (`zerojax.config.families`).
  c = family_preset(beside(__file__, "tiny.py"), "mistral")
  c.model.sliding_window = 32  # Each position attends to the 32 latest (itself included).
  c.model.sliding_window_pattern = 0  # On every layer.
  c.model.rope_theta = 10000.0  # Mistral 7B's rotary base.
  return c
