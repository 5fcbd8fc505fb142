"""Per-device memory of a Llama-70B ZeRO-3 train step, compiled but never allocated.

    python benchmarks/memory_70b.py --devices 64 [--xla-cpu-memory-flags] [--layers 8]
        [--top 15]

Lowers the step (bf16 params, AdamW with bf16 moments and a Kahan buffer, ZeRO stage 3
over `--devices` fake CPU devices, one 4096-token sequence per device, remat 'full',
global-norm clipping) on `zerojax.abstract_state` and prints XLA's memory analysis:
arguments (the sharded state), temporaries, outputs (aliased to the donated
arguments) and the total a device needs, arguments + temporaries. `--top N` also
dumps the compiled HLO and lists the N largest temporaries alive at the peak, with
the JAX op that made each, to see where the memory goes. `--layers 8` is a quick
proxy (seconds to compile): what grows with the params scales with the layers.

`--xla-cpu-memory-flags` adds zerojax.runtime.devices' XLA:CPU flags: the memory-optimizing
scheduler and no while-loop-invariant code motion (XLA:CPU upcasts bf16 and then
hoists whole-stack f32 copies out of the layer loop).
"""

import argparse
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
# pylint: disable=wrong-import-position
from zerojax.runtime import xla_dump
from zerojax.runtime.device_env import CPU_MEMORY_FLAGS
from zerojax.runtime.devices import fake_cpu_devices


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=64, help="fake CPU devices (ZeRO shards)")
  p.add_argument("--layers", type=int, default=80, help="decoder layers (80 = Llama 70B)")
  p.add_argument("--seq", type=int, default=4096, help="tokens per device")
  p.add_argument("--xla-cpu-memory-flags", action="store_true", help=" ".join(CPU_MEMORY_FLAGS))
  p.add_argument("--top", type=int, default=0, help="list the N largest temporaries at the peak")
  p.add_argument("--dump", default=None, help="keep the XLA dump in this directory")
  return p.parse_args()


def peak_buffers(dump_dir: str, n: int) -> list[str]:
  """The n largest temporaries live at the peak (`zerojax.runtime.xla_dump.live_at_peak`), with
  the JAX op that made each."""
  at_peak = xla_dump.live_at_peak(dump_dir)
  if not at_peak:
    return ["(no buffer assignment in the dump)"]
  values, ops = xla_dump.step_files(dump_dir) + "-buffer-assignment-values.txt", {}
  if os.path.exists(values):
    with open(values) as f:
      ops = dict(re.findall(r"from instruction: %(\S+) = .*?op_name=\"([^\"]*)\"", f.read()))
  total = sum(size for size, *_ in at_peak)
  rows = [f"{total / 1e9:8.2f} GB of temporaries live at the peak; the largest:"]
  rows += [f"{size / 1e9:8.2f} GB  {shape:24s} {name:28s} {ops.get(name.split('{')[0], '')[-70:]}"
           for size, shape, name in at_peak[:n]]
  return rows


def main():
  args = parse_args()
  dump = args.dump or (tempfile.mkdtemp(prefix="memory_70b_") if args.top else None)
  dump_flags = [f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text",
                "--xla_dump_hlo_module_re=.*step.*"] if dump else []
  # Read when JAX starts its backend (the first compile below), not at import.
  fake_cpu_devices(args.devices, *dump_flags, memory_flags=args.xla_cpu_memory_flags)

  import jax
  import jax.numpy as jnp

  import zerojax
  from zerojax import optim
  from zerojax.models import llama

  config = llama.LlamaConfig(
      vocab_size=128256, d_model=8192, n_layers=args.layers, n_heads=64, n_kv_heads=8,
      d_ff=28672, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192),
      attention_block=512, loss_chunk=1024, remat="full")
  model = llama.LlamaLM(config)
  tx = optim.adamw(1e-4, b2=0.95, weight_decay=0.1, state_dtype=jnp.bfloat16, update_rule="kahan")
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  plan = zerojax.make_plan(zerojax.make_mesh(1, args.devices), 3, shapes, tx,
                           logical_axes=model.logical_axes())
  step = zerojax.make_train_step(plan, model.loss, tx, max_grad_norm=1.0)
  batch = {"tokens": jax.ShapeDtypeStruct((args.devices, args.seq + 1), jnp.int32)}
  t0 = time.time()
  compiled = step.lower(zerojax.abstract_state(plan), batch).compile()
  seconds = time.time() - t0
  m = compiled.memory_analysis()
  G = 1e9
  params = llama.param_count(config)
  print(f"Llama {params / 1e9:.1f}B ({args.layers} layers), ZeRO-3 over {args.devices} "
        f"devices, {args.seq} tokens/device, XLA:CPU memory flags "
        f"{'on' if args.xla_cpu_memory_flags else 'off'} (compiled in {seconds:.0f} s)")
  print(f"per device: args {m.argument_size_in_bytes / G:.1f} GB  temp "
        f"{m.temp_size_in_bytes / G:.1f} GB  output {m.output_size_in_bytes / G:.1f} GB "
        f"(aliased {m.alias_size_in_bytes / G:.1f})  total (args + temp) "
        f"{(m.argument_size_in_bytes + m.temp_size_in_bytes) / G:.1f} GB")
  local = params / args.devices
  print(f"temp per local param element: {m.temp_size_in_bytes / local:.1f} bytes")
  if args.top:
    print(f"XLA dump: {dump}")
    print("\n".join(peak_buffers(dump, args.top)))


if __name__ == "__main__":
  main()
