"""Trains a language model with ZeRO: the one trainer, built only from library calls.

    python train.py                                     # configs/tiny.py on CPU, a few minutes
    python train.py --config configs/tiny.py --config.zero.stage=2 --workdir runs/x
    python train.py --config configs/70b_bf16.py --dry_run --fake_devices 64

At start it prints the resolved config (saved as <workdir>/config.json), the mesh, the
parameter count and the compiled per-device memory of the step; then a progress line
every train.log_every steps (loss, tokens/s, MFU where the device's peak is known, ETA)
and the held-out loss every train.eval_every steps. `--dry_run` compiles the step from
abstract inputs (nothing is allocated, so a 70B config works on a laptop with
`--fake_devices`) and exits. Bad command line, config or data: one `error:` line, exit
status 2, before the config is printed; on CPU a step larger than the host's free memory
is refused the same way before anything is allocated (not in a dry run). Several
processes (README, Multi-host): the same command on each; exit status 4 if they do not
all join within distributed.initialization_timeout.
"""

import contextlib
import os
import sys
import time

import jax
import numpy as np

import zerojax
from zerojax import (checkpoint, data, distributed, memory, memory_report, metrics,
                     precision)
from zerojax.build import build, compile_step
from zerojax.config import (ArgumentParser, ConfigError, exit_on_config_error, load_config,
                            parse_argv)
from zerojax.devices import fake_cpu_devices
from zerojax.mesh import processes_per_group
from zerojax.models import hf

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny.py")


