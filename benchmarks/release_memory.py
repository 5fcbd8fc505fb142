"""Compiled temporaries of a stage-3 step with and without gradient release.

Compiles (never runs) the normal stage-3 step and the release step of a bf16 MlpLM
with Kahan AdamW (bf16 moments) on 8 fake CPU devices with the XLA:CPU memory flags
(as train.py and the planner compile), and prints XLA's temporary bytes and the
largest fp32 buffers alive at each program's peak:

  python benchmarks/release_memory.py --layers 16 --d_model 512 --d_ff 2048
"""

import argparse
import tempfile

from zerojax.runtime.devices import fake_cpu_devices


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=5)
  parser.add_argument("--d_model", type=int, default=128)
  parser.add_argument("--d_ff", type=int, default=512)
  args = parser.parse_args()
  fake_cpu_devices(8)
  # pylint: disable=import-outside-toplevel  (JAX starts after the device flags)
  import jax
  import jax.numpy as jnp

  import zerojax
  from zerojax import optim
  from zerojax.models.mlp_lm import MlpLM
  from zerojax.release import make_release_step
  from zerojax.runtime import xla_dump

  bf16 = jnp.bfloat16
  model = MlpLM(vocab_size=64, d_model=args.d_model, d_ff=args.d_ff, n_layers=args.layers,
                context=4, param_dtype=bf16, compute_dtype=bf16, remat="full")
  tx = optim.adamw(1e-3, b2=0.95, state_dtype=bf16, update_rule="kahan")
  mesh = zerojax.make_mesh(1, 8)
  plan = zerojax.make_plan(mesh, 3, jax.eval_shape(model.init, jax.random.key(0)), tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  sharding = jax.sharding.NamedSharding(mesh, plan.batch_spec)
  batch = {"tokens": jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=sharding)}
  stack = sum(x.size for x in jax.tree.leaves(plan.params["layers"]))
  print(f"layer stack: {stack} params; its fp32 gradient shard: {4 * stack // 8} bytes")
  steps = {"normal": zerojax.make_train_step(plan, model.loss, tx),
           "release": make_release_step(plan, model.layered(), tx)}
  for name, step in steps.items():
    with tempfile.TemporaryDirectory() as dump:
      compiled = step.lower(zerojax.abstract_state(plan), batch).compile(compiler_options=dict(
          xla_dump_to=dump, xla_dump_hlo_as_text=True, xla_dump_hlo_module_re="jit_step"))
      fp32 = [(size, shape) for size, shape, _ in xla_dump.live_at_peak(dump)
              if shape.startswith("f32")]
    memory = compiled.memory_analysis()
    print(f"{name}: temp {memory.temp_size_in_bytes} bytes, arguments "
          f"{memory.argument_size_in_bytes} bytes; largest fp32 at the peak: {fp32[:3]}")


if __name__ == "__main__":
  main()
