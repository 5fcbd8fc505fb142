"""Trains a language model with ZeRO: the one trainer, built only from library calls.

    python train.py                                     # configs/tiny.py on CPU, under 8 minutes
    python train.py --config configs/tiny.py --config.zero.stage=2 --workdir runs/x
    python train.py --config configs/70b_bf16.py --dry_run --fake_devices 64
    python train.py --config configs/70b_8x80gb.py --dry_run --target h100:8   # XLA's GPU compiler
    zerojax-train --config my_config.py                 # the same, from an installed package

Read top-down: `setup` (config, data, the compiled step and its memory), `restore_or_init`,
`train_loop` (the steps), `main`. The checkout's train.py and the `zerojax-train` console
script both call `main`.

At start it prints the resolved config (saved as <workdir>/config.json once the run is
accepted: the workdir's lock taken, the checkpoint resumed), the mesh, the
parameter count and the compiled per-device memory of the step; then a progress line
every train.log_every steps (loss, tokens/s, MFU where the device's peak is known, ETA)
and the held-out loss every train.eval_every steps; with a workdir the same numbers go
to <workdir>/metrics.jsonl and TensorBoard (<workdir>/tb), and to W&B with
logging.wandb.project (zerojax/run/metrics.py). `--dry_run` compiles the step from
abstract inputs (nothing is allocated, so a 70B config works on a laptop with
`--fake_devices`) and exits; `--target h100:8` compiles it with XLA's GPU compiler for
that GPU instead (zerojax.gpu: no GPU needed), with each other phase of the run (init,
eval, a checkpoint's checksums, generation: zerojax.memory.phases; `--phases` picks),
and judges the largest against that GPU's memory as this trainer would run it there. Bad
command line, config or data: one `error:` line, exit status 2, before the config is
printed; on CPU a step larger than the host's free memory is refused the same way before
anything is allocated (not in a dry run). Several processes (README, Multi-host): the
same command on each; exit status 4 if they do not all join within
distributed.initialization_timeout. Stopped early by SIGTERM, Ctrl-C or --stop_after:
saved, exit status 75; the same command resumes. Every status:
zerojax/runtime/exits.py.
"""

import argparse
import contextlib
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

import zerojax
from zerojax import checkpoint, data, generate, hf, memory, streaming, zero
from zerojax.build import Built, build, compile_step
from zerojax.config import (
  ArgumentParser,
  ConfigError,
  exit_on_config_error,
  load_config,
  parse_argv,
)
from zerojax.data import sft
from zerojax.gpu import compile as gpu_compile, targets, xla_flags
from zerojax.memory import phases as run_phases, report as memory_report
from zerojax.mesh import processes_per_group
from zerojax.models.attention import attention_kernel
from zerojax.optim import precision
from zerojax.run import distributed, metrics, peers, preemption, watchdog, workdir
from zerojax.runtime import dispatch, exits, units
from zerojax.runtime.devices import fake_cpu_devices

# The quick start's config in a checkout (beside its train.py); an installed package has
# no configs/ folder, so there --config is required (a ConfigError that says so).
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = (os.path.join(_CHECKOUT, "configs", "tiny.py")
                  if os.path.exists(os.path.join(_CHECKOUT, "train.py")) else None)


class Run(NamedTuple):
  """What `setup` made of the command line and config, for the rest of the run."""
  config: ml_collections.ConfigDict
  path: str  # The config file.
  args: argparse.Namespace  # train.py's own flags.
  report: metrics.Reporter
  ckpt: checkpoint.Checkpointer | None  # None without a workdir.
  train_tokens: np.ndarray | sft.Examples  # sft.Examples for data.name='sft'.
  eval_tokens: np.ndarray | sft.Examples
  built: Built  # Mesh, model, optimizer, plan, batch sharding.
  train_step: Any  # The compiled step.
  compiled_memory: int  # Bytes per device (arguments + temporaries, + host-resident state).


