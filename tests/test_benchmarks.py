"""The GPU benchmark's CPU mode (benchmarks/gpu.sh --cpu): it runs and reports sane numbers."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_benchmark_cpu_mode(tmp_path):
  out = tmp_path / "gpu_cpu.json"
  # Not conftest's 8 devices (the script sets its own); its quicker code generation, as
  # every child of the suite: the numbers checked are ratios of this run's own rates.
  env = dict(os.environ, PYTHON=sys.executable, XLA_FLAGS=" ".join(FAST_COMPILE))
  # Tiny shapes, one config, one remat policy, one timed step: ~10-20 s on 2 cores.
  p = subprocess.run(
      ["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), "--cpu", "--configs", "1b",
       "--remat", "full", "--steps", "1", "--out", str(out)],
      capture_output=True, text=True, timeout=150, env=env, cwd=ROOT, check=False)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["cpu"] is True

  bw = res["bandwidth"]
  assert bw.get("status", "ok") == "ok", bw
  assert bw["bytes_per_param"] == 20  # p2 g4 mu2 nu2 kahan2 read, p mu nu kahan written.
  for key in ("bytes_per_s", "seconds", "fraction_of_peak"):
    assert _positive(bw[key]), (key, bw[key])
  assert _positive(res["peaks"]["flops"]) and _positive(res["peaks"]["bandwidth"])

  (run,) = res["mfu"]
  assert run["status"] == "ok", run
  assert run["remat"] == "full" and run["stage"] == 3
  for key in ("tokens_per_s", "step_s", "mfu", "flops_per_token", "compiled_bytes",
              "device_peak_bytes"):
    assert _positive(run[key]), (key, run[key])
  assert run["mfu"] < 2  # Against a measured matmul rate: noisy, never far above it.
  # Compiled memory holds at least the state: bf16 params + Kahan AdamW (3 x bf16).
  assert run["compiled_bytes"] >= 8 * run["params"]
  assert math.isfinite(run["loss_last"])
  assert "| 1b_bf16.py | full |" in p.stdout  # The table is printed.


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_quality_benchmark_tiny(tmp_path):
  out = tmp_path / "quality.json"
  env = dict(os.environ, PYTHON=sys.executable)
  # One CPU device, conftest's quicker code generation: compiling is most of this run.
  env["XLA_FLAGS"] = " ".join(FAST_COMPILE)
  # Its CPU mode (tiny size), two steps, the reference and one arm, two seeds.
  p = subprocess.run(
      ["bash", os.path.join(ROOT, "benchmarks", "gpu_quality.sh"), "--steps", "2",
       "--arms", "nearest", "--evals", "1", "--eval_batches", "1", "--out", str(out)],
      capture_output=True, text=True, timeout=150, env=env, cwd=ROOT, check=False)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["size"] == "tiny" and res["steps"] == 2
  assert set(res["runs"]) == {"fp32", "nearest"}
  ref, ours = ([r["final"] for r in res["runs"][a]] for a in ("fp32", "nearest"))
  assert len(ref) == len(ours) == 2 and all(_positive(x) for x in ref + ours)
  # Same seed, same init and data: the arms stay close; the seeds' data differ.
  assert all(abs(a - b) < 0.02 for a, b in zip(ref, ours)) and ref[0] != ref[1]
  diff = res["summary"]["nearest"]["diff_nats"]
  assert math.isclose(diff, (ours[0] - ref[0] + ours[1] - ref[1]) / 2, abs_tol=1e-9)
  assert (tmp_path / "quality.png").stat().st_size > 10_000
  assert "| nearest |" in p.stdout
