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
  `dropless_tiled`: the same, each expert's run padded to whole tiles of `TILE` rows, a
  matmul a tile (`tile_matmul`).
- `capacity`: each expert takes at most C = ceil(factor x N x k / E) assignments (the
  first in token order), gathered into an [E, C, D] buffer and computed as batched
  matmuls; the others contribute nothing. Static [E, C, D] blocks are what an all-to-all
  between expert-parallel devices moves.

`dense_reference` runs every token through its experts with per-token weight gathers:
the slow, obviously right version the tests hold the others to.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zerojax.mesh import EXPERT_AXIS
from zerojax.runtime import jax_internals

# Rows a tile of `dropless_tiled` (the decoder's dispatch): each expert's run is padded to
# whole tiles, so a layer computes at most N k + E x TILE rows.
TILE = 64


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


def _by_expert(routing: Routing) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The N k assignments sorted by expert (stable: token order within an expert):
  (their ids in token-major order, their tokens, their experts), each int32[N k]."""
  k = routing.experts.shape[1]
  flat = routing.experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return order, order // k, flat[order]


def _combine(y: jax.Array, routing: Routing, order: jax.Array, tokens: jax.Array,
             like: jax.Array) -> jax.Array:
  """The sorted assignments' outputs y [N k, D] weighted (fp32) and summed onto their
  tokens: [N, D] in `like`'s dtype."""
  y = y.astype(jnp.float32) * routing.weights.reshape(-1)[order][:, None]
  return jnp.zeros(like.shape, jnp.float32).at[tokens].add(y).astype(like.dtype)


def dropless(x: jax.Array, routing: Routing, experts: Experts,
             act: Callable = jax.nn.silu) -> jax.Array:
  """Every token through each of its k experts, weighted and summed: [N, D] in x's dtype.

  The N x k (token, expert) assignments are sorted by expert (stable: token order within
  an expert), so each expert's tokens are one contiguous run and `ragged_dot` multiplies
  run e by expert e's kernel. The outputs are weighted in fp32 and scattered back onto
  their tokens (a token's k contributions summed in fp32).
  """
  order, tokens, _ = _by_expert(routing)
  sizes = tokens_per_expert(routing, experts.gate.shape[0])
  xs = x[tokens]  # [N k, D], expert by expert.
  dot = lambda a, w: jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32)  # noqa: E731
  h = _mlp(dot(xs, experts.gate), dot(xs, experts.up), act).astype(x.dtype)
  return _combine(dot(h, experts.down), routing, order, tokens, x)


def dropless_tiled(x: jax.Array, routing: Routing, experts: Experts,
                   act: Callable = jax.nn.silu, tile: int = 64) -> jax.Array:
  """`dropless` without `ragged_dot`: each expert's run padded to whole tiles of `tile`
  rows, and each tile one dense matmul with its expert's kernel (`tiled_experts`).

  XLA lowers `ragged_dot` as E masked copies of the rows (docs/design/moe.md); here the
  rows are at most N k + E x tile (the padding), so the bytes and FLOPs grow with the
  tokens, not with E.

  Returns:
    [N, D] in x's dtype: `dropless`'s result.
  """
  order, tokens, chosen = _by_expert(routing)
  return _combine(tiled_experts(x[tokens], chosen, experts, act, tile), routing, order,
                  tokens, x)


def tiled_experts(rows: jax.Array, ids: jax.Array, experts: Experts,
                  act: Callable = jax.nn.silu, tile: int = 64) -> jax.Array:
  """Each row through its expert's MLP: rows [M, D] sorted by expert, ids int32[M] their
  experts in order (E: an empty row, through none; those last) -> float32[M, D] (an
  empty row: 0).

  Each expert's run is padded to whole tiles of `tile` rows (at most M + E x tile rows, a
  static bound for the buffers), and each occupied tile is one dense matmul with its
  expert's kernel (`tile_matmul`), one after another: the loop runs as many tiles as the
  runs fill (at most one of padding an expert), whatever the bound.
  """
  n_experts, (m, d) = experts.gate.shape[0], rows.shape
  sizes = jnp.bincount(ids, length=n_experts + 1)[:n_experts]
  padded = -(-sizes // tile) * tile  # Each expert's rows, up to whole tiles.
  ends = jnp.cumsum(padded)
  expert = jnp.minimum(ids, n_experts - 1)
  tiles = -(-m // tile) + n_experts  # A static bound on the tiles used.
  # Each row's place; an empty row goes to a spare row at the end, sliced off.
  rank = jnp.arange(m) - (jnp.cumsum(sizes) - sizes)[expert]
  row = jnp.where(ids < n_experts, (ends - padded)[expert] + rank, tiles * tile)
  xs = jnp.zeros((tiles * tile + 1, d), rows.dtype).at[row].set(rows)[:-1]
  # Tile t's expert; tiles past the last expert's are zeros and take the last kernel.
  owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(tiles) * tile, side="right"),
                      n_experts - 1).astype(jnp.int32)
  used = ends[-1] // tile  # The occupied tiles, first: the loops' trip count.
  mm = lambda a, w: tile_matmul(a, w, owner, used)  # noqa: E731
  h = _mlp(mm(xs, experts.gate), mm(xs, experts.up), act).astype(rows.dtype)
  return jnp.pad(mm(h, experts.down), ((0, 1), (0, 0)))[row]  # Empty rows: the zero row.


def _varying(*xs: jax.Array) -> tuple[str, ...]:
  """The mesh axes any of `xs` varies over (inside a `shard_map` that checks)."""
  return tuple(sorted(set().union(*(jax_internals.varying_axes(x) for x in xs))))


