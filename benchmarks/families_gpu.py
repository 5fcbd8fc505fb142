"""Sliding-window attention on a GPU: cuDNN's fused kernel against the fp32 reference.

    python benchmarks/families_gpu.py        # one GPU, ~1 min: results/families_gpu.json
    python benchmarks/families_gpu.py --cpu  # tiny shapes, XLA's kernel (no cuDNN)

What runs where the CPU suite cannot look (tests/test_families.py checks every CPU path):
1. `dot_product_attention` with a window in bf16 (cuDNN's `local_window_size`) against
   the fp32 blocked kernel, values and the q/k/v gradients, windows 0 (causal), 128 and
   511 at 2 x 2048 positions, GQA 16/4 heads of 128, and 128 on packed rows (segment
   ids: the mask cuDNN takes as a bias); and the compiled program's cuDNN custom call
   (present or not).
2. A Gemma 3-like decoder (local and global layers alternating, so each layer picks its
   kernel by `lax.cond` inside the remat layer loop) in bf16 with attention 'auto'
   (cuDNN), against the same params in fp32 with the blocked kernel: the loss and the
   gradient's relative error.
3. Step time of the windowed cuDNN kernel (window 1024) against the causal one at 16384
   positions: whether cuDNN skips the blocks outside the window.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerojax.models import attention, llama  # noqa: E402


def _relative(a, b) -> float:
  a, b = (np.asarray(x, np.float64) for x in (a, b))
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def kernels(B, T, H, K, Dh, block):
  rs = np.random.RandomState(0)
  q32 = jnp.asarray(rs.normal(size=(B, T, H, Dh)), jnp.float32)
  k32, v32 = (jnp.asarray(rs.normal(size=(B, T, K, Dh)), jnp.float32) for _ in range(2))
  ct = jnp.asarray(rs.normal(size=(B, T, H, Dh)), jnp.float32)
  bf = lambda x: x.astype(jnp.bfloat16)
  # Packed rows: segments of ~200 positions (SFT's examples) with the window inside them.
  seg = jnp.asarray(np.cumsum(rs.rand(B, T) < 1 / 200, axis=1), jnp.int32)
  rows = []
  for window, segments in ((0, None), (128, None), (511, None), (128, seg)):
    mask = attention.Mask(window, Dh ** -0.5)
    ref = lambda q, k, v: attention.blocked_attention(q, k, v, block, segments, mask)
    fused = lambda q, k, v: attention.dot_product_attention(q, k, v, segments, mask)

    def vjp(f):
      def run(q, k, v):
        out, back = jax.vjp(f, q, k, v)
        return out, back(ct.astype(q.dtype))
      return jax.jit(run)

    try:
      compiled = jax.jit(fused).lower(bf(q32), bf(k32), bf(v32)).compile().as_text()
      (got, got_g) = vjp(fused)(bf(q32), bf(k32), bf(v32))
    except Exception as e:  # noqa: BLE001  A combination cuDNN refuses: recorded, not fatal.
      rows.append(dict(window=window, packed=segments is not None, error=str(e)[:300]))
      print(rows[-1], flush=True)
      continue
    (want, want_g) = vjp(ref)(q32, k32, v32)
    (bf_blocked, _) = vjp(ref)(bf(q32), bf(k32), bf(v32))
    rows.append(dict(window=window, packed=segments is not None,
                     cudnn_call="cudnn" in compiled.lower(),
                     out_rel=_relative(got, want), bf16_blocked_rel=_relative(bf_blocked, want),
                     grad_rel=[_relative(g, w) for g, w in zip(got_g, want_g)]))
    print(rows[-1], flush=True)
  return rows


def model(T, cpu):
  c = llama.LlamaConfig(
      vocab_size=1024, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512,
      family="gemma3", head_size=128, qk_norm=True, norm_offset=1.0, scale_embeddings=True,
      hidden_act="gelu_tanh", post_norms=True, query_pre_attn_scalar=128, sliding_window=128,
      sliding_window_pattern=2, rope_local_theta=10000.0, rope_theta=1e6,
      rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_embeddings=True,
      attention="auto", attention_block=256, loss_chunk=512,
      param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
  ref = dataclasses.replace(c, attention="blocked", param_dtype=jnp.float32,
                            compute_dtype=jnp.float32)
  params = llama.LlamaLM(ref).init(jax.random.key(0))
  batch = {"tokens": jax.random.randint(jax.random.key(1), (2, T + 1), 0, c.vocab_size)}
  grad = lambda m: jax.jit(jax.value_and_grad(m.loss))
  low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  program = grad(llama.LlamaLM(c)).lower(low, batch).compile().as_text()
  (loss, g), (want_loss, want_g) = grad(llama.LlamaLM(c))(low, batch), grad(
      llama.LlamaLM(ref))(params, batch)
  flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(t)])
  row = dict(kernel=attention.attention_kernel("auto", jnp.bfloat16), cudnn_call="cudnn" in
             program.lower(), loss=float(loss), fp32_loss=float(want_loss),
             grad_rel=_relative(flat(g), flat(want_g)), cpu=cpu)
  print(row, flush=True)
  return row


def speed(T, Dh=128, H=16, K=8):
  rs = np.random.RandomState(0)
  q = jnp.asarray(rs.normal(size=(1, T, H, Dh)), jnp.bfloat16)
  k, v = (jnp.asarray(rs.normal(size=(1, T, K, Dh)), jnp.bfloat16) for _ in range(2))
  out = {}
  for window in (0, 1024):
    mask = attention.Mask(window)
    f = jax.jit(jax.grad(lambda q, k, v: attention.dot_product_attention(
        q, k, v, None, mask).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    jax.block_until_ready(f(q, k, v))
    start = time.perf_counter()
    for _ in range(10):
      r = f(q, k, v)
    jax.block_until_ready(r)
    out[f"window_{window}_ms"] = (time.perf_counter() - start) / 10 * 1e3
  print(out, flush=True)
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--cpu", action="store_true")
  parser.add_argument("--out", default="benchmarks/results/families_gpu.json")
  args = parser.parse_args()
  result = {"device": str(jax.devices()[0]), "jax": jax.__version__}
  if args.cpu:
    result["kernels"] = kernels(1, 600, 4, 2, 16, 128)
    result["model"] = model(256, True)
  else:
    result["kernels"] = kernels(2, 2048, 16, 4, 128, 512)
    result["model"] = model(2048, False)
    result["speed_16384"] = speed(16384)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
