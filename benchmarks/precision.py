"""bf16 update rules vs fp32: the stall regime, and training the tiny model.

    python benchmarks/precision.py                 # ~2 minutes on 2 CPU cores
    python benchmarks/precision.py --seeds 3       # quality over 3 seeds, ~5-7 minutes
    python benchmarks/precision.py --only stall    # part 1 only, ~15 seconds
    python benchmarks/precision.py --only quality --lr 1e-3   # a lower peak rate
    python benchmarks/precision.py --only quality --llama     # tiny.py's Llama, ~8 min
    python benchmarks/precision.py --only quality --llama --recipes five   # issue 7's five
    python benchmarks/precision.py --replot        # every saved quality table and plot again

1. **Stall**: 4096 bf16 weights (|w| log-uniform in [0.02, 1], random signs), lr 1e-5,
   the same stream of small gradients for every run, 3000 jitted steps of AdamW and of
   Lion per update rule. Error ||p - p_fp32|| / ||p_fp32 - p_init|| after 300 and 3000
   steps, next to the best any bf16-stored result can do, bf16(p_fp32); then the
   effect of weight decay under each rule.
2. **Quality**: a small model trained for 300 steps on one device with each recipe,
   same init, data order and held-out set; final eval and train losses. By default
   the MLP language model of the first configs/tiny.py (pinned below as overrides of
   configs/base.py); `--llama` trains today's configs/tiny.py Llama, for 300 steps.

Prints markdown tables; writes benchmarks/results/precision.json (one entry per part
and quality variant, others kept) and the plots precision_stall.png and
precision_quality[_llama][_lr...].png there. A quality run with issue 7's five recipes
(fp32, bf16 + fp32 master, bf16 + Kahan, bf16 + stochastic rounding, plain bf16) also
prints their table with the goal (final held-out loss within 1% of fp32's) and plots
their loss curves, precision_quality[...]_curves.png. Needs matplotlib.
"""

import argparse
import functools
import json
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=ungrouped-imports

import zerojax
from zerojax import data, models, optim
from zerojax.config import load_config
from zerojax.testing import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CONFIG = lambda name: os.path.join(ROOT, "configs", name)
F32, BF16 = jnp.float32, jnp.bfloat16

# --- 1. The stall regime -------------------------------------------------------------

REF, BEST = "fp32 reference", "best bf16: bf16(p_fp32)"
STALL_RECIPES = [(REF, F32, F32, "nearest"),  # (name, param dtype, state dtype, rule)
                 ("nearest, bf16 state", BF16, BF16, "nearest"),
                 ("kahan, bf16 state", BF16, BF16, "kahan"),
                 ("kahan, fp32 state", BF16, F32, "kahan"),
                 ("stochastic, bf16 state", BF16, BF16, "stochastic"),
                 ("master, fp32 state", BF16, F32, "master")]
# b2 as in the schema (zerojax/config/schema.py): bf16 state cannot hold optax's default 0.999 (nu
# stops decaying).
OPTIMIZERS = {"AdamW": lambda **kw: optim.adamw(1e-5, b1=0.9, b2=0.95, **kw),
              "Lion": lambda **kw: optim.lion(1e-5, **kw)}
N, STEPS, SHORT = 4096, 3000, 300  # Weights, steps run, steps of the table.
CHECK = (SHORT, STEPS)
WEIGHT_DECAY = 0.1


def stall_problem(stream):
  """bf16-representable initial weights (as fp32) and the gradients, [STEPS, N] fp32."""
  rng = np.random.default_rng(0)
  w = np.exp(rng.uniform(np.log(0.02), 0.0, N)) * rng.choice([-1.0, 1.0], N)
  drift, noise = rng.standard_normal(N), rng.standard_normal((STEPS, N))
  g = {"drift": drift + noise, "noise": noise, "constant": drift + 0 * noise}[stream]
  return jnp.asarray(w, BF16).astype(F32), jnp.asarray(1e-3 * g, F32)


