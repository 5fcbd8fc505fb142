"""Weight gradients in fp32 (`upcast_params`): their error against float64, before and after.

    python benchmarks/weight_grads.py     # ~1.5 min on 2 cores -> results/weight_grads.json

A bf16 Llama (d_model 64, 2 layers, vocab 256; 16 sequences of 128 tokens, the loss in 4
chunks of 32) on 8 fake CPU devices. The step's mean gradient (kept by an optax transform
whose state is the gradient) for each `upcast_params` ('none': today's path, every local
gradient rounded to bf16 before its fp32 reduction; 'gathered': the layer stack's
weights seen in fp32 where the model gathers them a layer at a time (stage 3); 'all':
every param) at stage 0, at stage 3, and at stage 3 with 2 microbatches, each against
the gradient of the same model in float64 (params: the same
bf16 values, activations float64). Error = ||g - g64|| / ||g64|| per kernel; the summary
is their root mean square. Most of it is the bf16 forward and backward activations', which
every mode shares; `matmul` isolates what the change removes: one weight gradient x^T dy
(4096 tokens, 256 x 256) from bf16 x and dy, emitted in bf16 or fp32
(`zerojax.models.llama.cast_matmul`), against float64 on the same inputs.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# XLA reads the device count when JAX starts its backend (in main), not at import.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models.llama import LlamaConfig, LlamaLM, cast_matmul  # noqa: E402
from zerojax.runtime.devices import fake_cpu_devices  # noqa: E402
from zerojax.testing import numerics  # noqa: E402

UPCAST = ("none", "gathered", "all")
CASES = ((0, 1), (3, 1), (3, 2))  # (stage, microbatches)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                "weight_grads.json"))
  args = ap.parse_args()
  fake_cpu_devices(8)
  kw = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
            attention_block=32, loss_chunk=32)
  model, tx = LlamaLM(LlamaConfig(**kw)), numerics.keep_gradient()
  params = model.init(jax.random.key(0))
  batch = {"tokens": jax.random.randint(jax.random.key(1), (16, 129), 0, 256)}
  wide = LlamaLM(LlamaConfig(**kw, param_dtype=jnp.float64, compute_dtype=jnp.float64))
  ref = numerics.float64_grads(wide.loss, params, batch)

  rms = lambda e: float(np.sqrt(np.mean(np.square(list(e.values())))))  # noqa: E731
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  rows = []
  for stage, microbatches in CASES:
    plan = zerojax.make_plan(zerojax.make_mesh(1, 8), stage, shapes, tx,
                             logical_axes=model.logical_axes(), min_shard_size=0)
    row = {"stage": stage, "microbatches": microbatches}
    for upcast in UPCAST:
      state = zerojax.init_state(plan, model.init, tx, jax.random.key(0),
                                 params=jax.tree.map(jnp.copy, params))
      step = zerojax.make_train_step(plan, model.loss, tx, microbatches=microbatches,
                                     upcast_params=upcast, donate=False)
      found = numerics.relative_errors(step(state, batch)[0].opt_state, ref)
      row[upcast] = {"rms": rms(found), "kernels": found}
    for upcast in UPCAST[1:]:
      row[f"ratio_{upcast}"] = row[upcast]["rms"] / row["none"]["rms"]
    rows.append(row)
    print(f"stage {stage}, {microbatches} microbatch(es): rms error none "
          f"{row['none']['rms']:.4e}, gathered {row['gathered']['rms']:.4e} "
          f"({row['ratio_gathered']:.3f}), all {row['all']['rms']:.4e} ({row['ratio_all']:.3f})")

  x, dy = (jax.random.normal(jax.random.key(k), (4096, 256), jnp.bfloat16) for k in (2, 3))
  matmul = {}
  for dtype in (jnp.bfloat16, jnp.float32):
    w = jnp.zeros((256, 256), dtype)
    # x and dy as arguments: closed over, XLA would constant-fold the product.
    dw = jax.jit(lambda w, x, dy: jax.vjp(
        lambda w: cast_matmul(x, w, None, jnp.bfloat16), w)[1](dy)[0])(w, x, dy)
    exact = np.float64(x).T @ np.float64(dy)
    matmul[jnp.dtype(dtype).name] = float(np.linalg.norm(np.float64(dw) - exact)
                                          / np.linalg.norm(exact))
  matmul["ratio"] = matmul["float32"] / matmul["bfloat16"]
  print(f"one weight gradient from bf16 inputs: error emitted in bf16 {matmul['bfloat16']:.3e}, "
        f"in fp32 {matmul['float32']:.3e} (ratio {matmul['ratio']:.2e})")
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump({"jax": jax.__version__, "model": kw, "batch": [16, 128], "rows": rows,
               "matmul": matmul}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
