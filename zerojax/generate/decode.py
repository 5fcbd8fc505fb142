"""KV-cached generation on the training mesh: a prefill, then a decode loop, one program.

    out = generate(model, state.params, prompts, max_new=64, plan=built.plan,
                   sampling=Sampling(temperature=0.7, top_p=0.9), seed=0, stop_ids={257})
    answers = [t[:n] for t, n in zip(out.tokens, out.lengths)]

One jitted program per (batch bucket, prompt bucket, total length): the batch is rounded
up to a power of two and a multiple of the data devices, the longest prompt and prompt +
new tokens up to multiples of `LENGTH_STEP`, so repeated calls reuse compiles; the
number of new tokens, the stop ids, the seed and the sampling settings are traced. The
program runs under `jax.shard_map` over the plan's mesh, each device decoding its rows
of the batch (`cache` module: why the batch): the prefill writes the prompts' keys and
values into the cache, then a `lax.while_loop` feeds each row its last token until
every row has stopped (a stop id, then padding) or `max_new` tokens are out. No host
round trip per token.

Prompts are right-padded: a token's cache slot is its RoPE position, each prompt's
own 0..n-1, so the prefill is the training forward pass over the padded buffer (as the
uncached `greedy` runs it) and needs no padding mask: causal attention never lets a
prompt see its padding, and a row's decode step writes its slot before attending, so
padding left there is overwritten before it is visible. The price: rows write different
slots per step (a scatter of one token each), where left padding would write one column.

Params stay as the plan holds them. `gather='layer'` gathers each layer inside the layer
loop of every step, as training's stage 3 does (`stage3.gather`): params cost their
shard plus one layer, but every token moves the whole model over the interconnect.
`'whole'` gathers them once before the prefill: whole params on every device for the
program's duration, no collective per token. `'auto'` takes 'whole' where the whole
params (param dtype) fit in `WHOLE_SHARE` of a device's memory (always on a CPU, whose
devices report no limit), else 'layer'.
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import mesh as mesh_lib, stage3, step, zero
from zerojax.generate import cache as cache_lib, sampling as sampling_lib
from zerojax.generate.sampling import Sampling
from zerojax.runtime import dispatch

GATHER = ("auto", "whole", "layer")
WHOLE_SHARE = 0.25  # Of a device's memory, for whole params; the rest: cache, activations.
LENGTH_STEP = 64  # Prompt and total lengths are rounded up to a multiple of this.
STOP_SLOTS = 8  # Stop ids are padded to a multiple of this (one compile for any few).


class Generated(NamedTuple):
  """Tokens of each prompt.

  Attributes:
    tokens: int32[N, max_new], row n's new tokens, `pad_id` after its stop id.
    lengths: int32[N], tokens generated per row, its stop id included.
  """
  tokens: np.ndarray
  lengths: np.ndarray


def batch_bucket(n: int, devices: int) -> int:
  """Rows decoded for n prompts: a power of two >= n, rounded up to a multiple of devices."""
  b = 1 << max(n - 1, 0).bit_length()
  return -(-b // devices) * devices


def length_bucket(n: int) -> int:
  """Positions for n tokens: n rounded up to a multiple of `LENGTH_STEP`."""
  return -(-n // LENGTH_STEP) * LENGTH_STEP


def choose_gather(plan: zero.ZeroPlan, gather: str) -> str:
  """'whole' or 'layer' for `gather` ('auto': see the module docstring)."""
  if gather not in GATHER:
    raise ValueError(f"gather must be one of {GATHER}, not {gather!r}")
  if gather != "auto":
    return gather
  limit = (plan.mesh.devices.flat[0].memory_stats() or {}).get("bytes_limit")
  whole = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
              for x in jax.tree.leaves(plan.params))
  return "whole" if not plan.behaviour.shards_params or not limit or (
      whole <= WHOLE_SHARE * limit) else "layer"


@functools.lru_cache(maxsize=8)
def single_device_plan(model: Any) -> zero.ZeroPlan:
  """The plan of whole params on one device (params given without a plan)."""
  mesh = mesh_lib.make_mesh(1, 1, devices=jax.devices()[:1])
  return zero.make_plan(mesh, 0, jax.eval_shape(model.init, jax.random.key(0)))


def _decode(model, plan, gather, params, tokens, lengths, stops, max_new, seed, settings,
            *, total):
  """One device's rows (runs inside `shard_map`): see `decoder`."""
  params = step.materialize(plan, params, whole_vocab=True)  # Layers `Sharded` at stage 3.
  if gather == "whole":
    params = stage3.gather(params)
  # On XLA:CPU every gather above finishes before the prefill's layer loop gathers (the
  # head's would run beside it: `stage3.after`).
  tokens = step.ordered_batch(params, tokens)
  B, T = tokens.shape
  rows = jax.lax.axis_index(plan.data_axes) * B + jnp.arange(B)
  key = jax.random.key(seed)
  stopped = lambda t: jnp.any(t[:, None] == stops[None, :], axis=-1)
  everywhere = lambda done: jax.lax.pmin(jnp.all(done).astype(jnp.int32), plan.data_axes) > 0

  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  # The prefill's logits at each prompt's last token only (not [B, T, V] in fp32).
  logits, kv = model.extend(params, tokens, positions, cache_lib.init_cache(model.config, B, total),
                            last=jnp.maximum(lengths, 1) - 1)
  last = logits[:, 0]
  first = sampling_lib.next_token(last, settings, key, rows, jnp.int32(0))
  done = (lengths == 0) | stopped(first)  # Length 0: a row that fills the batch bucket.
  out = jnp.zeros((B, total), jnp.int32).at[:, 0].set(first)
  count = jnp.where(lengths == 0, 0, 1)

  def more(carry):
    i, *_, finished = carry
    return (i < max_new) & ~finished

  def one(carry):
    i, prev, done, out, count, kv, _ = carry
    logits, kv = model.extend(params, prev[:, None], (lengths + i - 1)[:, None], kv)
    token = sampling_lib.next_token(logits[:, 0], settings, key, rows, i)
    token = jnp.where(done, 0, token)
    count = jnp.where(done, count, i + 1)
    done = done | stopped(token)
    return i + 1, token, done, out.at[:, i].set(token), count, kv, everywhere(done)

  carry = (jnp.int32(1), first, done, out, count, kv, everywhere(done))
  _, _, _, out, count, kv, _ = jax.lax.while_loop(more, one, carry)
  return out, count, kv


