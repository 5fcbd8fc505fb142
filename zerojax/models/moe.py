"""The mixture-of-experts feed-forward block (`MoeMlp`, the decoder's with `n_experts`)
and its parts as pure functions of arrays: the router, the experts' dispatch (dropless
or at a capacity), the router statistics a layer adds to the layer loop's carry, and the
auxiliary losses.

Shapes: N tokens (batch x positions, flattened), D model width, E experts of hidden
width F, k experts a token. The experts' weights are stacked on a leading expert axis,
in the decoder's [in, out] kernel layout: gate and up [E, D, F], down [E, F, D].

Routing follows Qwen3-MoE and Mixtral as transformers computes them: a softmax over
the router's fp32 logits, the k largest probabilities and their experts, renormalized
to sum to 1 when `norm_topk_prob` (Qwen3-MoE's option; Mixtral always renormalizes:
its softmax over the top-k logits is the same thing).

Dispatch:
- `dropless`: every token reaches each of its k experts. The N x k assignments are
  sorted by expert and each expert's run goes through its weights in one grouped matmul
  (`jax.lax.ragged_dot`): no token dropped and no padding; the shapes depend only on N.
  XLA (jax 0.10) lowers `ragged_dot` as E masked copies of the rows, so the decoder runs
  `dropless_tiled`: the same, each expert's run padded to whole tiles (`tile_rows`), a
  tile through its expert's MLP (`tile_mlp`).
- `capacity`: each expert takes at most C = ceil(factor x N x k / E) assignments (the
  first in token order), gathered into an [E, C, D] buffer and computed as batched
  matmuls; the others contribute nothing. Static [E, C, D] blocks are what an all-to-all
  between expert-parallel devices moves.

`dense_reference` runs every token through its experts with per-token weight gathers:
the slow, obviously right version the tests hold the others to.
"""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zerojax.mesh import EXPERT_AXIS
from zerojax.models import remat
from zerojax.runtime import jax_internals

# Rows a tile of the decoder's dispatch (`tile_rows`): each expert's run is padded to
# whole tiles, so a layer computes at most one tile of padding an expert.
MIN_TILE, MAX_TILE = 64, 256


