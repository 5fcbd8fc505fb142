"""Which backend the step being traced is for: the one question platform code asks.

`backend()` is "gpu" while a step is traced for a GPU target (`zerojax.gpu`, inside
`targeting()`), else JAX's default backend. Attention 'auto' picks cuDNN by it; stage 3
orders XLA:CPU's collectives by it; the planner counts GPU buffers by it. It lives here,
below the models and the algorithms, so that none of them imports the GPU-target code.
"""

import contextlib
import contextvars

import jax

_TARGET = contextvars.ContextVar("zerojax_gpu_target", default=None)


def backend() -> str:
  """The backend the step being traced is for: 'gpu' inside `targeting()`, else JAX's."""
  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def targeting(platform: str = "gpu"):
  """Traces inside answer `backend()` with `platform`."""
  token = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(token)
