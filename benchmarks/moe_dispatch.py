"""Compiled bytes of a mixture-of-experts block's dispatch: dropless by `jax.lax.ragged_dot`,
dropless in tiles (`moe.tile_mlp`) and the capacity mode's batched matmuls, forward
and forward + backward.

Compiles (never runs) the experts' MLP over N k token rows into E experts on XLA:CPU and
prints XLA's temporary bytes and the largest buffer of each program; with `--target`,
the same programs compiled by XLA's GPU compiler for that GPU (no GPU needed; the
`gpu-compile` extra). Results: `benchmarks/README.md` "Mixture-of-experts dispatch".

  python benchmarks/moe_dispatch.py                       # N k = 2048, D 128, F 96, E 8
  python benchmarks/moe_dispatch.py --experts 64 --target h100
"""

import argparse
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=2048, help="N k, the assignments")
  parser.add_argument("--d_model", type=int, default=128)
  parser.add_argument("--d_ff", type=int, default=96)
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--target", default="", help="also XLA's GPU compiler for this GPU")
  args = parser.parse_args()
  # pylint: disable=import-outside-toplevel  (the GPU target's flags come before JAX starts)
  if args.target:
    from zerojax.gpu import compile as gpu_compile, targets
    spec = targets.parse(args.target, 1)
    targets.without_driver()
    gpu_compile.prepare(1)
  import jax
  import jax.numpy as jnp

  from zerojax.models import moe

  m, d, f, e = args.rows, args.d_model, args.d_ff, args.experts
  x = jax.ShapeDtypeStruct((m, d), jnp.float32)
  w = moe.Experts(*(jax.ShapeDtypeStruct(shape, jnp.float32)
                    for shape in ((e, d, f), (e, d, f), (e, f, d))))
  sizes = jnp.full((e,), m // e, jnp.int32)  # Balanced: every expert m / e rows.
  blocks = jax.ShapeDtypeStruct((e, m // e, d), jnp.float32)  # Capacity factor 1.

  def mlp(dot, x, w):  # An expert MLP (gate, up, down) by a grouped matmul `dot`.
    return dot(jax.nn.silu(dot(x, w.gate)) * dot(x, w.up), w.down)

  def ragged(x, w):
    return mlp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)

  def batched(b, w):
    return mlp(lambda a, b: jnp.einsum("ecd,edf->ecf", a, b), b, w)

  tile = 64
  tiles = -(-m // tile) + e  # `moe.dropless_tiled`'s bound: each expert's run padded.
  padded = jax.ShapeDtypeStruct((tiles * tile, d), jnp.float32)
  # Every tile of the bound occupied (the loops' most trips), E / tiles an expert.
  ends = ((jnp.arange(e) + 1) * tiles // e).astype(jnp.int32)

  def tiled(x, w):
    return moe.tile_mlp(x, w, ends, jax.nn.silu, tile)

  programs = {
      "dropless (ragged_dot)": (ragged, (x, w)),
      f"dropless (tiles of {tile})": (tiled, (padded, w)),
      "capacity 1.0 (batched)": (batched, (blocks, w)),
  }
  print(f"{m} rows into {e} experts of [{d}, {f}], fp32 (useful product: "
        f"{m * d * f * 6 / 1e9:.3f} GFLOP forward)")
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
  for name, (fn, shapes) in programs.items():
    for label, prog in (("forward", fn), ("+ backward", jax.grad(
        lambda *a, fn=fn: jnp.sum(fn(*a)), argnums=(0, 1)))):
      compiled = jax.jit(prog).lower(*shapes).compile()
      rows = [("XLA:CPU", compiled.memory_analysis().temp_size_in_bytes, compiled.as_text())]
      if args.target:
        gpu = gpu_compile.compile_jitted(jax.jit(prog), shapes, mesh, spec)
        rows.append((f"GPU {spec}", gpu.memory["temporaries"], gpu.hlo))
      for where, temp, text in rows:
        big = max(re.findall(r"f32\[[\d,]+\]", text), default="f32[]",
                  key=lambda t: math.prod(int(n) for n in t[4:-1].split(",") if n))
        print(f"  {name:24s} {label:11s} {where:12s} temporaries {temp / 2**20:8.2f} MiB"
              f"  largest buffer {big}")

if __name__ == "__main__":
  main()