def parse_args(argv: list[str]) -> tuple[str, list[str], argparse.Namespace]:
  """(config path, overrides, train.py's flags); starts the fake CPU devices if asked."""
  path, overrides, rest = parse_argv(argv, default=DEFAULT_CONFIG)
  # prog is argparse's default, the command as typed: train.py or zerojax-train.
  parser = ArgumentParser(description=__doc__.split("\n")[0],
                          default_config=DEFAULT_CONFIG and os.path.relpath(DEFAULT_CONFIG))
  parser.add_argument("--dry_run", action="store_true",
                      help="compile the step from abstract inputs, report memory, train nothing")
  parser.add_argument("--fake_devices", type=int, default=0,
                      help="run on this many fake CPU devices (set before JAX starts a backend)")
  parser.add_argument("--target", default="",
                      help="with --dry_run: compile for this GPU with XLA's GPU compiler, e.g. "
                           "h100:8 or h100:2x8 (2 hosts of 8); zerojax.gpu.targets lists them")
  parser.add_argument("--phases", default=",".join(run_phases.PHASES),
                      help="with --target: the run's phases compiled beside the step, the "
                           "largest judged (default: every one the run takes)")
  parser.add_argument("--workdir", default=None, help="overrides config.workdir")
  parser.add_argument("--stop_after", type=int, default=None, metavar="STEP",
                      help="after this step (one this run takes: after the resumed one, up "
                           "to train.steps), save and exit as on SIGTERM (a preemption drill; "
                           "the same command without it resumes)")
  args = parser.parse_args(rest)
  if args.fake_devices < 0:
    parser.error(f"argument --fake_devices: {args.fake_devices} is not a number of devices")
  args.target_spec = None
  if args.target:
    if not args.dry_run or args.fake_devices:
      parser.error("--target compiles for a GPU without one: it takes --dry_run, not "
                   "--fake_devices (the target names the device count: h100:8)")
    args.target_spec = targets.parse(args.target)
    args.phases = memory_report.phases_arg(args.phases, parser.error)
    gpu_compile.prepare(args.target_spec.devices)  # Before JAX starts a backend.
  if args.fake_devices:  # XLA reads its flags when JAX starts a backend: nothing has yet.
    # With the memory-optimized scheduler, and no hoisting of whole-stack f32 copies out
    # of the layer loop, so the CPU's numbers resemble a GPU's (zerojax.runtime.devices).
    fake_cpu_devices(args.fake_devices)
  if args.workdir is not None:
    overrides = [*overrides, f"workdir={args.workdir}"]
  return path, overrides, args


def check_stop_after(stop_after: int | None, start: int, steps: int) -> None:
  """Refuses a --stop_after that the run would never reach: a step outside
  start+1..steps (`start`: the step it resumes from) would train on to the end."""
  if stop_after is not None and not start < stop_after <= steps:
    resumed = f" (it resumes from step {start})" if start else ""
    raise ConfigError(f"--stop_after {stop_after} is not a step this run takes{resumed}: it "
                      f"must be in {start + 1}..{steps} (train.steps).",
                      source="the command line")


