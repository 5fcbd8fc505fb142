"""Reading collectives out of HLO text: what is communicated, in which dtype, where.

Three views of one step, all readable by `collectives`:

- pre-optimization HLO (`step.lower(...).as_text(dialect='hlo')`): the collectives the
  program writes (`shard_map`), in the dtypes it asked for, but not yet those GSPMD
  inserts for sharding constraints;
- the HLO right after SPMD partitioning (`compile_partitioned`): every collective,
  both written and inserted, still in the program's dtypes;
- compiled HLO (`.compile().as_text()`): what the backend runs. On XLA:CPU that differs:
  right after partitioning, `all-reduce-promotion` and `float-normalization-bf16`
  rewrite every bf16 collective to f32, so only the first two views can tell a bf16
  reduction from an f32 one there. GPUs and TPUs keep the program's dtypes.
"""

import functools
import glob
import math
import os
import re
import tempfile
from typing import NamedTuple

from zerojax.runtime import xla_dump

# The compiled module's host copies are the library's to read (train.py reports them);
# re-exported here beside the collectives.
from zerojax.streaming.schedule import _INSTRUCTION, _TYPE, HostMove, Shape, host_moves

__all__ = ["COLLECTIVES", "Collective", "Dot", "HostMove", "Shape", "collectives",
           "compile_partitioned", "dots", "host_moves", "nbytes", "summarize"]

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
               "collective-permute")
