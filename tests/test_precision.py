"""Loss scaling and skipped non-finite steps: the pure state, the real step, train.py."""

import dataclasses
import json
import os
import signal
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import optim
from zerojax.config import base_config
from zerojax.models.llama import LlamaConfig, LlamaLM
from zerojax.models.mlp_lm import MlpLM
from zerojax.optim import precision
from zerojax.optim.precision import LossScaling, NonFiniteError
from zerojax.testing import numerics

from test_train import SMALL, train_here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.py")

CFG = LossScaling(dynamic=True, initial_power=4, window=3, hysteresis=2, min_scale=1.0)
F, O = True, False  # A finite step, an overflow.


# --- The pure state -------------------------------------------------------------------


class DeepSpeedScaler:
  """DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis=False), in Python.

  Written from DeepSpeed's loop (iteration counters, not zerojax's good_steps), so that
  agreeing with it checks the semantics rather than restating the implementation.
  """

  def __init__(self, cfg: LossScaling):
    self.cfg, self.scale, self.hysteresis = cfg, 2.0 ** cfg.initial_power, cfg.hysteresis
    self.cur_iter, self.last_overflow_iter = 0, -1

  def update(self, finite: bool) -> float:
    if not finite:
      if self.cfg.hysteresis == 1 or self.hysteresis == 1:
        self.scale = max(self.scale / 2, self.cfg.min_scale)
      else:
        self.hysteresis -= 1
      self.last_overflow_iter = self.cur_iter
    elif (self.cur_iter - self.last_overflow_iter) % self.cfg.window == 0:
      self.hysteresis = self.cfg.hysteresis
      self.scale *= 2
    self.cur_iter += 1
    return self.scale


def run_scale(cfg: LossScaling, flags, state=None):
  """Runs the jitted update over `flags`; returns the final state and per-step (scale, skips)."""
  update = jax.jit(lambda s, f: precision.update_loss_scale(s, f, cfg))
  state = precision.init_loss_scale(cfg) if state is None else state
  trace = []
  for finite in flags:
    state = update(state, jnp.asarray(finite))
    trace.append((float(state.scale), int(state.consecutive_skips)))
  return state, trace


def test_init_loss_scale():
  s = precision.init_loss_scale(CFG)
  assert s.scale.dtype == jnp.float32 and float(s.scale) == 16.0
  assert (int(s.good_steps), int(s.hysteresis), int(s.consecutive_skips)) == (0, 2, 0)
  assert float(precision.init_loss_scale().scale) == 1.0  # NO_SCALING.


def test_window_of_finite_steps_doubles_the_scale():
  state, trace = run_scale(CFG, [F] * 7)
  assert [s for s, _ in trace] == [16, 16, 32, 32, 32, 64, 64]
  assert all(k == 0 for _, k in trace)
  assert int(state.good_steps) == 1
  # The dtypes never change (a jitted loop carries this state).
  assert [x.dtype for x in state] == [jnp.float32] + [jnp.int32] * 4


def test_hysteresis_then_every_overflow_halves():
  # 2 tolerated: the first overflow keeps the scale, the second halves it, and every
  # further one halves again.
  _, trace = run_scale(CFG, [O, O, O, O])
  assert trace == [(16, 1), (8, 2), (4, 3), (2, 4)]


def test_tolerance_is_restored_only_when_the_scale_grows():
  flags = [O, O, F, O,   # the finite step in between does not restore the tolerance
           F, F, F,      # a window of finite steps: the scale grows, tolerance back to 2
           O, O]         # so one overflow is tolerated again
  state, trace = run_scale(CFG, flags)
  assert [s for s, _ in trace] == [16, 8, 8, 4, 4, 4, 8, 8, 4]
  assert [k for _, k in trace] == [1, 2, 0, 1, 0, 0, 0, 1, 2]
  assert int(state.hysteresis) == 1


def test_overflow_restarts_the_window():
  # Two finite steps, an overflow (tolerated), then a full window is needed again.
  _, trace = run_scale(CFG, [F, F, O, F, F, F])
  assert [s for s, _ in trace] == [16, 16, 16, 16, 16, 32]