def setup(argv: list[str], cleanup: contextlib.ExitStack) -> Run:
  """Config, processes, workdir lock, checkpoints, data, the compiled step and its memory.

  Every mistake of the user's surfaces here, before anything is allocated: the config
  and command line (ConfigError), the HF folder, the checkpoint's config, the data.
  """
  path, overrides, args = parse_args(argv)
  # Every config mistake surfaces here, before anything touches a device; then this
  # process joins the others of a multi-host run (zerojax.run.distributed: config keys, env,
  # SLURM / Open MPI; none = one process; exit 4 if they do not all join in time), and
  # only then are the mesh and batch checked against the devices of all processes.
  unchecked = load_config(path, overrides)
  # Before any process joins or compiles; a resumed run's lower bound: `train`.
  check_stop_after(args.stop_after, 0, unchecked.train.steps)
  # XLA reads its flags when JAX starts a backend, which joining the processes does.
  xla_lines = xla_flags.apply_gpu_profile(unchecked)
  distributed.initialize(unchecked.distributed)
  config = load_config(path, overrides, num_devices=jax.device_count())
  c = config
  report = metrics.Reporter(c.workdir)
  if c.workdir:  # One run per workdir: another one refuses (exit 2) before touching it.
    cleanup.enter_context(workdir.lock(c.workdir, log=report))
  if c.init_from:  # A model section that contradicts its config.json: HFError, exit 2.
    hf.check_config(c.init_from, c.model)
  # Checkpoints in <workdir>/checkpoints; a config that contradicts the newest one is an
  # error now, before anything is compiled (CheckpointError: exit 2).
  ckpt = None
  if c.workdir:
    k = c.checkpoint
    # Closed on every way out (an error too): saves in flight finish, orbax's threads stop.
    ckpt = cleanup.enter_context(checkpoint.Checkpointer(
        os.path.join(c.workdir, "checkpoints"), save_every_steps=k.every_steps,
        save_every_minutes=k.every_minutes, keep=k.keep, keep_every=k.keep_every,
        async_save=k.async_save, log=report))
    ckpt.check_config(config)

  # Every data mistake surfaces here too, before the model is built or compiled.
  data_lines = []
  if c.data.name == "sft":
    train_tokens, eval_tokens, data_lines = sft.load(c.data, c.model.vocab_size, c.train.seq_len)
    head_dim = c.model.head_size or c.model.d_model // c.model.n_heads
    if c.data.pack and attention_kernel(c.model.attention, c.precision.compute_dtype,
                                        head_dim=head_dim) != "blocked":
      data_lines.append("attention: dot_product with the packed examples' segment mask, which "
                        "cuDNN takes as a [B, 1, T, T] bias")
  else:
    train_tokens, eval_tokens = data.load_tokens(c.data, c.model.vocab_size, c.train.seq_len,
                                                 cache_dir=c.workdir)
  # Printed once the config and data are known good, so an error is the first thing shown.
  report(f"config {path} {' '.join(overrides)}\n{config}")
  for line in xla_lines:
    report(line)
  for line in data_lines:
    report(f"data: {line}")
  warning = hf.seq_len_warning(c.init_from, c.train.seq_len) if c.init_from else None
  if warning:
    report(warning)
  # The mesh, model, optimizer, ZeRO plan and jitted step (the memory planner compiles
  # the same ones: zerojax.build), compiled from abstract inputs: the memory is known
  # before anything is allocated, and the loop runs this same executable.
  built = build(config)
  start = time.perf_counter()
  spec = args.target_spec
  if spec:  # XLA's GPU compiler, for a GPU this process does not have; nothing to run.
    gpu = gpu_compile.compile_step(built, config, spec)
    train_step, mem, text = None, gpu.memory, gpu.hlo
    report(f"target {spec}: compiled by XLA's GPU compiler with the XLA flag profile "
           f"{'on' if c.xla.gpu_profile else 'off'} (nothing allocated)")
  else:
    train_step, mem = compile_step(built)
    train_step = dispatch.guarded(train_step)  # The executable, bounded as the jitted step.
    # XLA:CPU moves nothing between host and device: only a GPU's schedule has copies.
    text = train_step.as_text() if jax.devices()[0].platform == "gpu" else ""
  del mem["seconds"]
  # The run's other phases for a target: init, eval, checksums, generation (issue 52).
  phased = spec and run_phases.beside_step(config, spec, args.phases, built, mem)
  if text:  # The host copies the module makes a step, beside the planner's below.
    mem = memory_report.with_traffic(mem, text, *memory_report.schedule_rates(
        spec, c.train.peak_flops))
  mesh, plan = built.mesh, built.plan
  n_params = sum(x.size for x in jax.tree.leaves(plan.params))
  shape = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
  total = mem["arguments"] + mem["temporaries"]
  if jax.process_count() > 1:  # Hybrid (fsdp inside a host) or not.
    span = processes_per_group(mesh, "fsdp")
    shape += (f" (fsdp spans {span} processes)" if span > 1 else
              " (fsdp inside each process: hybrid)")
  kind = spec.target.device_kind if spec else jax.devices()[0].device_kind
  report(f"devices {jax.device_count()} ({kind})  "
         f"processes {jax.process_count()}  mesh {shape}  "
         f"stage {c.zero.stage}  params {n_params / 1e6:,.2f}M  "
         f"tokens {_tokens(train_tokens) / 1e6:.1f}M+{_tokens(eval_tokens) / 1e6:.2f}M\n"
         f"per-device memory (compiled): arguments {units.fmt_bytes(mem['arguments'])} + "
         f"temporaries {units.fmt_bytes(mem['temporaries'])} = {units.fmt_bytes(total)}"
         + (f", + {memory_report.host_parts(mem)} in host memory"
            if mem["host_arguments"] or mem.get("host_temporaries") else "") + "  "
         f"(compile {time.perf_counter() - start:.1f}s)",
         devices=jax.device_count(), processes=jax.process_count(), mesh=dict(mesh.shape),
         stage=c.zero.stage, params=n_params, memory=mem)
  if gathers := zero.whole_gather_line(plan):  # Stage 3: what is gathered whole, at once.
    report(gathers)
  if text and (copies := streaming.schedule.overlap_line(text)):
    report(copies)  # Whether the streams can hide behind the layers' compute.
    if timed := memory_report.timed_line(mem):
      report(timed)
  # CPU devices share the host's memory: a step that does not fit would swap, ignore
  # Ctrl-C while it allocates, then meet the OOM killer. A dry run allocates nothing.
  host = (memory_report.host_memory_available()
          if jax.devices()[0].platform == "cpu" and not args.dry_run else 0)
  # The memory planner's estimate beside the compiled numbers, and a verdict where the
  # device (or, on CPU, the host) says how much memory it has (python -m zerojax.memory
  # explains the rows).
  where = memory_report.target_budget(config, spec.target) if spec else None
  with memory_report.for_target(spec):  # The target's kernels (attention 'auto').
    estimate = memory.estimate(config, jax.device_count(),
                               where[0] if spec else host // jax.local_device_count() if host
                               else memory_report.device_memory(jax.devices()[0]),
                               gpu_memory=spec.target.memory if spec else 0)
  found = memory.suggestions(estimate.setup, device_memory=estimate.device_memory)
  report("\n".join(filter(None, [
      memory_report.format_table(estimate, mem, title=path, gpu=bool(spec)),
      spec and memory_report.format_target_verdict(spec, where, where[0], dict(
          mem, seconds=time.perf_counter() - start), phased),
      memory_report.traffic_line(mem, estimate),
      memory_report.format_suggestions(estimate, found)])), memory_estimate=estimate.total)
  # CPU devices' memory and host memory are one.
  total += mem["host_arguments"] + mem.get("host_temporaries", 0)
  if host and total * jax.local_device_count() > host:
    raise ConfigError(
        f"the step needs {units.fmt_bytes(total * jax.local_device_count())} of host memory "
        f"({units.fmt_bytes(total)} compiled per device x {jax.local_device_count()} CPU "
        f"devices), {units.fmt_bytes(host)} available.", source=path,
        fix="the memory plan above lists changes that fit; --dry_run compiles it without "
            "allocating")
  return Run(config, path, args, report, ckpt, train_tokens, eval_tokens, built, train_step,
             total)


