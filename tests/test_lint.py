"""The style rules that a tool can check: `ruff check` (pyproject.toml, [tool.ruff]) passes and no
Python file is over 500 lines."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCOPE = ("zerojax", "train.py", "benchmarks", "configs")
MAX_LINES = 500


def test_ruff_check_passes():
  # ruff from this interpreter's environment (the `test` extra pins it), run where
  # pyproject.toml is so that its config and its scope (extend-exclude) apply.
  result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_no_python_file_is_over_500_lines():
  long = []
  for top in SCOPE:
    path = os.path.join(ROOT, top)
    files = [path] if path.endswith(".py") else [
        os.path.join(folder, name) for folder, _, names in os.walk(path)
        for name in names if name.endswith(".py")]
    for file in files:
      with open(file) as f:
        n = sum(1 for _ in f)
      if n > MAX_LINES:
        long.append(f"{os.path.relpath(file, ROOT)}: {n} lines")
  assert not long, "split these along a seam: " + ", ".join(long)