def test_never_below_min_scale():
  cfg = LossScaling(dynamic=True, initial_power=4, window=3, hysteresis=2, min_scale=3.0)
  _, trace = run_scale(cfg, [O] * 6)
  assert [s for s, _ in trace] == [16, 8, 4, 3, 3, 3]
  _, trace = run_scale(CFG, [O] * 10)
  assert [s for s, _ in trace][-3:] == [1, 1, 1]


def test_consecutive_skips_count_and_reset():
  _, trace = run_scale(CFG, [O, O, O, F, O, F, F])
  assert [k for _, k in trace] == [1, 2, 3, 0, 1, 0, 0]


@pytest.mark.parametrize("cfg", [
    CFG, LossScaling(dynamic=True, initial_power=10, window=2, hysteresis=1, min_scale=1.0),
    LossScaling(dynamic=True, initial_power=6, window=4, hysteresis=3, min_scale=4.0),
], ids=["h2w3", "h1w2", "h3w4min4"])
def test_agrees_with_deepspeed_over_a_random_run(cfg):
  rs = np.random.RandomState(0)
  flags = list(rs.rand(120) < 0.7)
  ref = DeepSpeedScaler(cfg)
  _, trace = run_scale(cfg, flags)
  assert [s for s, _ in trace] == [ref.update(f) for f in flags]


def test_no_scaling_keeps_one_and_counts_skips():
  state, trace = run_scale(precision.NO_SCALING, [O, O, F, O, F, F, F, F])
  assert all(s == 1.0 for s, _ in trace)
  assert [k for _, k in trace] == [1, 2, 0, 1, 0, 0, 0, 0]
  # A static (non-dynamic) scale stays where it started.
  _, trace = run_scale(LossScaling(dynamic=False, initial_power=8), [O, O, F, F, F])
  assert all(s == 256.0 for s, _ in trace)


def test_loss_scaling_from_config():
  p = base_config().precision
  assert precision.loss_scaling_from_config(p) == precision.NO_SCALING  # bfloat16.
  p.param_dtype = p.compute_dtype = "float16"
  p.loss_scale.initial_power, p.loss_scale.window = 12, 50
  assert precision.loss_scaling_from_config(p) == LossScaling(True, 12, 50, 2, 1.0)


def test_all_finite():
  good = {"a": jnp.ones(3), "b": [jnp.zeros((2, 2), jnp.bfloat16)]}
  assert bool(jax.jit(precision.all_finite)(good))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    tree = {"a": jnp.ones(3), "b": [jnp.zeros((2, 2), jnp.bfloat16).at[1, 0].set(bad)]}
    assert not bool(jax.jit(precision.all_finite)(tree))
  assert bool(precision.all_finite({}))


def test_check_skips_lines_and_limit():
  ok = {"skipped": 0.0, "consecutive_skips": 0.0, "loss_scale": 1.0}
  assert precision.check_skips(5, ok, 3) is None
  row = {"skipped": 1.0, "consecutive_skips": 2.0, "loss_scale": 32768.0}
  line = precision.check_skips(7, row, 3)
  assert line.startswith("step 7:") and "2 in a row" in line and "32768" in line
  assert precision.check_skips(7, dict(row, consecutive_skips=500.0), 0)  # 0: never stops.
  with pytest.raises(NonFiniteError) as info:  # An fp16 run's dynamic scale, still above 1.
    precision.check_skips(8, dict(row, consecutive_skips=3.0), 3, LossScaling())
  message = str(info.value)
  assert message.startswith("step 8:") and "3 consecutive steps" in message
  assert "Try:" in message and "bfloat16" in message and "grad_clip" in message


