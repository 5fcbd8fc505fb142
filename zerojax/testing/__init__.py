"""Test and benchmark tooling, apart from the training library: nothing in `zerojax`
outside this package imports it (tests/test_imports.py checks).

The test tooling room; it imports the runtime and the streaming room.

`hlo`: the collectives of a step, read from its HLO text (what is communicated, in
which dtype, how often per step); `numerics`: a step's gradient against float64;
`markdown_table`: the tables the benchmarks print;
`DEFAULT_EMITTERS`: XLA:CPU's default code generation, for one compile.
"""

from collections.abc import Iterable, Sequence

# Compiler options for a step whose comparison was measured with XLA:CPU's default code
# generation for fusions (its MLIR emitters). tests/conftest.py compiles with the legacy
# emitters, which compile in half the time but fuse and round some steps differently:
# the offloaded-params step then differs from the on-device one in one bf16 element of
# 384, release on one shard from the normal step by 6e-6 (tolerance 1e-6), stage 3 from
# stage 0 by 6.9e-5 (tolerance 1e-5).
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
  """A GitHub markdown table: the header row, `| --- |` cells, then `rows` (cells `str`ed)."""
  lines = [headers, ["---"] * len(headers), *rows]
  return "\n".join("| " + " | ".join(str(c) for c in cells) + " |" for cells in lines)
