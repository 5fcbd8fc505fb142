"""Tests for the remat policies by name (zerojax/models/remat.py) in the Llama block:
each saves the values it names, and the planner counts their bytes. (That every policy
keeps the math: test_llama's blocked-attention test runs each.)"""

import contextlib
import dataclasses
import io
import math
import os

import flax.linen as nn
import jax
import pytest

from zerojax import memory, models
from zerojax.config import load_config
from zerojax.models import llama, remat

from test_memory import CONFIGS, run_clis

BY_NAME = [p for p in remat.POLICIES if remat.SAVED[p] is not None]


def saved_residuals(config: llama.LlamaConfig, policy: str, tokens: int) -> list[str]:
  """`print_saved_residuals`' lines for one layer of `config` (abstract: traced, not run)
  under `policy`, on one sequence of `tokens`."""
  config = dataclasses.replace(config, n_layers=1)
  shapes = jax.eval_shape(lambda: nn.unbox(llama.init_params(config, jax.random.key(0))))
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes["layers"])
  cos, sin = llama.rope_tables(config, tokens)
  layer = jax.checkpoint(lambda p, x: llama.apply_block(config, p, x, cos, sin).sum(),
                         policy=remat.policy(policy))
  x = jax.ShapeDtypeStruct((1, tokens, config.d_model), config.compute_dtype)
  with contextlib.redirect_stdout(io.StringIO()) as out:
    jax.ad_checkpoint.print_saved_residuals(layer, params, x)
  return out.getvalue().splitlines()


@pytest.mark.parametrize("policy", BY_NAME)
def test_policy_saves_what_it_names_and_the_planner_counts_it(policy):
  """One layer of the tiny config under the policy saves exactly its named values
  (`residuals`: not 'down_proj', which no derivative reads) besides its arguments and
  constants; the planner's saved activations are those values and the layer input, per
  layer and token (compared with the compiler below)."""
  cfg = load_config(os.path.join(CONFIGS, "tiny.py"), [f"model.remat={policy}"], num_devices=8)
  spec = memory.RunSpec.from_config(cfg, 8)
  lines = saved_residuals(models.from_config(cfg).config, policy, spec.seq_len)
  named = [line for line in lines if "named '" in line]
  assert {line.split("named '")[1].split("'")[0] for line in named} == set(remat.residuals(policy))
  assert all(line in named or "from the argument" in line or "from a constant" in line
             for line in lines), lines
  # Bytes of each saved value: "bf16[1,128,64] named ...": dtype bytes x elements.
  inputs = [line for line in lines if "from the argument x" in line]
  nbytes = sum({"bf16": 2, "f32": 4}[line.split("[")[0]]
               * math.prod(int(d) for d in line.split("[")[1].split("]")[0].split(","))
               for line in named + inputs)
  assert memory.estimate(spec).components["saved activations"] == (
      nbytes * spec.n_layers * spec.batch)


def test_planner_counts_each_policy_like_the_compiler():
  """Two by-name policies and 'full' on the tiny config, compiled on 8 fake CPU devices:
  the saved activations the planner counts are the compiled ones to the byte, and the
  compiled temporaries are ordered as the policies save. Every policy holds one fp32
  gradient per local param, as 'full' does (`stage3.scan_layers` writes it over the
  fp32 params; JAX's own scan would hold a second one). The total is 0.8-1.1 of the
  compiled for every policy (XLA keeps the tiny config's small layers whole); the 1B's
  table is in docs/design/planner.md."""
  policies = ["save_dot_with_context_except_mlp", "save_qkv_proj", "full"]  # Most saved first.
  results = dict(zip(policies, run_clis(*([
      "--config", os.path.join(CONFIGS, "tiny.py"), "--devices", "8",
      f"--config.model.remat={p}"] for p in policies))))
  full = results["full"]
  for policy, r in results.items():
    assert r["attributed"]["saved activations"] == r["components"]["saved activations"], policy
    assert r["attributed"]["gradients"] == full["attributed"]["gradients"], policy
    # At XLA:CPU's peak the vocabulary's local fp32 gradients are not made yet: 0.91 of
    # the planner's (0.99 before stage 3 sharded along the first dimension).
    assert r["attributed"]["gradients"] == pytest.approx(r["components"]["gradients"], rel=0.1)
    compiled = r["compiled"]["arguments"] + r["compiled"]["temporaries"]
    assert 0.75 < r["total"] / compiled < 1.1, (policy, r["total"], compiled)
  temporaries = [results[p]["compiled"]["temporaries"] for p in policies]
  assert temporaries == sorted(temporaries, reverse=True)
