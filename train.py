"""Trains a language model with ZeRO: the one trainer, built only from library calls.

    python train.py                                    # configs/tiny.py, under a minute on CPU
    python train.py --config configs/tiny.py --config.zero.stage=2 --config.train.steps=50
    python train.py --config configs/tiny.py --dry_run # build and compile, run no step

Prints a header (devices, mesh, stage, parameters, state bytes per device), one line
every train.log_every steps, the held-out loss every train.eval_every steps (0: only
at the end) and a summary. With `workdir` set, process 0 also appends every line's
numbers to <workdir>/metrics.jsonl.
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import zerojax
from zerojax import data, optim, precision
from zerojax.config import exit_on_config_error, load_config, parse_argv
from zerojax.mesh import mesh_from_config
from zerojax.models.mlp_lm import MlpLM

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny.py")


def log(workdir: str, text: str | None, **record) -> None:
  """Prints `text` and appends `record` to metrics.jsonl, on process 0 only."""
  if jax.process_index() != 0:
    return
  if text is not None:
    print(text, flush=True)
  if workdir and record:
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")


def bytes_per_device(tree) -> int:
  """The most bytes any local device holds of `tree`'s arrays (their addressable shards)."""
  per_device = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


@exit_on_config_error
def main(argv: list[str]) -> int:
  path, overrides, rest = parse_argv(argv, default=DEFAULT_CONFIG)
  parser = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n")[0])
  parser.add_argument("--dry_run", action="store_true", help="build and compile, run no step")
  args = parser.parse_args(rest)
  # Every config mistake surfaces here, before anything touches a device.
  config = load_config(path, overrides, num_devices=jax.device_count())
  c, t = config, config.train
  if c.workdir and jax.process_index() == 0:
    os.makedirs(c.workdir, exist_ok=True)

  # Every data mistake surfaces here too, before the model is built or compiled.
  train_tokens, eval_tokens = data.load_tokens(c.data, c.model.vocab_size, t.seq_len,
                                               cache_dir=c.workdir)
  mesh = mesh_from_config(c)
  model = MlpLM(vocab_size=c.model.vocab_size, d_model=c.model.d_model, d_ff=c.model.d_ff,
                n_layers=c.model.n_layers, context=c.model.context, remat=c.model.remat,
                param_dtype=jnp.dtype(c.precision.param_dtype),
                compute_dtype=jnp.dtype(c.precision.compute_dtype))
  tx, schedule = optim.optimizer_from_config(
      c.optimizer, t.steps, mask=optim.decay_mask(model.logical_axes()), seed=c.seed)
  loss_scaling = precision.loss_scaling_from_config(c.precision)
  key = jax.random.key(c.seed)
  plan = zerojax.make_plan(mesh, c.zero.stage, jax.eval_shape(model.init, key), tx,
                           logical_axes=model.logical_axes(),
                           min_shard_size=c.zero.min_shard_size)
  state = zerojax.init_state(plan, model.init, tx, key, loss_scaling)
  train_step = zerojax.make_train_step(
      plan, model.loss, tx, microbatches=t.microbatches, max_grad_norm=c.optimizer.grad_clip,
      learning_rate=schedule, reduce_dtype=c.precision.reduce_dtype,
      accum_dtype=c.precision.accum_dtype, loss_scaling=loss_scaling)
  batch_sharding = NamedSharding(mesh, plan.batch_spec)
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

  # Compile ahead of time, so a dry run checks the whole step and tokens/s excludes it.
  start = time.perf_counter()
  train_step = train_step.lower(state, batch(train_tokens, 0, c.seed)).compile()
  compile_s = time.perf_counter() - start

  n_params = sum(x.size for x in jax.tree.leaves(plan.params))
  param_b, opt_b = bytes_per_device(state.params), bytes_per_device(state.opt_state)
  shape = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
  log(c.workdir, f"devices {jax.device_count()} ({jax.default_backend()})  mesh {shape}  "
      f"stage {c.zero.stage}  params {n_params / 1e6:.2f}M  state/device "
      f"{(param_b + opt_b) / 2**20:.2f} MiB (params {param_b / 2**20:.2f} + opt {opt_b / 2**20:.2f})"
      f"  tokens {len(train_tokens) / 1e6:.1f}M+{len(eval_tokens) / 1e6:.2f}M  "
      f"compile {compile_s:.1f}s", devices=jax.device_count(), mesh=dict(mesh.shape),
      stage=c.zero.stage, params=n_params, param_bytes_per_device=param_b,
      opt_bytes_per_device=opt_b)
  if args.dry_run:
    return 0

  eval_loss = evaluate()
  log(c.workdir, f"step {0:5d}  eval_loss {eval_loss:.4f}", step=0, eval_loss=eval_loss)
  tick, tokens_seen, previous = time.perf_counter(), 0, None

  def check_skips(step, metrics):
    m = {k: float(metrics[k]) for k in ("skipped", "consecutive_skips", "loss_scale")}
    line = precision.check_skips(step, m, c.precision.max_consecutive_skips)
    if line:
      log(c.workdir, line, step=step, skipped=True, loss_scale=m["loss_scale"])

  for step in range(1, t.steps + 1):
    # state.step counts steps already taken, so the batch of update `step` is step - 1.
    state, metrics = train_step(state, batch(train_tokens, step - 1, c.seed))
    tokens_seen += t.global_batch_size * t.seq_len
    # Skips are checked one step late, so reading them never stalls the device queue.
    if previous:
      check_skips(*previous)
    previous = (step, metrics)
    if step % t.log_every == 0 or step in (1, t.steps):
      m = {k: float(v) for k, v in jax.device_get(metrics).items()}  # Waits for the step.
      now = time.perf_counter()
      rate, tick, tokens_seen = tokens_seen / (now - tick), now, 0
      log(c.workdir, f"step {step:5d}  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}  "
          f"lr {m['learning_rate']:.2e}  tokens/s {rate:,.0f}", step=step, loss=m["loss"],
          grad_norm=m["grad_norm"], learning_rate=m["learning_rate"], tokens_per_s=rate)
    if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
      eval_loss = evaluate()
      log(c.workdir, f"step {step:5d}  eval_loss {eval_loss:.4f}", step=step, eval_loss=eval_loss)
  check_skips(*previous)
  log(c.workdir, f"done: {t.steps} steps  final train loss {m['loss']:.4f}  "
      f"final eval loss {eval_loss:.4f}", step=t.steps, final_train_loss=m["loss"],
      final_eval_loss=eval_loss)
  return 0


def run(argv: list[str]) -> int:
  try:
    return main(argv)
  except precision.NonFiniteError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 3
  except data.DataError as e:  # Bad data, like a bad config: the message, no traceback.
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
  sys.exit(run(sys.argv[1:]))