def test_calibration_skips_do_not_count_toward_the_limit():
  cfg = LossScaling(dynamic=True, initial_power=32, window=1000, hysteresis=2, min_scale=1.0)
  # One overflow uses up the hysteresis, 32 halve 2^32 down to 1.
  assert precision.calibration_skips(cfg) == 33
  assert precision.calibration_skips(dataclasses.replace(cfg, min_scale=3.0)) == 1 + 31
  assert precision.calibration_skips(dataclasses.replace(cfg, min_scale=2.0 ** 32)) == 0
  assert precision.calibration_skips(precision.NO_SCALING) == 0
  skip = lambda row, scale: {"skipped": 1.0, "consecutive_skips": float(row), "loss_scale": scale}
  # Before the first finite step (row == step) the first 33 are calibration.
  line = precision.check_skips(20, skip(20, 2.0 ** 14), 10, cfg)
  assert "20 in a row" in line and "calibrating from 2^32: not counted" in line
  assert "not counted" not in precision.check_skips(42, skip(42, 1.0), 10, cfg)
  with pytest.raises(NonFiniteError) as info:
    precision.check_skips(43, skip(43, 1.0), 10, cfg)
  message = str(info.value)
  assert "10 consecutive steps had non-finite gradients after the 33 that brought" in message
  # At min_scale 1 the scale is not the cause: no advice to raise or lower it.
  assert "float16 forward or backward itself overflows" in message
  assert "smaller precision.loss_scale.min_scale" not in message
  # After a finite step every skip counts: a row of 10 ending at step 50 stops the run,
  # and while the scale was still coming down the advice says how to let it go lower.
  with pytest.raises(NonFiniteError) as info:
    precision.check_skips(50, skip(10, 64.0), 10, cfg)
  assert "still coming down" in str(info.value) and "max_consecutive_skips" in str(info.value)


# --- The real step --------------------------------------------------------------------


def tokens(batch=16, seq=16, vocab=64, seed=0):
  rs = np.random.RandomState(seed)
  return {"tokens": rs.randint(0, vocab, size=(batch, seq + 1)).astype(np.int32)}


def host(tree):
  """A host copy (the step donates its input state)."""
  return jax.tree.map(lambda x: np.array(x), tree)


