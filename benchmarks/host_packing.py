"""How much of a streamed layer's host copies XLA's GPU compiler schedules under compute:
a layer's leaves as separate host stacks against one packed host buffer per layer.

    python benchmarks/host_packing.py            # ~1 min on 2 cores, no GPU needed

A synthetic backward loop (`streaming.layers`' read-ahead, as gradient release reads its
offloaded state): L layers of K [D, D] bf16 weights in host memory, each trip multiplying
a [T, D] activation by its layer's K weights while the next layer's copy is in flight,
then updating the weights and writing them back into the host stack ('at the end' of
the trip, or 'behind': during the next trip, before or after its read-ahead). Compiled
for one RTX 4090 with train.py's XLA flag profile; read off the scheduled module
(`streaming.schedule`): the share of the loop's host-to-device bytes with compute
scheduled between copy start and done, and how many of its writes have compute under
them. A schedule, not a measurement.

This is the question of issue 35's first item (one copy per layer): the shipped recipes
stream each of a layer's leaves (9 params, their optimizer slices) as its own host
stack, and XLA's schedule hides 43% of the 70B-on-4090 recipe's copied bytes.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# XLA reads the device count when JAX starts its backend (in main), not at import.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from zerojax.config import load_config  # noqa: E402
from zerojax.gpu import compile as gpu_compile, targets  # noqa: E402
from zerojax.runtime.devices import fake_cpu_devices  # noqa: E402
from zerojax.runtime.units import fmt_bytes  # noqa: E402
from zerojax.streaming import layers, schedule  # noqa: E402
from zerojax.testing import markdown_table  # noqa: E402


def measure(packed: bool, write: str, layers_: int, leaves: int, width: int, tokens: int,
            target: str) -> dict:
  L, K, D = layers_, leaves, width
  mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))

  def unpack(layer):  # One packed row -> K [D, D] weights (slices of the arrived copy).
    return [layer[k * D * D:(k + 1) * D * D].reshape(D, D) for k in range(K)] if packed \
        else layer

  def repack(ws):
    return jnp.concatenate([w.reshape(-1) for w in ws]) if packed else ws

  def put(stack, layer, i):  # In place into the host stack.
    out = layers.outbound(layer, True)
    return jax.tree.map(lambda s, o: jax.lax.dynamic_update_index_in_dim(s, o, i, 0), stack,
                        out)

  def step(stack, x):
    def trip(k, state):
      x, stack, layer, pending = state
      i = L - 1 - k
      # "behind": the previous trip's layer goes back during this one, its write issued
      # before the read-ahead or after it (the read's barrier orders them).
      if write == "behind":
        stack = put(stack, pending, jnp.minimum(i + 1, L - 1))
      ahead, stack = layers.read_ahead(
          stack, lambda s: layers.fetch(s, jnp.maximum(i - 1, 0), True))
      if write == "behind, after the read":
        stack = put(stack, pending, jnp.minimum(i + 1, L - 1))
      ws = unpack(layer)
      for w in ws:
        x = jnp.tanh(x @ w)
      new = repack([w - 1e-3 * (x[:D].T @ x[:D]).astype(w.dtype) for w in ws])
      if write == "at the end":
        stack = put(stack, new, i)
      return x, stack, ahead, new

    first = layers.fetch(stack, L - 1, True)
    x, stack, _, last = jax.lax.fori_loop(0, L, trip, (x, stack, first, first))
    if write.startswith("behind"):
      stack = put(stack, last, 0)
    return x, stack

  host = NamedSharding(mesh, P(), memory_kind="pinned_host")
  stack = (jax.ShapeDtypeStruct((L, K * D * D), jnp.bfloat16, sharding=host) if packed else
           [jax.ShapeDtypeStruct((L, D, D), jnp.bfloat16, sharding=host) for _ in range(K)])
  x = jax.ShapeDtypeStruct((tokens, D), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  # train.py's XLA flag profile (its collectives' thresholds do not matter on one device).
  options = gpu_compile.profile_options(load_config(os.path.join(ROOT, "configs", "tiny.py")))
  out = gpu_compile.compile_jitted(jax.jit(step, donate_argnums=0), (stack, x), mesh,
                                   targets.parse(target), options)
  moves = [m for m in schedule.host_moves(out.hlo) if not m.computation.startswith("main")]
  reads = [m for m in moves if not m.to_host]
  writes = [m for m in moves if m.to_host]
  return dict(layout="one buffer a layer" if packed else f"{K} stacks",
              write=write, copies_in=len(reads),
              hidden_in=sum(m.nbytes for m in reads if m.overlaps)
              / sum(m.nbytes for m in reads),
              writes=len(writes), writes_under_compute=sum(bool(m.overlaps) for m in writes),
              temporaries=out.memory["temporaries"])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--leaves", type=int, default=9, help="weights a layer (a Llama's: 9)")
  ap.add_argument("--width", type=int, default=2048)
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--target", default="rtx4090:1")
  args = ap.parse_args(argv)
  fake_cpu_devices(1, memory_flags=False)

  rows = [measure(packed, write, args.layers, args.leaves, args.width, args.tokens,
                  args.target)
          for write in ("none", "at the end", "behind", "behind, after the read")
          for packed in (False, True)]
  print(markdown_table(
      ["layout", "write-back", "copies in (a trip)", "bytes in under compute",
       "writes under compute", "temporaries"],
      [[r["layout"], r["write"], r["copies_in"], f"{r['hidden_in']:.0%}",
        f"{r['writes_under_compute']} of {r['writes']}", fmt_bytes(r["temporaries"])]
       for r in rows]))


if __name__ == "__main__":
  main()