_programs: dict = {}


def decoder(model: Any, plan: zero.ZeroPlan, gather: str = "auto") -> Any:
  """The jitted decoder of `model` on `plan`'s mesh (made once per model, plan, gather).

  Returns:
    `run(params, tokens, lengths, stops, max_new, seed, settings, S)`: params laid
    out by the plan; tokens int32[B, T] right-padded prompts and lengths int32[B] (0: an
    unused row), B a multiple of the data devices; stops int32[n] (-1: none); max_new,
    seed int32 scalars; settings a `Sampling` of scalars; S >= T + max_new - 1 (static).
    Gives (int32[B, S] new tokens (0 after a stop), int32[B] counts, the final
    `KVCache` (`zerojax.models.llama`), batch over the data axes).
  """
  cache_lib.check_model(model)
  gather = choose_gather(plan, gather)
  key = (model, id(plan), gather)
  if key not in _programs:
    rows = P(plan.data_axes)
    kv = cache_lib.spec(model.config, plan.data_axes)

    def run(params, tokens, lengths, stops, max_new, seed, settings, total):
      body = functools.partial(_decode, model, plan, gather, total=total)
      return jax.shard_map(body, mesh=plan.mesh, check_vma=False,
                           in_specs=(plan.param_specs, rows, rows, P(), P(), P(), P()),
                           out_specs=(rows, rows, kv))(
                               params, tokens, lengths, stops, max_new, seed, settings)

    row, one = NamedSharding(plan.mesh, rows), NamedSharding(plan.mesh, P())
    program = dispatch.guarded(jax.jit(run, static_argnums=7, in_shardings=(
        plan.param_shardings, row, row, one, one, one, one),
        out_shardings=(row, row, cache_lib.shardings(model.config, plan.mesh, plan.data_axes))))
    _programs[key] = (plan, program)  # The plan kept alive: its id stays its own.
  return _programs[key][1]


