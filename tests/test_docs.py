"""The map stays a map: WORKSPACE.md short, design notes short and all linked from it.

No JAX: reads Markdown files only.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKSPACE = ROOT / "WORKSPACE.md"
DESIGN = ROOT / "docs" / "design"
MAX_WORKSPACE_LINES = 400
MAX_NOTE_LINES = 300
MAX_WORKSPACE_LINE_CHARS = 300


def _lines(path: pathlib.Path) -> list[str]:
  return path.read_text(encoding="utf-8").splitlines()


def _notes() -> list[pathlib.Path]:
  notes = sorted(DESIGN.glob("*.md"))
  assert notes, f"no design notes in {DESIGN}"
  return notes


def test_workspace_is_at_most_400_lines_of_at_most_300_characters():
  lines = _lines(WORKSPACE)
  assert len(lines) <= MAX_WORKSPACE_LINES, (
      f"WORKSPACE.md has {len(lines)} lines (at most {MAX_WORKSPACE_LINES}): move detail to "
      "a note in docs/design/")
  long = [i + 1 for i, line in enumerate(lines) if len(line) > MAX_WORKSPACE_LINE_CHARS]
  assert not long, f"WORKSPACE.md lines over {MAX_WORKSPACE_LINE_CHARS} characters: {long}"


def test_each_design_note_is_at_most_300_lines():
  long = {p.name: n for p in _notes() if (n := len(_lines(p))) > MAX_NOTE_LINES}
  assert not long, f"design notes over {MAX_NOTE_LINES} lines (split them): {long}"


def test_every_design_note_is_linked_from_workspace():
  targets = set(re.findall(r"\]\(([^)#\s]+)", WORKSPACE.read_text(encoding="utf-8")))
  linked = {(ROOT / t).resolve() for t in targets}
  missing = [p.name for p in _notes() if p.resolve() not in linked]
  assert not missing, f"design notes not linked from WORKSPACE.md: {missing}"


def test_workspace_links_point_at_files_that_exist():
  targets = re.findall(r"\]\(([^)#\s]+)", WORKSPACE.read_text(encoding="utf-8"))
  local = [t for t in targets if "://" not in t]
  missing = [t for t in local if not (ROOT / t).exists()]
  assert not missing, f"WORKSPACE.md links to missing files: {missing}"
