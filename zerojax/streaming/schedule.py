"""The host copies of a compiled (scheduled) module, and how much compute the schedule
put under them: what a streamed step can hide behind its layers on a GPU.

XLA's host offloader turns each move between host memory (memory space `S(5)`) and the
device into an asynchronous copy or dynamic-(update-)slice fusion: a `-start` and a
`-done`. Whatever the schedule places between the two can run while the copy is in
flight; a copy with nothing between them makes the compute stream wait for it. This is
read from the module, before anything runs: a schedule, not a measurement.
"""

import math
import re
from typing import NamedTuple

Shape = tuple[str, tuple[int, ...]]  # (dtype, dims), e.g. ('bf16', (64, 128)).

# `ROOT %name = type op(operands), attributes`; the `%` is absent before optimization.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_TYPE = re.compile(r"\b(pred|[a-z]+\d+\w*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


class HostMove(NamedTuple):
  """One asynchronous move between host memory (`S(5)`) and the device in a scheduled
  (compiled) module: a copy or a dynamic-(update-)slice fusion, started and done apart.

  Attributes:
    name: the `-start` instruction.
    computation: where it sits (a while body for the per-layer moves).
    to_host: True for device -> host (the result is in S(5)), False for host -> device.
    shape: (dtype, dims) of what arrives.
    overlaps: the compute scheduled between start and done: matmul fusions, custom calls
      (cuDNN attention) and collectives, by instruction name.
  """
  name: str
  computation: str
  to_host: bool
  shape: Shape
  overlaps: tuple[str, ...]


def _arriving(hlo_type: str) -> str:
  """The arriving value's type in an async start's tuple type: a copy-start's first
  element (destination, source, context), or an async fusion's result after its
  operand tuple ((operands...), result, context)."""
  inner = hlo_type.strip()[1:]
  if inner.startswith("("):
    depth = 0
    for i, ch in enumerate(inner):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        return inner[i + 1:]
  return inner


def host_moves(hlo_text: str) -> list[HostMove]:
  """Every asynchronous host <-> device move of a scheduled module, with the compute the
  schedule put between its start and done (what it can overlap on a GPU)."""
  moves, open_, comp = [], {}, ""
  compute = re.compile(r"gemm|custom-call|cudnn|-start$")
  for line in hlo_text.splitlines():
    if line[:1].strip() and line.rstrip().endswith("{") and "HloModule" not in line:
      comp, open_ = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", line).group(1), {}
      continue
    if not (inst := _INSTRUCTION.match(line)):
      continue
    name, hlo_type, op, rest = inst.groups()
    if op in ("copy-start", "fusion-start") and "S(5)" in hlo_type:
      arriving = _arriving(re.sub(r"/\*.*?\*/", "", hlo_type))
      first = _TYPE.search(arriving)
      layout = re.search(r"\]\{([^}]*)\}", arriving)
      open_[name] = (len(moves), [])
      moves.append([name, comp, bool(layout and "S(5)" in layout.group(1)),
                    (first.group(1), tuple(int(d) for d in first.group(2).split(",") if d)),
                    ()])
      continue
    if op in ("copy-done", "fusion-done"):
      operand = re.findall(r"%?([\w.\-]+)", rest.split(")")[0])
      if operand and operand[0] in open_:
        i, between = open_.pop(operand[0])
        moves[i][4] = tuple(between)
        continue
    if compute.search(name) or compute.search(op):
      for _, between in open_.values():
        between.append(name)
  return [HostMove(*m) for m in moves]


def overlap_line(hlo_text: str) -> str | None:
  """One line on the layer loops' copies to the device: how many a loop body holds and
  the share of their bytes with compute scheduled under them (None: no host copies).

  Copies in the entry computation (before the loops: the first layer's) run once and
  are left out; so are copies to the host (a write's size here is the whole stack's).
  """
  reads = [m for m in host_moves(hlo_text) if not m.to_host
           and not m.computation.startswith("main")]
  if not reads:
    return None
  size = lambda m: _BYTES.get(m.shape[0], 4) * math.prod(m.shape[1])
  hidden = sum(size(m) for m in reads if m.overlaps) / sum(size(m) for m in reads)
  loops = len({m.computation for m in reads})
  return (f"host copies in the layer loops: {len(reads)} to the device in {loops} loop "
          f"bod{'y' if loops == 1 else 'ies'}, {hidden:.0%} of their bytes with compute "
          "scheduled under them (the compiled schedule, not a measurement)")
