"""Test setup: 8 fake CPU devices, set before JAX starts a backend; LLVM at -O0 for the
tests' own compiles; one JAX compilation cache for every process the tests start."""

import os

import jax
import pytest

from zerojax.runtime.devices import fake_cpu_devices

# Compiling is most of an in-process test's CPU time, and LLVM's level changes only the
# machine code, not the HLO passes: buffer assignment (argument, output, temp and alias
# bytes) is the same at -O0 for 16 test_zero programs (stages 0-3, remat dots/none).
# test_zero.py: 212 -> 115 s of CPU. Not for children: a 30-step train.py run executes
# more than it compiles (17 -> 28 s of user CPU at -O0).
LLVM_O0 = "--xla_backend_optimization_level=0"

# Without the XLA:CPU memory flags: the tests compile faster with XLA's default scheduler.
fake_cpu_devices(8, LLVM_O0, memory_flags=False)
# The GPU-target tests (test_gpu_targets.py) compile with the CUDA plugin's compile-only
# client, which loads without a GPU only when told to before the backends start.
os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


@pytest.fixture(scope="session", autouse=True)
def child_environment(tmp_path_factory):
  """The environment every child process (train.py, launch, the CLIs) inherits: this
  process's XLA flags without -O0, and JAX's persistent compilation cache in one folder.

  Most subprocess tests compile the same few programs, and a tiny run's CPU time is
  mostly compiling (a 3-step tiny run: 14.9 s of user CPU without the cache, 4.3 s with
  it). A cache hit returns the executable XLA made before for the same HLO, flags and
  options, so what a program computes, and the memory it reports, is unchanged. This
  process's JAX read its config at import, so its own compiles stay uncached. A child
  whose environment lacks `JAX_COMPILATION_CACHE_DIR` compiles afresh (an XLA dump
  needs a real compile).
  """
  jax.devices()  # XLA reads XLA_FLAGS once, when the backend starts: with -O0.
  flags = [f for f in os.environ["XLA_FLAGS"].split() if f != LLVM_O0]
  with pytest.MonkeyPatch.context() as env:
    env.setenv("XLA_FLAGS", " ".join(flags))
    env.setenv("JAX_COMPILATION_CACHE_DIR", str(_cache_dir(tmp_path_factory)))
    env.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    yield


def _cache_dir(tmp_path_factory):
  """The children's compilation cache: one folder for the session, shared by the
  pytest-xdist workers (each worker's basetemp is a folder of the session's), so a
  program one worker's children compiled is a cache hit for the other's."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent
  path = base / "jax_cache"
  path.mkdir(exist_ok=True)
  return path


# The files by their measured seconds, heaviest first (benchmarks/README.md 'Test suite
# time'): with `--dist loadfile` each file runs whole on one worker, in this order, and a
# worker that finishes takes the next. Heaviest first is what keeps the two workers
# finishing together (xdist's own order is by test count: a 1-test, 2-minute file went
# last). Files not listed follow, in pytest's order; an approximate list is fine.
HEAVIEST_FIRST = (
    "test_gpu_targets.py", "test_multihost.py", "test_train.py", "test_faults.py",
    "test_release_train.py", "test_param_offload.py", "test_zero.py", "test_gpu_cli.py",
    "test_sequence.py", "test_release.py", "test_precision.py", "test_stage3_sweep.py",
    "test_offload.py", "test_families.py", "test_activation_offload.py", "test_optim.py",
    "test_tiled_mlp.py", "test_memory.py", "test_checkpoint.py", "test_cli.py",
)


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's: by test count.
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: within a file too.
