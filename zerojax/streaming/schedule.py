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
# An operand's type in a start's operand tuple: dtype, dims and its layout (memory space).
_OPERAND = re.compile(r"\b(pred|[a-z]+\d+\w*)\[([\d,]*)\](\{[^}]*\})?")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _computation(line: str) -> str | None:
  """The computation a module text's line opens (`%name (...) -> ... {`, `ENTRY ...`),
  None for any other line."""
  if line[:1].strip() and line.rstrip().endswith("{") and "HloModule" not in line:
    return re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", line).group(1)
  return None


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
    nbytes: the bytes one execution moves: what arrives on the device, or what leaves it
      (a write into a host stack moves its update, not the stack).
  """
  name: str
  computation: str
  to_host: bool
  shape: Shape
  overlaps: tuple[str, ...]
  nbytes: int = 0


def _split_start(hlo_type: str) -> tuple[str, str]:
  """(operand types, the rest starting with the arriving value's type) of an async
  start's tuple type: an async fusion's ((operands...), result, context), or a
  copy-start's (destination, source, context), whose operands are not listed ('')."""
  inner = hlo_type.strip()[1:]
  if inner.startswith("("):
    depth = 0
    for i, ch in enumerate(inner):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        return inner[1:i], inner[i + 1:]
  return "", inner


def _nbytes(dtype: str, dims: str | tuple[int, ...]) -> int:
  if isinstance(dims, str):
    dims = tuple(int(d) for d in dims.split(",") if d)
  return _BYTES.get(dtype, 4) * math.prod(dims)


def host_moves(hlo_text: str) -> list[HostMove]:
  """Every asynchronous host <-> device move of a scheduled module, with the compute the
  schedule put between its start and done (what it can overlap on a GPU)."""
  moves, open_, comp = [], {}, ""
  compute = re.compile(r"gemm|custom-call|cudnn|-start$")
  for line in hlo_text.splitlines():
    if opened := _computation(line):
      comp, open_ = opened, {}
      continue
    if not (inst := _INSTRUCTION.match(line)):
      continue
    name, hlo_type, op, rest = inst.groups()
    if op in ("copy-start", "fusion-start") and "S(5)" in hlo_type:
      operands, arriving = _split_start(re.sub(r"/\*.*?\*/", "", hlo_type))
      first = _TYPE.search(arriving)
      layout = re.search(r"\]\{([^}]*)\}", arriving)
      to_host = bool(layout and "S(5)" in layout.group(1))
      shape = (first.group(1), tuple(int(d) for d in first.group(2).split(",") if d))
      moved = _nbytes(*shape)
      if to_host and operands:  # What leaves the device: its operands not in host memory.
        moved = sum(_nbytes(dtype, dims) for dtype, dims, where in _OPERAND.findall(operands)
                    if dims and "S(5)" not in where)
      open_[name] = (len(moves), [])
      moves.append([name, comp, to_host, shape, (), moved])
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


def executions(hlo_text: str) -> dict[str, float]:
  """Computation name -> how many times one run of the module's entry runs it: a while
  loop's body its known trip count times its caller's, any other called computation
  (fusions, calls, a conditional's branches: at most) its caller's; NaN below a loop
  whose trip count XLA does not know."""
  callers, comp, entry = {}, "", ""
  for line in hlo_text.splitlines():
    if opened := _computation(line):
      comp = opened
      entry = comp if line.startswith("ENTRY") else entry
      continue
    if " while(" in line and (body := re.search(r"\bbody=%?([\w.\-]+)", line)):
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
      callers.setdefault(body.group(1), []).append((comp, int(trips.group(1)) if trips
                                                     else math.nan))
    for group in re.findall(r"\b(?:calls|to_apply|condition|true_computation|"
                            r"false_computation)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}",
                            line):
      for callee in re.findall(r"[\w.\-]+", " ".join(group)):
        callers.setdefault(callee, []).append((comp, 1))
  counts = {entry: 1.0}

  def count(name: str) -> float:
    if name not in counts:
      counts[name] = 0.0  # A cycle (none in HLO) would count once.
      counts[name] = sum(n * count(caller) for caller, n in callers.get(name, ()))
    return counts[name]

  return {name: count(name) for name in {entry, *callers}}


def host_traffic(hlo_text: str) -> tuple[float, float]:
  """(host-to-device, device-to-host) bytes one run of a scheduled module moves: each
  host move's bytes times the runs of the computation it sits in (`executions`); NaN
  where a loop's trip count is unknown. What the planner's PCIe figures
  (`zerojax.memory.bus.traffic`) count, read from the compiled module."""
  runs = executions(hlo_text)
  totals = [0.0, 0.0]
  for move in host_moves(hlo_text):
    totals[move.to_host] += move.nbytes * runs.get(move.computation, math.nan)
  return totals[0], totals[1]


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
  hidden = sum(m.nbytes for m in reads if m.overlaps) / sum(m.nbytes for m in reads)
  loops = len({m.computation for m in reads})
  return (f"host copies in the layer loops: {len(reads)} to the device in {loops} loop "
          f"bod{'y' if loops == 1 else 'ies'}, {hidden:.0%} of their bytes with compute "
          "scheduled under them (the compiled schedule, not a measurement)")


class LoopTime(NamedTuple):
  """One loop body's trip timed along its compiled schedule (`timed_loops`).

  Attributes:
    computation: the while body.
    runs: how many times a step runs it (`executions`).
    compute: seconds of the trip's matmuls and attention (FLOPs at the rate given).
    copies: seconds the trip's host copies take on the link, both directions summed (the
      most the trip could wait on them).
    trip: seconds of the trip: the compute, plus where it waits at a copy's done for
      bytes still on the link.
  """
  computation: str
  runs: float
  compute: float
  copies: float
  trip: float

  @property
  def exposed(self) -> float:
    """Seconds a trip waits on its copies."""
    return self.trip - self.compute

  @property
  def hidden(self) -> float:
    """The share of the copies' time under the trip's compute (1: all of it)."""
    return 1.0 - min(self.exposed / self.copies, 1.0) if self.copies else 1.0


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*?)\)\s*->")
_PARAM = re.compile(r"([\w.\-]+): ((?:pred|[a-z]+\d+\w*)\[[\d,]*\])")


