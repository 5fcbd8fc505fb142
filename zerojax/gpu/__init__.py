"""GPU targets: the train step compiled by XLA's GPU compiler for a named GPU, no GPU needed.

    python -m zerojax.memory --config configs/70b_8x80gb.py --target h100:8 --compile
    python train.py --config configs/70b_8x80gb.py --dry_run --target h100:8
    python -m zerojax.gpu.fit --config configs/70b_bf16.py   # which GPUs can run it

`targets` names the GPUs (one `specs/<name>.txtpb` each) and judges what fits;
`compile` runs the compile. Nothing is allocated and no kernel runs: the numbers are
XLA's GPU buffer assignment, the same program a GPU would run. Needs JAX's CUDA plugin
(the `gpu-compile` extra), not a driver.

`backend()` is the one question platform-dependent code asks ("gpu" while a step is
traced for a GPU target, else JAX's default backend): attention 'auto' picks cuDNN by it.
"""

import contextlib
import contextvars

_TARGET = contextvars.ContextVar("zerojax_gpu_target", default=None)


def backend() -> str:
  """The backend the step being traced is for: 'gpu' inside `targeting()`, else JAX's."""
  import jax  # noqa: PLC0415  (keeps `import zerojax.gpu` free of JAX)

  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def targeting(platform: str = "gpu"):
  """Traces inside answer `backend()` with `platform`."""
  token = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(token)
