"""The GPU flag profile: resolved against the XLA installed here, the user's flags first."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from zerojax.config import load_config
from zerojax.gpu import xla_flags
from zerojax.gpu.xla_flags import flag_name
from zerojax.models import llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_8B = os.path.join(ROOT, "configs", "8b_bf16.py")


@pytest.fixture(scope="module")
def config_8b():
  return load_config(CONFIG_8B, [])


def test_known_flags_asks_the_installed_xla_once():
  """A made-up flag is dropped (XLA would abort on it); real ones, GPU ones too, are kept.
  Asked with an environment, the answers are kept there (by flag name) and a second ask
  (say, by a child) runs no XLA: given no Python to run, it still answers, a known name
  with another value included; a name not asked before is asked. (Until 2026-12-05 the
  environment's answers were a test of their own that asked XLA again: 2 JAX starts.)"""
  env = {}
  real = ["--xla_gpu_enable_latency_hiding_scheduler=true",
          "--xla_gpu_all_gather_combine_threshold_bytes=1024"]
  made_up = ["--xla_gpu_no_such_flag=true", "--xla_nor_this_one=1"]
  assert xla_flags.known_flags([*made_up, *real], environ=env) == set(real)
  assert xla_flags.known_flags(made_up) == set()
  assert json.loads(env[xla_flags.ASKED_VAR]) == {
      **{flag_name(f): True for f in real}, **{flag_name(f): False for f in made_up}}
  other = real[0].replace("true", "false")
  assert xla_flags.known_flags([other, *made_up], "/no/python",
                               environ=dict(env)) == {other}
  with pytest.raises(FileNotFoundError):  # A name not asked before is asked.
    xla_flags.known_flags(["--xla_gpu_enable_pipelined_all_gather=true"], "/no/python",
                          environ=dict(env))


@pytest.fixture(scope="module")
def gpu_env(config_8b):
  """`apply_gpu_profile` on a GPU's environment with the user's flag and memory fraction:
  the environment after it, XLA asked once about the profile's forms (its answers kept
  in `ASKED_VAR`), and the lines it printed."""
  env = {"JAX_PLATFORMS": "cuda",
         "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false",
         "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
  lines = xla_flags.apply_gpu_profile(config_8b, env)
  return env, lines


def test_every_profile_entry_has_a_form_this_xla_knows(config_8b, gpu_env):
  """Resolved against the installed XLA, each entry gets a form, and XLA takes them all.
  The answers are `gpu_env`'s ask (one JAX start for both tests)."""
  profile = xla_flags.gpu_profile(xla_flags.layer_bytes(config_8b))
  known = xla_flags.known_flags(xla_flags.forms(profile), "/no/python", environ=dict(gpu_env[0]))
  chosen, lines = xla_flags.resolve(profile, "", known)
  assert not [line for line in lines if "not in this XLA" in line], lines
  assert set(chosen) <= known and len(chosen) == len(profile)


def test_layer_bytes_is_one_layer_in_float32(config_8b):
  c = llama.LlamaConfig.from_keys(config_8b.model)
  D, F, kv = c.d_model, c.d_ff, c.n_kv_heads * c.head_dim
  per_layer = 2 * D * D + 2 * D * kv + 3 * D * F + 2 * D
  assert xla_flags.layer_bytes(config_8b) == 4 * per_layer
  assert per_layer * c.n_layers < llama.param_count(c)  # Embeddings and head are not layers.
  threshold = xla_flags.gpu_profile(4 * per_layer)[-1].forms[0]
  value = int(threshold.split("=")[1])
  assert value >= 4 * per_layer and value < 8 * per_layer and math.log2(value).is_integer()


def test_resolve_user_flags_win_and_old_forms_are_the_fallback():
  profile = [xla_flags.Flag(("--new=A", "--old=true"), "why1"),
             xla_flags.Flag(("--other=1",), "why2"),
             xla_flags.Flag(("--gone=1",), "why3")]
  chosen, lines = xla_flags.resolve(profile, "--old=false --unrelated=1", {"--new=A", "--other=1"})
  assert chosen == ["--other=1"]  # The user set --old: the whole entry is theirs.
  assert lines[0] == "  old: as XLA_FLAGS sets it" and "not in this XLA: --gone=1" in lines[2]
  chosen, _ = xla_flags.resolve(profile, "", {"--old=true", "--other=1"})
  assert chosen == ["--old=true", "--other=1"]  # An older XLA: its form.


def test_apply_only_on_gpu_and_never_over_the_user(config_8b, gpu_env):
  cpu = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_x=1"}
  assert xla_flags.apply_gpu_profile(config_8b, cpu) == [] and cpu["XLA_FLAGS"] == "--xla_x=1"

  gpu, lines = gpu_env
  flags = gpu["XLA_FLAGS"].split()
  assert flags[0] == "--xla_gpu_enable_latency_hiding_scheduler=false"
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
  assert "--xla_gpu_enable_pipelined_all_gather=true" in flags
  assert gpu["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
  assert any("as XLA_FLAGS sets it" in line for line in lines)

  off = load_config(CONFIG_8B, ["xla.gpu_profile=False"])
  env = {"JAX_PLATFORMS": "cuda"}
  assert xla_flags.apply_gpu_profile(off, env) == [] and "XLA_FLAGS" not in env


def test_on_gpu_reads_jax_platforms_else_looks_for_a_cuda_plugin():
  assert xla_flags.on_gpu({"JAX_PLATFORMS": "cuda,cpu"})
  assert xla_flags.on_gpu({"JAX_PLATFORMS": "gpu"})
  assert not xla_flags.on_gpu({"JAX_PLATFORMS": "cpu"})
  # Unset (a plain `python train.py`): this machine has no CUDA plugin, nor maybe even
  # the jax_plugins package, whose absence must not be an error.
  plugin = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
  assert xla_flags.on_gpu({}) == (plugin and os.path.exists("/dev/nvidiactl"))


def test_cli_prints_the_profile():
  out = subprocess.run([sys.executable, "-m", "zerojax.gpu.xla_flags", "--config", CONFIG_8B],
                       capture_output=True, text=True, check=True, cwd=ROOT).stdout
  assert "--xla_gpu_enable_pipelined_reduce_scatter=true: stage 3" in out
  assert out.strip().splitlines()[-1].startswith("XLA_FLAGS='--xla_gpu_enable_latency_hiding")