@functools.partial(jax.jit, static_argnums=0)
def run_stall(tx, p0, grads):
  """(every step's params as fp32 [steps, N], the final optimizer state)."""
  def step(carry, g):
    p, s = carry
    u, new = tx.update(g, s, p)
    new = jax.tree.map(lambda n, o: n.astype(o.dtype), new, s)  # As step.py does.
    p = optax.apply_updates(p, u)
    return (p, new), p.astype(F32)
  (_, state), traj = jax.lax.scan(step, (p0, tx.init(p0)), grads)
  return traj, state


def rel_error(p, ref, p0):
  """||p - p_fp32|| / ||p_fp32 - p_init|| over the last axis (per step)."""
  return np.asarray(jnp.linalg.norm(p - ref, axis=-1) / jnp.linalg.norm(ref - p0, axis=-1))


def stall(stream):
  p0, grads = stall_problem(stream)
  bf16 = lambda x: x.astype(BF16).astype(F32)
  out = {}
  for opt, make in OPTIMIZERS.items():
    runs = {(name, wd): run_stall(make(weight_decay=wd, state_dtype=sdt, update_rule=rule),
                                  p0.astype(pdt), grads)[0]
            for wd in (0.0, WEIGHT_DECAY) for name, pdt, sdt, rule in STALL_RECIPES}
    runs[BEST, 0.0], runs[BEST, WEIGHT_DECAY] = bf16(runs[REF, 0.0]), bf16(runs[REF, WEIGHT_DECAY])
    names = [n for n, *_ in STALL_RECIPES] + [BEST]
    curves = {n: rel_error(runs[n, 0.0], runs[REF, 0.0], p0) for n in names[1:]}
    # Kahan's params plus what its (bf16) buffer still holds: how much the buffer keeps.
    buffer = {}
    for t in CHECK:
      p, s = run_stall(make(state_dtype=BF16, update_rule="kahan"), p0.astype(BF16), grads[:t])
      buffer[t] = float(rel_error(p[-1] + s.compensation.astype(F32), runs[REF, 0.0][t - 1], p0))
    # Weight decay: ||p_wd - p_nowd|| and the L1 shrinkage it causes, each over fp32's.
    diff = lambda n, t: jnp.linalg.norm(runs[n, 0.0][t - 1] - runs[n, WEIGHT_DECAY][t - 1])
    shrink = lambda n, t: (jnp.abs(runs[n, 0.0][t - 1]).sum()
                           - jnp.abs(runs[n, WEIGHT_DECAY][t - 1]).sum())
    decay = {n: {t: (float(diff(n, t) / diff(REF, t)), float(shrink(n, t) / shrink(REF, t)))
                 for t in CHECK} for n in names}
    out[opt] = dict(curves=curves, kahan_p_plus_buffer=buffer, weight_decay=decay)
  return out


