"""The activation terms of one microbatch: what the layers save for the backward pass
(by remat policy), one layer's recompute + backward working set, the loss chunk."""

from zerojax.memory.spec import DTYPE_BYTES, Counts, RunSpec
from zerojax.models import remat as remat_policies
from zerojax.models.attention import attention_kernel


def activations(s: RunSpec, counts: Counts, remat: str) -> dict:
  """Per-device bytes: 'saved activations', 'working set', 'loss chunk'."""
  pb, cb = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.compute_dtype]
  D, F, L, V, T, b = s.d_model, s.d_ff, s.n_layers, s.vocab_size, s.seq_len, s.batch
  H, kv = s.n_heads, s.n_kv_heads * (s.d_model // s.n_heads)
  n = b * T
  # Saved for the backward pass, per layer and token:
  if s.model == "mlp_lm":  # Rough: not calibrated.
    width = {"full": D, "dots": 2 * D + F, "none": (s.context + 4) * D + 3 * F}[remat]
  elif remat_policies.SAVED.get(remat) is not None:  # The layer input and the named values.
    width = D + remat_policies.saved_width(remat, D, H * (D // H), kv, F)
  else:  # none: also the norms' fp32 inputs and outputs (4 D of 4 bytes = 8 D of 2).
    width = {"dots": 3 * D + 2 * kv + 2 * F, "none": 3 * D + 2 * kv + 6 * F + 8 * D}[remat]
  saved = L * n * width * cb
  if remat == "none" and s.behaviour.shards_params:
    saved += pb * counts.layers  # Every layer's gathered weights, kept for the backward.
  # One layer's backward (with its forward recomputed): MLP or attention, whichever is more.
  # Only XLA's dot_product holds whole T x T scores; cuDNN's fused kernel (what 'auto'
  # picks on a GPU) keeps a block's worth, like the blocked loop.
  kernel = attention_kernel(s.attention, s.compute_dtype)
  fused = kernel == "dot_product" and attention_kernel("auto", s.compute_dtype) == kernel
  S = T if kernel == "dot_product" and not fused else min(s.attention_block, T)
  attention = 2 * b * H * S * T * 4 + (T // S) * n * D * 4 + 4 * n * D * 4
  if s.model == "mlp_lm":
    attention = 0
  mlp = n * F * (5 * cb + 4) + 5 * n * D * 4
  # Any remat but 'none' runs `stage3.scan_layers` (a layer recomputed from what it saved).
  working = n * (2 * F * cb + 12 * D * 4) if remat == "none" else max(mlp, attention)
  loss = b * min(s.loss_chunk, T) * V * 4  # A chunk of fp32 logits (or their gradient).
  if s.model == "mlp_lm":
    loss = 3 * n * V * 4  # Whole fp32 logits, log-softmax and gradient (rough).
  return {"saved activations": saved, "working set": working, "loss chunk": loss}