def _computations(hlo_text: str) -> tuple[dict, dict]:
  """(computation -> its instructions as (name, type, op, rest) in schedule order,
  instruction or parameter name -> its type), from a module's text."""
  comps, types, comp = {}, {}, None
  for line in hlo_text.splitlines():
    if opened := _computation(line):
      comp, comps[opened] = opened, []
      if head := _COMPUTATION.match(line):  # Its parameters' types.
        types.update(_PARAM.findall(head.group(2)))
      continue
    if comp is not None and (inst := _INSTRUCTION.match(line)):
      comps[comp].append(inst.groups())
      types[inst.group(1)] = inst.group(2)
  return comps, types


def _dims(hlo_type: str) -> tuple[int, ...]:
  first = _TYPE.search(hlo_type)
  return tuple(int(d) for d in first.group(2).split(",") if d) if first else ()


def _attention_flops(rest: str) -> float:
  """cuDNN's fused attention (a `__cudnn$fmha` custom call): 4 B H T S D multiply-adds
  forward (scores and values), half of them under a causal mask; its backward pass 2.5
  times that (the scores again, and four products for dq, dk, dv)."""
  shapes = [tuple(int(d) for d in dims.split(",") if d)
            for _, dims in _TYPE.findall(rest.split("operand_layout_constraints={")[1])]
  (b, t, h, d), (_, s, _, _) = shapes[0], shapes[1]
  flops = 4.0 * b * h * t * s * d * (0.5 if '"CAUSAL"' in rest else 1.0)
  return flops * (2.5 if "Backward" in rest else 1.0)