def report_stall(res, stream):
  opts = list(res)
  headers = ["recipe"] + [f"{o}, {t} steps" for t in CHECK for o in opts]
  rows = [[n] + [f"{res[o]['curves'][n][t - 1]:.3f}" for t in CHECK for o in opts]
          for n in res[opts[0]]["curves"]]
  rows.append(["(kahan, bf16 state: p + its bf16 buffer)"]
              + [f"{res[o]['kahan_p_plus_buffer'][t]:.3f}" for t in CHECK for o in opts])
  table(f"Stall: ||p - p_fp32|| / ||p_fp32 - p_init|| ({stream} stream)", headers, rows)
  table(f"Weight decay {WEIGHT_DECAY} vs 0: ||p_wd - p_nowd|| / fp32's, L1 shrinkage / fp32's",
        headers, [[n] + ["{:.2f} / {:.2f}".format(*res[o]["weight_decay"][n][t])
                         for t in CHECK for o in opts] for n in res[opts[0]]["weight_decay"]])
  # Curves that coincide (kahan bf16/fp32 state, master/best bf16) are drawn thick under thin.
  styles = [dict(color="C0"), dict(color="C1", lw=4, alpha=0.45),
            dict(color="C2", lw=1.2, ls="--"), dict(color="C3"),
            dict(color="C4", lw=4, alpha=0.45), dict(color="k", lw=1.2, ls=":")]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  for ax, (opt, r) in zip(axes, res.items()):
    for (name, curve), style in zip(r["curves"].items(), styles):
      ax.plot(np.arange(1, STEPS + 1), curve, label=name, **style)
    ax.axvline(SHORT, color="grey", lw=0.8, ls=":")
    ax.text(SHORT * 1.05, 5, f"{SHORT} steps", color="grey", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="step", title=f"{opt}, lr 1e-5, bf16 params")
  axes[0].set_ylabel("||p - p_fp32|| / ||p_fp32 - p_init||")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(RESULTS, "precision_stall.png"), dpi=110)
  return {o: dict(r, curves={n: [float(f"{x:.4g}") for x in c[49::50]]
                             for n, c in r["curves"].items()},
                  error={n: {t: float(c[t - 1]) for t in CHECK} for n, c in r["curves"].items()})
          for o, r in res.items()}  # Curves every 50 steps (steps 50, 100, ...).


# --- 2. Training quality -------------------------------------------------------------

FP32 = ["precision.param_dtype=float32", "optimizer.state_dtype=float32",
        "optimizer.update_rule=nearest"]
BF16_RUN = ["precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16"]
_opt = lambda rule, state: [f"optimizer.update_rule={rule}", f"optimizer.state_dtype={state}"]
# configs/tiny.py as it was when the issue asked for this (an MLP LM, ~10 s per run).
MLP = ("base.py", ["model.name=mlp_lm", "model.d_model=64", "model.d_ff=256",
                   "model.n_layers=2", "model.context=8", "model.remat=dots",
                   "train.seq_len=64", "train.steps=300", "train.global_batch_size=16",
                   "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=20"])
LLAMA = ("tiny.py", ["train.steps=300"])
QUALITY_RECIPES = {  # Overrides after MLP's or LLAMA's.
    "fp32": FP32 + ["precision.compute_dtype=float32"],
    "fp32 params, bf16 compute": FP32 + ["precision.compute_dtype=bfloat16"],
    "bf16 + master, fp32 state": BF16_RUN + _opt("master", "float32"),
    "bf16 + kahan, bf16 state": BF16_RUN + _opt("kahan", "bfloat16"),
    "bf16 + kahan, fp32 state": BF16_RUN + _opt("kahan", "float32"),
    "bf16 + stochastic, bf16 state": BF16_RUN + _opt("stochastic", "bfloat16"),
    "bf16 + nearest, bf16 state": BF16_RUN + _opt("nearest", "bfloat16")}
EVAL_EVERY = 25
# Issue 7's quality table: five recipes (its names -> QUALITY_RECIPES keys). Goal: the
# final held-out loss within 1% of fp32's for the recipes meant to match fp32; plain
# bf16 (round to nearest) is the contrast and has none.
FIVE = {"fp32": "fp32",
        "bf16 + fp32 master": "bf16 + master, fp32 state",
        "bf16 + Kahan (bf16 state)": "bf16 + kahan, bf16 state",
        "bf16 + stochastic rounding": "bf16 + stochastic, bf16 state",
        "plain bf16 (round to nearest)": "bf16 + nearest, bf16 state"}
QUALITY_GOAL = 1.01


