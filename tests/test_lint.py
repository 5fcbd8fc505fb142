"""The style rules that a tool can check: `ruff check` (pyproject.toml, [tool.ruff]) passes.

A file's length is not one of them: files are split by concern, and past ~800 lines a
reviewer looks again (docs/design/code-and-config.md)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
  # ruff from this interpreter's environment (the `test` extra pins it), run where
  # pyproject.toml is so that its config and its scope (extend-exclude) apply.
  result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

