"""Hugging Face Llama import/export (zerojax.hf) against a float64 numpy Llama
written here from the HF definition (modeling_llama.py), and train.py's --init_from."""

import json
import math
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zerojax.train
from zerojax import hf, make_mesh, make_plan
from zerojax.hf import export
from zerojax.models import llama
from zerojax.models.llama import LlamaLM
from zerojax.runtime import exits

from test_train import train_here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(V=64, D=32, L=2, H=4, K=2, F=64)
TOLERANCE = 1e-5  # max |ours - reference| / max |reference|, fp32 params and compute.


def hf_weights(V, D, L, H, K, F, tie=False, seed=0) -> dict[str, np.ndarray]:
  """Random fp32 weights in HF names and layout (torch Linear: [out, in])."""
  rng = np.random.default_rng(seed)
  Dh = D // H
  normal = lambda *shape, std=0.2: (std * rng.standard_normal(shape)).astype(np.float32)
  w = {"model.embed_tokens.weight": normal(V, D, std=1.0),
       "model.norm.weight": 1 + normal(D, std=0.1)}
  for i in range(L):
    p = f"model.layers.{i}."
    w.update({p + "input_layernorm.weight": 1 + normal(D, std=0.1),
              p + "post_attention_layernorm.weight": 1 + normal(D, std=0.1),
              p + "self_attn.q_proj.weight": normal(H * Dh, D),
              p + "self_attn.k_proj.weight": normal(K * Dh, D),
              p + "self_attn.v_proj.weight": normal(K * Dh, D),
              p + "self_attn.o_proj.weight": normal(D, H * Dh),
              p + "mlp.gate_proj.weight": normal(F, D),
              p + "mlp.up_proj.weight": normal(F, D),
              p + "mlp.down_proj.weight": normal(D, F)})
  if not tie:
    w["lm_head.weight"] = normal(V, D)
  return w


def hf_config(V, D, L, H, K, F, tie=False, rope="top") -> dict:
  """config.json; rope: 'top' (rope_theta at the top level) or 'parameters' (newer
  transformers' rope_parameters, with Llama 3.1 scaling that matters at this size)."""
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
            "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
            "num_attention_heads": H, "num_key_value_heads": K, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "tie_word_embeddings": tie, "torch_dtype": "float32"}
  if rope == "top":
    config.update(rope_theta=10000.0, rope_scaling=None)
  else:
    # head_dim 8, theta 1e4: wavelengths 6.3, 63, 628, 6283 -> one kept, one smoothed,
    # two divided by the factor with an original context of 64.
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}
  return config