def train(path, overrides, batches, eval_set):
  """The config at `path` with `overrides`, on one device, as train.py builds it."""
  c = load_config(path, overrides, num_devices=1)
  mesh = zerojax.make_mesh(1, 1, devices=jax.devices()[:1])
  model = models.from_config(c)
  # Every recipe, fp32 too, starts from the same bf16-representable weights: drawn in
  # fp32 (the Llama's flax initializers sample other values in bf16), rounded to bf16.
  f32 = c.copy_and_resolve_references()
  f32.precision.param_dtype = "float32"
  init = lambda k: jax.tree.map(lambda x: x.astype(BF16).astype(c.precision.param_dtype),
                                models.from_config(f32).init(k))
  tx, schedule = optim.optimizer_from_config(
      c.optimizer, c.train.steps, mask=optim.decay_mask(model.logical_axes()), seed=c.seed)
  key = jax.random.key(c.seed)
  plan = zerojax.make_plan(mesh, c.zero.stage, jax.eval_shape(model.init, key), tx,
                           logical_axes=model.logical_axes(),
                           min_shard_size=c.zero.min_shard_size)
  state = zerojax.init_state(plan, init, tx, key)
  step = zerojax.make_train_step(
      plan, model.loss, tx, microbatches=c.train.microbatches,
      max_grad_norm=c.optimizer.grad_clip, learning_rate=schedule,
      reduce_dtype=c.precision.reduce_dtype, accum_dtype=c.precision.accum_dtype)
  eval_step = zerojax.make_eval_step(plan, model.loss)
  put = lambda b: data.global_batch({"tokens": b},
                                    jax.sharding.NamedSharding(mesh, plan.batch_spec))
  evals = [put(b) for b in eval_set]
  evaluate = lambda: float(np.mean([float(eval_step(state.params, b)["loss"]) for b in evals]))
  losses, curve = [], [(0, evaluate())]
  for i, b in enumerate(batches, 1):
    state, metrics = step(state, put(b))
    losses.append(metrics["loss"])
    if i % EVAL_EVERY == 0 or i == len(batches):
      curve.append((i, evaluate()))
  losses = [round(float(x), 5) for x in losses]
  return dict(train_loss=losses, eval_curve=[(i, round(x, 5)) for i, x in curve],
              final_eval=curve[-1][1], final_train=float(np.mean(losses[-20:])))


def quality(seeds, path, extra, recipes=tuple(QUALITY_RECIPES)):
  """{recipe: [run per seed]}; seed s sets init, data order and rounding noise."""
  c = load_config(path, extra)
  t, out = c.train, {}
  train_tokens, eval_tokens = data.load_tokens(c.data, c.model.vocab_size, t.seq_len)
  eval_set = [data.batch_at(eval_tokens, i, t.global_batch_size, t.seq_len, c.seed + 1)
              for i in range(t.eval_batches)]  # One held-out set for every run.
  for seed in range(seeds):
    batches = [data.batch_at(train_tokens, i, t.global_batch_size, t.seq_len, seed)
               for i in range(t.steps)]
    for name in recipes:
      overrides = QUALITY_RECIPES[name]
      start = time.perf_counter()
      run = train(path, extra + overrides + [f"seed={seed}"], batches, eval_set)
      out.setdefault(name, []).append(run)
      print(f"  seed {seed}  {name}: eval {run['final_eval']:.4f}  "
            f"({time.perf_counter() - start:.0f}s)", flush=True)
  return out