_CALLEES = re.compile(r"\b(?:to_apply|calls|branch_computations|true_computation|"
                      r"false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


class Collective(NamedTuple):
  """One collective instruction.

  Attributes:
    op: one of `COLLECTIVES` (an async `-start` counts as its op).
    name: the instruction name.
    computation: the computation it sits in.
    results: (dtype, shape) of each result (a combined collective has several; for a
      reduce-scatter, the shard).
    group_size: devices in each replica group (0: not grouped, e.g. a
      collective-permute's source-target pairs, or unknown).
    loops: how many while loops it sits inside (0: runs once per step).
    trips: times it runs per step: the product of the trip counts of the loops around
      it, summed over the places its computation is called from.
    operands: (dtype, shape) of each operand, from the instructions defining them.
  """
  op: str
  name: str
  computation: str
  results: tuple[Shape, ...]
  group_size: int
  loops: int
  trips: int
  operands: tuple[Shape, ...] = ()

  @property
  def in_loop(self) -> bool:
    return self.loops > 0

  @property
  def dtypes(self) -> set[str]:
    return {dtype for dtype, _ in self.results}

  @property
  def result_bytes(self) -> int:
    """Bytes of the result on one device (for a reduce-scatter: one shard)."""
    return nbytes(self.results)

  @property
  def operand_bytes(self) -> int:
    """Bytes sent in by one device: the local gradient, or the shard to gather."""
    return nbytes(self.operands)

  @property
  def payload_bytes(self) -> int:
    """Bytes of the whole tensor being reduced or gathered, per device."""
    scale = self.group_size if self.op == "reduce-scatter" else 1
    return self.result_bytes * scale


def nbytes(shapes: tuple[Shape, ...]) -> int:
  """Bytes of (dtype, shape) pairs, e.g. a `Collective`'s `results` or `operands`."""
  return sum(math.prod(dims) * xla_dump.itemsize(dtype) for dtype, dims in shapes)


def _shapes(hlo_type: str) -> tuple[Shape, ...]:
  return tuple((d, tuple(int(n) for n in dims.split(",") if n))
               for d, dims in _TYPE.findall(hlo_type))


def _group_size(attrs: str, devices: int) -> int:
  """Devices per replica group, in each of the ways HLO prints replica groups."""
  if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attrs):  # {{0,1},{2,3}}
    return len(m.group(1).split(","))
  if m := re.search(r"replica_groups=\[\d+,(\d+)\]", attrs):  # [groups,size]<=[8]
    return int(m.group(1))
  # GSPMD's mesh form: mesh['axis_0'=2,'axis_1'=4] {'axis_1'}; a sub-axis of size k
  # prints as 'axis_1':(pre)k.
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs):
    sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(int(k) if k else sizes[a]
                     for a, k in re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", m.group(2)))
  return devices if "replica_groups={}" in attrs else 0  # {}: one group of all.


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in an HLO module's text, in order of appearance.

  HLO prints operands by name only, so their shapes come from the instructions that
  define them. A while body runs once per trip: XLA's `known_trip_count` where the
  compiler has annotated it, otherwise (before optimization or right after
  partitioning) the one integer constant of the loop condition, the `n` of the
  `i < n` that `lax.scan` and `fori_loop` from 0 compile to; else once.
  """
  header = hlo_text.split("\n", 1)[0]  # HloModule name, ..., num_partitions=8
  counts = [int(n) for n in
            re.findall(r"\b(?:num_partitions|replica_count)=(\d+)", header)]
  devices = math.prod(counts) if counts else 0  # All of them: replica_groups={}.
  shapes, found, edges, consts, starts, comp = {}, [], set(), {}, {}, ""
  for line in hlo_text.splitlines():
    if line[:1].strip() and line.rstrip().endswith("{") and "HloModule" not in line:
      comp = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", line).group(1)
      continue
    if not (inst := _INSTRUCTION.match(line)):
      continue
    name, hlo_type, op, rest = inst.groups()
    shapes[name] = _shapes(re.sub(r"/\*.*?\*/", "", hlo_type))
    operands = re.findall(r"%?([\w.\-]+)", re.sub(r"/\*.*?\*/", "", rest.split(")")[0]))
    if op == "while":
      known = re.search(r'known_trip_count"?:\{"n":"(\d+)"', rest)
      cond = re.search(r"condition=%?([\w.\-]+)", rest).group(1)
      body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
      edges.add((comp, body, int(known.group(1)) if known else cond, True))
    edges.update((comp, c.strip(" %"), 1, False) for callees in _CALLEES.findall(rest)
                 for c in callees.strip("{}").split(","))
    if op == "constant" and re.fullmatch(r"[su]\d+\[\]", hlo_type):
      consts.setdefault(comp, []).append(int(rest.split(")")[0]))
    if op.endswith("-done") and operands and operands[0] in starts:
      i = starts.pop(operands[0])  # An async op's result is its -done's.
      found[i] = found[i][:3] + (shapes[name],) + found[i][4:]
    if (kind := op.removesuffix("-start")) in COLLECTIVES:
      starts[name] = len(found)
      found.append((kind, name, comp, shapes[name], _group_size(rest, devices),
                    tuple(s for o in operands for s in shapes.get(o, ()))))

  callers = {}
  for caller, callee, trips, is_loop in edges:
    if isinstance(trips, str):  # The loop condition's name: its one constant bound.
      bounds = consts.get(trips, [])
      trips = bounds[0] if len(bounds) == 1 else 1
    callers.setdefault(callee, []).append((caller, trips, is_loop))

  @functools.cache
  def runs(c: str) -> tuple[int, int]:
    """(while loops around `c`, times `c` runs per step); uncalled: the entry."""
    if c not in callers:
      return 0, 1
    loops, total = 0, 0
    for caller, trips, is_loop in callers[c]:
      outer_loops, outer_runs = runs(caller)
      loops, total = max(loops, outer_loops + is_loop), total + outer_runs * trips
    return loops, total

  return [Collective(op, name, c, results, size, *runs(c), operands)
          for op, name, c, results, size, operands in found]


class Dot(NamedTuple):
  """One dot instruction.

  Attributes:
    name: the instruction name.
    result: its (dtype, shape).
    converted_to: the dtypes of the `convert`s that read it, directly or through
      transposes, reshapes and copies (e.g. ('bf16',): the product is rounded to bf16
      right after it).
  """
  name: str
  result: Shape
  converted_to: tuple[str, ...]


_MOVES = ("transpose", "reshape", "copy", "bitcast")  # Ops that change no value.


def dots(hlo_text: str) -> list[Dot]:
  """Every dot in an HLO module's text, in order, with the dtypes it is converted to.

  Read it before optimization (`lowered.as_text(dialect='hlo')`) or right after
  partitioning: XLA:CPU's compiler rewrites every bf16 dot as an fp32 one (float
  normalization), so its compiled module no longer shows which the program asked for.
  """
  found, readers = [], {}
  for line in hlo_text.splitlines():
    if not (inst := _INSTRUCTION.match(line)):
      continue
    name, hlo_type, op, rest = inst.groups()
    if op == "dot":
      found.append((name, _shapes(hlo_type)[0]))
    for source in re.findall(r"%?([\w.\-]+)", rest.split(")")[0]):
      readers.setdefault(source, []).append((name, op, _shapes(hlo_type)[:1]))

  def converts(name):
    for reader, op, result in readers.get(name, ()):
      if op == "convert":
        yield result[0][0]
      elif op in _MOVES:
        yield from converts(reader)
  return [Dot(name, result, tuple(converts(name))) for name, result in found]


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
      row["payload_bytes"] += nbytes(((dtype, shape),)) * scale * c.trips
  return table


def compile_partitioned(lowered):
  """Compiles a `jax.stages.Lowered`; also returns its HLO right after partitioning.

  That HLO holds every collective, the program's own and those GSPMD inserts, in the
  dtypes the program asked for, before a backend rewrites them (XLA:CPU promotes bf16
  collectives to f32). It is dumped during the same compile into a temporary
  directory (`xla_dump_to`, `xla_dump_hlo_pass_re='spmd-partitioning'`).

  Args:
    lowered: e.g. `jax.jit(f).lower(*args)`.

  Returns:
    (the `jax.stages.Compiled`, the partitioned HLO text; '' when nothing was
    partitioned, as on one device).

  Raises:
    RuntimeError: the program is partitioned but XLA dumped nothing, as when the
      executable came from JAX's persistent compilation cache.
  """
  with tempfile.TemporaryDirectory(prefix="zerojax_hlo_") as tmp, xla_dump.compiled_afresh():
    compiled = lowered.compile(compiler_options={
        "xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning"})
    paths = glob.glob(os.path.join(tmp, "*after_spmd-partitioning*"))
    if paths:
      with open(paths[0], encoding="utf-8") as f:
        return compiled, f.read()
  if re.search(r"num_partitions=([2-9]|\d\d)", compiled.as_text()):
    raise RuntimeError("XLA wrote no HLO after spmd-partitioning: was the executable "
                       "loaded from the persistent compilation cache? Disable it "
                       "(jax_enable_compilation_cache=False) to read partitioned HLO.")
  return compiled, ""
