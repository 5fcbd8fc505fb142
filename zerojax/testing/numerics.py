"""A step's gradient against float64: the transform that keeps it, the reference, the
errors (tests/test_precision.py and benchmarks/weight_grads.py read the same way)."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any


def keep_gradient() -> optax.GradientTransformation:
  """An optax transform whose state is the step's mean gradient (fp32); no update."""
  return optax.GradientTransformation(
      lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p),
      lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def float64_grads(loss: Callable[[PyTree, PyTree], jax.Array], params: PyTree,
                  batch: PyTree) -> PyTree:
  """The gradient of `loss` (a model computing in float64) at `params`' values, as
  float64 numpy arrays."""
  with jax.enable_x64(True):
    wide = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(wide, batch))


def relative_errors(grads: PyTree, reference: PyTree, keep: str = "kernel") -> dict[str, float]:
  """{leaf path: ||g - ref|| / ||ref||} for the leaves whose path names `keep`."""
  return {jax.tree_util.keystr(k): float(np.linalg.norm(np.float64(g) - r) / np.linalg.norm(r))
          for (k, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                               jax.tree.leaves(reference), strict=True)
          if keep in jax.tree_util.keystr(k)}