@exit_on_config_error
def main(argv: list[str], cleanup: contextlib.ExitStack) -> int:
  path, overrides, rest = parse_argv(argv, default=DEFAULT_CONFIG)
  parser = ArgumentParser(prog="train.py", description=__doc__.split("\n")[0])
  parser.add_argument("--dry_run", action="store_true",
                      help="compile the step from abstract inputs, report memory, train nothing")
  parser.add_argument("--fake_devices", type=int, default=0,
                      help="run on this many fake CPU devices (set before JAX starts a backend)")
  parser.add_argument("--workdir", default=None, help="overrides config.workdir")
  parser.add_argument("--stop_after", type=int, default=None, metavar="STEP",
                      help="after this step, save and exit as on SIGTERM (a preemption "
                           "drill; the same command without it resumes)")
  args = parser.parse_args(rest)
  if args.fake_devices < 0:
    parser.error(f"argument --fake_devices: {args.fake_devices} is not a number of devices")
  if args.fake_devices:  # XLA reads its flags when JAX starts a backend: nothing has yet.
    # With the memory-optimized scheduler, and no hoisting of whole-stack f32 copies out
    # of the layer loop (DESIGN.md), so the CPU's numbers resemble a GPU's.
    fake_cpu_devices(args.fake_devices)
  if args.workdir is not None:
    overrides = [*overrides, f"workdir={args.workdir}"]
  # Every config mistake surfaces here, before anything touches a device; then this
  # process joins the others of a multi-host run (zerojax.distributed: config keys, env,
  # SLURM / Open MPI; none = one process; exit 4 if they do not all join in time), and
  # only then are the mesh and batch checked against the devices of all processes.
  distributed.initialize(load_config(path, overrides).distributed)
  config = load_config(path, overrides, num_devices=jax.device_count())
  c, t = config, config.train
  report = metrics.Reporter(c.workdir)
  if c.workdir and jax.process_index() == 0:
    with open(os.path.join(c.workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  if c.init_from:  # A model section that contradicts its config.json: HFError, exit 2.
    hf.check_config(c.init_from, c.model)
  # Checkpoints in <workdir>/checkpoints; a config that contradicts the newest one is an
  # error now, before anything is compiled (CheckpointError: exit 2).
  ckpt, run_meta = None, {"config": config.to_dict()}
  if c.workdir:
    k = c.checkpoint
    # Closed on every way out (an error too): saves in flight finish, orbax's threads stop.
    ckpt = cleanup.enter_context(checkpoint.Checkpointer(
        os.path.join(c.workdir, "checkpoints"), save_every_steps=k.every_steps,
        save_every_minutes=k.every_minutes, keep=k.keep, keep_every=k.keep_every,
        async_save=k.async_save, log=report))
    ckpt.check_config(config)

  # Every data mistake surfaces here too, before the model is built or compiled.
  train_tokens, eval_tokens = data.load_tokens(c.data, c.model.vocab_size, t.seq_len,
                                               cache_dir=c.workdir)
  # Printed once the config and data are known good, so an error is the first thing shown.
  report(f"config {path} {' '.join(overrides)}\n{config}")
  warning = hf.seq_len_warning(c.init_from, t.seq_len) if c.init_from else None
  if warning:
    report(warning)
  # The mesh, model, optimizer, ZeRO plan and jitted step (the memory planner compiles
  # the same ones: zerojax.build).
  built = build(config)
  mesh, model, tx, schedule, loss_scaling, plan, train_step, batch_sharding = built[:8]
  key = jax.random.key(c.seed)

  # Compiled from abstract inputs: the memory is known before anything is allocated.
  start = time.perf_counter()
  # The loop runs this same executable: one compile.
  train_step, mem = compile_step(built)
  del mem["seconds"]
  n_params = sum(x.size for x in jax.tree.leaves(plan.params))
  shape = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
  total = mem["arguments"] + mem["temporaries"]
  if jax.process_count() > 1:  # Hybrid (fsdp inside a host) or not.
    span = processes_per_group(mesh, "fsdp")
    shape += (f" (fsdp spans {span} processes)" if span > 1 else
              " (fsdp inside each process: hybrid)")
  report(f"devices {jax.device_count()} ({jax.devices()[0].device_kind})  "
         f"processes {jax.process_count()}  mesh {shape}  "
         f"stage {c.zero.stage}  params {n_params / 1e6:,.2f}M  "
         f"tokens {len(train_tokens) / 1e6:.1f}M+{len(eval_tokens) / 1e6:.2f}M\n"
         f"per-device memory (compiled): arguments {metrics.fmt_bytes(mem['arguments'])} + "
         f"temporaries {metrics.fmt_bytes(mem['temporaries'])} = {metrics.fmt_bytes(total)}  "
         f"(compile {time.perf_counter() - start:.1f}s)",
         devices=jax.device_count(), processes=jax.process_count(), mesh=dict(mesh.shape), stage=c.zero.stage,
         params=n_params, memory=mem)
  # CPU devices share the host's memory: a step that does not fit would swap, ignore
  # Ctrl-C while it allocates, then meet the OOM killer. A dry run allocates nothing.
  host = (memory_report.host_memory_available()
          if jax.devices()[0].platform == "cpu" and not args.dry_run else 0)
  # The memory planner's estimate beside the compiled numbers, and a verdict where the
  # device (or, on CPU, the host) says how much memory it has (python -m zerojax.memory
  # explains the rows).
  estimate = memory.estimate(config, jax.device_count(),
                             host // jax.local_device_count() if host else
                             memory_report.device_memory(jax.devices()[0]))
  found = memory.suggestions(estimate.setup, device_memory=estimate.device_memory)
  report("\n".join(filter(None, [memory_report.format_table(estimate, mem, title=path),
                                 memory_report.format_suggestions(estimate, found)])),
         memory_estimate=estimate.total)
  if args.dry_run:
    return 0
  if host and total * jax.local_device_count() > host:
    raise ConfigError(
        f"the step needs {metrics.fmt_bytes(total * jax.local_device_count())} of host memory "
        f"({metrics.fmt_bytes(total)} compiled per device x {jax.local_device_count()} CPU "
        f"devices), {metrics.fmt_bytes(host)} available.", source=path,
        fix="the memory plan above lists changes that fit; --dry_run compiles it without "
            "allocating")

  # Resume from the newest intact checkpoint in the workdir, if any (a damaged one is
  # reported and skipped); a config that contradicts it is a CheckpointError (exit 2).
  restored = ckpt.restore_latest(plan, config=config) if ckpt else None
  if restored:
    state, meta = restored
    report(f"resumed from {ckpt.directory}/{meta['step']}", step=meta["step"], resumed=True)
    if c.init_from:
      report(f"init_from {c.init_from} ignored: the checkpoint takes precedence")
  else:
    params = None
    if c.init_from:  # Each device reads only its own shards of the HF weights.
      params = hf.load_params(c.init_from, plan)
      report(f"initialized from {c.init_from}", init_from=c.init_from)
    state = zerojax.init_state(plan, model.init, tx, key, loss_scaling, params=params)
  start = int(state.step)  # The data position: batches are a pure function of the step.
  stop = checkpoint.StopSignal()  # SIGTERM / SIGINT: save at the end of this step, exit.
  eval_step = zerojax.make_eval_step(plan, model.loss)
  rows = data.process_rows(t.global_batch_size)

  def batch(source, step, seed):
    # Each process reads only its own rows of the global batch.
    local = {"tokens": data.batch_at(source, step, t.global_batch_size, t.seq_len, seed,
                                     rows=rows)}
    return data.global_batch(local, batch_sharding)

  # A fixed held-out set: the same batches at every evaluation, drawn with another seed.
  eval_set = [batch(eval_tokens, i, c.seed + 1) for i in range(t.eval_batches)]

  def evaluate() -> float:
    # float() waits for each batch: one program with collectives in flight at a time.
    return float(np.mean([float(eval_step(state.params, b)["loss"]) for b in eval_set]))

  def check_skips(step, m):
    m = {k: float(m[k]) for k in ("skipped", "consecutive_skips", "loss_scale")}
    line = precision.check_skips(step, m, c.precision.max_consecutive_skips, loss_scaling)
    if line:
      report(line, step=step, skipped=True, loss_scale=m["loss_scale"])

  eval_loss = evaluate()
  report(f"step {start:6d}  eval_loss {eval_loss:.4f}", step=start, eval_loss=eval_loss)
  tokens_per_step = t.global_batch_size * t.seq_len
  peak = metrics.peak_flops(jax.devices()[0], t.peak_flops) * jax.device_count()
  speed = metrics.Throughput(t.steps, tokens_per_step, model.flops_per_token(t.seq_len), peak)
  previous = None
  report.start_bar(t.steps)
  for step in range(start + 1, t.steps + 1):
    # state.step counts steps already taken, so the batch of update `step` is step - 1.
    state, m = train_step(state, batch(train_tokens, step - 1, c.seed))
    speed.step(step)
    # Skips are checked one step late, so reading them never stalls the device queue.
    if previous:
      check_skips(*previous)
    previous = (step, m)
    if step % t.log_every == 0 or step in (1, t.steps):
      m = {k: float(v) for k, v in jax.device_get(m).items()}  # Waits for the step.
      rates = speed.report(step)
      line = metrics.progress_line(step, t.steps, m, rates)
      report(line, step=step, **m, **rates)
      report.advance(step, line.split("  ", 1)[1])
    else:
      report.advance(step)
    if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
      eval_loss = evaluate()
      report(f"step {step:6d}  eval_loss {eval_loss:.4f}", step=step, eval_loss=eval_loss)
    if ckpt:
      ckpt.maybe_save(step, state, run_meta)  # Async: training goes on while it writes.
    if stop(step) or step == args.stop_after:  # --stop_after: exactly like a SIGTERM.
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
      return 0
  stop.close()
  if ckpt:
    ckpt.save(t.steps, state, run_meta)  # The final state (no-op if already saved).
    ckpt.close()
  if previous is None:
    report(f"done: already at step {start} of {t.steps}", step=start)
    return 0
  check_skips(*previous)
  report.stop_bar()
  report(f"done: {t.steps} steps  final train loss {m['loss']:.4f}  final eval loss "
         f"{eval_loss:.4f}", step=t.steps, final_train_loss=m["loss"],
         final_eval_loss=eval_loss)
  return 0


def run(argv: list[str]) -> int:
  try:
    with contextlib.ExitStack() as cleanup:
      return main(argv, cleanup)
  except precision.NonFiniteError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 3
  except (data.DataError, checkpoint.CheckpointError, hf.HFError) as e:  # Like a bad config: exit 2.
    # The message, no traceback.
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
  sys.exit(run(sys.argv[1:]))
