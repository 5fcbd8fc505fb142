"""The activation terms of one microbatch: what the layers save for the backward pass
(by remat policy), one layer's recompute + backward working set, the loss chunk.

With sequence parallelism a device holds `T / fsdp` positions of each of its examples
for everything but attention (`RunSpec.positions`); attention runs on the whole T for
`H / fsdp` query heads and the KV heads the trade gives each device
(`sequence.ulysses.kv_repeats`).
"""

from zerojax.memory.spec import DTYPE_BYTES, Counts, RunSpec
from zerojax.models import moe, remat as remat_policies
from zerojax.models.attention import attention_kernel
from zerojax.runtime import platform
from zerojax.sequence import ulysses


def activations(s: RunSpec, counts: Counts, remat: str) -> dict:
  """Per-device bytes: 'saved activations', 'working set', 'loss chunk'; with activation
  offload also 'saved activations (host)', the layers' share kept in host memory."""
  pb, cb = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.compute_dtype]
  D, F, L, V, T, b = s.d_model, s.mlp_width, s.n_layers, s.vocab_size, s.seq_len, s.batch
  H, q, kv = s.n_heads, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
  local = s.positions  # T, or T / fsdp with sequence parallelism.
  n = b * local
  # Saved for the backward pass, per layer and token:
  if s.model == "mlp_lm":  # Rough: not calibrated.
    width = {"full": D, "dots": 2 * D + F, "none": (s.context + 4) * D + 3 * F}[remat]
  elif remat_policies.SAVED.get(remat) is not None:  # The layer input and the named values.
    width = D + remat_policies.saved_width(remat, D, q, kv, F)
  else:  # The input, q, k, v, o, gate and up (and down, normed with post_norms); none:
    # also the norms' fp32 inputs and outputs (4 D of 4 bytes = 8 D of 2). q is D wide
    # unless a family sets head_size.
    down = D if s.post_norms else 0
    width = {"dots": 2 * D + q + 2 * kv + 2 * F + down,
             "none": 2 * D + q + 2 * kv + 6 * F + 8 * D + down}[remat]
  saved, host = L * n * width * cb, 0
  if s.activation_offload:  # The layer in use and the one prefetched stay on the device.
    host, saved = saved, min(L, 2) * n * width * cb
  if remat == "none" and s.behaviour.shards_params:
    saved += pb * counts.gathered  # Every layer's gathered weights, kept for the backward.
  # One layer's backward (with its forward recomputed): MLP or attention, whichever is more.
  # Only XLA's dot_product holds whole T x T scores; cuDNN's fused kernel (what 'auto'
  # picks on a GPU) keeps a block's worth, like the blocked loop.
  kernel = attention_kernel(s.attention, s.compute_dtype, head_dim=s.head_dim)
  fused = kernel == "dot_product" and attention_kernel(
      "auto", s.compute_dtype, head_dim=s.head_dim) == kernel
  S = T if kernel == "dot_product" and not fused else min(s.attention_block, T)
  # The MLP's [.., d_ff] temporaries are for one chunk of positions (model.mlp_chunk).
  rows = b * min(s.mlp_chunk or local, local)
  if s.model == "llama" and (s.sequence_parallel or platform.backend() != "gpu"):
    attention, mlp = _layer_backward(s, S, rows, fused)
    if s.activation_offload and platform.backend() == "gpu":
      # 'saved activations' keeps two layers on the device: the one in use and the next,
      # read back from host memory. XLA's GPU schedule issues that read after the layer's
      # attention backward (configs/70b_256k_8x80gb.py, 8b_4m_8x80gb.py): through both
      # parts counted here the device holds the layer in use's input alone, a layer less.
      attention, mlp = attention - n * width * cb, mlp - n * width * cb
  else:  # mlp_lm (rough), and the GPU without sequence parallelism: calibrated at 4096
    # positions (docs/design/gpu-targets.md), its (T / S) n D term over-counts long sequences.
    attention = 2 * b * H * S * T * 4 + (T // S) * n * D * 4 + 4 * n * D * 4
    mlp = rows * F * (5 * cb + 4) + 5 * n * D * 4
  if s.n_experts and s.expert > 1:
    mlp = max(mlp, expert_dispatch_bytes(s, rows))
  if s.model == "mlp_lm":
    attention = 0
  # Any remat but 'none' runs `stage3.scan_layers` (a layer recomputed from what it saved).
  working = rows * 2 * F * cb + n * 12 * D * 4 if remat == "none" else max(mlp, attention)
  loss = b * min(s.loss_chunk, local) * V * 4  # A chunk of fp32 logits (or their gradient).
  if s.vocab_sharded:  # The logits of every shard's positions on this one's rows, and
    loss *= 2  # their gradient beside them (`zerojax.vocab.nll`'s backward).
  if s.model == "mlp_lm":
    loss = 3 * n * V * 4  # Whole fp32 logits, log-softmax and gradient (rough).
  return {"saved activations": saved, "working set": working, "loss chunk": loss,
          "saved activations (host)": host}


def _layer_backward(s: RunSpec, S: int, rows: int, fused: bool) -> tuple[int, int]:
  """One Llama layer's backward: (its attention part, its MLP part), read off the
  compilers' buffers at the peak (docs/design/long-context.md). With sequence parallelism
  attention runs on the whole sequence for H / fsdp query heads; without it (fsdp = 1 in
  what follows) on the device's own sequences for all heads.

  XLA:CPU, blocked attention: a query block's scores against all T keys (recomputed in
  fp32, their fp32 gradient, the probabilities in the compute dtype); q, k, v over the
  whole sequence in the compute dtype with the fp32 gradients of q and of k, v (summed
  over blocks); the slice's fp32 residual-stream buffers and one MLP chunk's [.., d_ff].
  The MLP's backward (before attention's) holds its [.., d_ff] values (one fp32, six in
  the compute dtype), the slice's [.., d_model] (five fp32, three in the compute dtype)
  and the recomputed attention's whole-sequence q and output.

  XLA's GPU compiler (sequence parallelism) keeps everything in the compute dtype: the
  MLP's backward holds four [.., d_ff] (three under release, untiled) and ten
  [.., d_model] values of the slice (tiled: nine, and four of the tile; the
  whole-sequence q and output among them: T x H / fsdp heads is the slice's width), its
  k and v, and the fp32 RoPE tables. cuDNN's
  attention materializes no scores: q, k, v, the output and their gradients over the
  whole sequence, six [.., d_model] of the slice
  (never the peak in the compiles measured: the MLP's backward was, down to d_ff =
  d_model / 2).
  """
  cb, T, b, D, F = DTYPE_BYTES[s.compute_dtype], s.seq_len, s.batch, s.d_model, s.mlp_width
  Dh = s.head_dim
  heads, kv = ((s.n_heads // s.fsdp, kv_width(s)) if s.sequence_parallel
               else (s.n_heads, s.n_kv_heads * Dh))
  q, n = heads * Dh, b * s.positions
  if platform.backend() == "gpu":
    # Release, MLP untiled: the down projection's weight gradient (from the product, for
    # the layer's update) comes first and frees the product before its input gradient is
    # made: three [n, d_ff]. Tiled, each tile's weight gradients are summed over the tiles
    # and the tile's backward holds all four.
    wide = 3 if s.release and rows == n else 4
    # Tiled, one of the slice's ten [n, d_model] values is the tile's four [rows, d_model]
    # (configs/8b_4m_8x80gb.py: nine and four, read off its compiled buffers).
    model = n * D * 10 if rows == n else n * D * 9 + rows * D * 4
    mlp = (rows * F * wide + model + 2 * n * s.n_kv_heads * Dh) * cb + 2 * n * Dh * 4
    if fused:
      return b * T * (q + kv) * 4 * cb + n * D * 6 * cb, mlp
  else:
    mlp = rows * F * (6 * cb + 4) + n * D * (5 * 4 + 3 * cb) + 2 * b * T * q * cb
  scores = b * heads * S * T * (2 * 4 + cb)
  whole = b * T * (q * (3 * cb + 4) + kv * (2 * cb + 2 * 4))
  return scores + whole + n * D * (3 * 4 + cb) + rows * F * cb, mlp


def expert_dispatch_bytes(s: RunSpec, tokens: int) -> int:
  """The expert-parallel block's backward at its peak (`moe.expert_parallel`), for
  `tokens` tokens a device: the rows it may receive, ep x `moe.exchange_slots` (ep x
  tokens x k dropless, the worst case; c x tokens x k at capacity factor c), each in the
  exchange's two buffers (2 cb bytes a model-width value), and with the tiles' padding
  (E / ep x `moe.tile_rows`) in the tiles and their cotangents, fp32 and in the compute
  dtype (8 + 2 cb). The experts' hidden values stay in a tile (`moe.tile_mlp`). Read off
  XLA's GPU compiler's buffers at the peak for Qwen3-30B-A3B on h100:8, 4 layers, to the
  byte at factors 0 and 1.5 (docs/design/moe.md)."""
  ep, cb = s.expert, DTYPE_BYTES[s.compute_dtype]
  received, local = ep * moe.exchange_slots(tokens * s.experts_per_token, ep,
                                            s.capacity_factor), s.n_experts // ep
  rows = received + local * moe.tile_rows(received, local)
  return s.d_model * (rows * (8 + 2 * cb) + received * 2 * cb)


def kv_width(s: RunSpec) -> int:
  """K/V values per position a device attends with under sequence parallelism: its share
  of the KV heads after their repeats (`ulysses.kv_repeats`)."""
  Dh = s.head_dim
  return s.n_kv_heads * ulysses.kv_repeats(s.n_heads, s.n_kv_heads, s.fsdp) // s.fsdp * Dh


def all_to_all_bytes(s: RunSpec, remat: str) -> int:
  """Bytes one device puts into all-to-alls per layer and step (all its microbatches):
  Ulysses' (`sequence.ulysses.all_to_all_bytes`) and the experts'
  (`models.moe.all_to_all_bytes`); 0 without sequence or expert parallelism."""
  total, cb = 0, DTYPE_BYTES[s.compute_dtype]
  if s.sequence_parallel:
    total += ulysses.all_to_all_bytes(s.batch * s.microbatches, s.seq_len, s.fsdp, s.n_heads,
                                      s.n_kv_heads, s.head_dim, cb, remat)
  if s.n_experts and s.expert > 1:
    total += s.microbatches * moe.all_to_all_bytes(
        s.batch * s.positions, s.experts_per_token, s.d_model, s.expert, cb, remat,
        s.capacity_factor)
  return total
