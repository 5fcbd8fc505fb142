"""Test setup: 8 fake CPU devices, set before JAX starts a backend, and one JAX
compilation cache for every process the tests start."""

import pytest

from zerojax.devices import fake_cpu_devices

# Without the XLA:CPU memory flags: the tests compile faster with XLA's default scheduler.
# LLVM at -O0: compiling is most of the suite's CPU time, and the level changes only the
# machine code, not the HLO passes: buffer assignment (argument, output, temp and alias
# bytes) is the same for 16 test_zero programs, stages 0-3, remat dots/none. Children
# (train.py, the CLIs) inherit it through XLA_FLAGS.
fake_cpu_devices(8, "--xla_backend_optimization_level=0", memory_flags=False)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """JAX's persistent compilation cache, in one folder, for every child process.

  Most subprocess tests (train.py, launch, the CLIs) compile the same few programs, and
  compiling is most of a tiny run's CPU time (a 3-step tiny run: 14.9 s of user CPU
  without the cache, 4.3 s with it). A cache hit returns the executable XLA made before
  for the same HLO, flags and options, so what a program computes, and the memory it
  reports, is unchanged. Set after collection, when this process's JAX has read its
  config: the tests' own compiles stay uncached, so those reading compiled HLO or buffer
  assignments always see a fresh compile. A child whose environment lacks
  `JAX_COMPILATION_CACHE_DIR` compiles afresh (an XLA dump needs a real compile).
  """
  with pytest.MonkeyPatch.context() as env:
    env.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_cache")))
    env.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    yield