def write_hf(folder, weights, config, files=1, dtype=np.float32):
  """A HF folder: config.json and one model.safetensors or `files` shards + index."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f)
  weights = {k: v.astype(dtype) for k, v in weights.items()}
  if files == 1:
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return
  names, weight_map = list(weights), {}
  for k, chunk in enumerate(np.array_split(np.arange(len(names)), files)):
    file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
    save_file({names[j]: weights[names[j]] for j in chunk}, os.path.join(folder, file))
    weight_map.update({names[j]: file for j in chunk})
  with open(os.path.join(folder, hf.INDEX), "w") as f:
    json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def reference_logits(w, config, tokens) -> np.ndarray:
  """LlamaForCausalLM's forward in float64: [B, T] ids -> [B, T, V] logits."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  D, H = config["hidden_size"], config["num_attention_heads"]
  K, L, eps = config["num_key_value_heads"], config["num_hidden_layers"], config["rms_norm_eps"]
  Dh, (B, T) = D // H, tokens.shape
  rope = config.get("rope_parameters") or {"rope_theta": config["rope_theta"]}
  inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, Dh, 2) / Dh)
  if rope.get("rope_type") == "llama3":  # _compute_llama3_parameters
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    inv_freq = np.where(medium, smoothed, scaled)
  emb = np.concatenate([np.arange(T)[:, None] * inv_freq] * 2, axis=-1)  # [T, Dh]
  cos, sin = np.cos(emb), np.sin(emb)
  rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g
  rotate_half = lambda x: np.concatenate([-x[..., Dh // 2:], x[..., :Dh // 2]], axis=-1)
  heads = lambda x, n: x.reshape(B, T, n, Dh).transpose(0, 2, 1, 3)  # [B, n, T, Dh]
  x = w["model.embed_tokens.weight"][tokens]
  for i in range(L):
    p = lambda name: w[f"model.layers.{i}.{name}.weight"]
    h = rms(x, p("input_layernorm"))
    q, k, v = (heads(h @ p(f"self_attn.{n}_proj").T, m) for n, m in (("q", H), ("k", K), ("v", K)))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)  # repeat_kv
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(Dh)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + (a @ v).transpose(0, 2, 1, 3).reshape(B, T, D) @ p("self_attn.o_proj").T
    h = rms(x, p("post_attention_layernorm"))
    gate = h @ p("mlp.gate_proj").T
    x = x + (gate / (1 + np.exp(-gate)) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
  head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
  return rms(x, w["model.norm.weight"]) @ head.T


def plan_for(folder, stage, dtype="float32", devices=8):
  """(model, plan): the folder's Llama in `dtype`, on `devices` devices, small leaves sharded."""
  model = LlamaLM(hf.llama_config(folder, param_dtype=dtype, compute_dtype=dtype))
  mesh = make_mesh(1, devices, devices=jax.devices()[:devices])
  plan = make_plan(mesh, stage, jax.eval_shape(model.init, jax.random.key(0)),
                   logical_axes=model.logical_axes(), min_shard_size=64)
  return model, plan


def bits(tree) -> dict:
  """{path: (dtype, shape, bytes)} of the host values: compare bit for bit."""
  return {jax.tree_util.keystr(p): (str(x.dtype), x.shape, np.asarray(x).tobytes())
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("rope,tie", [("top", True), ("parameters", False)])
def test_import_matches_hf_reference(tmp_path, rope, tie):
  weights, config = hf_weights(**SMALL, tie=tie), hf_config(**SMALL, tie=tie, rope=rope)
  write_hf(tmp_path, weights, config)
  model, plan = plan_for(str(tmp_path), stage=3)
  params = hf.load_params(str(tmp_path), plan)
  q = params["layers"]["self_attn"]["q_proj"]["kernel"]
  assert q.shape == (2, 32, 32) and q.sharding.spec == plan.param_specs["layers"][
      "self_attn"]["q_proj"]["kernel"] and q.sharding.spec != jax.sharding.PartitionSpec()
  tokens = np.random.default_rng(1).integers(0, SMALL["V"], (2, 16))
  ours = np.asarray(jax.jit(model.logits)(params, tokens))
  ref = reference_logits(weights, config, tokens)
  rel = np.abs(ours - ref).max() / np.abs(ref).max()
  print(f"rope={rope} tie={tie}: logits max |diff| / max |ref| = {rel:.2e}")
  assert rel < TOLERANCE
  if rope == "parameters":  # The scaling is in effect: without it the logits differ.
    plain = llama.LlamaConfig(**{**model.config.__dict__, "rope_scaling": None})
    unscaled = jax.jit(llama.logits, static_argnums=0)(plain, params, tokens)
    assert np.abs(np.asarray(unscaled) - ref).max() > 100 * rel


def test_sharded_files_onto_stage_3_and_1_read_only_own_blocks(tmp_path, monkeypatch):
  weights, config = hf_weights(**SMALL), hf_config(**SMALL)
  write_hf(tmp_path, weights, config, files=3, dtype=ml_dtypes.bfloat16)
  reads = []
  original = hf._read_slice
  monkeypatch.setattr(hf, "_read_slice", lambda files, tensors, name, index: reads.append(
      (name, original(files, tensors, name, index).size)) or original(files, tensors, name, index))
  loaded = {}
  for stage in (3, 1):
    reads.clear()
    _, plan = plan_for(str(tmp_path), stage, dtype="bfloat16")
    loaded[stage] = hf.load_params(str(tmp_path), plan)
    # Each element of each tensor is read exactly once: replicated leaves once, sharded
    # leaves as 8 disjoint blocks, each layer's slice read by the device that holds it.
    assert sum(n for _, n in reads) == sum(v.size for v in weights.values())
    q_reads = [n for name, n in reads if name == "model.layers.1.self_attn.q_proj.weight"]
    assert q_reads == ([32 * 32 // 8] * 8 if stage == 3 else [32 * 32])
  assert bits(loaded[3]) == bits(loaded[1])
  np.testing.assert_array_equal(  # HF [out, in] -> our [in, out], layer 1.
      np.asarray(loaded[3]["layers"]["mlp"]["down_proj"]["kernel"][1]),
      weights["model.layers.1.mlp.down_proj.weight"].astype(ml_dtypes.bfloat16).T)
  # fp32 files into bf16 params round to nearest, as jnp does.
  write_hf(tmp_path / "f32", weights, config)
  _, plan = plan_for(str(tmp_path / "f32"), 3, dtype="bfloat16")
  assert bits(hf.load_params(str(tmp_path / "f32"), plan)) == bits(loaded[3])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_then_import_is_bit_exact(tmp_path, dtype):
  weights, config = hf_weights(**SMALL), hf_config(**SMALL, rope="parameters")
  write_hf(tmp_path / "in", weights, config)
  model, plan = plan_for(str(tmp_path / "in"), 3, dtype=dtype)
  params = hf.load_params(str(tmp_path / "in"), plan)
  # Small files: the export is split, as save_pretrained splits over 5GB.
  names = hf.save_params(params, model.config, str(tmp_path / "out"), max_shard_size=20_000)
  assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
  index = json.loads((tmp_path / "out" / hf.INDEX).read_text())
  item = np.dtype(dtype).itemsize
  assert index["metadata"]["total_size"] == sum(v.size for v in weights.values()) * item
  assert set(index["weight_map"]) == set(weights)
  assert set(index["weight_map"].values()) == set(names)
  files = {}
  for name in names:
    files.update(load_file(str(tmp_path / "out" / name)))
  assert {k: v.shape for k, v in files.items()} == {k: v.shape for k, v in weights.items()}
  for k, v in files.items():  # HF layout and values (fp32: the very input).
    np.testing.assert_array_equal(v, weights[k].astype(dtype), err_msg=k)
  out_config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert out_config["architectures"] == ["LlamaForCausalLM"] and out_config["model_type"] == "llama"
  assert out_config["torch_dtype"] == dtype and out_config["rope_theta"] == 10000.0
  assert out_config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}
  assert hf.config_overrides(str(tmp_path / "out")) == hf.config_overrides(str(tmp_path / "in"))
  again = hf.load_params(str(tmp_path / "out"), plan_for(str(tmp_path / "out"), 1, dtype)[1])
  assert bits(again) == bits(params)
  # One file when it fits; the earlier export's shards and index are gone.
  assert hf.save_params(params, model.config, str(tmp_path / "out")) == ["model.safetensors"]
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
  assert bits(hf.load_params(str(tmp_path / "out"), plan)) == bits(params)


def _break(folder, how):
  """Damages a valid HF folder; returns the path the error must name."""
  single = os.path.join(folder, "model.safetensors")
  if how == "no folder":
    return os.path.join(folder, "absent")
  if how == "no config.json":
    os.remove(os.path.join(folder, "config.json"))
    return folder
  if how == "no safetensors":
    os.remove(single)
    return folder
  if how == "truncated":
    with open(single, "r+b") as f:
      f.truncate(os.path.getsize(single) - 100)
    return single
  if how == "unknown architecture":
    config = json.load(open(os.path.join(folder, "config.json")))
    config.update(architectures=["PhiForCausalLM"], model_type="phi")
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    return os.path.join(folder, "config.json")
  w = load_file(single)
  if how == "wrong shape":
    w["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
  elif how == "missing tensor":
    del w["model.layers.1.mlp.up_proj.weight"]
  elif how == "unexpected tensor":
    w["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
  elif how == "index names a missing file":
    os.rename(single, os.path.join(folder, "model-00001-of-00002.safetensors"))
    json.dump({"weight_map": {k: f"model-0000{1 + (k == 'model.norm.weight')}-of-00002.safetensors"
                              for k in w}}, open(os.path.join(folder, hf.INDEX), "w"))
    return os.path.join(folder, "model-00002-of-00002.safetensors")
  save_file(w, single)
  return single


@pytest.mark.parametrize("how,words", [
    ("no folder", "no such folder"), ("no config.json", "no config.json"),
    ("no safetensors", "no safetensors files"), ("truncated", "truncated"),
    ("unknown architecture", "PhiForCausalLM"),
    ("wrong shape", "model.layers.1.self_attn.k_proj.weight has shape (8, 32), config.json "
                    "implies (16, 32)"),
    ("missing tensor", "missing tensor model.layers.1.mlp.up_proj.weight"),
    ("unexpected tensor", "unexpected tensor model.layers.0.self_attn.q_norm.weight"),
    ("index names a missing file", "missing")])
def test_bad_folders_are_errors_naming_the_file(tmp_path, how, words):
  write_hf(tmp_path, hf_weights(**SMALL), hf_config(**SMALL))
  _, plan = plan_for(str(tmp_path), 3)  # Before the damage: config.json may go.
  path = _break(str(tmp_path), how)
  with pytest.raises(hf.HFError) as error:
    hf.load_params(path if how == "no folder" else str(tmp_path), plan)
  message = str(error.value)
  assert path in message and words in message, message


def test_check_config_names_every_contradicting_key(tmp_path):
  write_hf(tmp_path, {}, hf_config(**SMALL, rope="parameters"))
  model = {"name": "llama", **hf.config_overrides(str(tmp_path))}
  assert model["rope_scaling_factor"] == 8.0 and model["rope_original_context"] == 64
  hf.check_config(str(tmp_path), model)  # Agrees: no error.
  with pytest.raises(hf.HFError) as error:
    hf.check_config(str(tmp_path), {**model, "n_kv_heads": 4, "rope_original_context": 8192})
  assert "model.n_kv_heads: config 4, config.json 2" in str(error.value)
  assert "--config.model.rope_original_context=64" in str(error.value)
  # Without scaling in config.json, a config that scales is a difference too; the other
  # RoPE-scaling keys are then ignored.
  write_hf(tmp_path, {}, hf_config(**SMALL))
  model = {"name": "llama", **hf.config_overrides(str(tmp_path)), "rope_original_context": 1}
  hf.check_config(str(tmp_path), model)
  with pytest.raises(hf.HFError, match="model.rope_scaling_factor: config 8.0"):
    hf.check_config(str(tmp_path), {**model, "rope_scaling_factor": 8.0})


def test_seq_len_past_max_position_embeddings_is_a_warning(tmp_path):
  write_hf(tmp_path, {}, dict(hf_config(**SMALL), max_position_embeddings=16))
  assert hf.seq_len_warning(str(tmp_path), 16) is None
  warning = hf.seq_len_warning(str(tmp_path), 32)
  assert warning.startswith(
      "warning: train.seq_len=32 is longer than max_position_embeddings=16 in ")
  assert "--config.train.seq_len=16" in warning
  write_hf(tmp_path, {}, hf_config(**SMALL))  # No max_position_embeddings: nothing to say.
  assert hf.seq_len_warning(str(tmp_path), 1 << 20) is None


TRAIN_ARGS = [os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "tiny.py")]


def test_train_init_from_hf(tmp_path, capsys):
  from zerojax import data
  from zerojax.config import base_config
  shape = dict(V=256, D=32, L=2, H=4, K=2, F=64)
  # A context of 8 positions, trained at 16: allowed (context extension), with a warning.
  write_hf(tmp_path / "hf", hf_weights(**shape), dict(hf_config(**shape),
                                                      max_position_embeddings=8))
  model_args = [f"--config.model.{k}={v}" for k, v in dict(
      vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
      rope_theta=10000.0, attention_block=16, loss_chunk=16).items()]
  run_args = ["--config.precision.param_dtype=float32", "--config.precision.compute_dtype=float32",
              "--config.optimizer.update_rule=nearest", "--config.optimizer.state_dtype=float32",
              "--config.train.steps=2", "--config.optimizer.warmup_steps=1",
              "--config.train.global_batch_size=8",
              "--config.train.seq_len=16", "--config.train.log_every=1",
              "--config.train.eval_every=0", "--config.train.eval_batches=1",
              f"--config.init_from={tmp_path / 'hf'}", f"--config.workdir={tmp_path / 'run'}"]
  # train.py's main in this process (`test_train.train_here`: its 8 CPU devices, no JAX
  # start): what is tested is the import and the first loss, not a process boundary.
  result = train_here(*TRAIN_ARGS[1:], *model_args, *run_args)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "warning: train.seq_len=16 is longer than max_position_embeddings=8" in result.stdout
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  records = [json.loads(line) for line in lines]
  first = next(r["loss"] for r in records if r.get("step") == 1 and "loss" in r)
  # The loss of the imported params on train.py's first batch (seed 0, step 0).
  model, plan = plan_for(str(tmp_path / "hf"), 0, devices=1)
  params = hf.load_params(str(tmp_path / "hf"), plan)
  train_tokens, _ = data.load_tokens(base_config().data, 256, 16)
  batch = {"tokens": data.batch_at(train_tokens, 0, 8, 16, 0)}
  expected = float(jax.jit(model.loss)(params, batch))
  print(f"train.py first loss {first:.7f}, imported params {expected:.7f}")
  assert first == pytest.approx(expected, rel=1e-5)
  # The final checkpoint back to a HF folder: the trained params, the same config.json.
  # The CLI's main in this process (no second interpreter and JAX start-up): the same
  # 8 CPU devices the command would have, restored at stage 3 over all of them.
  capsys.readouterr()
  assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
  assert "wrote" in capsys.readouterr().out
  assert hf.config_overrides(str(tmp_path / "out")) == hf.config_overrides(str(tmp_path / "hf"))
  trained = hf.load_params(str(tmp_path / "out"), plan)
  assert float(jax.jit(model.loss)(trained, batch)) < expected  # Two steps of training.
  # A model section that contradicts config.json: exit 2 naming the key, no traceback.
  # In this process too: train.py checks it before it touches JAX beyond
  # jax.device_count() (no compile, no jax.config change), so nothing leaks.
  code = zerojax.train.main([*TRAIN_ARGS[1:], *model_args, "--config.model.d_ff=128",
                             *run_args[:-1], f"--config.workdir={tmp_path / 'other'}"])
  assert code == 2 and "model.d_ff: config 128, config.json 64" in capsys.readouterr().err


def test_export_without_a_checkpoint_is_one_error_line(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "zerojax.hf.export", "--workdir", str(tmp_path), "--out",
       str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == exits.BAD_INPUT, result.stderr[-2000:]
  assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result.stderr
  assert "no checkpoints directory" in result.stderr and not (tmp_path / "out").exists()
