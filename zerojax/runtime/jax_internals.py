"""Every JAX and orbax internal zerojax leans on, and what it does without each.

JAX's public API has no answer to a few questions a trainer must ask; each answer lives
here, guarded, so a JAX that moves an internal gets a fallback or a clear error naming
this file instead of a crash deep in a run. Tested with jax 0.10.2 (CI; the newest the
package index here serves); the pins allow up to 0.11.x (round 1's H200 run used 0.11.2).

Each internal, what it is used for, and what happens without it:

- `jax._src.xla_bridge._backends`: has a backend started? (XLA reads XLA_FLAGS then, so
  fake devices, the GPU-target compile and `distributed.initialize` must come first).
  Without it: assumed not started, and a late call's flags are silently ignored.
- `jax._src.distributed.global_state.client`: `jax.distributed`'s key-value store (the
  peer watch's port). Without it: a `RuntimeError` naming this file.
- `jax._src.clusters.ClusterEnv._cluster_types`: which cluster (SLURM, Open MPI, k8s) JAX
  would detect, to report it. Without it: detection is left to JAX, unreported.
- `jax._src.compiler.get_compile_options`, `Lowered._lowering.compile_args`,
  `jax._src.lib.xla_client.DeviceList`: the GPU-target compile (`zerojax/gpu/compat.py`).
  Without them: `UnsupportedJax` naming that file.
- `jax._src.lib.cuda_versions`: the CUDA plugin's cuDNN and runtime versions for a GPU
  target. Without it: the target config without them (XLA's defaults).
- `jax._src.cudnn.fused_attention_stablehlo.check_compute_capability` and
  `.is_cuda_compute_capability_equal`: jax's cuDNN attention asks them (of this
  machine's GPU) whether heads of 256 are allowed; while a step is traced for a GPU target
  (`cudnn_checks_for`) they answer for the target's compute capability. Without them: the
  trace is told the capability is not known, so heads of 256 take the blocked loop.
- `jax.typeof(x).manual_axis_type.varying` (jax 0.10; `.vma` before): the mesh axes a
  value varies over inside a `shard_map` that checks replication, for a custom vjp that
  must sum a gradient over the others (`models.moe.tile_matmul`). Without either: no
  axis, right inside the train step (which does not check) and an error from JAX in a
  checking `shard_map`.
- The jaxpr of an init (`jax.make_jaxpr`, `jax.extend.core`'s `Var` / `Literal` /
  `jaxpr_as_fun`, a `scan` eqn's params `num_consts` / `num_carry` / `jaxpr` / `length`
  / `reverse` / `unroll`, `Primitive.get_bind_params`): `streaming.made_in_host` re-runs
  it eqn by eqn to make stacked leaves a layer at a time in host memory. Without them:
  the function as it is (each leaf made whole on the device, then moved).
- `orbax.checkpoint._src.asyncio_utils._run_sync_via_new_loop`: a failed save's sibling
  writes run to their end (`checkpoint.py`). Without it: orbax's own behaviour.

Behaviour (not modules) a version change could alter, each tested: `jax.device_put` to a
memory space inside `jit` (offload), `jax.nn.dot_product_attention(implementation=)`
(cuDNN), `jax.shard_map(check_vma=)`, XLA's flag names (`zerojax.gpu.xla_flags` asks the
installed XLA which forms it knows).
"""

import contextlib
import sys

import jax


def backends_started() -> bool:
  """Whether JAX has started a backend in this process (its XLA flags are then fixed)."""
  bridge = sys.modules.get("jax._src.xla_bridge")
  return bool(bridge is not None and getattr(bridge, "_backends", None))


def varying_axes(x) -> frozenset:
  """The mesh axes `x` varies over inside a checking `jax.shard_map` (empty outside one,
  and inside one that does not check)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", None) or getattr(aval, "vma", None) or ())


def distributed_client():
  """The `jax.distributed` key-value store client of this process (None before
  `jax.distributed.initialize`)."""
  try:
    from jax._src import distributed  # noqa: PLC0415
    return distributed.global_state.client
  except (ImportError, AttributeError) as err:
    import jax  # noqa: PLC0415
    raise RuntimeError(f"jax {jax.__version__} keeps jax.distributed's key-value store where "
                       "zerojax does not look (zerojax/runtime/jax_internals.py)") from err


def cluster_types() -> list:
  """JAX's cluster environments in its detection order ([] where JAX has none to tell)."""
  try:
    from jax._src import clusters  # noqa: PLC0415
    return list(clusters.ClusterEnv._cluster_types)  # noqa: SLF001
  except (ImportError, AttributeError):
    return []


_CAPABILITY_CHECKS = ("check_compute_capability", "is_cuda_compute_capability_equal")


@contextlib.contextmanager
def cudnn_checks_for(capability: tuple[int, int] | None):
  """jax's cuDNN attention checks answer for a GPU of `capability` inside (they read this
  machine's GPU, which a GPU-target compile does not have). Yields the capability they
  answer for: `capability`, or None when it is None or the checks are not where they were
  (then jax's own checks run, which allow heads of at most 128 without a Hopper here)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as checks  # noqa: PLC0415  guarded internal
  except ImportError:
    checks = None
  if capability is None or not all(callable(getattr(checks, n, None)) for n in _CAPABILITY_CHECKS):
    yield None
    return

  def parse(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))

  saved = {n: getattr(checks, n) for n in _CAPABILITY_CHECKS}
  checks.check_compute_capability = lambda at_least: tuple(capability) >= parse(at_least)
  checks.is_cuda_compute_capability_equal = lambda equal: tuple(capability) == parse(equal)
  try:
    yield capability
  finally:
    for name, check in saved.items():
      setattr(checks, name, check)
