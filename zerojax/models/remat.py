"""Remat policies by name: what the backward pass keeps of each Llama layer.

The Llama block names its intermediate values with `jax.ad_checkpoint.checkpoint_name`
(`NAMES`); a policy is the set of names it saves, as MaxText's `remat_policy` choices
are (its meanings, our names). Everything a policy does not save is recomputed from the
layer's input in the backward pass. Any policy but 'none' also recomputes a stage-3
layer's gathered weights instead of saving them (they are not named values); 'none'
saves everything, every layer's gathered weights included.

Gradient release (`zerojax.release`) ignores the policy: it saves only layer inputs.
"""

import jax
from jax.ad_checkpoint import checkpoint_name

# Each named value of the block: its width per token, from (D, q, kv, F) = (d_model,
# query width H * Dh, key/value width K * Dh, d_ff). Names are the Hugging Face module
# whose output it is; 'attention_out' is the attention's output before o_proj.
NAMES = {
    "q_proj": lambda D, q, kv, F: q,
    "k_proj": lambda D, q, kv, F: kv,
    "v_proj": lambda D, q, kv, F: kv,
    "attention_out": lambda D, q, kv, F: q,
    "o_proj": lambda D, q, kv, F: D,
    "gate_proj": lambda D, q, kv, F: F,
    "up_proj": lambda D, q, kv, F: F,
    "down_proj": lambda D, q, kv, F: D,
}
# The mixture of experts' outputs (`moe.tile_mlp`): matmul outputs, but made in a loop
# that `jax.checkpoint_policies.dots_with_no_batch_dims_saveable` cannot see into, so
# 'dots' saves them by name (else the backward pass runs the experts' forward loop again).
EXPERTS = "experts"
_QKV = ("q_proj", "k_proj", "v_proj")
_PROJECTIONS = (*_QKV, "o_proj", "gate_proj", "up_proj", "down_proj")

# Policy -> the names it saves (None: not a by-name policy). Most memory first.
SAVED = {
    "none": None,  # No remat: everything.
    "dots": None,  # Every matmul output without batch dims (the projections, by JAX's
    # rule), and the experts' outputs (`EXPERTS`).
    "minimal": _PROJECTIONS,  # MaxText's 'minimal': every projection, not attention_out.
    "save_dot_with_context_except_mlp": (*_QKV, "attention_out", "o_proj"),
    "save_dot_except_mlp": (*_QKV, "o_proj"),
    "save_qkv_proj": _QKV,
    "save_attention_out": ("attention_out",),
    "full": (),  # Only the layer's input.
}
POLICIES = tuple(SAVED)


def policy(name: str):
  """The `jax.checkpoint` policy of a `POLICIES` name (None for 'none': no remat)."""
  if name == "none":
    return None
  if name == "dots":
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(EXPERTS))
  if name == "full":
    return jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint_policies.save_only_these_names(*SAVED[name])


def residuals(name: str) -> tuple[str, ...]:
  """The named values a by-name policy really saves: its names but 'down_proj', whose
  output the backward pass never reads (it is only added to the residual stream)."""
  return tuple(n for n in SAVED[name] if n != "down_proj")


def saved_width(name: str, d_model: int, q: int, kv: int, d_ff: int) -> int:
  """Elements per token and layer a by-name policy saves besides the layer's input."""
  return sum(NAMES[n](d_model, q, kv, d_ff) for n in residuals(name))


def named(x: jax.Array, name: str) -> jax.Array:
  """`x`, tagged `name` (a key of `NAMES`, or `EXPERTS`) for the policies that save by
  name; no-op otherwise."""
  assert name in NAMES or name == EXPERTS, name
  return checkpoint_name(x, name)