def tile_rows(rows: int, n_experts: int) -> int:
  """The tile for `rows` sorted rows into `n_experts` experts: the largest power of two
  at most half a balanced expert's rows, within [MIN_TILE, MAX_TILE]. A tile is one trip
  of the loop (`tile_mlp`): larger ones run closer to a GEMM's speed and launch fewer
  kernels on a GPU; smaller ones pad less (at most a tile an expert). Half, not all, of a
  balanced expert's rows: an expert a little over balanced takes two tiles, not one and
  a whole tile of padding (`benchmarks/moe_step.py`'s tiny MoE without expert
  parallelism, 1,024 rows into 8 experts: in a one-off A/B of its steps interleaved in
  one process, 64-row tiles ran 0.73 of the dense model's tokens/s and 128-row tiles
  0.64; the recorded run gives 0.65, and runs on this machine vary 0.58-0.73)."""
  balanced = max(rows // n_experts // 2, 1)
  return min(max(1 << (balanced.bit_length() - 1), MIN_TILE), MAX_TILE)


class Routing(NamedTuple):
  """Where each token goes.

  Attributes:
    logits: float32[N, E], the router's logits (the auxiliary losses read them).
    experts: int32[N, k], each token's experts, most probable first.
    weights: float32[N, k], the weight of each expert's output in the token's sum.
  """
  logits: jax.Array
  experts: jax.Array
  weights: jax.Array


class Experts(NamedTuple):
  """The experts' stacked kernels: gate, up [E, D, F] and down [E, F, D]."""
  gate: jax.Array
  up: jax.Array
  down: jax.Array


def route(x: jax.Array, router: jax.Array, k: int, norm_topk_prob: bool = True) -> Routing:
  """Top-k routing of tokens x [N, D] by the router kernel [D, E], in fp32.

  Ties between equal probabilities go to the lower expert index, as `torch.topk` on CPU
  and `jax.lax.top_k` both do.
  """
  logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(logits, experts.astype(jnp.int32), weights)


def _mlp(h_gate: jax.Array, h_up: jax.Array, act: Callable) -> jax.Array:
  return act(h_gate) * h_up  # GLU: act(x W_gate) * (x W_up), as the dense MLP.


class Sorted(NamedTuple):
  """The N k (token, expert) assignments sorted by expert (stable: token order within an
  expert), each int32[N k]: `order[s]` the token-major id (token x k + j) of the s-th,
  `inverse[a]` the place of id a (order's inverse), `experts[s]` its expert."""
  order: jax.Array
  inverse: jax.Array
  experts: jax.Array


def _by_expert(routing: Routing) -> Sorted:
  flat = routing.experts.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  return Sorted(order, _inverse(order), flat[order])


def _inverse(perm: jax.Array, size: int | None = None) -> jax.Array:
  """int32[size]: where each index went under `perm` (perm[s] = a: inverse[a] = s; an
  index perm does not reach, and perm's entries >= size, `size`: nowhere)."""
  size = perm.shape[0] if size is None else size
  return jnp.full(size + 1, size, jnp.int32).at[jnp.minimum(perm, size)].set(
      jnp.arange(perm.shape[0], dtype=jnp.int32))[:size]


@jax.custom_vjp
def _moved(x: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
  """x's rows moved by a gather: out[p] = x[src[p]], 0 where src[p] >= len(x). `dst` is
  its inverse (dst[j]: where row j went, >= len(out): nowhere), so each row goes to one
  place at most, and the backward pass is the gather by `dst`, not the scatter-add JAX
  makes of a gather's transpose: XLA:CPU runs a scatter a row at a time (the tiny MoE's
  block spent 5 of its 18 ms forward and backward in them)."""
  return jnp.take(x, src, axis=0, mode="fill", fill_value=0)


def _moved_fwd(x, src, dst):
  return _moved(x, src, dst), (src, dst)


def _moved_bwd(res, g):
  src, dst = res
  return _moved(g, dst, src), None, None


_moved.defvjp(_moved_fwd, _moved_bwd)


def _sorted_rows(x: jax.Array, by: Sorted) -> jax.Array:
  """x [N, D]'s row for each sorted assignment: [N k, D] (a token's k copies)."""
  k = by.order.shape[0] // x.shape[0]
  copies = jnp.broadcast_to(x[:, None], (x.shape[0], k, x.shape[1])).reshape(-1, x.shape[1])
  return _moved(copies, by.order, by.inverse)


def _combine(y: jax.Array, routing: Routing, by: Sorted, like: jax.Array) -> jax.Array:
  """The sorted assignments' outputs y [N k, D] weighted (fp32) and summed onto their
  tokens: [N, D] in `like`'s dtype."""
  n, k = routing.weights.shape
  y = _moved(y, by.inverse, by.order).astype(jnp.float32).reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y, routing.weights.astype(jnp.float32)).astype(like.dtype)


def dropless(x: jax.Array, routing: Routing, experts: Experts,
             act: Callable = jax.nn.silu) -> jax.Array:
  """Every token through each of its k experts, weighted and summed: [N, D] in x's dtype.

  The N x k (token, expert) assignments are sorted by expert (stable: token order within
  an expert), so each expert's tokens are one contiguous run and `ragged_dot` multiplies
  run e by expert e's kernel. The outputs are weighted in fp32 and scattered back onto
  their tokens (a token's k contributions summed in fp32).
  """
  by = _by_expert(routing)
  sizes = tokens_per_expert(routing, experts.gate.shape[0])
  xs = _sorted_rows(x, by)  # [N k, D], expert by expert.
  dot = lambda a, w: jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32)  # noqa: E731
  h = _mlp(dot(xs, experts.gate), dot(xs, experts.up), act).astype(x.dtype)
  return _combine(dot(h, experts.down), routing, by, x)


def dropless_tiled(x: jax.Array, routing: Routing, experts: Experts,
                   act: Callable = jax.nn.silu, tile: int | None = None) -> jax.Array:
  """`dropless` without `ragged_dot`: each expert's run padded to whole tiles of `tile`
  rows (None: `tile_rows`), each tile through its expert's MLP (`tiled_experts`).

  XLA lowers `ragged_dot` as E masked copies of the rows (docs/design/moe.md); here the
  rows are at most N k + E x tile (the padding), so the bytes and FLOPs grow with the
  tokens, not with E.

  Returns:
    [N, D] in x's dtype: `dropless`'s result.
  """
  by = _by_expert(routing)
  return _combine(tiled_experts(_sorted_rows(x, by), by.experts, experts, act, tile), routing,
                  by, x)


