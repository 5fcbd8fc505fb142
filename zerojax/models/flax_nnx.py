"""Flax NNX modules on the plan: one adapter from a module to what the plan and step take.

`make_plan`, `init_state` and `make_train_step` work on a params pytree and pure
functions of it; an NNX module is a mutable object holding its params in
`nnx.Param` variables. `from_nnx` splits a module into its graph definition (the
structure, static) and its params, and gives back the pieces the library takes:

- `init`: rng -> the params as a plain nested dict (`nnx.to_pure_dict` of the
  `nnx.Param` state; the same tree a linen model with the same submodule names has),
  so `init_state` creates them sharded and a checkpoint holds plain dicts;
- `params` / `logical_axes`: their shapes and the axis names read from each
  variable's sharding metadata (`nnx.with_partitioning(init, names)`, stored as
  `out_sharding`); layers made by `nnx.vmap` / `nnx.scan` with
  `transform_metadata={nnx.PARTITION_NAME: 'layers'}` carry the leading 'layers' axis
  that makes stage 3 gather them one layer at a time;
- `loss`: `(params, batch, rng) -> loss`, the module rebuilt from the params
  (`nnx.merge`) and handed to the user's `loss_fn(module, batch, rng)`.

At stage 3 the stacked layers' variables hold `zerojax.Sharded` shards: the module's
scan body calls `zerojax.gather(block)` on its one layer (NNX modules are pytrees), as
a plain JAX model calls it on its layer's params.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import errors as flax_errors, nnx

PyTree = Any


class NnxModel(NamedTuple):
  """An NNX module as `make_plan`, `init_state` and `make_train_step` take it.

  Attributes:
    init: `rng -> params`, the module's `nnx.Param` values as a nested dict.
    params: their shapes and dtypes (`jax.ShapeDtypeStruct`s), for `make_plan`.
    logical_axes: per param, its axis names from the sharding metadata (None for a
      param without it), for `make_plan(logical_axes=...)`.
    loss: `(params, batch, rng) -> loss`, for `make_train_step` / `make_eval_step`;
      with model state `(params, batch, rng, model_state) -> (loss, aux,
      new_model_state)`.
    module: `(params[, model_state]) -> module`, the NNX module holding these params
      (e.g. the trained `state.params`, to run or save the model after training).
    model_state: the shapes of the module's `nnx.BatchStat` values (BatchNorm's running
      statistics) as a nested dict, for `make_plan(model_state=...)`; None without any.
      Then `init` returns `(params, model_state)`.
    eval_loss: `loss` on the module switched to inference (`module.eval()`: BatchNorm
      reads its running statistics, dropout is off), returning no new state: for
      `make_eval_step`.
  """
  init: Callable[[jax.Array], Any]
  params: PyTree
  logical_axes: PyTree
  loss: Callable[..., Any]
  module: Callable[..., nnx.Module]
  model_state: PyTree = None
  eval_loss: Callable[..., Any] | None = None


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def axis_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
  """A variable's logical axis names from its `out_sharding` metadata, or None.

  Entries that are not one name (a tuple of mesh axes) carry no logical name, so they
  become None: the plan only reads names, the 'layers' axis above all.
  """
  names = variable.get_metadata().get("out_sharding")
  if not names:
    return None
  names = getattr(names, "spec", names)  # A NamedSharding: its PartitionSpec.
  return tuple(n if isinstance(n, str) else None for n in names)


def from_nnx(create: Callable[..., nnx.Module],
             loss_fn: Callable[[nnx.Module, PyTree, jax.Array], Any]) -> NnxModel:
  """Splits an NNX module into the params pytree and pure functions the plan takes.

  Args:
    create: builds the module from `rngs=nnx.Rngs(key)` (a module class whose only
      argument is `rngs`, or `functools.partial(Module, config)`). It runs abstractly
      here and inside `init`'s jit, so no whole copy of the params is ever made.
      Variables are created without NNX's eager sharding: the plan decides the layout.
    loss_fn: `(module, batch, rng) -> loss` or `(loss, aux_dict)`; the rng is the
      step's: pass it to each call that draws random numbers (`module(x,
      rngs=nnx.Rngs(dropout=rng))` for dropout). An `nnx.Rngs` stored in the module
      cannot draw inside the jitted step: its count would have to advance across steps
      the step does not carry, so `loss` says so in one line (a `ValueError`) instead of
      flax's `TraceContextError`.

  Returns:
    The `NnxModel`.

  Raises:
    ValueError: if the module holds variables other than `nnx.Param`, `nnx.BatchStat`
      and RNG state (caches, other mutable state): the step would drop their updates.
  """
  def build(key):
    with nnx.use_eager_sharding(False):
      return nnx.split(create(rngs=nnx.Rngs(key)), nnx.Param, nnx.BatchStat, ...)

  graphdef, abstract, stats, rest = nnx.eval_shape(lambda: build(jax.random.key(0)))
  others = {type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=_is_variable)
            if not isinstance(v, nnx.RngState)}
  if others:
    raise ValueError(
        f"the module holds {sorted(others)} variables besides nnx.Param, nnx.BatchStat and "
        "RNG state: the step carries params and batch statistics only and would drop their "
        "updates; keep such state outside the module")
  stateful = bool(jax.tree.leaves(stats))
  # The RNG state the module keeps (its Rngs' keys and counts) is made for real, but
  # only it: under jit the params it does not return are never computed.
  rest = jax.jit(lambda: build(jax.random.key(0))[3])()

  def fill(abstract_state: nnx.State, values: PyTree) -> nnx.State:
    # A fresh State per call: `replace_by_pure_dict` writes into the one it is given.
    state = jax.tree.map(lambda v: v, abstract_state, is_leaf=_is_variable)
    nnx.replace_by_pure_dict(state, values)
    return state

  def module(params: PyTree, model_state: PyTree = None) -> nnx.Module:
    if stateful and model_state is None:
      raise ValueError("the module has batch statistics: module(params, model_state)")
    filled = fill(stats, model_state) if stateful else stats
    return nnx.merge(graphdef, fill(abstract, params), filled, rest)

  def loss(params: PyTree, batch: PyTree, rng: jax.Array, *model_state) -> Any:
    m = module(params, *model_state)
    out = _run(loss_fn, m, batch, rng)
    if not stateful:
      return out
    loss, aux = out if isinstance(out, tuple) else (out, {})
    return loss, aux, nnx.to_pure_dict(nnx.state(m, nnx.BatchStat))

  def eval_loss(params: PyTree, batch: PyTree, rng: jax.Array, *model_state) -> Any:
    m = module(params, *model_state)
    m.eval()  # BatchNorm's running statistics, no dropout.
    return _run(loss_fn, m, batch, rng)

  def init(rng: jax.Array) -> Any:
    _, params, batch_stats, _ = build(rng)
    made = nnx.to_pure_dict(params)
    return (made, nnx.to_pure_dict(batch_stats)) if stateful else made

  return NnxModel(
      init=init,
      params=nnx.to_pure_dict(abstract),
      logical_axes=nnx.to_pure_dict(abstract, axis_names),
      loss=loss, module=module,
      model_state=nnx.to_pure_dict(stats) if stateful else None, eval_loss=eval_loss)


def _run(loss_fn: Callable, module: nnx.Module, batch: PyTree, rng: jax.Array) -> Any:
  """`loss_fn(module, batch, rng)`, with flax's error for a stored `nnx.Rngs` made one
  line that names the fix."""
  try:
    return loss_fn(module, batch, rng)
  except flax_errors.TraceContextError as e:
    if "Rng" not in str(e):  # RNG state is what a stored nnx.Rngs advances.
      raise
    raise ValueError(
        "the NNX module draws random numbers from an nnx.Rngs stored in it, which cannot "
        f"advance inside zerojax's jitted step (flax: {str(e).split(' (')[0]}): pass the "
        "step's rng to each call instead, e.g. module(x, rngs=nnx.Rngs(dropout=rng)) in "
        "loss_fn (nnx.Dropout takes rngs= when called)") from None

