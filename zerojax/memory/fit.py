"""Which GPUs can run a config: the cheapest recipe that fits, per GPU target and count.

    python -m zerojax.memory.fit --config configs/70b_bf16.py                # the planner
    python -m zerojax.memory.fit --config configs/70b_bf16.py --compile      # + XLA's GPU compiler
    python -m zerojax.memory.fit --config C --targets h100,a100_40gb --devices 8,16 [--json]
    python -m zerojax.memory.fit --list                                      # the targets

For each target and device count the planner judges the config as it is against the
memory XLA's allocator has on that GPU (`targets.budget`); if it does not fit, its ranked
changes (`zerojax.memory.suggestions`: stage, remat, release, microbatches, offload,
Lion, more devices), cheapest first. With `--compile` each recipe the planner accepts is
compiled by XLA's GPU compiler for that topology, and the first that really fits is the
answer (the planner's misses show as recipes skipped). Counts above 8 are hosts of 8.
The global batch is the config's where the count divides it, else one sequence a device.
"""

from __future__ import annotations

import json
import sys
from typing import NamedTuple

import jax

from zerojax import build, memory
from zerojax.config import (
  ArgumentParser,
  ConfigError,
  exit_on_config_error,
  load_config,
  parse_argv,
)
from zerojax.gpu import compile as gpu_compile, targets
from zerojax.memory import report
from zerojax.runtime import platform
from zerojax.runtime.units import fmt_bytes

COUNTS = (1, 2, 4, 8, 16, 64)


class Fit(NamedTuple):
  """One row: the recipe that fits `target` x `devices` (None: nothing tried fits)."""
  target: str
  devices: int
  change: str | None  # "as configured", a suggestion's text, or None.
  overrides: tuple[str, ...]
  planner: int  # Bytes a device, the planner's.
  compiled: int | None  # Bytes a device, XLA's GPU compiler's (--compile).
  host_per_node: int  # Offloaded state per host of (at most) 8 devices.
  skipped: int  # Recipes the planner accepted and the compiler did not.


def spec_for(target: targets.Target, devices: int) -> targets.TargetSpec:
  """`devices` GPUs as hosts of at most 8."""
  per_host = min(devices, 8)
  return targets.TargetSpec(target, devices // per_host, per_host)


def candidates(path: str, overrides: list[str], devices: int, budget: int):
  """(change, overrides, estimate) to try, cheapest first: the config as it is if the
  planner says it fits, else each of its suggestions that keeps the device count."""

  config = load_config(path, overrides, num_devices=devices)
  with platform.targeting():
    e = memory.estimate(config, devices, budget)
    if e.fits:
      return [("as configured", (), e)]
    return [(s.change, s.overrides, s.estimate)
            for s in memory.suggestions(e.setup, device_memory=budget)
            if s.estimate.setup.devices == devices]


def batch_overrides(path: str, overrides: list[str], devices: int) -> list[str]:

  batch = load_config(path, overrides).train.global_batch_size
  return [] if batch % devices == 0 else [f"train.global_batch_size={devices}"]


def fit(path: str, overrides: list[str], target: targets.Target, devices: int,
        compile_: bool = False) -> Fit:
  """The cheapest recipe for `config` on `devices` x `target` (see the module's doc)."""

  base = [*overrides, *batch_overrides(path, overrides, devices)]
  budget, _ = report.target_budget(load_config(path, base), target)
  skipped = 0
  for change, more, e in candidates(path, base, devices, budget):
    compiled = host = None
    if compile_:
      config = load_config(path, [*base, *more],
                           num_devices=devices)
      with platform.targeting():
        built = build.build(config, jax.devices()[:devices])
      out = gpu_compile.compile_step(built, config, spec_for(target, devices)).memory
      compiled, host = out["arguments"] + out["temporaries"], out["host_arguments"]
      if compiled > budget:
        skipped += 1
        continue
    host = e.host_per_node if host is None else host * min(devices, 8)
    return Fit(target.name, devices, change, tuple(more), e.total, compiled, host, skipped)
  return Fit(target.name, devices, None, (), 0, None, 0, skipped)


def format_rows(rows: list[Fit], path: str) -> str:
  lines = [f"{path}: the cheapest recipe that fits each GPU (device bytes: planner"
           + (" / XLA's GPU compiler" if any(r.compiled for r in rows) else "") + ")",
           f"  {'target':10s} {'devices':>7s}  {'device':>21s}  {'host/node':>10s}  recipe"]
  for r in rows:
    if r.change is None:
      lines.append(f"  {r.target:10s} {r.devices:7d}  {'-':>21s}  {'-':>10s}  nothing the "
                   "planner tries fits" + (f" ({r.skipped} compiled too large)" if r.skipped
                                            else ""))
      continue
    size = fmt_bytes(r.planner) + (f" / {fmt_bytes(r.compiled)}" if r.compiled else "")
    recipe = r.change + (f"  ({' '.join('--config.' + o for o in r.overrides)})"
                         if r.overrides else "")
    if r.skipped:
      recipe += f"  [{r.skipped} cheaper recipe(s) compiled too large]"
    lines.append(f"  {r.target:10s} {r.devices:7d}  {size:>21s}  "
                 f"{fmt_bytes(r.host_per_node) if r.host_per_node else '-':>10s}  {recipe}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:

  return exit_on_config_error(_main)(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:

  path, overrides, rest = parse_argv(argv, default="")
  p = ArgumentParser(prog="python -m zerojax.memory.fit", description=__doc__.split("\n")[0])
  p.add_argument("--targets", default=",".join(targets.names()), help="comma list of targets")
  p.add_argument("--devices", default=",".join(map(str, COUNTS)), help="comma list of counts")
  p.add_argument("--compile", action="store_true", help="check each recipe with XLA's GPU "
                 "compiler (needs the gpu-compile extra; ~10 s a 70B compile)")
  p.add_argument("--json", action="store_true", help="one JSON object per row")
  p.add_argument("--list", action="store_true", help="list the targets and exit")
  args = p.parse_args(rest)
  if args.list:
    for name in targets.names():
      t = targets.load(name)
      print(f"{name:10s} {t.device_kind:26s} {fmt_bytes(t.memory):>11s}  "
            f"compute capability {t.compute_capability[0]}.{t.compute_capability[1]}")
    return 0
  if not path:
    raise ConfigError("no config file given.", source="the command line",
                      fix="pass --config path/to/config.py, e.g. --config configs/70b_bf16.py")
  try:
    counts = [int(n) for n in args.devices.split(",")]
  except ValueError:
    p.error(f"--devices {args.devices}: not a comma list of numbers")
  if any(n < 1 or (n > 8 and n % 8) for n in counts):
    p.error(f"--devices {args.devices}: counts above 8 are whole hosts of 8")
  chosen = [targets.load(t) for t in args.targets.split(",")]
  targets.without_driver()
  if args.compile:
    gpu_compile.prepare(max(counts))
  rows = [fit(path, overrides, t, n, args.compile) for t in chosen for n in counts]
  if args.json:
    for r in rows:
      print(json.dumps(r._asdict()))
  else:
    print(format_rows(rows, path))
  return 0


if __name__ == "__main__":
  sys.exit(main())