def _zeros(shape, dtype, vary: tuple[str, ...]) -> jax.Array:
  """Zeros that vary over `vary`, as a loop's carry that varying values update must."""
  z = jnp.zeros(shape, dtype)
  return jax.lax.pcast(z, vary, to="varying") if vary else z


@jax.custom_vjp
def tile_matmul(a: jax.Array, w: jax.Array, owner: jax.Array, used: jax.Array) -> jax.Array:
  """a [tiles x t, K] @ w[owner[i]] [K, M] tile by tile for the first `used` tiles:
  float32[tiles x t, M], the rows of the other tiles 0.

  A loop whose trip count is `used` (int32[], at most tiles): a grouped matmul that
  does the routed rows' work, not the static bound's. XLA's lowering of
  `jax.lax.ragged_dot` (jax 0.10) multiplies every row by every expert, masked, on
  XLA:CPU and XLA's GPU compiler alike (docs/design/moe.md). A custom vjp: the loop's
  trip count is dynamic, which reverse-mode cannot differentiate, and each tile's weight
  gradient is added into one [E, K, M] accumulator as the backward loop goes."""
  t = a.shape[0] // owner.shape[0]

  def tile(i, out):
    y = jnp.dot(jax.lax.dynamic_slice_in_dim(a, i * t, t), w[owner[i]],
                preferred_element_type=jnp.float32)
    return jax.lax.dynamic_update_slice_in_dim(out, y, i * t, 0)

  out = _zeros((a.shape[0], w.shape[-1]), jnp.float32, _varying(a, w, owner, used))
  return jax.lax.fori_loop(0, used, tile, out)


def _tile_matmul_fwd(a, w, owner, used):
  return tile_matmul(a, w, owner, used), (a, w, owner, used)


def _tile_matmul_bwd(res, g):
  a, w, owner, used = res
  t = a.shape[0] // owner.shape[0]

  def tile(i, carry):
    da, dw = carry
    x, dy = (jax.lax.dynamic_slice_in_dim(v, i * t, t) for v in (a, g))
    e = owner[i]
    dx = jnp.dot(dy, w[e].T.astype(jnp.float32), preferred_element_type=jnp.float32)
    dw = dw.at[e].add(jnp.dot(x.T.astype(jnp.float32), dy, preferred_element_type=jnp.float32))
    return jax.lax.dynamic_update_slice_in_dim(da, dx.astype(a.dtype), i * t, 0), dw

  # Inside a shard_map that checks replication, the tiles vary over the token axes; the
  # accumulators start varying as they do, and the kernel's gradient is summed over the
  # axes the kernel does not vary over (its cotangent is the whole sum there). The
  # train step's shard_map does not check (no axis varies): it sums gradients itself.
  vary = _varying(a, g, owner, w, used)
  da, dw = jax.lax.fori_loop(0, used, tile, (_zeros(a.shape, a.dtype, vary),
                                             _zeros(w.shape, jnp.float32, vary)))
  extra = tuple(sorted(jax_internals.varying_axes(dw) - jax_internals.varying_axes(w)))
  dw = jax.lax.psum(dw, extra) if extra else dw
  return da, dw.astype(w.dtype), None, None


tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)


def exchange_slots(rows: int, ep: int, factor: float) -> int:
  """Rows each device sends each of the `ep` expert-parallel devices at most (the
  all-to-all's block) for `rows` = N k assignments a device: all of them at factor 0
  (dropless: every assignment may go to one device), else ceil(factor x rows / ep),
  `factor` times a balanced router's share, at most `rows`."""
  return rows if not factor else min(rows, math.ceil(factor * rows / ep))


def expert_parallel(x: jax.Array, routing: Routing, local: Experts, axis: str,
                    act: Callable = jax.nn.silu, tile: int = 64,
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
  order, tokens, chosen = _by_expert(routing)  # By expert, so by device too.
  m, d = order.shape[0], x.shape[-1]
  slots = exchange_slots(m, ep, factor)
  dest = chosen // el
  counts = jnp.bincount(dest, length=ep)
  rank = jnp.arange(m) - (jnp.cumsum(counts) - counts)[dest]  # Place in its block.
  kept = rank < slots
  at = (dest, jnp.where(kept, rank, slots))  # A dropped row: a spare slot, sliced off.
  send = jnp.zeros((ep, slots + 1, d), x.dtype).at[at].set(x[tokens])[:, :slots]
  ids = jnp.full((ep, slots + 1), el, jnp.int32).at[at].set(chosen % el)[:, :slots]
  exchange = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)  # noqa: E731
  rows = ep * slots
  got, got_ids = exchange(send).reshape(rows, d), exchange(ids).reshape(rows)
  mine = jnp.argsort(got_ids, stable=True)  # By local expert; empty rows last.
  y = jnp.zeros((rows, d), jnp.float32).at[mine].set(
      tiled_experts(got[mine], got_ids[mine], local, act, tile)).astype(x.dtype)
  back = jnp.pad(exchange(y.reshape(ep, slots, d)), ((0, 0), (0, 1), (0, 0)))[at]
  return (_combine(back, routing, order, tokens, x),  # A dropped row's is the spare 0.
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
      out, dropped = expert_parallel(h, routing, experts, EXPERT_AXIS, self.act, TILE,
                                     self.capacity_factor)
    elif self.capacity_factor:
      out, dropped = with_capacity(h, routing, experts, self.capacity_factor, self.act)
    else:  # In tiles, not by `ragged_dot`: XLA lowers that as E copies of the rows.
      out = dropless_tiled(h, routing, experts, self.act, TILE)
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
