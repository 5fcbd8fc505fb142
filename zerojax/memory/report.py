"""The memory planner's report and CLI: the tables `python -m zerojax.memory` and
`train.py` print (see `zerojax.memory` for what is estimated and how).

    python -m zerojax.memory --config configs/70b_bf16.py --devices 64 --device-memory 80GiB
        [--compile] [--json] [--config.a.b=value ...]
    python -m zerojax.memory --config configs/70b_8x80gb.py --target h100:8 --compile
    python -m zerojax.memory --config configs/70b_8x80gb.py --target rtx4090:8 \
        --host-memory 1TiB --config.zero.param_offload=host --config.optimizer.offload=host
    python -m zerojax.memory --config configs/8b_bf16.py --target h100:8 --longest-sequence \
        --config.mesh.sequence_parallel=True --config.mesh.data=1 \
        --config.train.global_batch_size=1 [--compile]

`--target` names a GPU (`zerojax.gpu.targets`): the verdict is against the memory XLA's
allocator has on it as train.py runs, and `--compile` compiles with XLA's GPU compiler
for it (no GPU needed: the `gpu-compile` extra) instead of XLA:CPU on fake devices.

With offload (`zero.param_offload`, `optimizer.offload`, `model.activation_offload`) it
gives the host bytes per device and per node (`--host-memory` judges them) and the bytes
moved over the host link per step, timed at the target's link (`zerojax.gpu.host_link`)
or `--host-bandwidth` beside the step's compute at `--mfu` (`zerojax.memory.bus`).

With `--target --compile` each phase of the run is compiled too (`zerojax.memory.phases`:
init, the eval step, a checkpoint's checksums, generation where the run decodes; `--phases`
picks), and the largest of them decides the device's verdict: the whole run's peak, not
the step's alone.

Exit status: 0 fits (or no device memory known), 1 does not fit (device or host memory),
2 bad config. With --target --compile the compiled bytes decide the device's verdict.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import jax

from zerojax import build, models
from zerojax.config import (
  ArgumentParser,
  ConfigError,
  exit_on_config_error,
  load_config,
  parse_argv,
)
from zerojax.generate import cache, decode
from zerojax.gpu import compile as gpu_compile, host_link as links, targets
from zerojax.memory import (
  DEVICES_PER_NODE,
  DTYPE_BYTES,
  Estimate,
  RunSpec,
  Suggestion,
  active_params,
  attribute,
  bus,
  estimate,
  longest_sequence,
  phases as run_phases,
  sequence_unit,
  suggestions,
)
from zerojax.run import metrics
from zerojax.runtime import platform, xla_dump
from zerojax.runtime.device_env import CPU_MEMORY_FLAGS
from zerojax.runtime.devices import fake_cpu_devices
from zerojax.runtime.units import fmt_bytes, parse_bytes
from zerojax.streaming import schedule


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gb(n: float) -> str:  # Decimal units, as the hand arithmetic counts.
  return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _cpu_without_memory_flags() -> bool:
  """Compiled by XLA:CPU without `device_env.CPU_MEMORY_FLAGS` (its default scheduler keeps
  more alive than the planner, calibrated with them, expects)."""
  return (jax.default_backend() == "cpu"
          and not all(f in os.environ.get("XLA_FLAGS", "") for f in CPU_MEMORY_FLAGS))


def host_lines(e: Estimate, link=None) -> list[str]:
  """Param offload without release's caveat, the host memory's verdict, the bus line
  (`link`: a `bus.Bus`)."""
  s, out = e.setup, []
  if s.param_offload and not s.release:
    out.append("param offload without gradient release: the step brings the whole param "
               "shard to the device (no device bytes saved; host memory between steps): pair "
               "it with --config.optimizer.release=True")
  if e.host_memory and e.host:
    over = e.host_per_node - e.host_memory
    out.append(f"host memory: {fmt_bytes(e.host_per_node)} per node of {s.per_node} "
               f"device(s) {'fits in' if over <= 0 else 'does NOT fit in'} "
               f"{fmt_bytes(e.host_memory)} (--host-memory): "
               f"{'headroom' if over <= 0 else 'short by'} {fmt_bytes(abs(over))}"
               + ("" if over <= 0 else "; offload less (the changes below), or spread the "
                  "run over more nodes / devices (smaller shards, fewer devices a node)"))
  if link is not None and link.line():
    out.append(link.line())
  return out


def host_link(e: Estimate, spec, bandwidth: float, peak: float, mfu: float) -> bus.Bus:
  """The bus terms of `e` over the target's host link (or `bandwidth`), at the target's
  peak bf16 FLOP/s (`metrics.PEAK_FLOPS`; or the config's train.peak_flops) x `mfu`."""
  if spec:  # A Target has the device_kind peak_flops reads of a device.
    peak = metrics.peak_flops(spec.target, peak)
  return bus.bus(e.setup, e.host, spec and links.of(spec.target.name), bandwidth, peak, mfu)


def schedule_rates(spec, peak: float = 0.0, mfu: float = bus.DEFAULT_MFU,
                   bandwidth: float = 0.0) -> tuple[float, float]:
  """(FLOP/s, host link bytes/s a direction) a GPU target's compiled schedule is timed at
  (`streaming.schedule.timed_step`): its peak (or `peak`) x `mfu`, its host link (or
  `bandwidth`); 0 where unknown."""
  link = links.of(spec.target.name) if spec else None
  return (metrics.peak_flops(spec.target, peak) * mfu if spec else 0.0,
          bandwidth or (link.bandwidth if link else 0.0))


def _labels(s: RunSpec, gpu: bool = False, one_device: bool = False) -> dict:
  b = s.behaviour
  shard = lambda on: f", /{s.fsdp}" if on else ""
  params = ""
  if s.param_offload:
    params = "; host stack, 3 layers" if s.release else "; host between steps"
    if one_device:  # Estimate.one_device
      params = "; the layer stack in host memory"
  moments = {"adamw": "mu + nu", "lion": "momentum", "sgd": "momentum"}[s.optimizer]
  grads = {"psum_scatter_in_gather": "local shards",
           "psum_scatter_per_microbatch": f"/{s.fsdp} + one leaf whole"}.get(
               b.grad_reduction, "whole + fp32 params")
  if s.release:
    grads = "non-layer + one layer" + ("" if gpu and s.gathers else ", x2")  # memory.step
  buffer_dtype = "float32" if s.update_rule == "master" else s.param_dtype
  return {
      "params": f"params ({s.param_dtype}{shard(b.shards_params)}{params})",
      "params (host)": "params (the layer stack's shard)",
      "optimizer": f"optimizer {moments} ({s.state_dtype}{shard(b.shards_opt_state)})",
      "update buffer": f"{s.update_rule} buffer ({buffer_dtype}{shard(b.shards_opt_state)})",
      "layer gradients": f"layer gradients, stacked ({s.param_dtype})",
      "gradients": f"gradients ({s.reduce_dtype}, {grads})",
      "accumulator": f"gradient accumulator ({s.accum_dtype}, {s.microbatches} microbatches)",
      "saved activations": "saved activations (" + (
          "2 layers; the rest in host memory" if s.activation_offload else
          "release: layer inputs" if s.release else f"remat {s.remat}") + ")",
      "working set": "one layer's recompute + backward",
      "gathered layer": "gathered layer (fp32 on XLA:CPU)",
      "gathered head": "gathered head/embedding + a copy",
      "head gradient": "head gradient (fp32, " + (
          "the vocabulary shard's, two and a cast)" if s.vocab_sharded
          else "whole)"),
      "vocab gradient buffers": "embedding/head gradient buffers, made at the start",
      "loss chunk": "loss chunk (fp32 logits)",
      "embedding copy": "embedding copy (XLA:CPU)",
      "streamed state": "optimizer state streamed in for the update",
      # One device, release, the layer stack in host memory (memory.step._one_device):
      "streamed layers": "layers in flight: this one's params and state, the next's params"
                         + ("" if s.write_behind else " and state") + ", its gradient",
      "vocab copies": "embedding/head: " + (
          "one copy" if s.update_rule == "stochastic" else "two copies"),
      "written behind": "the last layer's update, written back behind",
      "backward layers": "layers in flight in the backward: this one's params and state, "
                         "the next's params",
      "update activations": "the layer's activations at its update",
      "vocab update": "embedding/head update: their state",
      "saved activations (host)": "saved activations (every layer's)",
      "batch": "batch (int32 tokens)"}


def _positions(s: RunSpec) -> str:
  return f"{s.positions} (of {s.seq_len})" if s.sequence_parallel else str(s.seq_len)


def format_sequence(e: Estimate) -> str:
  """Sequence or expert parallelism's line: the split and the all-to-all bytes ("" without
  either; MoE refuses sequence parallelism, so one of them)."""
  s = e.setup
  if s.sequence_parallel:
    split = (f"sequence parallel over fsdp={s.fsdp}: {s.positions} positions a device, "
             f"attention on all {s.seq_len} for {s.n_heads // s.fsdp} of {s.n_heads} heads")
    source = "zerojax.sequence.ulysses.all_to_all_bytes"
  elif s.n_experts and s.expert > 1:
    split = (f"expert parallel over expert={s.expert}: {s.n_experts // s.expert} of "
             f"{s.n_experts} experts a device, " + (
                 f"{s.capacity_factor:g} x a balanced router's rows sent each device (the "
                 "rest dropped)" if s.capacity_factor else "the dropless worst case's buffers"))
    source = "zerojax.models.moe.all_to_all_bytes"
  else:
    return ""
  return (f"{split}; all-to-all {fmt_bytes(e.all_to_all)} a device per layer and step "
          f"({fmt_bytes(e.all_to_all * s.n_layers)} for all layers; {source})")


def format_table(e: Estimate, compiled: dict | None = None, attributed: dict | None = None,
                 title: str = "", gpu: bool = False, link=None) -> str:
  """The plan as text: conventional bytes/param, per-device components (estimate and,
  if given, compiled), total, verdict."""
  s, c = e.setup, e.conventional
  grads = 0 if s.release else DTYPE_BYTES[s.reduce_dtype]  # Release: one layer's at a time.
  held = c["params"] + grads + c["optimizer"]
  k = c["optimizer"]
  active = (f" ({_count(active_params(s))} active a token: {s.experts_per_token} of "
            f"{s.n_experts} experts)") if s.n_experts else ""
  lines = [
      f"memory plan {title} on {s.devices} devices (data={s.data}"
      + (f" expert={s.expert} fsdp={s.fsdp // s.expert}" if s.expert > 1 else f" fsdp={s.fsdp}")
      + "), "
      f"ZeRO stage {s.stage}".replace("  ", " "),
      f"  {_count(e.params)} params{active}; per device {s.batch} x {_positions(s)} tokens x "
      f"{s.microbatches} microbatch(es); remat {s.remat}; {s.optimizer}, {s.state_dtype} state, "
      f"{s.update_rule} updates" + ("; gradient release" if s.release else ""),
      f"model state as users count it: params {c['params']} + gradients {c['gradients']:.3g} + "
      f"optimizer {k:g} = {e.bytes_per_param:g} B/param = {_gb(e.params * e.bytes_per_param)} "
      f"in all; per device at stage {s.stage}: {_gb(e.conventional_per_device)}",
      f"what zerojax holds: params {c['params']} + optimizer {k:g} (state) + {s.reduce_dtype} "
      f"gradients {grads} (temporaries{'; release: one layer at a time' if s.release else ''}) "
      f"= {held:g} B/param before sharding, plus activations:"]
  head = f"  {'component (per device)':44s} {'estimate':>11s}"
  if compiled:
    head += f" {'compiled':>11s}  est/comp"
  lines.append(head)
  peak = e.peak_phase

  def row(mark, label, est, comp=None):
    text = f"{mark} {label:44s} {fmt_bytes(est):>11s}"
    if comp is not None:
      text += f" {fmt_bytes(comp):>11s}  " + (f"{est / comp:5.2f}" if comp else "  -")
    lines.append(text)

  labels = _labels(s, gpu, e.one_device)
  for key in ("params", "optimizer", "update buffer", "batch"):
    if key in e.components:
      row(" ", labels[key], e.components[key])
  row(" ", "= arguments (state and batch)", e.state, compiled and compiled["arguments"])
  attributed = dict(attributed or {})
  if "accumulator" in e.parts[peak]:  # Same shapes as the gradients: counted with them.
    attributed["gradients"] = attributed.get("gradients", 0) - e.components["accumulator"]
    attributed["accumulator"] = e.components["accumulator"]
  for key, est in e.components.items():
    if key not in ("params", "optimizer", "update buffer", "batch"):
      row("*" if key in e.parts[peak] else " ", labels[key], est,
          attributed.get(key) if compiled and attributed else None)
  if compiled and attributed:
    rest = compiled["temporaries"] - sum(v for k, v in attributed.items() if k in e.components)
    label = "(compiled only: padding, other buffers)"
    lines.append(f"  {label:44s} {'':>11s} {fmt_bytes(rest):>11s}")
  row(" ", f"= temporaries at the peak: {peak} (*)", e.phases[peak],
      compiled and compiled["temporaries"])
  row(" ", "= total per device", e.total,
      compiled and compiled["arguments"] + compiled["temporaries"])
  if compiled and attributed:
    lines += _differences(e, compiled, attributed, labels)
  if compiled and not gpu and _cpu_without_memory_flags():
    lines.append("(compiled by XLA:CPU without its memory flags, which the estimate assumes: "
                 "train.py --fake_devices N or python -m zerojax.memory --compile set them)")
  if format_sequence(e):
    lines.append(format_sequence(e))
  if e.host:
    node = min(s.devices, DEVICES_PER_NODE)
    lines.append("host memory (offload): " + " + ".join(
        f"{labels.get(k + ' (host)', labels[k])} {fmt_bytes(v)}" for k, v in e.host.items())
        + f" = {fmt_bytes(e.host_total)} per device, {fmt_bytes(e.host_per_node)} per node "
        f"of {node} device(s)")
  lines += host_lines(e, link)
  if e.device_memory:
    ok = e.fits_device
    lines.append(f"verdict: {'fits' if ok else 'does NOT fit'} in "
                 f"{fmt_bytes(e.device_memory)} per device: {'headroom' if ok else 'short by'} "
                 f"{fmt_bytes(abs(e.headroom))} ({abs(e.headroom) / e.device_memory:.0%})"
                 + ("" if e.fits_host else "; the host memory does NOT fit (above)"))
  return "\n".join(lines)


def _differences(e, compiled, attributed, labels) -> list[str]:
  """The total's ratio; where it is off by more than 10%, the components that differ."""
  total = compiled["arguments"] + compiled["temporaries"]
  ratio = e.total / total
  out = [f"estimate / compiled = {ratio:.3f}" + ("" if abs(ratio - 1) <= 0.1 else
                                                 "  (more than 10% apart)")]
  peak = e.parts[e.peak_phase]  # Compiled at its peak vs the estimate's peak phase.
  keys = [k for k in e.components if k in peak or attributed.get(k)]
  diffs = sorted(((attributed.get(k, 0) - (e.components[k] if k in peak else 0), k)
                  for k in keys), key=lambda d: -abs(d[0]))
  big = [(d, k) for d, k in diffs if abs(d) > 0.1 * max(e.components[k], 1)
         and abs(d) > 0.02 * total]
  if big and abs(ratio - 1) > 0.1:
    out.append("where they differ (compiled minus estimate at the peak): " + "; ".join(
        f"{labels[k]} {'+' if d > 0 else '-'}{fmt_bytes(abs(d))}" for d, k in big))
  return out


def format_suggestions(e: Estimate, found: list[Suggestion]) -> str:
  if not e.device_memory or e.fits:
    return ""
  if not found:
    return "no change tried here makes it fit (see zerojax.memory.search._changes)"
  lines = ["changes that make it fit, cheapest first:"]
  for i, x in enumerate(found, 1):
    lines.append(f"  {i}. {x.change:60s} -> {fmt_bytes(x.estimate.total):>11s} "
                 f"({' '.join('--config.' + o for o in x.overrides)})")
  return "\n".join(lines)


def to_dict(e: Estimate) -> dict:
  return dict(setup=dataclasses.asdict(e.setup), params=e.params,
              bytes_per_param=e.bytes_per_param, conventional=e.conventional,
              conventional_per_device=e.conventional_per_device, components=e.components,
              phases=e.phases, peak_phase=e.peak_phase, state=e.state, total=e.total,
              device_memory=e.device_memory, fits=e.fits, host=e.host,
              host_total=e.host_total, host_per_node=e.host_per_node,
              host_memory=e.host_memory, fits_host=e.fits_host, all_to_all=e.all_to_all)


def main(argv: list[str] | None = None) -> int:
  """The CLI; exit status 0: fits (or no --device-memory), 1: does not fit, 2: bad config."""
  return exit_on_config_error(_main)(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
  path, overrides, rest = parse_argv(argv, default="")  # So that --help works without one.
  p = ArgumentParser(prog="python -m zerojax.memory", description=__doc__.split("\n")[0])
  p.add_argument("--devices", type=int, default=0,
                 help="devices the run uses (or --target NAME:N)")
  p.add_argument("--device-memory", "--device_memory", default="",
                 help="memory per device, e.g. 80GiB or 141GB; gives a verdict and suggestions")
  p.add_argument("--target", default="", help="a GPU target, e.g. h100, h100:8, h100:2x8 "
                 "(python -m zerojax.memory.fit --list): its memory gives the verdict; with "
                 "--compile, XLA's GPU compiler compiles the step for it")
  p.add_argument("--compile", action="store_true", help="also compile the step (for --target "
                 "with XLA's GPU compiler; else on as many fake CPU devices with XLA:CPU's "
                 "memory flags) and show XLA's numbers")
  p.add_argument("--phases", default=",".join(run_phases.PHASES),
                 help="with --target --compile: the run's phases compiled beside the step, "
                 "the largest deciding the verdict (default: every one the run takes; "
                 "train_step: the step alone)")
  p.add_argument("--longest-sequence", "--longest_sequence", action="store_true",
                 help="plan (and with --compile, compile) at the longest train.seq_len that "
                 "fits in the device memory, at this batch (zerojax.memory.longest_sequence)")
  p.add_argument("--host-memory", "--host_memory", default="",
                 help="host memory per node, e.g. 1TiB: offload's host bytes must fit in it")
  p.add_argument("--host-bandwidth", "--host_bandwidth", default="",
                 help="bytes per second one direction of the host link moves, e.g. 25GB "
                 "(default: the --target's, zerojax.gpu.host_link)")
  p.add_argument("--mfu", type=float, default=bus.DEFAULT_MFU,
                 help="model FLOPs utilization the step's compute time assumes (0.4)")
  p.add_argument("--json", action="store_true", help="print one JSON object instead")
  p.add_argument("--generate", default="", metavar="BATCHxLEN",
                 help="also the KV cache of generating BATCH prompts of LEN tokens in all, "
                 "e.g. 64x512 (default with train.eval_exact_match: its batch of 64 x seq_len)")
  args = p.parse_args(rest)
  if not path:
    raise ConfigError("no config file given.", source="the command line",
                      fix="pass --config path/to/config.py, e.g. --config configs/70b_bf16.py")
  try:
    device_memory, host_memory, bandwidth = (parse_bytes(x) if x else 0 for x in (
        args.device_memory, args.host_memory, args.host_bandwidth))
  except ValueError as err:
    p.error(str(err))
  if not 0 < args.mfu <= 1:
    p.error(f"--mfu {args.mfu:g}: a fraction in (0, 1]")
  phases = phases_arg(args.phases, p.error)
  spec = None
  if args.target:
    spec = targets.parse(args.target, args.devices)
    args.devices = spec.devices
    targets.without_driver()
  if not args.devices:
    raise ConfigError("no device count given.", source="the command line",
                      fix="pass --devices N, or --target NAME:N (e.g. --target h100:8)")
  if args.compile:  # XLA reads its flags when JAX starts its backend: before any device work.
    gpu_compile.prepare(args.devices) if spec else fake_cpu_devices(args.devices)
  config = load_config(path, overrides, num_devices=args.devices)
  where = None
  if spec:
    where = target_budget(config, spec.target)
    device_memory = device_memory or where[0]
  # The target's memory: XLA's scheduler limit reads the device's, not the pool's (the
  # suggestions' setups keep it).
  per_host = dict(per_host=spec.per_host, gpu_memory=spec.target.memory) if spec else {}
  fit = dict(device_memory=device_memory, host_memory=host_memory)
  with for_target(spec):  # The estimate's kernels are the target's (attention 'auto').
    e = estimate(dataclasses.replace(RunSpec.from_config(config, args.devices), **per_host),
                 **fit)
    longest = None
    if args.longest_sequence:
      longest = longest_sequence_line(config, e, args.devices, device_memory, host_memory)
      if longest is None:
        return 1
      e = estimate(dataclasses.replace(longest[0].setup, **per_host), **fit)
      config.train.seq_len = e.setup.seq_len
  compiled = attributed = phased = None
  if args.compile:
    compiled, attributed, built = compile_and_attribute(
        config, e, spec, schedule_rates(spec, config.train.peak_flops, args.mfu, bandwidth))
    if spec:  # The run's other phases (issue 52).
      phased = run_phases.beside_step(config, spec, phases, built, compiled)
  with for_target(spec):  # Each suggestion's estimate is the target's too.
    found = suggestions(e.setup, **fit)
  generation = generation_cache(config, args.devices, args.generate, p.error)
  fits = e.fits_device if not (spec and compiled) else (
      compiled_peak(compiled, phased) <= device_memory)
  link = host_link(e, spec, bandwidth, config.train.peak_flops, args.mfu)
  if args.json:
    print(json.dumps(dict(to_dict(e), compiled=compiled, attributed=attributed, phases=phased,
                          target=str(spec) if spec else None, fits=fits and e.fits_host,
                          fits_device=fits, pcie=link.to_dict(), generate=generation,
                          suggestions=[dict(change=x.change, overrides=x.overrides,
                                            total=x.estimate.total) for x in found])))
  else:
    if longest:
      print(longest[1])
    at = [f"at train.seq_len={e.setup.seq_len}"] if longest else []
    print(format_table(e, compiled, attributed, title=" ".join([path, *overrides, *at]),
                       gpu=bool(spec), link=link))
    if spec:
      print(format_target_verdict(spec, where, device_memory, compiled, phased))
      if compiled and (moved := traffic_line(compiled, e)):
        print(moved)
      if compiled and (timed := timed_line(compiled)):
        print(timed)
    elif compiled:
      print(f"(compiled in {compiled['seconds']:.1f} s on {args.devices} fake CPU devices)")
    if generation:
      print(f"generation ({generation['why']}): KV cache {fmt_bytes(generation['bytes'])} per "
            f"device for {generation['batch']} rows x {generation['length']} tokens, beside "
            "the params (zerojax.generate.cache_bytes)")
    text = format_suggestions(e, found)
    if text:
      print(text)
  return 0 if (not device_memory or fits) and e.fits_host else 1


def longest_sequence_line(config, e: Estimate, devices: int, device_memory: int,
                          host_memory: int = 0):
  """(the estimate at the longest train.seq_len that fits, a line that says so), or None
  (said on stdout) when none fits or no device memory is given."""
  if not device_memory:
    print("--longest-sequence needs the device memory: --device-memory or --target")
    return None
  unit = sequence_unit(e.setup)
  found = longest_sequence(config, devices, device_memory, host_memory=host_memory,
                           gpu_memory=e.setup.gpu_memory)
  if found is None:
    print(f"no train.seq_len (a multiple of {unit}) fits in {fmt_bytes(device_memory)} at "
          f"{e.setup.batch} sequence(s) per device")
    return None
  return found, (f"longest train.seq_len that fits: {found.setup.seq_len} (a multiple of "
                 f"{unit}: sequence_unit), {e.setup.batch} sequence(s) per device")


def generation_cache(config, devices: int, flag: str, error) -> dict | None:
  """The KV cache of `zerojax.generate` per device for `--generate BATCHxLEN` (or the eval's
  exact match: 64 prompts, a training row's length), rounded as the decoder rounds its
  batch and length; None for no generation, or a model without a cache."""
  model = models.from_config(config)
  if flag:
    batch, _, length = flag.lower().partition("x")
    if not (batch.isdigit() and length.isdigit() and int(batch) > 0 and int(length) > 0):
      error(f"--generate {flag!r}: expected BATCHxLEN, e.g. 64x512")
    why, batch, length = f"--generate {flag}", int(batch), int(length)
  elif config.train.eval_exact_match:
    why, batch, length = "train.eval_exact_match", 64, config.train.seq_len
  else:
    return None
  if not hasattr(model, "extend"):
    return None
  rows, length = decode.batch_bucket(batch, devices), decode.length_bucket(length)
  return dict(why=why, batch=rows, length=length,
              bytes=cache.cache_bytes(model.config, rows, length, devices))


def for_target(spec):
  """The context a planner estimate for `spec` (None: this machine) runs in."""

  # The target's compute capability: which head sizes cuDNN takes, as its compile traces.
  return (platform.targeting("gpu", spec.target.compute_capability) if spec
          else contextlib.nullcontext())


def target_budget(config, target) -> tuple[int, float]:
  """(bytes a device of `target` has for the step when train.py runs `config`, the
  allocator's memory fraction)."""
  fraction = targets.memory_fraction(config)
  return targets.budget(target, fraction), fraction


def compile_and_attribute(config, e: Estimate, spec=None,
                          rates: tuple[float, float] = (0.0, 0.0)) -> tuple[dict, dict]:
  """The step compiled (for `spec`'s GPU with XLA's GPU compiler, else by XLA:CPU on this
  process's devices) and its temporaries at the peak attributed to the planner's
  components (read from the buffer assignment XLA dumps); a GPU compile's host copies
  timed along its schedule at `rates` (`with_traffic`)."""
  dump = tempfile.mkdtemp(prefix="zerojax_memory_")
  try:
    built = build.build(config)
    if spec:
      out = gpu_compile.compile_step(built, config, spec, dump_to=dump)
      compiled = with_traffic(out.memory, out.hlo, *rates)
    else:
      compiled = build.compiled_memory(built, dump_to=dump)
    return compiled, attribute(e.setup, xla_dump.live_at_peak(dump),
                               one_device=e.one_device), built
  finally:
    shutil.rmtree(dump, ignore_errors=True)


def format_target_verdict(spec, where: tuple[int, float], device_memory: int,
                          compiled: dict | None, phased: dict | None = None) -> str:
  """Where the verdict's bytes come from on a GPU target, and (compiled) the verdict: on
  the step's bytes, or with `phased` (`phases.phase_memory`, the step among them) on the
  largest phase's, each phase listed."""
  t = spec.target
  pool, fraction = where
  lines = [f"target {spec}: {spec.devices} x {t.device_kind}, {fmt_bytes(t.memory)} each; "
           f"XLA's allocator takes {fraction:g} of it less {fmt_bytes(targets.CONTEXT_BYTES)} "
           f"for the CUDA context = {fmt_bytes(pool)} per device"
           + ("" if device_memory == pool else f" (--device-memory {fmt_bytes(device_memory)} "
              "judged instead)")]
  if compiled:
    total = compiled["arguments"] + compiled["temporaries"]
    host = compiled["host_arguments"] + compiled.get("host_temporaries", 0)
    step = (f"XLA's GPU compiler ({compiled['seconds']:.1f} s; buffer assignment, nothing "
            f"allocated): {fmt_bytes(total)} per device"
            + (f" + {fmt_bytes(host)} in host memory ({host_parts(compiled)}; "
               f"{fmt_bytes(host * min(spec.per_host, DEVICES_PER_NODE))} per host)"
               if host else ""))
    if phased:
      top, total = run_phases.whole_run(phased)
      lines += [step + " for the step", "the run's phases, GiB a device "
                "(python -m zerojax.memory.phases):", *run_phases.lines(phased)]
      step = f"the whole run's peak ({top}): {fmt_bytes(total)} per device"
    lines.append(step + f"; verdict: {'fits' if total <= device_memory else 'does NOT fit'} "
                 f"({'headroom' if total <= device_memory else 'short by'} "
                 f"{fmt_bytes(abs(device_memory - total))})")
  return "\n".join(lines)


def phases_arg(text: str, error) -> tuple[str, ...]:
  """--phases' names (the step always among them), or `error` naming the unknown."""
  names = tuple(dict.fromkeys(["train_step", *filter(None, text.split(","))]))
  if unknown := [n for n in names if n not in run_phases.PHASES]:
    error(f"--phases: no phase {unknown[0]!r}; the phases: {', '.join(run_phases.PHASES)}")
  return names


def compiled_peak(compiled: dict, phased: dict | None) -> int:
  """The device bytes a GPU-target verdict judges: the largest phase's, else the step's."""
  return (run_phases.whole_run(phased)[1] if phased
          else compiled["arguments"] + compiled["temporaries"])


def traffic_line(compiled: dict, e: Estimate) -> str:
  """The compiled step's host copies per device and step (host_h2d / host_d2h of a GPU
  compile: `with_traffic`) beside the planner's PCIe bytes for `e` (`bus.traffic`); ''
  where the step moves nothing."""
  moved = compiled.get("host_h2d", 0.0), compiled.get("host_d2h", 0.0)
  if not any(moved):
    return ""
  planned = bus.totals(bus.traffic(e.setup, e.host))
  gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
  ratio = lambda i: f"{planned[i] / moved[i]:.3f}" if moved[i] else "-"  # noqa: E731
  return (f"host copies in the compiled step: {gb(moved[0])} in, {gb(moved[1])} out per "
          f"device (each copy x its loops' trip counts); the planner's PCIe / compiled: "
          f"{ratio(0)} in, {ratio(1)} out")


def with_traffic(memory: dict, hlo_text: str, flop_rate: float = 0.0,
                 link: float = 0.0) -> dict:
  """`memory` (a compile's bytes) with the host copies its module makes a run
  (`streaming.schedule.host_traffic`) as host_h2d / host_d2h; with both rates, the
  layer loops' copies timed along its schedule (`streaming.schedule.timed_step`) as
  host_copy_seconds / host_wait_seconds, at flop_rate / link_rate."""
  h2d, d2h = schedule.host_traffic(hlo_text)
  out = dict(memory, host_h2d=h2d, host_d2h=d2h)
  if flop_rate and link:
    copies, waits = schedule.timed_step(hlo_text, flop_rate, link)
    out.update(host_copy_seconds=copies, host_wait_seconds=waits, flop_rate=flop_rate,
               link_rate=link)
  return out


def timed_line(compiled: dict) -> str:
  """`schedule.timed_line` of a compile `with_traffic` timed; '' otherwise."""
  if not compiled.get("host_copy_seconds"):
    return ""
  return schedule.timed_line(compiled["host_copy_seconds"], compiled["host_wait_seconds"],
                             compiled["flop_rate"], compiled["link_rate"])


def host_parts(compiled: dict) -> str:
  """What a compiled step keeps in host memory: offloaded state (its host arguments) and
  saved activations (its host temporaries, the activation offload's stacks)."""
  parts = [(compiled["host_arguments"], "state"),
           (compiled.get("host_temporaries", 0), "saved activations")]
  return " + ".join(f"{what} {fmt_bytes(n)}" for n, what in parts if n)


def device_memory(device) -> int:
  """Bytes of memory `device` has (its `memory_stats()` limit), or 0 where unknown (CPU)."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  # Backends without memory stats.
    return 0
  return int(stats.get("bytes_limit", 0))


def host_memory_available() -> int:
  """Bytes of host memory free for new allocations, or 0 where unknown.

  Linux's MemAvailable (free plus reclaimable cache), capped by a cgroup v2 limit (a
  container's) where one is set; elsewhere the free pages `os.sysconf` reports.
  """
  try:
    with open("/proc/meminfo") as f:
      free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
  except (OSError, StopIteration, ValueError):
    try:
      free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
      return 0
  try:
    with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
      free = min(free, int(f.read()) - int(g.read()))
  except (OSError, ValueError):  # No cgroup v2, or "max": no limit.
    pass
  return max(free, 0)