def report_quality(res, note="", tag=""):
  ref, n = res["fp32"], len(res["fp32"])
  fmt = lambda x: f"{x.mean():.4f}" + (f" ± {x.std(ddof=1):.4f}" if n > 1 else "")
  get = lambda runs, k: np.array([r[k] for r in runs])
  table(f"Tiny model, {len(ref[0]['train_loss'])} steps{note}"
        + (f" (mean ± std over {n} seeds; ratios per seed)" if n > 1 else ""),
        ["recipe", "final eval loss", "final train loss (last 20)", "eval / fp32's",
         "train / fp32's"],
        [[name, fmt(get(runs, "final_eval")), fmt(get(runs, "final_train")),
          fmt(get(runs, "final_eval") / get(ref, "final_eval")),
          fmt(get(runs, "final_train") / get(ref, "final_train"))] for name, runs in res.items()])
  smooth = lambda r: np.convolve(r["train_loss"], np.ones(20) / 20, mode="valid")
  ev = lambda r: np.array([loss for _, loss in r["eval_curve"]])
  rel = lambda f, name: 100 * np.mean([f(r) / f(q) - 1 for r, q in zip(res[name], ref)], 0)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  steps, t = [s for s, _ in ref[0]["eval_curve"]], np.arange(20, len(ref[0]["train_loss"]) + 1)
  for name in res:
    axes[0].plot(steps[1:], rel(ev, name)[1:], marker="o", ms=3, label=name)
    axes[1].plot(t, rel(smooth, name), lw=1, label=name)
  for ax, what in zip(axes, ("held-out loss", "train loss (mean of 20 steps)")):
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(xlabel="step", ylabel="% above fp32", title=f"{what} vs fp32")
  axes[0].legend(fontsize=8)
  fig.suptitle(f"Tiny model{note}" + (f", mean over {n} seeds" if n > 1 else ""))
  fig.tight_layout()
  fig.savefig(os.path.join(RESULTS, f"precision_quality{tag}.png"), dpi=110)
  return dict(seeds=n, runs=res)


def report_goal(res, note="", tag=""):
  """Issue 7's five-row table (goal beside each) and the loss curves, if `res` has them."""
  if not all(k in res for k in FIVE.values()):
    return None
  ref, n = res["fp32"], len(res["fp32"])
  final = lambda runs: np.array([r["final_eval"] for r in runs])
  rows, out = [], {}
  for label, key in FIVE.items():
    loss, ratio = final(res[key]), final(res[key]) / final(ref)
    goal = None if key in ("fp32", "bf16 + nearest, bf16 state") else QUALITY_GOAL
    met = None if goal is None else bool(ratio.mean() <= goal)
    out[label] = dict(recipe=key, final_eval=loss.tolist(), ratio=ratio.tolist(), goal=goal,
                      met=met)
    spread = lambda x: f"{x.mean():.4f}" + (f" ± {x.std(ddof=1):.4f}" if n > 1 else "")
    rows.append([label, spread(loss), " / ".join(f"{x:.3f}" for x in loss), spread(ratio),
                 "reference" if key == "fp32" else "— (contrast)" if goal is None
                 else f"≤ {goal:.2f}", "—" if met is None else "met" if met else "**missed**"])
  table(f"Quality{note}: final held-out loss after {len(ref[0]['train_loss'])} steps"
        + (f" ({n} seeds)" if n > 1 else ""),
        ["recipe", "final held-out loss" + (" (mean ± std)" if n > 1 else ""),
         "per seed", "/ fp32's (per seed, mean ± std)" if n > 1 else "/ fp32's", "goal",
         "met"], rows)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, (label, key) in enumerate(FIVE.items()):
    runs = res[key]
    steps = [s for s, _ in runs[0]["eval_curve"]]
    ev = np.array([[x for _, x in r["eval_curve"]] for r in runs])
    axes[0].plot(steps, ev.mean(0), marker="o", ms=3, color=f"C{i}", label=label)
    if n > 1:
      axes[0].fill_between(steps, ev.min(0), ev.max(0), color=f"C{i}", alpha=0.12)
    tr = np.array([np.convolve(r["train_loss"], np.ones(20) / 20, mode="valid") for r in runs])
    axes[1].plot(np.arange(20, tr.shape[1] + 20), tr.mean(0), lw=1, color=f"C{i}", label=label)
  for ax, what in zip(axes, ("held-out loss", "train loss (mean of 20 steps)")):
    ax.set(xlabel="step", ylabel="loss (nats per token)", yscale="log",
           title=what + (f", mean over {n} seeds" + (" (band: min-max)" if ax is axes[0] else "")
                         if n > 1 else ""))
  axes[0].legend(fontsize=8)
  fig.suptitle(f"Tiny model{note}: loss curves of the five precision recipes")
  fig.tight_layout()
  fig.savefig(os.path.join(RESULTS, f"precision_quality{tag}_curves.png"), dpi=110)
  return out


