"""Test and benchmark tooling, apart from the training library: nothing in `zerojax`
outside this package imports it (tests/test_imports.py checks).

The test tooling room; it imports the runtime and the streaming room.

`hlo`: the collectives of a step, read from its HLO text (what is communicated, in
which dtype, how often per step); `markdown_table`: the tables the benchmarks print.
"""

from collections.abc import Iterable, Sequence


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
  """A GitHub markdown table: the header row, `| --- |` cells, then `rows` (cells `str`ed)."""
  lines = [headers, ["---"] * len(headers), *rows]
  return "\n".join("| " + " | ".join(str(c) for c in cells) + " |" for cells in lines)
