"""How much of a streamed layer's host copies XLA's GPU compiler schedules under compute:
a layer's leaves as separate host stacks or one packed host buffer per layer, the stacks
whole or interleaved over 3 buffers, and how many host copies XLA keeps in flight.

    python benchmarks/host_packing.py            # ~10 s on 2 cores (20 compiles), no GPU needed

A synthetic backward loop (`streaming.layers`' read-ahead, as gradient release reads its
offloaded state): L layers of K [D, D] bf16 weights in host memory, each trip multiplying
a [T, D] activation by its layer's K weights while the next layer's copy is in flight,
then updating the weights and writing them back into the host stack ('at the end' of
the trip, or 'behind': during the next trip, before or after its read-ahead). With 3
interleaved buffers, layer i lives in buffer i % 3, so a trip reads layer i-1 from one
buffer and writes layer i+1 behind into another, and no barrier orders the two.
Compiled for one RTX 4090 with train.py's XLA flag profile, at XLA's limit of 2 async
computations in flight (a host copy is one) and at
`xla_gpu_experimental_parallel_async_compute_limit=64`; read off the scheduled module
(`streaming.schedule`): the share of the loop's bytes read and written with compute
scheduled between copy start and done. A schedule, not a measurement.

This is the question of issue 35's first item (one copy per layer): the shipped recipes
stream each of a layer's leaves (9 params, their optimizer slices) as its own host
stack; in their own trip XLA's schedule put compute under 43% of the 70B-on-4090
recipe's copied bytes. Release writing behind (`optimizer.release_write_behind`) gets
all of them there without a new layout (docs/design/offload-and-streaming.md).
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


def measure(packed: bool, write: str, groups: int, limit: int | None, layers_: int,
            leaves: int, width: int, tokens: int, target: str) -> dict:
  L, K, D, G = layers_, leaves, width, groups
  n = L // G  # Rows a buffer: layer i lives in buffer i % G, row i // G.
  mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))

  def unpack(layer):  # One packed row -> K [D, D] weights (slices of the arrived copy).
    return [layer[k * D * D:(k + 1) * D * D].reshape(D, D) for k in range(K)] if packed \
        else layer

  def repack(ws):
    return jnp.concatenate([w.reshape(-1) for w in ws]) if packed else ws

  def put(bufs, g, layer, row):  # In place into buffer g of the host stacks.
    out = layers.outbound(layer, True)
    new = jax.tree.map(lambda s, o: jax.lax.dynamic_update_index_in_dim(s, o, row, 0),
                       bufs[g], out)
    return bufs[:g] + (new,) + bufs[g + 1:]

  def step(bufs, x):
    def trip(jj, state):
      x, bufs, layer, pending = state
      j = n - 1 - jj
      for r in range(G - 1, -1, -1):  # Layer i = G j + r, the trip's G in backward order.
        # Behind: the previous layer (i + 1) goes back during this one, its write issued
        # before the read-ahead or after it (with one buffer the read's barrier orders
        # them; with G >= 3 the two touch other buffers). Above the top layer the row is
        # clamped: a schedule, never run.
        up_g, up_row = (r + 1) % G, (j if r < G - 1 else jnp.minimum(j + 1, n - 1))
        if write == "behind":
          bufs = put(bufs, up_g, pending, up_row)
        down_g, down_row = (r - 1) % G, (j if r > 0 else jnp.maximum(j - 1, 0))
        if G == 1:  # The trip writes this buffer too: the read goes first.
          ahead, read = layers.read_ahead(
              bufs[down_g], lambda s, row=down_row: layers.fetch(s, row, True))
          bufs = bufs[:down_g] + (read,) + bufs[down_g + 1:]
        else:  # Its next write is two layers on.
          ahead = layers.fetch(bufs[down_g], down_row, True)
        if write == "behind, after the read":
          bufs = put(bufs, up_g, pending, up_row)
        ws = unpack(layer)
        for w in ws:
          x = jnp.tanh(x @ w)
        new = repack([w - 1e-3 * (x[:D].T @ x[:D]).astype(w.dtype) for w in ws])
        if write == "at the end":
          bufs = put(bufs, r, new, j)
        layer, pending = ahead, new
      return x, bufs, layer, pending

    first = layers.fetch(bufs[(L - 1) % G], n - 1, True)
    x, bufs, _, last = jax.lax.fori_loop(0, n, trip, (x, bufs, first, first))
    if write.startswith("behind"):
      bufs = put(bufs, 0, last, 0)
    return x, bufs

  host = NamedSharding(mesh, P(), memory_kind="pinned_host")
  stack = (jax.ShapeDtypeStruct((n, K * D * D), jnp.bfloat16, sharding=host) if packed else
           [jax.ShapeDtypeStruct((n, D, D), jnp.bfloat16, sharding=host) for _ in range(K)])
  x = jax.ShapeDtypeStruct((tokens, D), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  # train.py's XLA flag profile (its collectives' thresholds do not matter on one device).
  options = gpu_compile.profile_options(load_config(os.path.join(ROOT, "configs", "tiny.py")))
  if limit:  # Host copies are async computations: at most this many in flight.
    options["xla_gpu_experimental_parallel_async_compute_limit"] = limit
  out = gpu_compile.compile_jitted(jax.jit(step, donate_argnums=0), ((stack,) * G, x), mesh,
                                   targets.parse(target), options)
  moves = [m for m in schedule.host_moves(out.hlo) if not m.computation.startswith("main")]
  reads = [m for m in moves if not m.to_host]
  writes = [m for m in moves if m.to_host]
  share = lambda ms: sum(m.nbytes for m in ms if m.overlaps) / max(sum(m.nbytes for m in ms), 1)
  return dict(limit=limit or 2, layout=("one buffer a layer" if packed else f"{K} stacks")
              + (f", {G} interleaved" if G > 1 else ""),
              write=write, copies_in=len(reads), hidden_in=share(reads), writes=len(writes),
              hidden_out=share(writes), temporaries=out.memory["temporaries"],
              host_temporaries=out.memory["host_temporaries"])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=9, help="a multiple of 3")
  ap.add_argument("--leaves", type=int, default=9, help="weights a layer (a Llama's: 9)")
  ap.add_argument("--width", type=int, default=2048)
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--target", default="rtx4090:1")
  ap.add_argument("--limits", default="2,64",
                  help="xla_gpu_experimental_parallel_async_compute_limit values (2: XLA's)")
  args = ap.parse_args(argv)
  fake_cpu_devices(1, memory_flags=False)

  modes = [(1, "none"), (1, "at the end"), (1, "behind"), (1, "behind, after the read"),
           (3, "behind")]
  rows = [measure(packed, write, groups, int(limit) if limit != "2" else None,
                  args.layers, args.leaves, args.width, args.tokens, args.target)
          for limit in args.limits.split(",") for groups, write in modes
          for packed in (False, True)]
  print(markdown_table(
      ["async limit", "layout", "write-back", "copies in (a loop body)",
       "bytes in under compute", "bytes out under compute", "temporaries",
       "host temporaries"],
      [[r["limit"], r["layout"], r["write"], r["copies_in"], f"{r['hidden_in']:.0%}",
        f"{r['hidden_out']:.0%}" if r["writes"] else "", fmt_bytes(r["temporaries"]),
        fmt_bytes(r["host_temporaries"])]
       for r in rows]))


if __name__ == "__main__":
  main()
