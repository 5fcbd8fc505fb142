"""A position-wise layer run tile by tile over the sequence (ALST's "TiledMLP").

Each position of an MLP is computed alone, so the sequence can be cut anywhere and no
mask is involved. At long context the SwiGLU's [B, T, F] temporaries (gate, up, their
product and, in the backward pass, the gradient of each) outgrow the rest of a layer:
at 70B, 32K positions a device make 1.9 GB per buffer in bf16 (arithmetic). Run `chunk` positions at
a time, each tile under `jax.checkpoint`, and one tile's temporaries are alive, forward
or backward; the backward pass recomputes a tile's gate and up from the tile's input.
The layer's remat policy still decides what is kept: one that saves gate and up ('dots'
as matmul outputs, 'minimal' by name) saves every tile's, stacked back to [B, T, F]
(measured in tests/test_tiled_mlp.py); with 'full', 'none' or a policy that names
neither, one tile's are alive at a time.

Why a `lax.scan` over a plain function and not Flax's lifted `nn.scan` with
`variable_broadcast="params"`: each tile is a fresh `apply` of the layer's own untiled
module with the params the layer was given, so the param tree, the math and the
`checkpoint_name` tags are the untiled layer's by construction, and no lifted transform
has to nest inside the layer stack's `nn.map_variables`, `nn.remat` and `nn.scan` (nor
inside `zerojax.scan_layers`, which applies the block as a plain function).
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def apply(module: nn.Module, x: jax.Array, chunk: int) -> jax.Array:
  """`module(x)` for a bound, position-wise `module`, `chunk` positions at a time.

  At init (and with chunk 0) `module` is called as it is, so it makes its params under
  its own names; afterwards each tile applies an unbound clone to `module.variables`.

  Args:
    module: a child constructed in its parent's compact method (its name is its params'
      path), mapping [B, C, D] -> [B, C, E] for any C, each position on its own.
    x: [B, T, D], the dtype `module` takes.
    chunk: positions per tile; 0 = untiled (see `over_sequence`).

  Returns:
    [B, T, E] in `module`'s output dtype.
  """
  if not chunk or module.is_initializing():
    return module(x)
  return over_sequence(module.clone(parent=None).apply, module.variables, x, chunk)


def over_sequence(fn: Callable[[Any, jax.Array], jax.Array], params: Any, x: jax.Array,
                  chunk: int) -> jax.Array:
  """`fn(params, x)` computed `chunk` positions of the sequence axis at a time.

  Each tile is under `jax.checkpoint` saving nothing of its own but its input; a remat
  policy around the call still saves what it names inside `fn`, tile by tile.

  Args:
    fn: `(params, [B, C, D]) -> [B, C, E]`, C <= chunk; position-wise.
    params: a pytree of arrays, the same for every tile.
    x: [B, T, D], any dtype `fn` takes.
    chunk: positions per tile; T is padded up to a multiple (the padding's outputs are
      dropped), and T <= chunk is one tile of T (a decode step: one position).

  Returns:
    [B, T, E] in `fn`'s output dtype: `fn(params, x)` up to float rounding.
  """
  B, T = x.shape[:2]
  size = min(chunk, T)
  n = -(-T // size)
  tiles = jnp.pad(x, [(0, 0), (0, n * size - T)] + [(0, 0)] * (x.ndim - 2))
  tiles = tiles.reshape(B, n, size, *x.shape[2:]).swapaxes(0, 1)  # [n, B, size, D]
  tile = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable,
                        prevent_cse=False)  # In a scan body there is no CSE to prevent.
  _, out = jax.lax.scan(lambda _, t: (None, tile(params, t)), None, tiles)
  return out.swapaxes(0, 1).reshape(B, n * size, *out.shape[3:])[:, :T]
