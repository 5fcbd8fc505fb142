"""A function's outputs made into host memory a layer at a time, where its jaxpr shows how.

`init_state`'s program for a group of offloaded leaves computes the whole init and keeps
those leaves: XLA makes each on the device, whole, and copies it out (one MLP stack of
the 70B: 35 GiB on one GPU). But a stacked leaf is usually the stacked output of a
`lax.scan` over the layers (a linen `nn.scan`'s init) or a broadcast (an optimizer's
zeros): `made_in_host` re-runs the function's jaxpr eqn by eqn, and for such an output
runs the scan with that output moved to host memory in its body (`outbound`: the scan
stacks it there, one layer's copy a trip) or the broadcast as a scan of one layer's
broadcast. The values are the same ops' (bit for bit); any other output is left as it
is (made whole, then moved).
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core

from zerojax.streaming.memory import to_host


def made_in_host(fn: Callable, stacked: list[bool], *args) -> list:
  """`fn(*args)`'s output leaves (a flat list), those `stacked` names (layer-stacked, to
  host memory) made there layer by layer where `fn`'s top-level jaxpr makes them with a
  scan or a broadcast; call it inside `jax.jit` over one device (a broadcast's sharding
  is not kept)."""
  try:
    return _rerun(jax.make_jaxpr(fn)(*args), stacked, *args)
  except (AttributeError, KeyError, TypeError):  # A JAX whose jaxprs moved (jax_internals).
    return jax.tree.leaves(fn(*args))


def _rerun(closed: Any, stacked: list[bool], *args) -> list:
  jaxpr, env = closed.jaxpr, {}
  outputs = {v for v, s in zip(jaxpr.outvars, stacked, strict=True)
             if s and isinstance(v, core.Var)}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]  # noqa: E731
  for v, x in zip(jaxpr.constvars, closed.consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, jax.tree.leaves(args)):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins, hit = [read(v) for v in eqn.invars], [v in outputs for v in eqn.outvars]
    if eqn.primitive.name == "scan" and any(hit[eqn.params["num_carry"]:]):
      outs = _scan_into_host(eqn.params, ins, hit)
    elif (eqn.primitive.name == "broadcast_in_dim" and hit[0]
          and len(eqn.params["shape"]) > 1 and not jax.numpy.ndim(ins[0])):
      outs = [_broadcast_into_host(ins[0], eqn.params["shape"])]
    else:
      outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
      outs = outs if eqn.primitive.multiple_results else [outs]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _scan_into_host(params: dict, ins: list, hit: list[bool]) -> list:
  """A scan eqn run again with the stacked outputs `hit` names moved to host memory in
  its body."""
  consts_n, carry_n, body = params["num_consts"], params["num_carry"], params["jaxpr"]
  consts, init, xs = ins[:consts_n], ins[consts_n:consts_n + carry_n], ins[consts_n + carry_n:]

  def trip(carry, x):
    out = core.jaxpr_as_fun(body)(*consts, *carry, *x)
    ys = [to_host(y, True) if h else y for y, h in zip(out[carry_n:], hit[carry_n:])]
    return out[:carry_n], ys

  carry, ys = jax.lax.scan(trip, init, xs, length=params["length"], reverse=params["reverse"],
                           unroll=params["unroll"])
  return [*carry, *ys]


def _broadcast_into_host(value: Any, shape: tuple[int, ...]) -> jax.Array:
  """`broadcast(value, shape)` made one leading slice a trip, each moved to host memory."""
  layer = lambda _, __: (None, to_host(jax.lax.broadcast(value, shape[1:]), True))  # noqa: E731
  return jax.lax.scan(layer, None, length=shape[0])[1]
