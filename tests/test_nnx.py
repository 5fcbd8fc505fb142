"""Flax NNX on the plan: the README's NNX model against its linen twin at every stage."""

import os
import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import zerojax
from zerojax.testing import hlo

from test_zero import check_zero_formula, rel

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@pytest.fixture(scope="module")
def example():
  """The README's "Flax NNX models" example, run: its namespace (LM, loss_fn, state...)."""
  text = open(README).read().split("## Flax NNX models", 1)[1]
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  namespace = {}
  exec(compile(code, "README.md (Flax NNX models)", "exec"), namespace)  # noqa: S102
  return namespace


def linen_twin(ns):
  """The README's LM in linen, with the same submodule names, so the same param tree."""
  D, VOCAB, LAYERS = ns["D"], ns["VOCAB"], ns["LAYERS"]

  def dense(features, names, name):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
    return nn.Dense(features, use_bias=False, kernel_init=init, name=name)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = jax.nn.gelu(dense(4 * D, ("embed", "mlp"), "up")(x))
      return x + dense(D, ("mlp", "embed"), "down")(h), None

  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed_init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
      x = nn.Embed(VOCAB, D, embedding_init=embed_init, name="embed")(tokens)
      block = nn.map_variables(Block, "params", trans_in_fn=zerojax.gather, mutable=True)
      layers = nn.scan(nn.remat(block), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=LAYERS,
                       metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = layers(name="layers")(x, None)
      return dense(VOCAB, ("embed", "vocab"), "head")(x)

  return LM()


def test_readme_example_trains(example):
  """The trained module (`model.module` of the state's params) beats a fresh one."""
  model, batch, trained = example["model"], example["batch"], example["trained"]
  assert isinstance(trained, example["LM"])
  assert trained.layers.up.kernel.shape == (example["LAYERS"], example["D"], 4 * example["D"])
  fresh = model.module(jax.jit(model.init)(jax.random.key(1)))
  after, before = (float(example["loss_fn"](m, batch, None)) for m in (trained, fresh))
  assert np.isfinite(after) and after < before - 0.1, (after, before)


def test_nnx_equals_linen_at_every_stage(example):
  """Same losses as the linen twin from the same params at stages 0-3; the NNX step's
  compiled per-device state is the ZeRO formula's, and stage 3 gathers per layer."""
  model, batch, D, LAYERS = (example[k] for k in ("model", "batch", "D", "LAYERS"))
  linen = linen_twin(example)
  boxed = jax.eval_shape(linen.init, jax.random.key(0), batch["tokens"][:, :-1])["params"]
  assert model.logical_axes == zerojax.flax_logical_axes(boxed)
  assert model.logical_axes["layers"]["up"]["kernel"] == ("layers", "embed", "mlp")

  def linen_loss(params, batch, rng):
    logits = linen.apply({"params": params}, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]).mean()

  tx = optax.adamw(1e-3)
  for stage in range(4):
    plan = zerojax.make_plan(zerojax.make_mesh(1, 8), stage, model.params, tx,
                             logical_axes=model.logical_axes, min_shard_size=0)
    losses = {}
    for name, loss in (("nnx", model.loss), ("linen", linen_loss)):
      # Both start from the NNX module's initial params: the trees are the same.
      state = zerojax.init_state(plan, model.init, tx, jax.random.key(0))
      step = zerojax.make_train_step(plan, loss, tx).lower(state, batch).compile()
      losses[name] = []
      for _ in range(3):
        state, metrics = step(state, batch)
        losses[name].append(float(metrics["loss"]))
      if name == "nnx":
        state_bytes = check_zero_formula(plan, step)
      if name == "nnx" and stage == 3:  # Each layer's own gather, one per scan trip.
        up = [c for c in hlo.collectives(step.as_text()) if c.op == "all-gather"
              and (D, 4 * D) in {s for _, s in c.results}]
        assert up and all(c.trips == LAYERS for c in up)
    assert rel(losses["nnx"], losses["linen"]) <= 1e-6, (stage, losses)
    print(f"stage {stage}: losses {losses['nnx']}, relative difference to linen "
          f"{rel(losses['nnx'], losses['linen']):.1e}; state bytes (compiled, formula) "
          f"{state_bytes}")
    assert losses["nnx"][-1] < losses["nnx"][0]


def test_state_besides_params_and_batch_stats_is_refused():
  from flax import nnx

  class Counter(nnx.Variable):  # Mutable state the step would not carry.
    pass

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.BatchNorm(8, rngs=rngs)  # Carried: make_plan(model_state=...).
      self.calls = Counter(jax.numpy.zeros(()))

  model = zerojax.from_nnx(lambda rngs: nnx.BatchNorm(8, rngs=rngs),
                           lambda module, batch, rng: 0.0)
  assert set(model.model_state) == {"mean", "var"}
  with pytest.raises(ValueError, match=r"\['Counter'\] variables besides nnx.Param"):
    zerojax.from_nnx(Net, lambda module, batch, rng: 0.0)


def test_a_key_stored_in_the_module_is_one_line_naming_the_fix():
  """Dropout drawing from the module's own `nnx.Rngs` cannot advance its count inside the
  jitted step: one line naming `nnx.Rngs(dropout=rng)`, not flax's TraceContextError; the
  step's rng passed per call traces. Traced only: nothing is compiled."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(16, 16, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, rngs=None):
      return self.dropout(self.linear(x), rngs=rngs)

  stored = lambda module, batch, rng: (module(batch["x"]) ** 2).mean()
  per_call = lambda module, batch, rng: (module(batch["x"], nnx.Rngs(dropout=rng)) ** 2).mean()
  tx = optax.sgd(0.1)

  def trace(loss_fn):
    model = zerojax.from_nnx(Net, loss_fn)
    plan = zerojax.make_plan(zerojax.make_mesh(1, 8), 2, model.params, tx)
    zerojax.make_train_step(plan, model.loss, tx).trace(
        zerojax.abstract_state(plan), {"x": jax.ShapeDtypeStruct((8, 16), np.float32)})

  trace(per_call)
  with pytest.raises(ValueError, match=r"^the NNX module draws random numbers from an "
                     r"nnx.Rngs stored in it.*RngCount.*: pass the step's rng to each call "
                     r"instead, e.g. module\(x, rngs=nnx.Rngs\(dropout=rng\)\)") as e:
    trace(stored)
  assert "\n" not in str(e.value)
