"""Rotary position embeddings (RoPE) as Hugging Face's Llama computes them.

`rope_frequencies` (Llama 3.1's scaling and linear scaling included), `rope_tables` (cos
and sin at given positions: packed examples and the KV-cached decoder pass each token's
own position) and `apply_rope` (rotate-half). Local (sliding-window) layers may have a
base of their own (Gemma 3's `rope_local_base_freq`, without the scaling): `local=True`.
Shapes as in `zerojax.models.llama`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(config: Any, local: bool = False) -> np.ndarray:
  """Rotary inverse frequencies, as Hugging Face computes them.

  inv_freq[i] = 1 / theta^(2i / Dh); with `rope_scaling` of type 'linear', all divided by
  `factor`; else Llama 3.1's rule (`_compute_llama3_parameters`): wavelengths above
  original / low_freq_factor are divided by `factor`, those below original /
  high_freq_factor kept, those between interpolated smoothly. `local` with a
  `rope_local_theta`: that base, unscaled (else the same as the global layers').

  Returns:
    float32[Dh // 2], a constant (numpy, computed in float64).
  """
  d = config.head_dim
  own = local and config.rope_local_theta
  theta = config.rope_local_theta if own else config.rope_theta
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  s = None if own else config.rope_scaling
  if s is not None and s.get("rope_type") == "linear":
    inv_freq = inv_freq / s["factor"]
  elif s is not None:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def rope_tables(config: Any, positions: int | jax.Array, local: bool = False
                ) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the rotary angles at `positions` (int[..., T]; an int T = 0..T-1):
  float32[..., T, Dh] each (packed examples: positions from 0 in each, as HF's); `local`:
  a local layer's (`rope_frequencies`)."""
  if isinstance(positions, int):
    positions = jnp.arange(positions, dtype=jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(config, local)
  angles = jnp.concatenate([angles, angles], axis=-1)  # HF: both halves, same angles.
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """HF's rotate-half RoPE in fp32: x * cos + rotate_half(x) * sin.

  x: [B, T, N, Dh] queries or keys; cos, sin: float32[T, Dh] or [B, T, Dh]. Returns x's
  shape and dtype.
  """
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)
