"""Test setup: 8 fake CPU devices, set before JAX starts a backend; XLA:CPU's quicker
code generation for the tests' own compiles; JAX's compilation cache for this process and
for every process the tests start."""

import json
import os
import resource
import time

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

from zerojax.runtime.devices import fake_cpu_devices

# Compiling is most of an in-process test's CPU time (test_zero.py: 105 of 127 s), and
# three XLA:CPU settings make it cheaper without touching what the tests read:
# - LLVM at -O0 changes only the machine code, not the HLO passes: buffer assignment
#   (argument, output, temp and alias bytes) is the same for 16 test_zero programs.
# - The legacy LLVM emitters for fusions, not the MLIR fusion emitters: the tiny stage-3
#   step compiles in 3.2 s of CPU instead of 8.0 (test_zero.py: 134 -> 62 s of user
#   CPU). Fusion decisions may differ by a few ops (that step's temporaries: 8,135,848
#   bytes, not 8,135,720); collectives, their dtypes and the layout are GSPMD's, before.
# - LLVM on the whole module in one go, not split into chunks for a thread pool
#   (xla_cpu_parallel_codegen_split_count=1): on two cores the split costs more than it
#   parallelizes; the HLO and its buffers are untouched (test_zero.py: 39-41 -> 35-36 s
#   of CPU, three runs each, 2026-12-05).
# Children (train.py, launch, the CLIs) inherit them: they test what a process does
# (exit statuses, signals, files, resuming bit for bit, peers), which no XLA:CPU code
# generation setting changes, and their runs are tiny, so compiling is most of their CPU
# (a 16-step 1-layer run: 23.8 s of user CPU with XLA's defaults, 13.0 s with these).
# Where a test needs train.py's own XLA:CPU flags it sets them (test_stage3_sweep.py).
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_parallel_codegen_split_count=1")

# Without the XLA:CPU memory flags: the tests compile faster with XLA's default scheduler.
fake_cpu_devices(8, *FAST_COMPILE, memory_flags=False)
# The GPU-target tests (test_gpu_targets.py) compile with the CUDA plugin's compile-only
# client, which loads without a GPU only when told to before the backends start.
os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """JAX's persistent compilation cache in one folder for the session: this process's
  compiles, and every child process's (train.py, launch, the CLIs), whose environment
  has this process's XLA flags.

  Tests compile the same programs again (test_sequence.py: 94 of its compiles, 37 s of
  CPU; a 3-step tiny train.py run: 14.9 s of user CPU without the cache, 4.3 s with it).
  A cache hit returns the executable XLA made before for the same HLO, flags and
  options, so what a program computes, and the memory it reports, is unchanged. A
  compile that dumps what XLA made compiles afresh (`xla_dump.compiled_afresh`): the
  cache's key leaves the dump options out.
  """
  folder = str(_cache_dir(tmp_path_factory))
  for name, value in (("jax_compilation_cache_dir", folder),
                      ("jax_persistent_cache_min_compile_time_secs", 0),
                      ("jax_persistent_cache_min_entry_size_bytes", 0)):
    jax.config.update(name, value)
  cc.reset_cache()  # JAX decides once whether to use the cache: a collection-time compile.
  with pytest.MonkeyPatch.context() as env:
    env.setenv("JAX_COMPILATION_CACHE_DIR", folder)
    env.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    yield


def _cache_dir(tmp_path_factory):
  """The compilation cache: one folder for the session, shared by the
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
# worker that finishes takes the next. Heaviest first is what keeps the workers
# finishing together (xdist's own order is by test count: a 1-test, 2-minute file went
# last). Files not listed follow, in pytest's order; an approximate list is fine.
HEAVIEST_FIRST = (
    "test_gpu_targets.py", "test_gpu_cli.py", "test_multihost.py", "test_train.py",
    "test_param_offload.py", "test_release_train.py", "test_faults.py", "test_sequence.py",
    "test_stage3_sweep.py", "test_zero.py", "test_release.py", "test_precision.py",
    "test_checkpoint.py", "test_offload.py", "test_memory.py", "test_cli.py",
    "test_generate.py", "test_activation_offload.py", "test_config.py", "test_optim.py",
)


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's: by test count.
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: within a file too.


# ZEROJAX_TEST_CPU=FILE: each test's CPU seconds (this process's and its finished
# children's: train.py, launch, the CLIs), setup and teardown included, appended to FILE
# as JSON lines. The suite is CPU-bound on 2 cores (benchmarks/README.md 'Test suite
# time'): this, not the wall time each test shares with the others, says what it costs.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  path = os.environ.get("ZEROJAX_TEST_CPU")
  if not path:
    yield
    return
  cpu = lambda: sum(getattr(resource.getrusage(who), field) for who in (  # noqa: E731
      resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for field in ("ru_utime", "ru_stime"))
  start, wall = cpu(), time.perf_counter()
  yield
  with open(path, "a") as f:
    f.write(json.dumps({"test": item.nodeid, "cpu_s": round(cpu() - start, 2),
                        "wall_s": round(time.perf_counter() - wall, 2),
                        # When it ended and where: the workers' timelines (idle tails).
                        "end": round(time.time(), 1),
                        "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