def _tokens(source: np.ndarray | sft.Examples) -> int:
  return len(source.ids) if isinstance(source, sft.Examples) else len(source)


def restore_or_init(run: Run) -> zerojax.TrainState:
  """The newest intact checkpoint of the workdir, else the HF weights, else a fresh init.

  A damaged checkpoint is reported and skipped; a config that contradicts the one it was
  saved with is a CheckpointError (exit 2); a restore that failed otherwise (out of memory,
  an I/O error) is a RestoreError (exit 8), and no checkpoint is moved.
  """
  c, report, ckpt, built = run.config, run.report, run.ckpt, run.built
  restored = ckpt.restore_latest(built.plan, config=c) if ckpt else None
  if restored:
    state, meta = restored
    report(f"resumed from {ckpt.directory}/{meta['step']}", step=meta["step"], resumed=True)
    if c.init_from:
      report(f"init_from {c.init_from} ignored: the checkpoint takes precedence")
    return state
  params = None
  if c.init_from:  # Each device reads only its own shards of the HF weights.
    params = hf.load_params(c.init_from, built.plan)
    report(f"initialized from {c.init_from}", init_from=c.init_from)
  return zerojax.init_state(built.plan, built.model.init, built.tx, jax.random.key(c.seed),
                            built.loss_scaling, params=params)


