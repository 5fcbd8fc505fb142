"""Tests for the remat policies by name (zerojax/models/remat.py) in the Llama block:
each keeps the math, saves the values it names, and the planner counts its bytes."""

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from zerojax.models import llama, remat

from test_memory import CONFIGS, run_cli

TINY = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=64, param_dtype=jnp.float32, compute_dtype=jnp.float32,
                         attention="blocked", attention_block=8)
BY_NAME = [p for p in remat.POLICIES if remat.SAVED[p] is not None]


def test_every_policy_keeps_the_math():
  """Two SGD steps under each policy (jit, fp32): the losses and the updated params are
  those of remat 'none' (recomputation changes no arithmetic)."""
  params = nn.unbox(llama.init_params(TINY, jax.random.key(0)))
  batch = {"tokens": jax.random.randint(jax.random.key(1), (2, 17), 0, TINY.vocab_size)}

  def run(policy):
    grad = jax.jit(jax.value_and_grad(
        lambda p: llama.loss(dataclasses.replace(TINY, remat=policy), p, batch)))
    p, losses = params, []
    for _ in range(2):
      value, g = grad(p)
      p, losses = jax.tree.map(lambda a, b: a - 0.5 * b, p, g), losses + [float(value)]
    return losses, p

  ref_losses, ref_params = run("none")
  assert ref_losses[1] < ref_losses[0]
  for policy in remat.POLICIES[1:]:
    losses, p = run(policy)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6), policy
    diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(abs(a - b))), p,
                                            ref_params)))
    assert diff < 1e-5, (policy, diff)


@pytest.mark.parametrize("policy", BY_NAME)
def test_policy_saves_the_values_it_names(policy, capsys):
  """`print_saved_residuals` of one layer under the policy: exactly its named values
  (`residuals`: not 'down_proj', which no derivative reads) besides the layer's
  arguments and constants."""
  params = jax.tree.map(lambda a: a[0], nn.unbox(llama.init_params(TINY, jax.random.key(0)))
                        ["layers"])
  cos, sin = llama.rope_tables(TINY, 8)
  layer = jax.checkpoint(lambda p, x: llama.apply_block(TINY, p, x, cos, sin).sum(),
                         policy=remat.policy(policy))
  jax.ad_checkpoint.print_saved_residuals(layer, params, jnp.ones((1, 8, TINY.d_model)))
  lines = capsys.readouterr().out.splitlines()
  named = {line.split("named '")[1].split("'")[0] for line in lines if "named '" in line}
  assert named == set(remat.residuals(policy))
  # Nothing else computed in the layer is saved: the rest are its inputs and constants.
  assert all("named '" in line or "from the argument" in line or "from a constant" in line
             for line in lines), lines


def test_planner_counts_each_policy_like_the_compiler():
  """Each by-name policy on the tiny config, compiled on 8 fake CPU devices: the saved
  activations the planner counts are the compiled ones to the byte, and the compiled
  temporaries are ordered as the policies save. The total is 0.84-0.96 of the compiled
  (measured; XLA keeps the tiny config's small layers whole, as for remat 'full', 0.79)."""
  results = {p: run_cli("--config", os.path.join(CONFIGS, "tiny.py"), "--devices", "8",
                        f"--config.model.remat={p}") for p in BY_NAME}
  for policy, r in results.items():
    assert r["attributed"]["saved activations"] == r["components"]["saved activations"], policy
    compiled = r["compiled"]["arguments"] + r["compiled"]["temporaries"]
    assert 0.8 < r["total"] / compiled < 1.1, (policy, r["total"], compiled)
  temporaries = [results[p]["compiled"]["temporaries"] for p in BY_NAME]  # Most saved first.
  assert temporaries == sorted(temporaries, reverse=True)
