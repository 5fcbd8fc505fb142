"""The loop the multi-arm benchmarks share: one arm's run for one seed, held-out loss.

An arm is a config built by `zerojax.build` as train.py builds it; `run_seed` trains it
for the config's steps on the seed's data order and evaluates on a fixed held-out set.
Used by `release_quality.py` and `quality.py`.
"""

import time
from typing import Any, Callable

import jax
import numpy as np

import zerojax
from zerojax import data

EVAL_SEED = 10_000  # One held-out set for every arm and seed.
_EVAL_STEPS: dict[int, tuple[Any, Callable]] = {}  # id(built) -> (built, its eval step)


def eval_step(built: Any) -> Callable:
  """`built`'s jitted eval step, made once, so later seeds reuse its compiled program."""
  if id(built) not in _EVAL_STEPS:  # Keeps `built` alive, so its id is not reused.
    _EVAL_STEPS[id(built)] = built, zerojax.make_eval_step(built.plan, built.model.loss)
  return _EVAL_STEPS[id(built)][1]


def run_seed(built: Any, config: Any, seed: int, tokens: np.ndarray, held_out: np.ndarray, *,
             eval_batches: int, eval_every: int = 0,
             init: Callable[[jax.Array], Any] | None = None) -> dict:
  """Trains `built` from `seed` for `config.train.steps` steps; returns its losses.

  Args:
    built: `zerojax.build(config)`.
    config: the arm's config (its train section sets steps, batch and sequence length).
    seed: sets the init (through `jax.random.key(seed)`) and the data order.
    tokens: training tokens; `held_out`: the held-out tokens.
    eval_batches: held-out batches per evaluation.
    eval_every: also evaluate every this many steps (0: only at the end).
    init: the params' init function; default the model's own. Pass the same function
      for every seed: a new one compiles the init again.

  Returns:
    {"final": the mean held-out loss at the end, "curve": [(step, held-out loss)],
     "train_loss": the loss of every step, "seconds": wall time}.
  """
  t = config.train
  put = lambda rows: data.global_batch({"tokens": rows}, built.batch_sharding)
  evaluate = eval_step(built)
  evals = [put(data.batch_at(held_out, i, t.global_batch_size, t.seq_len, EVAL_SEED))
           for i in range(eval_batches)]
  held_out_loss = lambda params: float(np.mean([float(evaluate(params, b)["loss"])
                                                for b in evals]))
  start = time.perf_counter()
  state = jax.block_until_ready(zerojax.init_state(
      built.plan, init or built.model.init, built.tx, jax.random.key(seed),
      built.loss_scaling))
  # One program with collectives in flight at a time: on a loaded host XLA:CPU's device
  # threads can otherwise starve each other's rendezvous (as train.py). A GPU keeps its
  # queue full instead.
  wait = jax.default_backend() == "cpu"
  losses, curve = [], []
  for step in range(1, t.steps + 1):
    state, metrics = built.train_step(
        state, put(data.batch_at(tokens, step - 1, t.global_batch_size, t.seq_len, seed)))
    losses.append(metrics["loss"])
    if wait:
      jax.block_until_ready(metrics)
    if eval_every and step % eval_every == 0 and step < t.steps:
      curve.append((step, held_out_loss(state.params)))
  skipped = float(metrics["skipped"])
  curve.append((t.steps, held_out_loss(state.params)))
  return dict(final=curve[-1][1], curve=curve, train_loss=[round(float(x), 5) for x in losses],
              skipped=skipped, seconds=round(time.perf_counter() - start, 1))
