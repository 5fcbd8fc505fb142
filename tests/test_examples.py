"""Every script in examples/ runs, in this process on the suite's 8 fake CPU devices (a
script's `__main__` asks for the same 8 before JAX starts), with fewer steps; what each
one claims is asserted here."""

import importlib.util
import pathlib

import jax
import numpy as np

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def load(name):
  spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_example_is_tested():
  tested = {"linen_cnn_batchnorm", "linen_scan_transformer", "frozen_layers_microbatches",
            "checkpoint_resume", "nnx_model"}
  assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_linen_cnn_batchnorm_learns():
  out = load("linen_cnn_batchnorm").main(steps=12)
  assert float(out["eval"]["accuracy"]) > 0.5  # 10 classes: chance is 0.1
  stats = out["state"].model_state["batch_stats"]
  assert all(np.any(np.asarray(v) != 0) for v in jax.tree.leaves(stats))


def test_linen_scan_transformer_learns_in_bf16():
  out = load("linen_scan_transformer").main(steps=12)
  assert float(out["train"]["loss"]) < 0.8 * np.log(128)
  # The wrapped optax AdamW keeps its moments in fp32 beside the bf16 params.
  dtypes = {x.dtype.name for x in jax.tree.leaves(out["state"].opt_state)
            if x.ndim and x.dtype.kind == "f"}
  assert "float32" in dtypes


def test_frozen_layers_microbatches():
  out = load("frozen_layers_microbatches").main(steps=4)  # asserts the frozen embedding
  assert np.isfinite(float(out["train"]["loss"]))


def test_checkpoint_resume_is_bit_exact(tmp_path):
  out = load("checkpoint_resume").main(str(tmp_path), steps=8)
  assert out["same"] and out["saved_at"] == 4


def test_nnx_model_with_batch_norm_and_dropout():
  out = load("nnx_model").main(steps=12)
  assert float(out["eval"]["accuracy"]) > 0.4  # 4 classes: chance is 0.25
  stats = out["state"].model_state["norm"]
  assert np.any(np.asarray(stats["mean"]) != 0) and np.any(np.asarray(stats["var"]) != 1)
  # The module comes back holding the trained statistics.
  np.testing.assert_array_equal(np.asarray(out["module"].norm.mean[...]),
                                np.asarray(stats["mean"]))