def tiled_experts(rows: jax.Array, ids: jax.Array, experts: Experts,
                  act: Callable = jax.nn.silu, tile: int | None = None) -> jax.Array:
  """Each row through its expert's MLP: rows [M, D] sorted by expert, ids int32[M] their
  experts in order (E: an empty row, through none; those last) -> float32[M, D] (an
  empty row: 0).

  Each expert's run is padded to whole tiles of `tile` rows (None: `tile_rows(M, E)`; at
  most M + E x tile rows, a static bound for the buffers), and each occupied tile goes
  through its expert's MLP (`tile_mlp`), one after another: the loop runs as many tiles
  as the runs fill (at most one of padding an expert), whatever the bound.
  """
  n_experts, m = experts.gate.shape[0], rows.shape[0]
  tile = tile or tile_rows(m, n_experts)
  sizes = jnp.bincount(ids, length=n_experts + 1)[:n_experts]
  padded = -(-sizes // tile) * tile  # Each expert's rows, up to whole tiles.
  ends = jnp.cumsum(padded)
  expert = jnp.minimum(ids, n_experts - 1)
  tiles = -(-m // tile) + n_experts  # A static bound on the tiles used.
  # Each row's place; an empty row goes to a spare row at the end, sliced off.
  rank = jnp.arange(m) - (jnp.cumsum(sizes) - sizes)[expert]
  row = jnp.where(ids < n_experts, (ends - padded)[expert] + rank, tiles * tile)
  src = _inverse(row, tiles * tile)  # Each slot's row; m: a padding slot, zeros.
  xs = _moved(rows, src, row)
  # Expert e's tiles are [ends[e - 1], ends[e]) / tile; those past the last expert's
  # are zeros, and no loop reaches them.
  out = tile_mlp(xs, experts, (ends // tile).astype(jnp.int32), act, tile)
  return _moved(out, row, src)  # An empty row's is past the slots: 0.


def _varying(*xs: jax.Array) -> tuple[str, ...]:
  """The mesh axes any of `xs` varies over (inside a `shard_map` that checks)."""
  return tuple(sorted(set().union(*(jax_internals.varying_axes(x) for x in xs))))


def _zeros(shape, dtype, vary: tuple[str, ...]) -> jax.Array:
  """Zeros that vary over `vary`, as a loop's carry that varying values update must."""
  z = jnp.zeros(shape, dtype)
  return jax.lax.pcast(z, vary, to="varying") if vary else z


def _tile_forward(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                  act: Callable) -> tuple[jax.Array, tuple]:
  """One tile's rows x [t, D] through one expert's MLP: float32[t, D], and (the gate's
  and up projection's fp32 outputs, their product in x's dtype) for its backward."""
  h_gate = jnp.dot(x, gate, preferred_element_type=jnp.float32)
  h_up = jnp.dot(x, up, preferred_element_type=jnp.float32)
  h = _mlp(h_gate, h_up, act).astype(x.dtype)
  return jnp.dot(h, down, preferred_element_type=jnp.float32), (h_gate, h_up, h)


def _expert_tiles(tile_ends: jax.Array, e) -> tuple[jax.Array, jax.Array]:
  """Expert e's tiles: [first, end)."""
  return jnp.where(e > 0, tile_ends[jnp.maximum(e - 1, 0)], 0), tile_ends[e]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def tile_mlp(xs: jax.Array, experts: Experts, tile_ends: jax.Array, act: Callable,
             t: int) -> jax.Array:
  """Each occupied tile of `t` rows of xs [tiles x t, D] through its expert's MLP:
  float32[tiles x t, D], the rows of the other tiles 0. Expert e's tiles are
  [tile_ends[e - 1], tile_ends[e]) (int32[E], cumulative; expert 0's start at 0).

  A loop over the experts, each with a loop over its tiles whose trip count is the tiles
  its rows fill: a grouped matmul that does the routed rows' work, not the static
  bound's. An expert's kernels are sliced once for its tiles (not copied each trip), and
  its three matmuls run in one trip, so the [t, F] hidden values never leave the tile.
  XLA's lowering of `jax.lax.ragged_dot` (jax 0.10) multiplies every row by every
  expert, masked, on XLA:CPU and XLA's GPU compiler alike (docs/design/moe.md). A
  custom vjp: reverse mode cannot differentiate a loop with a dynamic trip count. The
  backward loops recompute each tile's hidden values and sum an expert's weight
  gradients over its tiles in fp32; they round where autodiff of the three matmuls one
  by one would (the hidden values' cotangent to x's dtype, the input's two parts each),
  so the numbers are theirs."""

  def expert(e, out):
    gate, up, down = experts.gate[e], experts.up[e], experts.down[e]

    def tile(i, out):
      y, _ = _tile_forward(jax.lax.dynamic_slice_in_dim(xs, i * t, t), gate, up, down, act)
      return jax.lax.dynamic_update_slice_in_dim(out, y, i * t, 0)

    return jax.lax.fori_loop(*_expert_tiles(tile_ends, e), tile, out)

  out = _zeros((xs.shape[0], xs.shape[-1]), jnp.float32, _varying(xs, *experts, tile_ends))
  return jax.lax.fori_loop(0, experts.gate.shape[0], expert, out)


def _tile_mlp_fwd(xs, experts, tile_ends, act, t):
  # Named: remat 'dots' keeps the outputs (it keeps every matmul's), not running the loop
  # again in the backward pass.
  y = remat.named(tile_mlp(xs, experts, tile_ends, act, t), remat.EXPERTS)
  return y, (xs, experts, tile_ends)


def _tile_mlp_bwd(act, t, res, ct):
  xs, experts, tile_ends = res
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)  # noqa: E731
  vary = _varying(xs, ct, tile_ends, *experts)

  def expert(dxs, e):
    gate, up, down = experts.gate[e], experts.up[e], experts.down[e]

    def tile(i, carry):
      dxs, (d_gate_w, d_up_w, d_down_w) = carry
      x, dy = (jax.lax.dynamic_slice_in_dim(v, i * t, t) for v in (xs, ct))
      _, (h_gate, h_up, h) = _tile_forward(x, gate, up, down, act)
      dh = f32(dot(dy, f32(down).T).astype(x.dtype))
      _, pull = jax.vjp(lambda a, b: _mlp(a, b, act), h_gate, h_up)
      d_gate, d_up = pull(dh)
      dx = dot(d_gate, f32(gate).T).astype(x.dtype) + dot(d_up, f32(up).T).astype(x.dtype)
      sums = (d_gate_w + dot(f32(x).T, d_gate), d_up_w + dot(f32(x).T, d_up),
              d_down_w + dot(f32(h).T, dy))
      return jax.lax.dynamic_update_slice_in_dim(dxs, dx, i * t, 0), sums

    zero = tuple(_zeros(w.shape[1:], jnp.float32, vary) for w in experts)
    return jax.lax.fori_loop(*_expert_tiles(tile_ends, e), tile, (dxs, zero))

  # Inside a shard_map that checks replication, the tiles vary over the token axes; the
  # accumulators start varying as they do, and the kernels' gradients are summed over
  # the axes the kernels do not vary over (their cotangent is the whole sum there). The
  # train step's shard_map does not check (no axis varies): it sums gradients itself.
  # The scan stacks each expert's fp32 sums: the kernels' gradients [E, ...].
  dxs, grads = jax.lax.scan(expert, _zeros(xs.shape, xs.dtype, vary),
                            jnp.arange(experts.gate.shape[0]))

  def summed(g, w):
    extra = tuple(sorted(jax_internals.varying_axes(g) - jax_internals.varying_axes(w)))
    return (jax.lax.psum(g, extra) if extra else g).astype(w.dtype)

  return dxs, Experts(*map(summed, grads, experts)), None


tile_mlp.defvjp(_tile_mlp_fwd, _tile_mlp_bwd)


def exchange_slots(rows: int, ep: int, factor: float) -> int:
  """Rows each device sends each of the `ep` expert-parallel devices at most (the
  all-to-all's block) for `rows` = N k assignments a device: all of them at factor 0
  (dropless: every assignment may go to one device), else ceil(factor x rows / ep),
  `factor` times a balanced router's share, at most `rows`."""
  return rows if not factor else min(rows, math.ceil(factor * rows / ep))


def expert_parallel(x: jax.Array, routing: Routing, local: Experts, axis: str,
                    act: Callable = jax.nn.silu, tile: int | None = None,
                    factor: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """`dropless` with the experts split over mesh axis `axis` (inside `jax.shard_map`),
  each device sending each other at most `exchange_slots(N k, ep, factor)` rows.

  The device at index r of `axis` (size ep) holds experts [r El, (r + 1) El) of the E =
  ep El (`local`: their kernels, El on the leading axis); each device routes its own N
  tokens over all E (`routing`). Its N k assignments, sorted by expert, go to the
  devices holding their experts by one `all_to_all` of [ep, S, D] blocks (S slots a
  destination), are computed there in tiles (`tiled_experts`: only the tiles the
  received rows occupy), and come back by a second, to be weighted and summed onto their
  tokens as `dropless` does.

  Factor 0: S = N k, the dropless worst case (every assignment to one device), exact.
  Factor c > 0: S = ceil(c N k / ep), c times what a balanced router sends each device;
  a destination's assignments past its S (in expert order, then token order) are
  dropped: they add nothing to their tokens' outputs (`with_capacity`'s rule, per
  destination device instead of per expert), and are counted. The exchange then moves,
  and the experts' buffers hold, c / ep of the dropless case's rows.

  The step's `shard_map` does not check replication (`check_vma=False`): the experts'
  gradient on a device is its own tokens' part, and the step sums it over the axes that
  replicate the experts (`zero.ZeroPlan.reduce_axes`), as for every other param.
  (`jax.lax.ragged_all_to_all` would move only the rows used into a buffer sized the
  same way; XLA:CPU does not run it, so it could not be held to this one here.)

  Returns:
    ([N, D] in x's dtype: `dropless`'s result at factor 0, int32[] the assignments of
    this device's tokens dropped).
  """
  el = local.gate.shape[0]
  ep = routing.logits.shape[-1] // el
  by = _by_expert(routing)  # By expert, so by device too.
  m, d = by.order.shape[0], x.shape[-1]
  slots = exchange_slots(m, ep, factor)
  rows = ep * slots
  dest = by.experts // el
  counts = jnp.bincount(dest, length=ep)
  rank = jnp.arange(m) - (jnp.cumsum(counts) - counts)[dest]  # Place in its block.
  kept = rank < slots
  at = jnp.where(kept, dest * slots + rank, rows)  # A dropped row: nowhere.
  src = _inverse(at, rows)  # Each slot's row; m: an empty slot.
  send = _moved(_sorted_rows(x, by), src, at).reshape(ep, slots, d)
  ids = jnp.where(src < m, jnp.take(by.experts % el, src, mode="clip"), el)  # el: empty.
  exchange = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)  # noqa: E731
  got = exchange(send).reshape(rows, d)
  got_ids = exchange(ids.reshape(ep, slots)).reshape(rows)
  mine = jnp.argsort(got_ids, stable=True).astype(jnp.int32)  # By local expert; empty last.
  theirs = _inverse(mine)
  y = _moved(tiled_experts(_moved(got, mine, theirs), got_ids[mine], local, act, tile),
             theirs, mine).astype(x.dtype)
  back = _moved(exchange(y.reshape(ep, slots, d)).reshape(rows, d), at, src)
  return (_combine(back, routing, by, x),  # A dropped row's is past the slots: 0.
          jnp.sum(~kept).astype(jnp.int32))


def all_to_all_bytes(tokens: int, k: int, d_model: int, ep: int, itemsize: int,
                     remat: str, factor: float = 0.0) -> int:
  """Bytes one device puts into `expert_parallel`'s all-to-alls per layer for `tokens`
  tokens (operands; (ep - 1) / ep of them leave the device): the assignments' rows out
  and back ([ep, S, D] each, S = `exchange_slots`, `itemsize` bytes a value) and their
  experts (int32 [ep, S]) in the forward pass, the two row exchanges' transposes in the
  backward pass and, unless `remat` is 'none', the forward's recomputation.

  Measured against the compiled step: `tests/test_moe.py`.
  """
  slots = ep * exchange_slots(tokens * k, ep, factor)
  rows, ids = slots * d_model * itemsize, slots * 4
  forward = 2 * rows + ids
  return forward + 2 * rows + (0 if remat == "none" else forward)


def capacity(n: int, k: int, n_experts: int, factor: float) -> int:
  """Assignments each expert takes at `factor`: ceil(factor x N x k / E), at most N."""
  return min(n, math.ceil(factor * n * k / n_experts))


def with_capacity(x: jax.Array, routing: Routing, experts: Experts, factor: float,
                  act: Callable = jax.nn.silu) -> tuple[jax.Array, jax.Array]:
  """Like `dropless`, but each expert takes at most `capacity(...)` assignments.

  An expert's assignments are taken in token order (and, for one token, its most
  probable expert first); those past the capacity are dropped: they add nothing to the
  token's output (a token with all k dropped passes through the block as 0).

  Returns:
    ([N, D] in x's dtype, int32[] the number of assignments dropped).
  """
  n, k = routing.experts.shape
  n_experts = experts.gate.shape[0]
  c = capacity(n, k, n_experts, factor)
  onehot = jax.nn.one_hot(routing.experts.reshape(-1), n_experts, dtype=jnp.int32)  # [N k, E]
  slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # Rank within expert.
  kept = slot < c
  flat = routing.experts.reshape(-1)
  # Dropped assignments write to an extra slot c, sliced off below.
  where = (flat, jnp.where(kept, slot, c))
  tokens = jnp.arange(n * k) // k
  blocks = jnp.zeros((n_experts, c + 1, x.shape[-1]), x.dtype).at[where].set(x[tokens])[:, :c]
  mm = lambda a, w: jnp.einsum("ecd,edf->ecf", a, w, preferred_element_type=jnp.float32)  # noqa: E731
  h = _mlp(mm(blocks, experts.gate), mm(blocks, experts.up), act).astype(x.dtype)
  y = jnp.pad(mm(h, experts.down), ((0, 0), (0, 1), (0, 0)))[where]  # [N k, D]; dropped: 0.
  y = y * (routing.weights.reshape(-1) * kept)[:, None]
  out = jnp.zeros((n, x.shape[-1]), jnp.float32).at[tokens].add(y).astype(x.dtype)
  return out, jnp.sum(~kept).astype(jnp.int32)


def dense_reference(x: jax.Array, routing: Routing, experts: Experts,
                    act: Callable = jax.nn.silu) -> jax.Array:
  """Each token through its k experts by gathering their kernels per token (fp32)."""
  x32 = x.astype(jnp.float32)
  out = jnp.zeros(x.shape, jnp.float32)
  for j in range(routing.experts.shape[1]):
    e = routing.experts[:, j]
    g, u, d = (w.astype(jnp.float32)[e] for w in experts)
    h = _mlp(jnp.einsum("nd,ndf->nf", x32, g), jnp.einsum("nd,ndf->nf", x32, u), act)
    out = out + routing.weights[:, j, None] * jnp.einsum("nf,nfd->nd", h, d)
  return out


def tokens_per_expert(routing: Routing, n_experts: int) -> jax.Array:
  """int32[E]: how many assignments each expert received (the metrics' load)."""
  return jnp.bincount(routing.experts.reshape(-1), length=n_experts).astype(jnp.int32)


def stats(routing: Routing, mask: jax.Array | None = None,
          dropped: jax.Array | int = 0) -> jax.Array:
  """float32[2 E + 2]: one layer's router statistics, summed over its tokens (what the
  auxiliary losses and the metrics need of every layer): top-k assignments per expert,
  softmax probability per expert, the assignments `dropped` at a capacity, and
  logsumexp(logits)^2; `mask` (float or bool [N], None: all) weighs each token (0:
  padding, counted in none of them)."""
  logits = routing.logits.astype(jnp.float32)
  m = jnp.ones(logits.shape[0], jnp.float32) if mask is None else mask.astype(jnp.float32)
  counts = jnp.einsum("nke,n->e", jax.nn.one_hot(routing.experts, logits.shape[-1]), m)
  probs = m @ jax.nn.softmax(logits, axis=-1)
  z = m @ jax.nn.logsumexp(logits, axis=-1) ** 2
  return jnp.concatenate([counts, probs, jnp.asarray(dropped, jnp.float32)[None], z[None]])


def losses_from_stats(summed: jax.Array, tokens: Any, layers: int) -> tuple[jax.Array, jax.Array]:
  """(load-balancing loss, z-loss) from `stats` summed over `layers` layers of `tokens`
  (counted) tokens each.

  The load-balancing loss is transformers' (Switch Transformer's, over every layer's
  router together, before `router_aux_loss_coef`): E x sum_e f_e p_e, f_e the top-k
  assignments to expert e and p_e the sum of its probability, each over every layer's
  tokens and divided by (layers x tokens). The z-loss is ST-MoE's: the mean of
  logsumexp(logits)^2.
  """
  n_experts = (summed.shape[0] - 2) // 2
  rows = tokens * layers
  counts, probs = summed[:n_experts] / rows, summed[n_experts:2 * n_experts] / rows
  return n_experts * jnp.sum(counts * probs), summed[-1] / rows


def _logits_losses(logits: jax.Array, k: int, mask: jax.Array | None) -> tuple:
  """`losses_from_stats` of each layer's router logits float[L, N, E]."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  summed = sum(stats(Routing(layer, jax.lax.top_k(p, k)[1], p), mask)
               for layer, p in zip(logits, probs))
  tokens = logits.shape[1] if mask is None else jnp.sum(mask.astype(jnp.float32))
  return losses_from_stats(summed, tokens, logits.shape[0])


def load_balancing_loss(logits: jax.Array, k: int, mask: jax.Array | None = None) -> jax.Array:
  """The load-balancing loss (`losses_from_stats`) of each layer's router logits
  float[L, N, E], k experts a token, `mask` float or bool [N] (None: all): float32."""
  return _logits_losses(logits, k, mask)[0]


def router_z_loss(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """The z-loss (`losses_from_stats`) of each layer's router logits float[L, N, E]."""
  return _logits_losses(logits, 1, mask)[1]


class MoeMlp(nn.Module):
  """The mixture-of-experts feed-forward block (HF Qwen3-MoE's `mlp`, Mixtral's
  `block_sparse_moe`): [B, T, D] -> ([B, T, D], float32[2 E + 2] `stats`).

  Params: `router/kernel` [D, E] and `experts/{gate,up,down}_proj` ([E, D, F], [E, D, F],
  [E, F, D]), in `param_dtype`, with logical axes 'embed', 'experts', 'mlp'. Routing is
  in fp32; the experts' matmuls take `dtype` inputs and accumulate in fp32. Given fewer
  than E experts (inside the step's `shard_map`, a plan over a mesh with an 'expert'
  axis gives each device E / ep of them), the block dispatches by all-to-all over that
  axis (`expert_parallel`, sized by `capacity_factor`).
  """
  n_experts: int
  k: int
  d_ff: int
  norm_topk_prob: bool
  capacity_factor: float  # 0: dropless.
  act: Callable
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    B, T, D = x.shape
    E, F = self.n_experts, self.d_ff
    # The router's expert dimension is not 'experts': every device needs all of it.
    (router,) = _Params((("kernel", (D, E), ("embed", "router")),), self.param_dtype,
                        name="router")()
    experts = Experts(*(w.astype(self.dtype) for w in _Params((
        ("gate_proj", (E, D, F), ("experts", "embed", "mlp")),
        ("up_proj", (E, D, F), ("experts", "embed", "mlp")),
        ("down_proj", (E, F, D), ("experts", "mlp", "embed"))), self.param_dtype,
        name="experts")()))
    h = x.reshape(B * T, D).astype(self.dtype)
    routing = route(h, router.astype(self.dtype), self.k, self.norm_topk_prob)
    dropped = jnp.zeros((), jnp.int32)
    if experts.gate.shape[0] < E:  # Inside the step's shard_map, this device's experts
      # only: the plan split them over the mesh's expert axis.
      out, dropped = expert_parallel(h, routing, experts, EXPERT_AXIS, self.act,
                                     factor=self.capacity_factor)
    elif self.capacity_factor:
      out, dropped = with_capacity(h, routing, experts, self.capacity_factor, self.act)
    else:  # In tiles, not by `ragged_dot`: XLA lowers that as E copies of the rows.
      out = dropless_tiled(h, routing, experts, self.act)
    return out.reshape(B, T, D), stats(routing, dropped=dropped)


class _Params(nn.Module):
  """Params (name, shape, logical axes) initialised as HF does (normal, std 0.02)."""
  specs: tuple
  param_dtype: Any

  @nn.compact
  def __call__(self) -> tuple:
    # Given params are read as they are: inside the step's shard_map a device holds E / ep
    # of the experts, a shape `self.param`'s check would refuse.
    return tuple(self.get_variable("params", name) if self.has_variable("params", name) else
                 self.param(name, nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                               axes), shape, self.param_dtype)
                 for name, shape, axes in self.specs)
