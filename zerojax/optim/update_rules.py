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

**State precision.** optax makes a transform's state (moments, EMAs, accumulators) in
the dtype of the params it is initialised on, so on bf16 params Adam's `nu` is bf16
and `b2 * nu` rounds back to `nu`: it never decays, silently. `with_update_rule`
initialises its inner transform on the params cast to fp32 and updates it with fp32
gradients and params, so that state is fp32 at every rule ('nearest' included), and
refuses a float state leaf narrower than its `state_dtype` (one the transform itself
makes narrow) unless the caller declares it. `check_state_precision` is the same guard
for a transform given to the train step unwrapped.
"""

import contextlib
import threading
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


# --- State precision ------------------------------------------------------------------


def _is_float(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _narrower(dtype: Any, floor: Any) -> bool:
  """Whether float `dtype` holds less than `floor`: fewer bits, or as many in another
  format (float16 against a bfloat16 floor: more mantissa, far less range)."""
  dtype, floor = jnp.dtype(dtype), jnp.dtype(floor)
  return dtype != floor and jnp.finfo(dtype).bits <= jnp.finfo(floor).bits


def widen(tree: PyTree) -> PyTree:
  """`tree` with its float leaves narrower than float32 cast to float32, others as given."""
  return jax.tree.map(lambda x: f32(x) if _is_float(x) and _narrower(x.dtype, jnp.float32)
                      else x, tree)


# Which state leaves a `with_update_rule` made (and so checked against its declared
# state dtype): each init being checked pushes a list, and every wrapper's init adds its
# whole state's leaves to the innermost one. Leaves are matched by identity: a
# composition that only nests states (`optax.chain`, `multi_transform`,
# `carry_grad_norm`) passes them on as they are; one that computes on them makes new
# leaves, which are checked as unwrapped (refused if narrow: the safe side).
_vouching = threading.local()


@contextlib.contextmanager
def _recording():
  stack = _vouching.__dict__.setdefault("stack", [])
  stack.append([])
  try:
    yield stack[-1]
  finally:
    stack.pop()


def _vouch(state: PyTree) -> PyTree:
  stack = getattr(_vouching, "stack", None)
  if stack:
    stack[-1].extend(jax.tree.leaves(state))
  return state


def _narrow_leaves(init: Any, params: PyTree, floor: Any) -> tuple[PyTree, dict[str, Any]]:
  """`init(params)`, and its float leaves narrower than `floor` that no nested
  `with_update_rule` made: {path: dtype}."""
  with _recording() as vouched:
    state = init(params)
    # `vouched` holds its leaves alive while their ids are compared.
    made = {id(x) for x in vouched}
    narrow = {jax.tree_util.keystr(path) or "state": leaf.dtype
              for path, leaf in jax.tree_util.tree_leaves_with_path(state)
              if _is_float(leaf) and _narrower(leaf.dtype, floor) and id(leaf) not in made}
  return state, narrow


def _listed(narrow: dict[str, Any], first: int = 3) -> str:
  """The first few 'path (dtype)', and how many more: a model has hundreds of leaves."""
  named = [f"{path} ({jnp.dtype(dtype).name})" for path, dtype in narrow.items()]
  more = f" and {len(named) - first} more" if len(named) > first else ""
  return ", ".join(named[:first]) + more


def check_state_precision(tx: optax.GradientTransformation, params: PyTree) -> None:
  """Refuses an optimizer whose state would hold an undeclared sub-fp32 float leaf.

  optax makes state in the params' dtype: an optax transform given to the train step
  unwrapped, on bf16 params, keeps its moments in bf16, where an average with decay
  above 1 - 2^-8 (Adam's b2 = 0.999) never decays. A state leaf made by
  `with_update_rule` (zerojax's `adamw`, `lion` and `sgd` are built on it) passes: the
  wrapper checked it against the state dtype its caller declared. Only shapes are
  traced (`jax.eval_shape` of `tx.init`); nothing is computed.

  Args:
    tx: the optimizer.
    params: the params or their shapes (arrays or `jax.ShapeDtypeStruct`s, any dtype).

  Raises:
    ValueError: a float leaf of the state is narrower than float32 and was not made by
      `with_update_rule` (one line, naming the leaves and the fix).
  """
  narrow = {}
  jax.eval_shape(lambda p: narrow.update(_narrow_leaves(tx.init, p, jnp.float32)[1]), params)
  if narrow:
    raise ValueError(
        f"optimizer state leaves {_listed(narrow)} are below float32 (optax makes state in "
        f"the params' dtype; a bf16 average with decay above 0.996 never decays): wrap the "
        f"optimizer as zerojax.with_update_rule(tx, rule) for fp32 "
        f"state, or use zerojax.optim.adamw / lion / sgd")


# --- The wrapper ----------------------------------------------------------------------


def with_update_rule(inner: optax.GradientTransformation, rule: str, *, seed: int = 0,
                     state_dtype: Any = jnp.float32,
                     fp32_params: bool = True) -> optax.GradientTransformation:
  """Makes `inner`'s updates land on low-precision params by `rule`, its state in fp32.

  The inner transform runs in fp32 whatever the params' dtype: it is initialised on the
  params with every float leaf narrower than float32 cast to float32, so the state optax
  makes "like the params" (moments, EMAs, accumulators) is fp32, and its update gets the
  gradients and params cast likewise (at 'master', the fp32 master params). An update
  that returns a state leaf narrower than its init made it is refused when traced; a
  wider one is cast back, so the state's dtypes never drift from step to step.

  Args:
    inner: any optax transform producing the (fp32) update for each param; its state
      may be built from the params (optax's usual `zeros_like(params)`).
    rule: one of `UPDATE_RULES`.
    seed: seeds the stochastic-rounding stream (rule 'stochastic'). Its update takes
      an extra argument `stream`: an int32 scalar, or one per param leaf (a tree like
      the params). Leaf j of an update given stream s draws the bits of key j of
      `split(fold_in(step key, s), leaves)`, so the slices of one tree (a layer:
      `zerojax.updates.update_by_layer` passes the layer index; a device's shard:
      gradient release passes layer and shard) each draw their own. The state's key
      still advances once per step (every slice reads it as it was).
    state_dtype: the narrowest float dtype the inner state may hold (float32 or
      bfloat16). A declaration, not a cast: the wrapper never narrows a leaf; it
      refuses at init a leaf the inner transform makes narrower (e.g.
      `optax.adam(mu_dtype=jnp.bfloat16)`'s `mu`) unless declared here. bfloat16 is
      safe only for averages that decay by more than 2^-8 a step (b <= 0.996):
      zerojax's own `scale_by_adam` refuses a b2 that bf16 cannot hold; for any other
      transform, the caller declaring bf16 answers for its decay rates. A declared bf16
      leaf costs 2 bytes: no fp32 copy of it is kept.
    fp32_params: False hands the inner update the params as they are (bf16), not cast
      to fp32. For zerojax's `adamw`, `lion` and `sgd`, whose moments are stored in
      their own `state_dtype` whatever the params': their weight decay `wd * p` then
      rounds in the param dtype as it always has (their results bit for bit). A
      transform whose update makes its state in the params' dtype (optax's adafactor)
      is refused with it.

  Returns:
    A transform whose updates `u` (fp32) make `optax.apply_updates(p, u)` equal the
    rounded new params exactly. Its state adds, per rule: nothing ('nearest': the
    inner state itself), a compensation buffer in the param dtype ('kahan'), a uint32[2]
    PRNG key ('stochastic'), fp32 master params ('master'). Those buffers mirror the
    params, so a ZeRO plan shards them like the moments. `check_state_precision`
    accepts every leaf of this state.

  Raises:
    ValueError: an unknown rule or a non-float `state_dtype`; at init, an inner float
      state leaf narrower than `state_dtype`; when the update is traced, one narrower
      than its init made it.
  """
  if rule not in UPDATE_RULES:
    raise ValueError(f"unknown update rule {rule!r}; use one of {UPDATE_RULES}")
  floor = jnp.dtype(state_dtype)
  if not jnp.issubdtype(floor, jnp.floating):
    raise ValueError(f"state_dtype must be a float dtype (float32 or bfloat16), not {floor}")
  inner = optax.with_extra_args_support(inner)

  def inner_init(params):
    """The inner state, from fp32 params, with every float leaf at least `floor`."""
    state, narrow = _narrow_leaves(inner.init, widen(params), floor)
    if narrow:
      name = jnp.dtype(next(iter(narrow.values()))).name
      raise ValueError(
          f"optimizer state leaves {_listed(narrow)} are narrower than state_dtype="
          f"{floor.name}: keep them in {floor.name} (e.g. drop optax.adam's mu_dtype) or "
          f"declare them with with_update_rule(..., state_dtype=jnp.{name}), taking on "
          f"their decay rates (an average with decay above 0.996 never decays in bfloat16)")
    return state

  def inner_update(grads, state, params, **extra):
    """The inner update in fp32, its state kept in the dtypes its init made."""
    u, new = inner.update(widen(grads), state, widen(params) if fp32_params else params,
                          **extra)
    narrowed = {}

    def keep(path, old, new):
      if not (_is_float(old) and _is_float(new)) or new.dtype == old.dtype:
        return new
      if _narrower(new.dtype, old.dtype):
        narrowed[jax.tree_util.keystr(path)] = new.dtype
      return new.astype(old.dtype)

    new = jax.tree_util.tree_map_with_path(keep, state, new)
    if narrowed:
      raise ValueError(
          f"the optimizer's update returns state leaves {_listed(narrowed)} narrower than "
          f"its init made them (its state follows the params' dtype): leave "
          f"with_update_rule's fp32_params=True")
    return u, new

  def land(params, new):
    """fp32 updates that take each param exactly to `new` (fp32, representable)."""
    return jax.tree.map(lambda p, n: n - f32(p), params, new)

  if rule == "nearest":
    # optax.apply_updates rounds p + u to nearest itself.
    init = inner_init

    def update(grads, state, params=None, **extra):
      return inner_update(grads, state, params, **extra)

  elif rule == "kahan":
    def init(params):
      return KahanState(inner_init(params), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params, **extra):
      u, inner_state = inner_update(grads, state.inner, params, **extra)
      exact = jax.tree.map(lambda p, u, c: f32(p) + f32(u) + f32(c),
                           params, u, state.compensation)
      new = jax.tree.map(lambda s, p: round_to(s, p.dtype), exact, params)
      compensation = jax.tree.map(lambda s, n, c: round_to(s - n, c.dtype).astype(c.dtype),
                                  exact, new, state.compensation)
      return land(params, new), KahanState(inner_state, compensation)

  elif rule == "stochastic":
    def init(params):
      return StochasticState(inner_init(params),
                             jax.random.key_data(jax.random.key(seed)))

    def update(grads, state, params, *, stream=None, **extra):
      u, inner_state = inner_update(grads, state.inner, params, **extra)
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
      return MasterState(inner_init(master), master)

    def update(grads, state, params, **extra):
      u, inner_state = inner_update(grads, state.inner, state.master, **extra)
      master = jax.tree.map(lambda m, u: m + f32(u), state.master, u)
      new = jax.tree.map(lambda m, p: round_to(m, p.dtype), master, params)
      return land(params, new), MasterState(inner_state, master)

  # Every leaf of this state passed the check above (the rule's buffers are the rule's).
  return optax.GradientTransformationExtraArgs(lambda params: _vouch(init(params)), update)
