"""Reading collectives out of HLO text: what is communicated, in which dtype, where.

Works on both the pre-optimization HLO of a lowered step
(`step.lower(...).as_text(dialect='hlo')`), which shows the dtypes the program asked
for, and the compiled HLO (`.compile().as_text()`), which shows what the backend will
run. They differ on XLA:CPU: its float normalization upcasts every bf16 collective to
f32, so only the pre-optimization text can tell a bf16 reduction from an f32 one there.
"""

import math
import re
from typing import NamedTuple

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
               "collective-permute")

# A computation header starts at column 0 and opens a block; instructions are indented.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVES) +
    r")(?:-start)?\(")
_TYPE = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
_CALLS = re.compile(r"\b(?:to_apply|calls|body|condition|branch_computations)=\{?"
                    r"([%\w.\-, ]+)\}?")


class Collective(NamedTuple):
  """One collective instruction.

  Attributes:
    op: one of `COLLECTIVES`.
    name: the instruction name.
    computation: the computation it sits in.
    results: (dtype, shape) of each result (a combined collective has several).
    group_size: devices in each replica group.
    loops: how many while loops it sits inside (0: runs once per step).
    trips: times it runs per step: the product of the known trip counts of the loops
      around it (a loop whose trip count XLA does not know counts once).
  """
  op: str
  name: str
  computation: str
  results: tuple[tuple[str, tuple[int, ...]], ...]
  group_size: int
  loops: int
  trips: int

  @property
  def in_loop(self) -> bool:
    return self.loops > 0

  @property
  def dtypes(self) -> set[str]:
    return {dtype for dtype, _ in self.results}

  @property
  def result_bytes(self) -> int:
    """Bytes of the result on one device (for a reduce-scatter: one shard)."""
    return sum(math.prod(shape) * _itemsize(dtype) for dtype, shape in self.results)

  @property
  def payload_bytes(self) -> int:
    """Bytes of the whole tensor being reduced or gathered, per device."""
    scale = self.group_size if self.op == "reduce-scatter" else 1
    return self.result_bytes * scale


def _itemsize(dtype: str) -> int:
  """Bytes per element of an HLO type name: f32 -> 4, bf16 -> 2, pred -> 1."""
  return max(1, int(re.sub(r"\D", "", dtype) or 8) // 8)


def _group_size(line: str) -> int:
  groups = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if groups:
    return len(groups.group(1).split(","))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  return int(iota.group(2)) if iota else 1


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in an HLO module's text, in order of appearance."""
  computation, found, calls = "", [], {}
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    for callees in _CALLS.findall(line):
      calls.setdefault(computation, set()).update(
          c.strip().lstrip("%") for c in callees.split(","))
    inst = _INSTRUCTION.match(line)
    if inst:
      name, types, op = inst.groups()
      results = tuple((d, tuple(int(n) for n in s.split(",") if n))
                      for d, s in _TYPE.findall(types))
      found.append((op, name, computation, results, _group_size(line)))
  # Each loop body, and everything it calls, runs `trips` times per iteration above.
  loops = [(_reachable(calls, {body}), trips) for body, trips in _loops(hlo_text)]
  return [Collective(op, name, comp, results, size,
                     sum(comp in inside for inside, _ in loops),
                     math.prod(t for inside, t in loops if comp in inside))
          for op, name, comp, results, size in found]


def _loops(hlo_text: str) -> list[tuple[str, int]]:
  """(body computation, known trip count or 1) of every while instruction."""
  found = []
  for line in hlo_text.splitlines():
    body = re.search(r"\bbody=%?([\w.\-]+)", line)
    if body and " while(" in line:
      trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
      found.append((body.group(1), int(trips.group(1)) if trips else 1))
  return found


def _reachable(calls: dict[str, set[str]], roots: set[str]) -> set[str]:
  seen, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c not in seen:
      seen.add(c)
      todo.extend(calls.get(c, ()))
  return seen


def summarize(found: list[Collective]) -> dict[str, dict[str, int]]:
  """Count and payload bytes per step for each (op, dtype), loops unrolled.

  Returns:
    e.g. {'reduce-scatter f32': {'count': 7, 'payload_bytes': 99840}}.
  """
  table: dict[str, dict[str, int]] = {}
  for c in found:
    scale = c.group_size if c.op == "reduce-scatter" else 1
    for dtype, shape in c.results:
      row = table.setdefault(f"{c.op} {dtype}", {"count": 0, "payload_bytes": 0})
      row["count"] += c.trips
      row["payload_bytes"] += math.prod(shape) * _itemsize(dtype) * scale * c.trips
  return table

