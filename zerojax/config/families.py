"""Each Hugging Face family's architecture as `model.*` values: what every config of the
family sets, whatever its size, in one place.

A family's config starts from a recipe (optimizer, plan, sequence length), takes its
family's values here, then its own sizes (vocabulary, widths, layers, heads, and what
varies between a family's sizes: Qwen's tied head on the small ones, Gemma 3's head size
and RoPE scaling, Mistral's rotary base):

    c = family_preset(beside(__file__, "70b_8x80gb.py"), "qwen3")
    c.model.d_model = 5120
    ...

The values are the published config.json files' (`tests/test_families.py` checks each
real-size recipe against its model's); import still checks every key against the
checkpoint (`hf.check_config`), so a preset never overrides a folder.
"""

import ml_collections

# family -> {model key: value}; each value with what it is in the family's config.json.
FAMILIES: dict[str, dict[str, object]] = {
    "qwen2": {  # Qwen2 and Qwen2.5.
        "family": "qwen2",  # Export writes Qwen2ForCausalLM.
        "qkv_bias": True,  # q, k and v projections with biases (o_proj without).
        "rope_theta": 1000000.0,
        "rope_scaling_factor": 0.0,  # No Llama 3.1 scaling (the Llama recipes have it).
        "norm_eps": 1e-6,  # rms_norm_eps.
    },
    "qwen3": {
        "family": "qwen3",  # Export writes Qwen3ForCausalLM.
        "qk_norm": True,  # An RMSNorm of each query and key head, before RoPE.
        "rope_theta": 1000000.0,
        "rope_scaling_factor": 0.0,  # No Llama 3.1 scaling (the Llama recipes have it).
        "norm_eps": 1e-6,  # rms_norm_eps.
    },
    "mistral": {
        "family": "mistral",  # Export writes MistralForCausalLM.
        "rope_scaling_factor": 0.0,  # No Llama 3.1 scaling (the Llama recipes have it).
        "norm_eps": 1e-5,  # rms_norm_eps.
        "tie_embeddings": False,
    },
    "gemma3": {  # The text model (of Gemma3ForCausalLM, or of the multimodal checkpoints).
        "family": "gemma3",  # Export writes Gemma3ForCausalLM.
        "qk_norm": True,  # An RMSNorm of each query and key head, before RoPE.
        "norm_offset": 1.0,  # Every norm multiplies by (1 + w), w initialised at 0.
        "scale_embeddings": True,  # The embedding's output times sqrt(d_model).
        "hidden_act": "gelu_tanh",  # GeGLU: tanh-approximated GELU on the gate.
        "post_norms": True,  # Norms on the attention and MLP outputs, and before the MLP.
        "sliding_window": 1024,  # Local layers attend to the latest 1024 positions.
        "sliding_window_pattern": 6,  # Every sixth layer global.
        "rope_theta": 1000000.0,  # Global layers' rotary base.
        "rope_local_theta": 10000.0,  # Local layers' own base, unscaled.
        "norm_eps": 1e-6,  # rms_norm_eps.
        "tie_embeddings": True,  # The head is the embedding, in every Gemma 3.
    },
}


def family_preset(config: ml_collections.ConfigDict, family: str) -> ml_collections.ConfigDict:
  """Sets `config.model` to `family`'s architecture (`FAMILIES[family]`); returns `config`.

  Raises:
    KeyError: `family` has no preset (the message lists those that do).
  """
  if family not in FAMILIES:
    raise KeyError(f"no preset for family {family!r}; presets: {', '.join(FAMILIES)}")
  for key, value in FAMILIES[family].items():
    config.model[key] = value
  return config