def train_loop(run: Run, state: zerojax.TrainState, dog: watchdog.Watchdog,
               stop: preemption.StopSignal) -> int:
  """Steps from `state.step` to `train.steps`: logs, evaluations, checkpoints, stops (on
  `stop`'s SIGTERM / SIGINT: save at the end of this step, exit); each marked on the hang
  watchdog `dog`.

  Returns:
    `exits.DONE` after the last step, `exits.STOPPED` when a signal or --stop_after
    stopped it early (saved first, when there is a workdir).
  """
  c, t, report, ckpt, args = run.config, run.config.train, run.report, run.ckpt, run.args
  model, loss_scaling = run.built.model, run.built.loss_scaling
  run_meta = {"config": c.to_dict()}
  start = int(state.step)  # The data position: batches are a pure function of the step.
  meet_timeout = c.distributed.initialization_timeout
  eval_step = distributed.together(zerojax.make_eval_step(run.built.plan, model.loss),
                                   "eval step", meet_timeout)
  rows = data.process_rows(t.global_batch_size)

  def batch(source, step, seed):
    # Each process reads only its own rows of the global batch.
    if isinstance(source, sft.Examples):
      local = sft.batch_at(source, step, t.global_batch_size, seed, rows=rows)
    else:
      local = {"tokens": data.batch_at(source, step, t.global_batch_size, t.seq_len, seed,
                                       rows=rows)}
    return data.global_batch(local, run.built.batch_sharding)

  # A fixed held-out set: the same batches at every evaluation, drawn with another seed.
  eval_set = [batch(run.eval_tokens, i, c.seed + 1) for i in range(t.eval_batches)]

  def evaluate(step: int) -> float:
    # float() waits for each batch: one program with collectives in flight at a time.
    loss = float(np.mean([float(eval_step(state.params, b)["loss"]) for b in eval_set]))
    extra = {}
    if t.eval_exact_match:  # Greedy decoding, the same answers on every process: KV-cached
      # on the params as the plan shards them; a model without a cache (MlpLM) uncached,
      # on whole params gathered from every process.
      cached = hasattr(model, "extend")
      params = state.params if cached else multihost_utils.process_allgather(state.params,
                                                                             tiled=True)
      extra["exact_match"] = generate.exact_match(model if cached else model.logits, params,
                                                  run.eval_tokens, t.eval_exact_match,
                                                  plan=run.built.plan)
    report(f"step {step:6d}  eval_loss {loss:.4f}"
           + "".join(f"  {k} {v:.3f}" for k, v in extra.items()),
           step=step, eval_loss=loss, **extra)
    return loss

  def check_skips(step, m):
    m = {k: float(m[k]) for k in ("skipped", "consecutive_skips", "loss_scale")}
    line = precision.check_skips(step, m, c.precision.max_consecutive_skips, loss_scaling,
                                 release=c.optimizer.release)
    if line:
      report(line, step=step, skipped=True, loss_scale=m["loss_scale"])

  # A resumed run's first held-out loss was logged before the stop when eval_every
  # divides its step (evaluation comes before the save): not again, no step twice.
  resumed_at_eval = start and t.eval_every and start % t.eval_every == 0
  eval_loss = None if resumed_at_eval else evaluate(start)
  report(step=start, compiled_memory=run.compiled_memory)
  tokens_per_step = t.global_batch_size * t.seq_len
  peak = metrics.peak_flops(jax.devices()[0], t.peak_flops) * jax.device_count()
  speed = metrics.Throughput(t.steps, tokens_per_step, model.flops_per_token(t.seq_len), peak)
  previous = None
  report.start_bar(t.steps)
  saved = False  # The first save's start-up is not timed.
  distributed.meet("train step", meet_timeout)  # Compiled in setup, not yet run.
  for step in range(start + 1, t.steps + 1):
    dog.mark(f"step {step} (data, dispatch, or waiting on the device)", step=True)
    watchdog.test_stall(jax.process_index(), step)
    # state.step counts steps already taken, so the batch of update `step` is step - 1.
    state, m = run.train_step(state, batch(run.train_tokens, step - 1, c.seed))
    speed.step(step)
    # Skips are checked one step late, so reading them never stalls the device queue.
    if previous:
      check_skips(*previous)
    previous = (step, m)
    if step % t.log_every == 0 or step in (1, t.steps):
      m = {k: float(v) for k, v in jax.device_get(m).items()}  # Waits for the step.
      rates = speed.report(step)
      line = metrics.progress_line(step, t.steps, m, rates)
      report(line, step=step, **m, **rates, **metrics.device_memory())
      report.advance(step, {**m, **rates})
    else:
      report.advance(step)
    if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
      dog.mark(f"evaluation at step {step}")
      eval_loss = evaluate(step)
    if ckpt:
      dog.mark(f"checkpoint save at step {step}", watched=saved)
      # Async: training goes on while it writes.
      saved = ckpt.maybe_save(step, state, run_meta) or saved
    # --stop_after: exactly like a SIGTERM. After the last step, done is done.
    if step < t.steps and (stop(step) or step == args.stop_after):
      dog.close()  # The stop's save waits for its write: not a hang.
      if ckpt:
        ckpt.save(step, state, run_meta)  # No-op if maybe_save just saved this step.
        ckpt.close()  # Waits for the write to commit.
      stop.close()
      report.stop_bar()
      why = (f"signal {stop.received.name}" if stop.received else "--stop_after"
             if step == args.stop_after else "a preemption notice (SIGTERM, multi-process)")
      report(f"stopped by {why} after step {step}: "
             + ("saved; the same command resumes" if ckpt else "no workdir, nothing saved"),
             step=step, stopped=True)
      return exits.STOPPED
  stop.close()
  dog.close()
  if ckpt:
    ckpt.save(t.steps, state, run_meta)  # The final state (no-op if already saved).
    ckpt.close()
  check_skips(*previous)
  report.stop_bar()
  report(f"done: {t.steps} steps  final train loss {m['loss']:.4f}  final eval loss "
         f"{eval_loss:.4f}", step=t.steps, final_train_loss=m["loss"],
         final_eval_loss=eval_loss)
  return exits.DONE


