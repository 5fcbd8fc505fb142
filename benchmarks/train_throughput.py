"""Tokens/s of configs/tiny.py through zerojax's train step vs a plain Flax + optax loop.

    python benchmarks/train_throughput.py            # ~3.5 minutes on 2 CPU cores
    python benchmarks/train_throughput.py --quick    # 4 rounds, no 8-device part, ~1 minute
    python benchmarks/train_throughput.py --ablate   # + where the time goes, ~8 minutes

The model, optimizer, schedule, clipping, batch and data are configs/tiny.py's (Llama,
bf16 params and compute, Kahan AdamW with bf16 moments, clip 1.0). zerojax's step is
built as train.py builds it (`make_plan` / `init_state` / `make_train_step`); the
baseline is the loop a Flax user writes: `jax.jit` of `jax.value_and_grad(model.loss)`,
`tx.update`, `optax.apply_updates`, state donated, where `tx` is the *same* optimizer
(zerojax's Kahan AdamW, bf16 moments) after `optax.clip_by_global_norm`: both loops then
do the same update on state of the same dtypes, and the ratio is the cost of the step
itself (`optax.adamw`, bf16 moments and no Kahan buffer, is timed for reference). All
steps run in one process, interleaved one step at a time (each waited for); a round is
`--steps` steps of every variant, the tokens/s ratio is taken per round and its median
reported. At 8 fake CPU devices (a subprocess) the baseline is GSPMD data parallelism.
With `--ablate`, rows add or remove one of zerojax's extras at a time, to show where the
time goes. Prints a markdown table, writes benchmarks/results/train_throughput.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--quick", action="store_true", help="4 rounds, no 8-device part")
ARGS.add_argument("--ablate", action="store_true", help="add the ablation rows")
ARGS.add_argument("--rounds", type=int, default=0, help="timed rounds (default 8; quick 4)")
ARGS.add_argument("--steps", type=int, default=4, help="steps per variant per round")
ARGS.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
args = ARGS.parse_args()
args.rounds = args.rounds or (4 if args.quick else 8)

# pylint: disable=wrong-import-position
from zerojax.runtime.devices import fake_cpu_devices

fake_cpu_devices(args.devices, memory_flags=False)  # Before JAX starts a backend.

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax import data, models, optim
from zerojax.config import load_config
from zerojax.optim import precision
from zerojax.testing import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "train_throughput.json")
C = load_config(os.path.join(ROOT, "configs", "tiny.py"), [], num_devices=args.devices)
T = C.train
MODEL = models.from_config(C)
TX, SCHEDULE = optim.optimizer_from_config(
    C.optimizer, T.steps, mask=optim.decay_mask(MODEL.logical_axes()), seed=C.seed)
O, CLIP = C.optimizer, C.optimizer.grad_clip
OPTAX_ADAMW = optax.adamw(SCHEDULE, O.b1, O.b2, O.eps, O.weight_decay,
                          mask=optim.decay_mask(MODEL.logical_axes()))
KEY = jax.random.key(C.seed)
MESH = zerojax.make_mesh(data=1, fsdp=-1)
TRAIN, _ = data.load_tokens(C.data, C.model.vocab_size, T.seq_len)


def zerojax_step(stage, **kw):
  """(step, state) exactly as train.py builds them (kw: make_train_step overrides)."""
  plan = zerojax.make_plan(MESH, stage, jax.eval_shape(MODEL.init, KEY), TX,
                           logical_axes=MODEL.logical_axes(),
                           min_shard_size=C.zero.min_shard_size)
  kw = dict(dict(microbatches=T.microbatches, max_grad_norm=CLIP, learning_rate=SCHEDULE,
                 reduce_dtype=C.precision.reduce_dtype, accum_dtype=C.precision.accum_dtype,
                 loss_scaling=precision.loss_scaling_from_config(C.precision)), **kw)
  step = zerojax.make_train_step(plan, MODEL.loss, TX, **kw)
  return step, zerojax.init_state(plan, MODEL.init, TX, KEY)


def plain_step(tx, *, f32_grads=False, finite_check=False):
  """The hand-written loop: replicated params and state, GSPMD over the batch.

  The flags add one zerojax extra each (ablations): differentiate w.r.t. the params
  cast to fp32 (fp32 gradients), and skip the update unless every gradient is finite.
  """
  def step(state, batch):
    params, opt_state = state
    if f32_grads:
      p32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
      loss, grads = jax.value_and_grad(
          lambda p: MODEL.loss(jax.tree.map(lambda q, o: q.astype(o.dtype), p, params),
                               batch))(p32)
    else:
      loss, grads = jax.value_and_grad(MODEL.loss)(params, batch)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if finite_check:
      ok = precision.all_finite(grads)
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
      new_params, new_opt = keep(new_params, params), keep(new_opt, opt_state)
    return (new_params, new_opt), loss

  rep = NamedSharding(MESH, P())
  params = jax.jit(MODEL.init, out_shardings=rep)(KEY)
  state = (params, jax.jit(tx.init, out_shardings=rep)(params))
  return jax.jit(step, donate_argnums=(0,), out_shardings=(rep, rep)), state


def variants():
  clipped = lambda tx: optax.chain(optax.clip_by_global_norm(CLIP), tx)
  v = {"plain, zerojax Kahan AdamW": plain_step(clipped(TX))}
  if args.devices == 1:
    v["plain, optax.adamw"] = plain_step(clipped(OPTAX_ADAMW))
  v["zerojax stage 0"] = zerojax_step(0)
  v["zerojax stage 3"] = zerojax_step(3)
  if not args.ablate:
    return v
  v["zerojax stage 0, update_by_layer=False"] = zerojax_step(0, update_by_layer=False)
  if args.devices > 1:
    v["zerojax stage 1"], v["zerojax stage 2"] = zerojax_step(1), zerojax_step(2)
  else:  # One extra at a time, on either side.
    v["plain + fp32 grads"] = plain_step(clipped(TX), f32_grads=True)
    v["plain + finite check"] = plain_step(clipped(TX), finite_check=True)
    v["zerojax stage 0, no clipping"] = zerojax_step(0, max_grad_norm=0.0)
    v["plain, no clipping"] = plain_step(TX)
  return v


def measure():
  batch_sharding = NamedSharding(MESH, P(("data", "fsdp")))
  batches = [jax.device_put({"tokens": data.batch_at(TRAIN, s, T.global_batch_size,
                                                      T.seq_len, C.seed)}, batch_sharding)
             for s in range(args.steps)]
  runs = variants()
  states = {}
  for name, (step, state) in runs.items():  # Compile and warm up: two steps each.
    start = time.perf_counter()
    for b in batches[:2]:
      state, out = step(state, b)
    jax.block_until_ready((state, out))
    states[name] = state
    print(f"  {name}: compiled + 2 steps in {time.perf_counter() - start:.1f}s", flush=True)
  # Interleaved step by step (A B C, A B C, ...), so load from other processes, which
  # drifts over seconds, falls on every variant of a round alike.
  times = {name: [] for name in runs}
  for _ in range(args.rounds):
    spent = dict.fromkeys(runs, 0.0)
    for b in batches:
      for name, (step, _) in runs.items():
        start = time.perf_counter()
        states[name], out = step(states[name], b)
        jax.block_until_ready((states[name], out))
        spent[name] += time.perf_counter() - start
    for name in runs:
      times[name].append(spent[name] / len(batches))
  return times


def rows(times, base):
  tokens = T.global_batch_size * T.seq_len
  out = []
  for name, ts in times.items():
    ratios = [b / t for b, t in zip(times[base], ts)]  # Throughput ratio per round.
    out.append(dict(devices=args.devices, step=name, ms=1e3 * statistics.median(ts),
                    tokens_per_s=tokens / statistics.median(ts),
                    ratio=statistics.median(ratios), lo=min(ratios), hi=max(ratios),
                    best_ratio=min(times[base]) / min(ts), ms_rounds=[1e3 * t for t in ts]))
  return out


def table(results):
  return markdown_table(
      ["devices", "step", "ms / step", "tokens/s", "tokens/s ratio to plain (median)", "range",
       "fastest-round ratio"],
      [[r["devices"], r["step"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['ratio']:.3f}",
        f"{r['lo']:.2f}-{r['hi']:.2f}", f"{r['best_ratio']:.3f}"] for r in results])


if __name__ == "__main__":
  print(f"{args.devices} device(s), {args.rounds} rounds x {args.steps} steps, "
        f"batch {T.global_batch_size} x {T.seq_len}", flush=True)
  results = rows(measure(), "plain, zerojax Kahan AdamW")
  if args.devices > 1:  # The child: hand the rows to the parent.
    print("ROWS " + json.dumps(results))
    sys.exit(0)
  if not args.quick:
    child = subprocess.run([sys.executable, __file__, "--devices", "8", "--steps",
                            str(args.steps), "--rounds", str(max(args.rounds // 2, 3))]
                           + ["--ablate"] * args.ablate,
                           capture_output=True, text=True, check=True)
    print(child.stdout.split("ROWS ")[0], end="")
    results += json.loads(child.stdout.split("ROWS ")[1])
  print(table(results))
  saved = {}  # One entry per mode: a --quick run does not erase the full one.
  if os.path.exists(OUT):
    with open(OUT) as f:
      saved = json.load(f)
  mode = "ablate" if args.ablate else "quick" if args.quick else "default"
  saved[mode] = dict(jax=jax.__version__, cpu_cores=os.cpu_count(), rounds=args.rounds,
                     steps=args.steps, load_avg=os.getloadavg(), results=results)
  with open(OUT, "w") as f:
    json.dump(saved, f, indent=1)
  print(f"wrote {os.path.relpath(OUT, ROOT)}")