def same_bits(a, b) -> bool:
  return all(x.dtype == y.dtype and x.tobytes() == y.tobytes()
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def setup(model, stage, mesh_shape, tx, loss_scaling):
  mesh = zerojax.make_mesh(*mesh_shape)
  plan = zerojax.make_plan(mesh, stage, jax.eval_shape(model.init, jax.random.PRNGKey(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  state = zerojax.init_state(plan, model.init, tx, jax.random.PRNGKey(0), loss_scaling)
  return plan, state


FP16_MODEL = MlpLM(vocab_size=64, d_model=64, d_ff=128, n_layers=2, context=4,
                   param_dtype=jnp.float16, compute_dtype=jnp.float16)


@jax.jit
def ref_norm(params, batch):
  """The fp32 norm of the unscaled gradient: what an fp16 step must report."""
  model32 = dataclasses.replace(FP16_MODEL, param_dtype=jnp.float32, compute_dtype=jnp.float32)
  params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  return optax.tree.norm(jax.grad(model32.loss)(params, batch))


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflow_backs_off_then_trains_and_grows(stage):
  model = FP16_MODEL
  tx = optim.adamw(1e-3)
  # 2^30 times the loss overflows float16 in the backward pass; so do the next dozen halvings.
  cfg = LossScaling(dynamic=True, initial_power=30, window=2, hysteresis=2, min_scale=1.0)
  plan, state = setup(model, stage, (1, 8), tx, cfg)
  assert jax.tree.leaves(state.params)[0].dtype == jnp.float16
  step = zerojax.make_train_step(plan, model.loss, tx, loss_scaling=cfg)
  batch = tokens()
  ref = DeepSpeedScaler(cfg)

  rows = []  # (skipped, consecutive_skips, scale after the step, loss)
  for i in range(24):
    before = host((state.params, state.opt_state))
    scale_before = float(state.loss_scale.scale)
    state, m = step(state, batch)
    m = jax.device_get(m)
    after = host((state.params, state.opt_state))
    skipped = bool(m["skipped"])
    assert int(state.step) == i + 1  # Skipped or not, the step counter advances.
    assert np.isfinite(m["loss"])  # The unscaled loss is finite even when the grads are not.
    if skipped:
      assert same_bits(before, after), f"step {i + 1} was skipped but changed the state"
      assert float(m["update_norm"]) == 0.0
    else:
      assert not same_bits(before[0], after[0]), f"step {i + 1} was finite but params did not move"
      assert float(m["update_norm"]) > 0
      # The gradients were unscaled: their norm is that of the unscaled loss (fp32 reference).
      want = float(ref_norm(before[0], batch))
      assert abs(float(m["grad_norm"]) - want) < 0.05 * want, (float(m["grad_norm"]), want)
    assert float(m["loss_scale"]) == ref.update(not skipped), (i, scale_before, m)
    assert float(state.loss_scale.scale) == float(m["loss_scale"])
    rows.append((skipped, int(m["consecutive_skips"]), float(m["loss_scale"]), float(m["loss"])))

  skipped = [r[0] for r in rows]
  first_ok = skipped.index(False)
  # The first steps all overflow: hysteresis keeps 2^30 once, then it halves each step.
  assert first_ok >= 3 and all(skipped[:first_ok])
  assert [r[1] for r in rows[:first_ok]] == list(range(1, first_ok + 1))
  assert [r[2] for r in rows[:first_ok]] == [2.0 ** 30] + [2.0 ** (30 - k) for k in range(1,
                                                                                          first_ok)]
  assert rows[first_ok][1] == 0  # A finite step resets the run of skips.
  # After `window` finite steps in a row the scale doubles.
  assert not skipped[first_ok + 1]
  assert rows[first_ok + 1][2] == 2 * rows[first_ok][2]
  # The loss (of the same batch) falls over the finite steps; skipped ones leave it.
  finite_losses = [r[3] for r in rows if not r[0]]
  assert len(finite_losses) >= 5
  assert finite_losses[-1] < finite_losses[0] - 0.3, finite_losses
  assert rows[first_ok][3] == rows[0][3]  # Nothing changed before the first finite step.


def test_bf16_nan_gradients_skip_and_stop_at_the_limit():
  model = MlpLM(vocab_size=64, d_model=64, d_ff=128, n_layers=2, context=4,
                param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
  tx = optim.adamw(1e-3)
  plan, state = setup(model, 3, (2, 4), tx, precision.NO_SCALING)
  loss_fn = lambda p, b, r: model.loss(p, b, r) * b["scale"][0]
  step = zerojax.make_train_step(plan, loss_fn, tx)  # bf16: the default static scale of 1.
  good = dict(tokens(), scale=np.ones(16, np.float32))
  # Only the first device's slice is poisoned: the whole step must still be skipped.
  bad = dict(good, scale=np.ones(16, np.float32))
  bad["scale"][0] = np.inf

  start = host((state.params, state.opt_state))
  limit = 3
  for i in range(1, limit + 1):
    state, m = step(state, bad)
    m = jax.device_get(m)
    assert float(m["skipped"]) == 1.0 and int(m["consecutive_skips"]) == i
    assert float(m["loss_scale"]) == 1.0 and int(state.step) == i
    assert same_bits(start, host((state.params, state.opt_state)))
    assert precision.check_skips(i, m, 0) is not None  # 0 never stops.
    if i < limit:
      line = precision.check_skips(i, m, limit)
      assert line.startswith(f"step {i}:") and f"{i} in a row" in line, line
    else:
      with pytest.raises(NonFiniteError) as info:
        precision.check_skips(i, m, limit)
      message = str(info.value)
      assert message.startswith(f"step {limit}:") and f"{limit} consecutive steps" in message
      assert "Try:" in message and "learning rate" in message and "bad tokens" in message

  state, m = step(state, good)
  m = jax.device_get(m)
  assert float(m["skipped"]) == 0.0 and int(m["consecutive_skips"]) == 0
  assert precision.check_skips(limit + 1, m, limit) is None
  assert not same_bits(start[0], host(state.params))
  assert int(state.step) == limit + 1 and float(m["loss_scale"]) == 1.0


def test_reported_learning_rate_counts_only_applied_updates():
  """Skipped steps do not advance optax's schedule; the reported rate must agree."""
  model = MlpLM(vocab_size=64, d_model=64, d_ff=128, n_layers=2, context=4)
  schedule = optax.linear_schedule(0.0, 1.0, 10)
  tx = optim.sgd(schedule)
  plan, state = setup(model, 2, (2, 4), tx, precision.NO_SCALING)
  loss_fn = lambda p, b, r: model.loss(p, b, r) * b["scale"][0]
  step = zerojax.make_train_step(plan, loss_fn, tx, learning_rate=schedule)
  good = dict(tokens(), scale=np.ones(16, np.float32))
  bad = dict(good, scale=np.full(16, np.inf, np.float32))
  for batch in (bad, bad, bad):
    state, m = step(state, batch)
  before = host(state.params)
  state, m = step(state, good)  # The first applied update: the schedule's step 0.
  assert float(m["learning_rate"]) == 0.0
  assert same_bits(before, host(state.params))  # lr 0 moves nothing.
  state, m = step(state, good)
  assert float(m["learning_rate"]) == pytest.approx(0.1)
  assert int(state.loss_scale.total_skips) == 3 and int(state.step) == 5


# --- train.py end to end --------------------------------------------------------------


def run_train(*args: str) -> subprocess.CompletedProcess:
  """train.py on configs/tiny.py in this process (`test_train.train_here`): its exit
  status and lines are what is tested here, not the process boundary."""
  return train_here("--config", TINY, *args)


# One layer of width 32 (test_train.SMALL): XLA:CPU computes fp16 matmuls slowly, and the
# loss scale's behaviour (and a nat of learning in 20 steps) needs neither depth nor
# width (the four fp16 runs: 64 -> 34 s at one layer; the three train.py runs at width
# 32, not 128: 20.9 -> 12.4 s of CPU). The run that calibrates from 2^32 trains 7 steps
# after 17 skips: at learning rate 1e-2 those reach 4.5 (5.2 at the quick start's 3e-3).
FP16 = ("--config.precision.param_dtype=float16", "--config.precision.compute_dtype=float16",
        *SMALL)


def test_train_fp16_runs_and_learns(tmp_path):
  result = run_train(*FP16, "--config.train.steps=20", "--config.optimizer.warmup_steps=5",
                     "--config.train.log_every=5", f"--config.workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in records if "loss" in r]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert [r["step"] for r in records if "loss" in r] == [1, 5, 10, 15, 20]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0, losses
  assert evals[-1] < evals[0] - 1.0, evals
  # An occasional overflow is handled by the scale; never a run of them.
  skips = [r for r in records if r.get("skipped")]
  assert len(skips) <= 3, skips
  assert "done: 20 steps" in result.stdout


def test_train_fp16_from_2_to_the_32_calibrates_then_trains():
  # DeepSpeed's initial_scale_power=32: the scale needs more halvings than
  # max_consecutive_skips (10) to reach what fp16 gradients bear; that is calibration.
  result = run_train(*FP16, "--config.precision.loss_scale.initial_power=32",
                     "--config.train.steps=24", "--config.optimizer.warmup_steps=5",
                     "--config.optimizer.learning_rate=1e-2",
                     "--config.train.log_every=8", "--config.train.eval_every=0",
                     "--config.train.eval_batches=1")
  assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
  skipped = [s for s in range(1, 25) if f"step {s}: gradients not finite" in result.stdout]
  assert len(skipped) > 10 and skipped == list(range(1, len(skipped) + 1)), skipped
  assert len(skipped) < 20, skipped  # Finite steps follow: it trains.
  assert (f"step {skipped[-1]}: gradients not finite, update skipped ({skipped[-1]} in a row"
          in result.stdout)
  assert "calibrating from 2^32: not counted" in result.stdout
  final = float(result.stdout.split("final train loss ")[1].split()[0])
  assert "done: 24 steps" in result.stdout and final < 5.0, result.stdout[-2000:]


def test_train_fp16_that_never_becomes_finite_still_exits_3_after_calibration():
  """From 2^40 down to min_scale 2^36 is calibration (1 + 4 skips); at 2^36 every fp16
  backward still overflows, so 3 more end the run (exit 3, one error line, no
  traceback), advising a smaller min_scale or bfloat16. Also the run that stops with
  no calibration (test_train_stops_with_status_3_when_gradients_stay_non_finite until
  2026-12-05: a scale starting at its floor, stopped at step 3): the same floor's
  advice and exit (this run's last 3 skips), its 0 calibration skips
  `test_calibration_skips_do_not_count_toward_the_limit`'s; and the run's SIGTERM
  handler is gone with it."""
  handler = signal.getsignal(signal.SIGTERM)
  result = run_train(*FP16, "--config.precision.loss_scale.initial_power=40",
                     f"--config.precision.loss_scale.min_scale={2.0 ** 36}",
                     "--config.precision.max_consecutive_skips=3", "--config.train.steps=20",
                     "--config.optimizer.warmup_steps=5", "--config.train.eval_batches=1")
  assert result.returncode == 3, (result.returncode, result.stderr[-3000:])
  # The run's SIGTERM handler is gone with it, error or not (main called in a process).
  assert signal.getsignal(signal.SIGTERM) == handler
  error = [l for l in result.stderr.splitlines() if l.startswith("error:")]
  assert len(error) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert error[0].startswith("error: step 8:"), error[0]
  assert "3 consecutive steps had non-finite gradients after the 5 that brought" in error[0]
  assert "a smaller precision.loss_scale.min_scale" in error[0]
  assert "Try:" in error[0] and "bfloat16 instead of float16" in error[0]
  for s in range(1, 8):
    assert f"step {s}: gradients not finite, update skipped ({s} in a row" in result.stdout
  assert "done:" not in result.stdout and "step    20" not in result.stdout
  assert "step 5: gradients not finite, update skipped (5 in a row; loss scale now 6.87195e+10, " \
         "calibrating from 2^40: not counted)" in result.stdout


# --- Weight gradients in fp32 (`upcast_params`) -----------------------------------------


def test_fp32_weight_gradients_are_closer_to_float64():
  """A bf16 Llama's mean gradient from the stage-3 step (8 devices), against the same
  model in float64 on the same bf16 weights: with every param seen in fp32 ('all'), each
  kernel's error is below today's ('none'), whose local gradients are rounded to bf16.
  Most of the error is the bf16 forward's, which both share: the ratio is ~0.96
  (docs/design/precision.md: 'Weight gradients in fp32')."""
  kw = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
            attention_block=8, loss_chunk=8)
  model, tx = LlamaLM(LlamaConfig(**kw)), numerics.keep_gradient()
  params = model.init(jax.random.key(0))
  batch = {"tokens": jax.random.randint(jax.random.key(1), (8, 33), 0, 64)}
  wide = LlamaLM(LlamaConfig(**kw, param_dtype=jnp.float64, compute_dtype=jnp.float64))
  ref = numerics.float64_grads(wide.loss, params, batch)
  plan = zerojax.make_plan(zerojax.make_mesh(1, 8), 3, jax.eval_shape(model.init,
                                                                      jax.random.key(0)),
                           tx, logical_axes=model.logical_axes(), min_shard_size=0)
  errors = {}
  for upcast in ("none", "all"):
    state = zerojax.init_state(plan, model.init, tx, jax.random.key(0),
                               params=jax.tree.map(jnp.copy, params))
    step = zerojax.make_train_step(plan, model.loss, tx, upcast_params=upcast, donate=False)
    grads = step(state, batch)[0].opt_state
    errors[upcast] = numerics.relative_errors(grads, ref)
  rms = {u: np.sqrt(np.mean(np.square(list(e.values())))) for u, e in errors.items()}
  assert all(errors["all"][k] < errors["none"][k] for k in errors["none"]), errors
  assert rms["all"] / rms["none"] < 0.98, rms
