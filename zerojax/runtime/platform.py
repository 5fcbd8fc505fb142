"""Which backend the step being traced is for: the one question platform code asks.

`backend()` is "gpu" while a step is traced for a GPU target (`zerojax.gpu`, inside
`targeting()`), else JAX's default backend. Attention 'auto' picks cuDNN by it; stage 3
orders XLA:CPU's collectives by it; the planner counts GPU buffers by it. It lives here,
below the models and the algorithms, so that none of them imports the GPU-target code.
`compute_capability()` is that GPU's CUDA compute capability (the target's, or this
machine's first GPU's): cuDNN's attention takes heads of 256 only from Hopper (9.0) on.
"""

import contextlib
import contextvars

import jax

from zerojax.runtime import jax_internals

_TARGET = contextvars.ContextVar("zerojax_gpu_target", default=None)
_CAPABILITY = contextvars.ContextVar("zerojax_gpu_capability", default=None)


def backend() -> str:
  """The backend the step being traced is for: 'gpu' inside `targeting()`, else JAX's."""
  return _TARGET.get() or jax.default_backend()


def compute_capability() -> tuple[int, int] | None:
  """The CUDA compute capability of the GPU the step being traced is for: inside
  `targeting()` the one it was given, else this machine's first GPU's; None when not
  known (no CUDA GPU, or a target given none)."""
  if _TARGET.get() is not None:
    return _CAPABILITY.get()
  if jax.default_backend() != "gpu":
    return None
  text = getattr(jax.devices()[0], "compute_capability", None)  # "9.0"; absent on ROCm.
  try:
    major, minor = str(text).split(".")[:2]
    return int(major), int(minor)
  except ValueError:
    return None


@contextlib.contextmanager
def targeting(platform: str = "gpu", compute_capability: tuple[int, int] | None = None):
  """Traces inside answer `backend()` with `platform` and `compute_capability()` with
  `compute_capability` (None: not known).

  jax's own cuDNN checks read this machine's GPU, which a trace for a target does not
  have; inside they answer for `compute_capability` too (`jax_internals.cudnn_checks_for`),
  or, where they cannot be told, `compute_capability()` answers None: a kernel chosen by
  it is one jax accepts.
  """
  with jax_internals.cudnn_checks_for(compute_capability) as told:
    token, capability = _TARGET.set(platform), _CAPABILITY.set(told)
    try:
      yield
    finally:
      _CAPABILITY.reset(capability)
      _TARGET.reset(token)
