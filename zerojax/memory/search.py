"""What to change when a step does not fit: `suggestions` re-estimates modified setups
(one code path, `estimate`) and ranks those that fit; `fewest_devices`."""

import copy
import dataclasses
import math

from zerojax.config import ConfigError
from zerojax.config.rules import validate
from zerojax.memory.spec import RunSpec, _as_setup
from zerojax.memory.step import Estimate, estimate
from zerojax.models.attention import attention_kernel

_REMAT_ORDER = ("none", "dots", "full")  # Increasing recomputation (and a by-name policy
# is followed by 'full').


@dataclasses.dataclass(frozen=True)
class Suggestion:
  """A change (config overrides) and the estimate it gives."""
  change: str
  overrides: tuple
  estimate: Estimate


_ACCUMULATE = ("optimizer.release_accumulation=optimizer",)


def _changes(s: RunSpec) -> list[list[tuple[str, tuple, dict]]]:
  """Changes that save memory, cheapest kind first; each kind's levels mildest first.

  Cost to training: Kahan matches fp32 master weights (the stall table in
  docs/design/precision.md); a stage
  adds communication; bf16 moments lose precision; remat recomputes (full: ~1/3 more
  FLOPs); gradient release recomputes as remat full does and leaves no global gradient
  norm to clip by and one microbatch a step; microbatches lower per-device efficiency;
  offload moves the optimizer state over the host link twice a step; Lion is another
  optimizer to tune.
  """
  kinds = []
  if s.update_rule == "master":
    kinds.append([("Kahan-compensated updates instead of fp32 master weights",
                   ("optimizer.update_rule=kahan",), dict(update_rule="kahan"))])
  kinds.append([(f"ZeRO stage {k}", (f"zero.stage={k}",), dict(stage=k))
                for k in range(s.stage + 1, 4)])
  if s.state_dtype == "float32":
    kinds.append([("bf16 optimizer state" + (" (AdamW: b2 <= 0.996)" if s.optimizer == "adamw"
                                             else ""),
                   ("optimizer.state_dtype=bfloat16",), dict(state_dtype="bfloat16"))])
  order = _REMAT_ORDER if s.remat in _REMAT_ORDER else (s.remat, "full")
  kinds.append([(f"remat {r}", (f"model.remat={r}",), dict(remat=r))
                for r in order[order.index(s.remat) + 1:]])
  release = () if s.release else ("optimizer.release=True", "optimizer.grad_clip=0",
                                   *_ACCUMULATE * (s.microbatches > 1))
  if not s.release and _releases(s):
    kinds.append([("gradient release (stage 3, no global-norm clipping)", release,
                   dict(release=True))])
  kinds.append([(f"{s.microbatches * k} microbatches of {s.batch // k} sequence(s) per device",
                 (f"train.microbatches={s.microbatches * k}",),
                 dict(microbatches=s.microbatches * k, batch=s.batch // k))
                for k in range(2, s.batch + 1) if s.batch % k == 0])
  if not s.offload:
    kinds.append([("optimizer state offloaded to host memory", ("optimizer.offload=host",),
                   dict(offload=True))])
  # Param offload saves device bytes only with release (without, the step brings the whole
  # shard in): the two together.
  if not s.param_offload and (s.release or _releases(s)):
    kinds.append([("parameters offloaded to host memory (with gradient release)",
                   ("zero.param_offload=host", *release),
                   dict(param_offload=True, release=True))])
  if s.optimizer == "adamw":
    kinds.append([("Lion instead of AdamW (one moment)", ("optimizer.name=lion",),
                   dict(optimizer="lion"))])
  return [k for k in kinds if k]


def _releases(s: RunSpec) -> bool:
  """What `validate._check_release` accepts: stage 3 (over any number of shards, one
  included), no float16; several microbatches with optimizer accumulation (adamw, lion)."""
  return (s.stage == 3 and "float16" not in (s.param_dtype, s.compute_dtype)
          and (s.microbatches == 1 or s.optimizer != "sgd"))


def _fewer_offloads(s: RunSpec) -> list[list[tuple[str, tuple, dict]]]:
  """When the host memory is short: each offload undone, the one holding most first."""
  kinds = [(s.activation_offload, "activations kept on the device (no activation offload)",
            "model.activation_offload=none", dict(activation_offload=False)),
           (s.param_offload, "parameters kept on the device (no param offload)",
            "zero.param_offload=none", dict(param_offload=False)),
           (s.offload, "optimizer state kept on the device (no optimizer offload)",
            "optimizer.offload=none", dict(offload=False))]
  return [[(change, (override,), fields)] for on, change, override, fields in kinds if on]


def fewest_devices(config, devices: int | None = None, device_memory: int = 0,
                   limit: int = 4096, host_memory: int = 0) -> Estimate | None:
  """The fewest devices of `device_memory` on which the step fits (and its host bytes in
  `host_memory` per node), at the same per-device batch and `mesh.data` (the ZeRO shards
  grow); None if none up to `limit` does."""
  s = _as_setup(config, devices)
  fit = dict(device_memory=device_memory, host_memory=host_memory)
  top = 1 << (limit // s.data).bit_length() - 1  # The most divisible count: if even it
  sizes = [k for k in range(1, top + 1) if _splits(s, k)]
  if s.sequence_parallel:  # The most divisible count the sequence splits over.
    top = max(sizes)
  if not estimate(dataclasses.replace(s, fsdp=top), **fit).fits:
    return None  # does not fit, none does (indivisible leaves stay whole).
  for fsdp in sizes:
    e = estimate(dataclasses.replace(s, fsdp=fsdp), **fit)
    if e.fits:
      return e
  return None


def _splits(s: RunSpec, fsdp: int) -> bool:
  """Whether sequence parallelism can split over `fsdp` devices (`validate`'s rule): the
  query heads, the sequence and the KV heads (or fsdp by them) divide; always without it."""
  K = s.n_kv_heads
  return not s.sequence_parallel or (s.n_heads % fsdp == 0 and s.seq_len % fsdp == 0
                                     and (K % fsdp == 0 or fsdp % K == 0))


def suggestions(config, devices: int | None = None, device_memory: int = 0,
                host_memory: int = 0) -> list[Suggestion]:
  """Changes that make the step fit in `device_memory` (and, given, its host bytes in
  `host_memory` per node), ranked cheapest first.

  Each kind of change (see `_changes`; with the host memory short, first each offload
  undone) at its mildest level that fits; if none fits alone, the kinds applied
  together, cheapest first, until it fits; last, the fewest devices of this size that
  fit the unchanged config.
  """
  s = _as_setup(config, devices)
  fit = dict(device_memory=device_memory, host_memory=host_memory)
  now = estimate(s, **fit)
  if now.fits or not device_memory:
    return []
  out, kinds = [], (_fewer_offloads(s) if not now.fits_host else []) + _changes(s)
  for levels in kinds:
    for change, overrides, fields in levels:
      e = estimate(dataclasses.replace(s, **fields), **fit)
      if e.fits:
        out.append(Suggestion(change, overrides, e))
        break
  changes, overrides, fields = [], (), {}
  for levels in kinds:  # Together, cheapest first, each kind at its strongest level.
    change, more, f = levels[-1]
    if fields.get("release") and "microbatches" in f and _ACCUMULATE[0] not in overrides:
      more = (*more, *_ACCUMULATE)  # Release's microbatches: optimizer accumulation.
    more = tuple(x for x in more if x not in overrides)  # Release's, once.
    changes, overrides, fields = changes + [change], overrides + more, {**fields, **f}
    e = estimate(dataclasses.replace(s, **fields), **fit)
    if e.fits and not out:
      out.append(Suggestion(" + ".join(changes), overrides, e))
      break
  # The fewest devices: as it is, or else (nothing found so far) with every change above.
  tries = [(s, (), "")] + ([] if out else [(dataclasses.replace(s, **fields), overrides,
                                            " with " + " + ".join(changes))])
  for base, more, text in tries:
    e = fewest_devices(base, **fit)
    if e is not None:
      batch = e.setup.batch * e.setup.example_shards * e.setup.microbatches
      out.append(Suggestion(f"{e.setup.devices} devices of this size (same per-device batch)"
                            + text, more + (f"train.global_batch_size={batch}",), e))
      break
  return out


# ---------------------------------------------------------------- longest sequence


def sequence_unit(s: RunSpec) -> int:
  """The step between the sequence lengths `longest_sequence` tries: divisible by the
  devices a sequence is split over, and padding no attention block (blocked kernel), loss
  chunk or MLP chunk (the chunks run on a device's positions)."""
  f = s.fsdp if s.sequence_parallel else 1
  blocked = attention_kernel(s.attention, s.compute_dtype, head_dim=s.head_dim) == "blocked"
  block = s.attention_block if blocked else 1
  return math.lcm(f, block, f * s.loss_chunk, f * (s.mlp_chunk or 1))


def longest_sequence(config, devices: int | None = None, device_memory: int = 0,
                     limit: int = 1 << 26, host_memory: int = 0,
                     gpu_memory: int = 0) -> Estimate | None:
  """The estimate at the longest `train.seq_len` (a multiple of `sequence_unit`, at most
  `limit`) whose step fits in `device_memory`, at the same batch; None if even one unit
  does not. Given a config (not a `RunSpec`), the length is one it validates with.
  `gpu_memory`: the target GPU's whole memory, for XLA's scheduler limit (`estimate`'s)."""
  s = _as_setup(config, devices)
  unit = sequence_unit(s)
  at = lambda k: estimate(dataclasses.replace(s, seq_len=k * unit), device_memory=device_memory,
                          host_memory=host_memory, gpu_memory=gpu_memory)
  if not device_memory or not at(1).fits:
    return None
  lo, hi = 1, 2  # Every term grows with the length: double, then bisect (lo fits, hi not).
  while hi * unit <= limit and at(hi).fits:
    lo, hi = hi, hi * 2
  hi = min(hi, limit // unit + 1)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if at(mid).fits else (lo, mid)
  if isinstance(config, RunSpec):
    return at(lo)
  for k in range(lo, 0, -1):  # Rules the planner does not model (a newer key's).
    if _valid(config, devices, k * unit):
      return at(k)
  return None


def _valid(config, devices: int | None, seq_len: int) -> bool:
  candidate = copy.deepcopy(config)
  candidate.train.seq_len = seq_len
  try:
    validate(candidate, num_devices=devices, check_fixes=False)
  except ConfigError:
    return False
  return True