def abstract_inputs(plan: zero.ZeroPlan, batch: int, width: int, total: int) -> tuple:
  """`decoder`'s arguments as shapes with shardings (to lower or compile it without
  allocating: e.g. for a GPU target): `batch` rows of `width` prompt tokens, `total`
  positions, greedy."""
  row, one = NamedSharding(plan.mesh, P(plan.data_axes)), NamedSharding(plan.mesh, P())
  like = lambda x, sharding: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                  sharding=sharding)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        plan.params, plan.param_shardings)
  return (params, like(np.zeros((batch, width), np.int32), row),
          like(np.zeros(batch, np.int32), row), like(np.zeros(STOP_SLOTS, np.int32), one),
          like(np.int32(0), one), like(np.int32(0), one),
          jax.tree.map(lambda x: like(x, one), sampling_lib.as_arrays(Sampling())), total)


def _global(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A host array (the same on every process) as a global array."""
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def generate(model: Any, params: Any, prompts: list, max_new: int, *,
             plan: zero.ZeroPlan | None = None, sampling: Sampling = Sampling(), seed: int = 0,
             stop_ids: Any = (), gather: str = "auto") -> Generated:
  """Generates up to `max_new` tokens after each prompt (see the module docstring).

  Args:
    model: a model with `extend` (`LlamaLM`).
    params: laid out by `plan` (e.g. `state.params`); without a plan, whole params.
    prompts: token id sequences, each non-empty.
    max_new: tokens to generate at most, >= 1.
    plan: the params' ZeRO plan; None: whole params on one device.
    sampling: greedy (the default) or sampled.
    seed: the sampling seed (same seed, same tokens).
    stop_ids: ids that end a row (EOS, end of turn), kept as its last token.
    gather: 'auto', 'whole' or 'layer'.

  Returns:
    `Generated`: the new tokens and their count per prompt.
  """
  cache_lib.check_model(model)
  sampling_lib.check(sampling)
  if max_new < 1 or not prompts or not all(len(p) for p in prompts):
    raise ValueError("generate needs max_new >= 1 and at least one prompt, none empty")
  vocab = model.config.vocab_size
  if any(min(p) < 0 or max(p) >= vocab for p in prompts):
    raise ValueError(f"a prompt has a token id outside the vocabulary [0, {vocab})")
  plan = plan or single_device_plan(model)
  program = decoder(model, plan, gather)
  n, longest = len(prompts), max(len(p) for p in prompts)
  batch, width = batch_bucket(n, plan.num_data), length_bucket(longest)
  tokens = np.zeros((batch, width), np.int32)
  lengths = np.zeros(batch, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)], lengths[b] = p, len(p)
  stops = np.full(max(1, -(-len(set(stop_ids)) // STOP_SLOTS)) * STOP_SLOTS, -1, np.int32)
  stops[:len(set(stop_ids))] = sorted(set(stop_ids))
  row = NamedSharding(plan.mesh, P(plan.data_axes))
  out, count, _ = program(params, _global(tokens, row), _global(lengths, row), stops,
                          np.int32(max_new), np.int32(seed), sampling_lib.as_arrays(sampling),
                          length_bucket(longest + max_new))
  out, count = (np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (out, count))
  return Generated(out[:n, :max_new], count[:n])