def table(title, headers, rows):
  print(f"\n### {title}\n\n" + markdown_table(headers, rows))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", choices=("stall", "quality"), help="run one part")
  ap.add_argument("--stream", default="drift", choices=("drift", "noise", "constant"), help=(
      "stall gradients / 1e-3: per weight a fixed N(0,1) drift + N(0,1) noise each step"))
  ap.add_argument("--seeds", type=int, default=1, help="quality: seeds 0..n-1 per recipe")
  ap.add_argument("--lr", type=float, help="quality: peak learning rate (MLP: 1e-2)")
  ap.add_argument("--llama", action="store_true", help="quality: configs/tiny.py's Llama")
  ap.add_argument("--recipes", default="", help=(
      "quality: 'five' (issue 7's five recipes) or a comma list of recipe names; default all. "
      "A subset is saved as its own entry (key suffix _five or _subset)"))
  ap.add_argument("--replot", action="store_true", help=(
      "quality: print the tables and redraw the plots of every saved quality entry"))
  args = ap.parse_args()
  os.makedirs(RESULTS, exist_ok=True)
  path = os.path.join(RESULTS, "precision.json")
  results = json.load(open(path)) if os.path.exists(path) else {}  # Keeps other entries.
  if args.replot:
    for key, entry in results.items():
      if key.startswith("quality") and isinstance(entry, dict) and "runs" in entry:
        tag = key[len("quality"):]
        lr = re.search(r"_lr([^_]+)", tag)
        note = (", tiny.py Llama" if "_llama" in tag else ", MLP") + (
            f", peak lr {lr.group(1)}" if lr else "")
        report_quality(entry["runs"], note, tag)
        if (goal := report_goal(entry["runs"], note, tag)) is not None:
          entry["goal"] = goal
  else:
    run_parts(args, results)
  with open(path, "w") as f:  # One line per list of numbers.
    f.write(re.sub(r"\n\s+(?=[-\d\]])", " ", json.dumps(results, indent=1)) + "\n")


def run_parts(args, results):
  """Runs the parts `args` select, adding their entries to `results`."""
  results["jax"] = jax.__version__
  if args.only != "quality":
    results["stall"] = dict(stream=args.stream, **report_stall(stall(args.stream), args.stream))
  if args.only != "stall":
    name, extra = LLAMA if args.llama else MLP
    extra = extra + ([f"optimizer.learning_rate={args.lr}"] if args.lr else [])
    # Each variant has its own table, plot and JSON entry.
    recipes = (list(FIVE.values()) if args.recipes == "five" else
               [r.strip() for r in args.recipes.split(",")] if args.recipes else
               list(QUALITY_RECIPES))
    if unknown := [r for r in recipes if r not in QUALITY_RECIPES]:
      raise SystemExit(f"unknown recipes {unknown}; known: {list(QUALITY_RECIPES)}")
    if "fp32" not in recipes:
      recipes.insert(0, "fp32")  # Every ratio is taken against it.
    tag = ("_llama" if args.llama else "") + (f"_lr{args.lr:g}" if args.lr else "") + (
        "" if len(recipes) == len(QUALITY_RECIPES) else
        "_five" if recipes == list(FIVE.values()) else "_subset")
    note = (", tiny.py Llama" if args.llama else ", MLP") + (
        f", peak lr {args.lr:g}" if args.lr else "")
    runs = quality(args.seeds, CONFIG(name), extra, recipes)
    results["quality" + tag] = dict(config=name, overrides=extra, recipes=recipes,
                                    **report_quality(runs, note, tag))
    if (goal := report_goal(runs, note, tag)) is not None:
      results["quality" + tag]["goal"] = goal


if __name__ == "__main__":
  main()
