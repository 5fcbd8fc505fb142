"""Update rules: how an fp32 update reaches a low-precision (bf16) parameter.

- `nearest`: round to nearest, what `optax.apply_updates` does. An update smaller than
  half an ulp of the weight is lost: training stalls.
- `kahan`: a compensation buffer in the parameter dtype carries each step's rounding
  error into the next (2 bytes/param for bf16).
- `stochastic`: round up or down at random with the probabilities that make the
  rounding unbiased (no memory).
- `master`: an fp32 copy of the params that the inner transform updates; the bf16
  params are its rounding (DeepSpeed's bf16 mode, 4 bytes/param).

`with_update_rule` wraps any `GradientTransformation`, so it composes with optax's
transforms, and it returns updates `u` such that `optax.apply_updates(p, u)` lands
exactly on the new parameter it chose: `u = p_new - p` in fp32, which is exact, and
`p + u` in fp32 rounds back to `p_new`. Every other part of a training loop (the
ZeRO step, clipping, schedules) stays plain optax. Weight decay is part of the inner
transform's update, so it goes through the same compensated rounding: a bf16 multiply
by `1 - lr * wd` rounds back to the weight itself once `lr * wd < 2^-9`.

Rounding is forced with `lax.reduce_precision`: XLA may keep bf16 arithmetic in fp32
and drop an f32 -> bf16 -> f32 round trip (`xla_allow_excess_precision`), which would
silently zero a compensation computed as `s - f32(bf16(s))`.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any
UPDATE_RULES = ("nearest", "kahan", "stochastic", "master")


# --- Rounding -------------------------------------------------------------------------


def round_to(x: jax.Array, dtype: Any) -> jax.Array:
  """`x` rounded to nearest in `dtype`'s format, kept in `x`'s dtype; never elided."""
  info = jnp.finfo(dtype)
  if info.bits >= jnp.finfo(x.dtype).bits:
    return x
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
  """Unbiased stochastic rounding of fp32 `x` to bf16: E[result] = x.

  Adds 16 random bits below bf16's last mantissa bit and truncates: the magnitude
  rounds up with probability equal to the dropped fraction of an ulp (sign-magnitude
  makes it symmetric for negatives).

  Args:
    x: float32 array.
    dtype: bfloat16 (float32 returns `x`).
    key: a PRNG key.

  Returns:
    float32 array whose values are exactly representable in bf16.
  """
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return x
  if dtype != jnp.bfloat16 or x.dtype != jnp.float32:
    raise ValueError(f"stochastic rounding goes from float32 to bfloat16, not "
                     f"{x.dtype} to {dtype}")
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint32) & jnp.uint32(0xFFFF)
  rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(rounded, jnp.float32)


# --- Update rules ---------------------------------------------------------------------


class KahanState(NamedTuple):
  """`compensation`: per param, the rounding error not yet applied (param dtype)."""
  inner: optax.OptState
  compensation: PyTree


class MasterState(NamedTuple):
  """`master`: the fp32 params the inner transform updates."""
  inner: optax.OptState
  master: PyTree


class StochasticState(NamedTuple):
  """`key`: uint32[2] key data, split every step."""
  inner: optax.OptState
  key: jax.Array


def f32(x):
  return x.astype(jnp.float32)


def with_update_rule(inner: optax.GradientTransformation, rule: str, *,
                     seed: int = 0) -> optax.GradientTransformation:
  """Makes `inner`'s updates land on low-precision params by `rule`.

  Args:
    inner: any optax transform producing the (fp32) update for each param.
    rule: one of `UPDATE_RULES`.
    seed: seeds the stochastic-rounding stream (rule 'stochastic'). Its update takes
      an extra argument `stream`: an int32 scalar, or one per param leaf (a tree like
      the params). Leaf j of an update given stream s draws the bits of key j of
      `split(fold_in(step key, s), leaves)`, so the slices of one tree (a layer:
      `zerojax.updates.update_by_layer` passes the layer index; a device's shard:
      gradient release passes layer and shard) each draw their own. The state's key
      still advances once per step (every slice reads it as it was).

  Returns:
    A transform whose updates `u` (fp32) make `optax.apply_updates(p, u)` equal the
    rounded new params exactly. Its state adds, per rule: nothing ('nearest'), a
    compensation buffer in the param dtype ('kahan'), a PRNG key ('stochastic'), fp32
    master params ('master'). Those buffers mirror the params, so a ZeRO plan shards
    them like the moments.
  """
  if rule not in UPDATE_RULES:
    raise ValueError(f"unknown update rule {rule!r}; use one of {UPDATE_RULES}")
  if rule == "nearest":
    return inner

  def land(params, new):
    """fp32 updates that take each param exactly to `new` (fp32, representable)."""
    return jax.tree.map(lambda p, n: n - f32(p), params, new)

  if rule == "kahan":
    def init(params):
      return KahanState(inner.init(params), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params, **extra):
      u, inner_state = inner.update(grads, state.inner, params, **extra)
      exact = jax.tree.map(lambda p, u, c: f32(p) + f32(u) + f32(c),
                           params, u, state.compensation)
      new = jax.tree.map(lambda s, p: round_to(s, p.dtype), exact, params)
      compensation = jax.tree.map(lambda s, n, c: round_to(s - n, c.dtype).astype(c.dtype),
                                  exact, new, state.compensation)
      return land(params, new), KahanState(inner_state, compensation)

  elif rule == "stochastic":
    def init(params):
      return StochasticState(inner.init(params),
                             jax.random.key_data(jax.random.key(seed)))

    def update(grads, state, params, *, stream=None, **extra):
      u, inner_state = inner.update(grads, state.inner, params, **extra)
      key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
      leaves, treedef = jax.tree.flatten(params)
      n = len(leaves)
      if stream is None or jax.tree.structure(stream) != treedef:  # One for every leaf.
        keys = jax.random.split(
            step_key if stream is None else jax.random.fold_in(step_key, stream), n)
      else:  # A stream per leaf: leaf j takes key j of its stream's split.
        keys = [jax.random.split(jax.random.fold_in(step_key, s), n)[j]
                for j, s in enumerate(treedef.flatten_up_to(stream))]
      new = [stochastic_round(f32(p) + f32(u), p.dtype, k)
             for p, u, k in zip(leaves, treedef.flatten_up_to(u), keys)]
      return (land(params, treedef.unflatten(new)),
              StochasticState(inner_state, jax.random.key_data(key)))

  else:  # master
    def init(params):
      master = jax.tree.map(f32, params)
      return MasterState(inner.init(master), master)

    def update(grads, state, params, **extra):
      u, inner_state = inner.update(grads, state.inner, state.master, **extra)
      master = jax.tree.map(lambda m, u: m + f32(u), state.master, u)
      new = jax.tree.map(lambda m, p: round_to(m, p.dtype), master, params)
      return land(params, new), MasterState(inner_state, master)

  return optax.GradientTransformationExtraArgs(init, update)