def computation_flops(hlo_text: str, unknown_trips: int = 1) -> tuple[dict, dict]:
  """(instruction name -> its matmul and attention FLOPs, computation -> its instructions
  in schedule order) of a module: a dot 2 x its output's elements x its contracted
  size; a fusion or call its computations' dots; a while loop its body's times its known
  trip count, or `unknown_trips` times where its trip count is dynamic (a grouped
  matmul's tiles, `models.moe.tile_matmul`); cuDNN attention by `_attention_flops`.
  Everything else counts 0: the elementwise and reduction work, memory-bound, is left out
  (so what this times is the compute a copy is sure to have under it, no more)."""
  comps, types = _computations(hlo_text)
  per_comp: dict[str, float] = {}
  per_inst: dict[str, float] = {}

  def inst_flops(name, hlo_type, op, rest):
    if op == "dot":
      lhs = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
      contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
      dims = _dims(types.get(lhs, ""))
      k = math.prod(dims[int(i)] for i in contracting.group(1).split(",") if i) \
          if contracting and dims else 0
      return 2.0 * math.prod(_dims(hlo_type)) * k
    if op == "custom-call" and "__cudnn$fmha" in rest:
      return _attention_flops(rest)
    total = sum(comp_flops(c) for c in re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", rest))
    if op == "while" and (body := re.search(r"\bbody=%?([\w.\-]+)", rest)):
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
      total += comp_flops(body.group(1)) * (int(trips.group(1)) if trips else unknown_trips)
    return total

  def comp_flops(comp):
    if comp not in per_comp:
      per_comp[comp] = 0.0  # HLO has no recursion; this guards the walk all the same.
      per_comp[comp] = sum(per_inst.setdefault(i[0], inst_flops(*i)) for i in comps.get(comp, ()))
    return per_comp[comp]

  for comp in comps:
    comp_flops(comp)
  return per_inst, comps


def timed_loops(hlo_text: str, flop_rate: float, link: float) -> list[LoopTime]:
  """Each loop body with host copies, its trip timed along the compiled schedule: the
  compute stream runs the instructions in order, a matmul or attention taking its FLOPs
  / `flop_rate` seconds; a copy starts on the link (one copy at a time a direction,
  `link` bytes per second, full duplex) when the stream reaches its start, and the
  stream waits at its done until it is over. An estimate from the schedule (XLA's
  order, FLOPs and bytes), not a measurement: it is how much of the bus the schedule
  can hide at that rate, whatever XLA's own cost model thought.

  Args:
    hlo_text: a scheduled (compiled) module's text.
    flop_rate: FLOP/s the matmuls run at (peak x MFU).
    link: bytes per second a direction of the host link moves.
  """
  flops, comps = computation_flops(hlo_text)
  moves = {m.name: m for m in host_moves(hlo_text)}
  runs = executions(hlo_text)
  bodies = {m.computation for m in moves.values() if not m.computation.startswith("main")}
  out = []
  for body in sorted(bodies):
    now, free, ends, busy = 0.0, [0.0, 0.0], {}, [0.0, 0.0]
    for name, _, op, rest in comps[body]:
      if name in moves:
        move = moves[name]
        start = max(now, free[move.to_host])
        free[move.to_host] = ends[name] = start + move.nbytes / link
        busy[move.to_host] += move.nbytes / link
      elif op in ("copy-done", "fusion-done") and (
          started := re.match(r"\s*%?([\w.\-]+)", rest).group(1)) in ends:
        now = max(now, ends[started])
      else:
        now += flops.get(name, 0.0) / flop_rate
    compute = sum(flops.get(i[0], 0.0) for i in comps[body]) / flop_rate
    out.append(LoopTime(body, runs.get(body, math.nan), compute, sum(busy), now))
  return out


def timed_step(hlo_text: str, flop_rate: float, link: float) -> tuple[float, float]:
  """(seconds the layer loops' host copies take on the link, seconds of them the compute
  stream waits for) per run of a scheduled module: `timed_loops`' trips times their runs.
  (0, 0) without loop copies."""
  loops = timed_loops(hlo_text, flop_rate, link)
  return (sum(t.runs * t.copies for t in loops),
          sum(t.runs * max(t.exposed, 0.0) for t in loops))


def timed_line(copies: float, exposed: float, flop_rate: float, link: float) -> str:
  """One line on `timed_step`'s figures: how much of the layer loops' copy time the
  schedule puts under compute, at the rates they were timed at."""
  hidden = 1.0 - exposed / copies if copies else 1.0
  seconds = lambda t: f"{t:.2f} s" if t >= 0.1 or not t else f"{t * 1e3:.1f} ms"
  return (f"timed along the schedule (matmuls and attention at {flop_rate / 1e12:.0f} "
          f"TFLOP/s, the host link at {link / 1e9:.3g} GB/s a direction): the layer loops' "
          f"copies take {seconds(copies)} a step (both directions), {hidden:.0%} of it under "
          f"compute (the step waits {seconds(exposed)} on them; an estimate, not a "
          "measurement)")