@exit_on_config_error
def train(argv: list[str], cleanup: contextlib.ExitStack) -> int:
  """The run: setup, then a dry run's exit, or the restored state trained to train.steps."""
  run = setup(argv, cleanup)
  if run.args.dry_run:
    return exits.DONE
  state = restore_or_init(run)
  c, start = run.config, int(state.step)
  if start >= c.train.steps:  # Nothing to train, and so nothing to save.
    run.report(f"done: already at step {start} of {c.train.steps}" if start == c.train.steps
               else f"done: checkpoint {run.ckpt.directory}/{start} is past train.steps="
               f"{c.train.steps}: nothing to train or save (a larger --config.train.steps "
               "trains on)", step=start)
    return exits.DONE
  check_stop_after(run.args.stop_after, start, c.train.steps)
  if c.workdir and jax.process_index() == 0:  # The run is accepted: its config is this.
    with open(os.path.join(c.workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))
  # TensorBoard and W&B from here: a refused or finished run leaves their runs untouched.
  # An error unwinding through here closes them as failed (W&B shows the run failed).
  cleanup.push(lambda error, *_: run.report.close(failed=error is not None))
  run.report.open_writers(c, start)
  # A process that stops making progress ends the run with its stacks (exit 7); closed on
  # every way out (an in-process caller's error must not leave it running).
  dog = watchdog.Watchdog(c.train.step_timeout, jax.process_index())
  cleanup.callback(dog.close)
  # The signal handlers go back on every way out too: a run that ended in an error (exit
  # 3, 6, ...) left an in-process caller's SIGTERM handled by a dead run.
  stop = preemption.StopSignal()
  cleanup.callback(stop.close)
  return train_loop(run, state, dog, stop)


def main(argv: list[str] | None = None) -> int:
  """`train` with each error turned into its line and exit status (zerojax/runtime/exits.py).

  Args:
    argv: the command line after the program's name (default: sys.argv[1:]).
  """
  argv = sys.argv[1:] if argv is None else argv
  try:
    # A lost peer ends the run (one line, exits.PEER_LOST) before the cleanup, which could
    # wait on it forever.
    with contextlib.ExitStack() as cleanup, peers.exit_on_lost_peer():
      return train(argv, cleanup)
  except precision.NonFiniteError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return exits.NON_FINITE
  except checkpoint.SaveError as e:  # Disk full, no permission: the line says which.
    print(f"error: {e}", file=sys.stderr, flush=True)
    return exits.SAVE_FAILED
  except checkpoint.RestoreError as e:  # Out of memory, an I/O error: nothing was moved.
    print(f"error: {e}", file=sys.stderr, flush=True)
    return exits.RESTORE_FAILED
  except (data.DataError, checkpoint.CheckpointError, hf.HFError,
          workdir.WorkdirInUse) as e:  # Like a bad config: exit 2.
    # The message, no traceback.
    print(f"error: {e}", file=sys.stderr, flush=True)
    return exits.BAD_INPUT


if __name__ == "__main__":
  sys.exit(main())
