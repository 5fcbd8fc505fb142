"""The memory planner: will a config fit on these devices, and if not, what to change.

    python -m zerojax.memory --config configs/70b_bf16.py --devices 64 --device-memory 80GiB
    python -m zerojax.memory --config configs/1b_bf16.py --devices 8 --compile   # + XLA's numbers

`estimate(config, devices)` is arithmetic on the config (no JAX work, milliseconds):
per-device bytes of every component of a train step, in two views.

* **Model state as users count it** (the ZeRO paper's count): bytes per parameter
  of params + gradients + optimizer state, gradients in the param dtype (in fp32 with
  fp32 master weights, as DeepSpeed's bf16 mode keeps them), each sharded by its stage:
  70B with bf16 params, bf16 AdamW moments and a Kahan buffer is 10 B/param.
* **What the zerojax step holds per device**: the state (params, optimizer moments,
  Kahan / master buffers), plus the step's temporaries: gradients in the reduce dtype
  (fp32) -- at stage 3 one fp32 gradient per local param, reduce-scattered layer by
  layer -- an fp32 accumulator with microbatches, the activations saved for the
  backward pass (by remat policy), one layer's recompute working set, stage 3's
  gathered layer / embedding / head, the loss chunk's fp32 logits. Their peak is the
  largest of three phases (layer backward, loss backward, end of the backward).

The temporaries are calibrated against XLA:CPU with `devices.CPU_MEMORY_FLAGS` (the only
compiler this project can check; `--compile` shows it beside the estimate): the total
within 2% for the 8B and 70B configs, 4-7% low for the 1B (its stage-2 layer working
set is overestimated), 3% low for the tiny one (one exception: the tiny config with
remat 'full', 0.79, whose small layers XLA keeps whole). What is XLA:CPU's own:
collectives run in fp32, so a gathered layer costs 4 B/param (a GPU gathers bf16);
at stages 0-2 it keeps a copy of the embedding. At stages 0-2 the scan's layer
gradients come out stacked in the param dtype and are upcast and reduced after the
backward pass (stage 2 reduce-scatters them leaf by leaf), so stage 2 holds a whole
gradient for a while. Where estimate and compiler differ by more than 10%,
`--compile` says which component the difference is in, from XLA's buffer assignment.
A by-name remat policy (`zerojax.models.remat`) saves the layer input and its named
values: XLA's saved bytes exactly; the 1B at stage 3 within 0.90-1.02 (WORKSPACE).
On one H200 (XLA:GPU, jax 0.11.2) the estimate was 1.003 (1B, 8 sequences of 4096) and
1.035 (8B, 2 sequences) of both the compiled bytes and the measured peak
(`memory_stats()['peak_bytes_in_use']`); multi-GPU stage 3 is not measured yet.

`suggestions(config, devices, device_memory)` re-estimates modified setups (one code
path) and ranks the changes that make it fit, cheapest first: Kahan instead of fp32
master weights, a higher stage, bf16 optimizer state, more remat, smaller
micro-batches, optimizer-state offload, Lion, and the fewest devices of this size that fit.

With `optimizer.offload='host'` the moments and Kahan / master buffers move from the
device's bytes to the host's (`Estimate.host`: per device, and per node of
`DEVICES_PER_NODE`); the device holds, during the update, the gradients and the state
streamed in (one layer's, or the embedding's and head's, whichever is more; all of it
for an update that is not leafwise). Not checked against a compiler: XLA:CPU has no
separate host memory space to report (`zerojax.offload`).
"""

import collections
import dataclasses
import functools
import math
import re

from zerojax import gpu as zerojax_gpu, models
from zerojax.models import remat as remat_policies
from zerojax.models.attention import attention_kernel
from zerojax.zero import StageBehaviour, local_shape, shard_dim

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_REMAT_ORDER = ("none", "dots", "full")  # Increasing recomputation (and a by-name policy
# is followed by 'full').
# Devices one node holds, for host memory per node (the common 8-GPU node; a run on
# fewer devices is counted as one node).
DEVICES_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One training run as the planner sees it: what it reads of a config, resolved for a
  device count (the `setup` of an `Estimate`)."""
  model: str
  vocab_size: int
  d_model: int
  d_ff: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  context: int
  tie_embeddings: bool
  attention: str
  attention_block: int
  loss_chunk: int
  remat: str
  param_dtype: str
  compute_dtype: str
  reduce_dtype: str
  accum_dtype: str
  optimizer: str
  state_dtype: str
  update_rule: str
  momentum: float
  stage: int
  min_shard_size: int
  data: int
  fsdp: int
  batch: int  # Sequences per device per microbatch.
  microbatches: int
  seq_len: int
  release: bool  # Gradient release (`zerojax.release`): stage 3, one microbatch.
  # The model's own (shape, logical axes) of every parameter leaf (`param_shapes()`).
  param_shapes: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]
  offload: bool = False  # The optimizer state in host memory (optimizer.offload='host').

  @classmethod
  def from_config(cls, config, devices: int) -> "RunSpec":
    """Raises ConfigError when the mesh does not fit `devices`."""
    from zerojax.validate import resolve_mesh_shape  # pylint: disable=import-outside-toplevel
    m, p, o, t = config.model, config.precision, config.optimizer, config.train
    data, fsdp = resolve_mesh_shape(config, devices)
    shapes = models.from_config(config).param_shapes().values()
    return cls(
        model=m.name, vocab_size=m.vocab_size, d_model=m.d_model, d_ff=m.d_ff,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, context=m.context,
        tie_embeddings=m.tie_embeddings, attention=m.attention,
        attention_block=m.attention_block, loss_chunk=m.loss_chunk, remat=m.remat,
        param_dtype=p.param_dtype, compute_dtype=p.compute_dtype, reduce_dtype=p.reduce_dtype,
        accum_dtype=p.accum_dtype, optimizer=o.name, state_dtype=o.state_dtype,
        update_rule=o.update_rule, momentum=o.momentum, stage=config.zero.stage,
        min_shard_size=config.zero.min_shard_size, data=data, fsdp=fsdp,
        batch=max(t.global_batch_size // (data * fsdp * t.microbatches), 1),
        microbatches=t.microbatches, seq_len=t.seq_len, release=o.release,
        param_shapes=tuple((tuple(shape), tuple(names)) for shape, names in shapes),
        offload=o.offload == "host")

  @property
  def devices(self) -> int:
    return self.data * self.fsdp

  @property
  def behaviour(self) -> StageBehaviour:
    """What the stage shards and how it reduces, as the plan would say (one rule)."""
    return StageBehaviour.of(self.stage, self.fsdp)


def _leaves(s: RunSpec) -> list[tuple[tuple[int, ...], bool, bool]]:
  """(shape, layer-stacked, vocab-sized) of every parameter leaf, as the model makes them."""
  return [(shape, "layers" in names, "vocab" in names) for shape, names in s.param_shapes]


def _local_shape(s: RunSpec, shape: tuple[int, ...], layered: bool) -> tuple[int, ...]:
  """One device's shard of a leaf, by the plan's rule (`zero.shard_dim`)."""
  names = ("layers",) + (None,) * (len(shape) - 1) if layered else None
  return local_shape(shape, shard_dim(shape, names, s.fsdp, s.min_shard_size), s.fsdp)


class Counts(collections.namedtuple("Counts", "total layers local local_layers largest")):
  """Parameter counts: all, layer-stacked, one device's shard (all, layer-stacked), and
  the largest layer-stacked leaf."""


def param_counts(s: RunSpec) -> Counts:
  total = layers = local = local_layers = largest = 0
  for shape, layered, _ in _leaves(s):
    n, n_local = math.prod(shape), math.prod(_local_shape(s, shape, layered))
    total, local = total + n, local + n_local
    if layered:
      layers, local_layers, largest = layers + n, local_layers + n_local, max(largest, n)
  return Counts(total, layers, local, local_layers, largest)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Per-device bytes of a train step (see the module docstring).

  Attributes:
    setup: what was estimated.
    params: parameter count.
    conventional: bytes per parameter as users count model state: params, gradients
      (param dtype; fp32 with master weights), optimizer (moments + Kahan / master).
    components: name -> per-device bytes the zerojax step holds (state and temporaries).
    parts: phase name -> the temporaries (component names) alive together in it.
    state: per-device bytes of the train state and the batch (the step's arguments)
      in device memory.
    device_memory: bytes per device to fit in (0: not given).
    host: name -> per-device bytes of the state kept in host memory (offload).
  """
  setup: RunSpec
  params: int
  conventional: dict
  components: dict
  parts: dict
  state: int
  device_memory: int = 0
  host: dict = dataclasses.field(default_factory=dict)

  @property
  def phases(self) -> dict:
    """Phase name -> per-device bytes of its temporaries."""
    return {k: sum(self.components[x] for x in v) for k, v in self.parts.items()}

  @property
  def total(self) -> int:
    """The per-device peak: the state plus the largest phase."""
    return self.state + max(self.phases.values())

  @property
  def bytes_per_param(self) -> float:
    return sum(self.conventional.values())

  @property
  def conventional_per_device(self) -> float:
    """The ZeRO paper's per-device model state, e.g. (4 + K) Psi / N at stage 3."""
    b, shards, c = self.setup.behaviour, self.setup.fsdp, self.conventional
    return self.params * (c["params"] / (shards if b.shards_params else 1)
                          + c["gradients"] / (shards if b.shards_grads else 1)
                          + c["optimizer"] / (shards if b.shards_opt_state else 1))

  @property
  def host_total(self) -> int:
    """Per-device bytes of host memory the state takes (offload; 0 without)."""
    return sum(self.host.values())

  @property
  def host_per_node(self) -> int:
    """Host bytes of the devices of one node: `DEVICES_PER_NODE` (or all, if fewer)."""
    return self.host_total * min(self.setup.devices, DEVICES_PER_NODE)

  @property
  def peak_phase(self) -> str:
    return max(self.phases, key=self.phases.get)

  @property
  def fits(self) -> bool:
    return bool(self.device_memory) and self.total <= self.device_memory

  @property
  def headroom(self) -> int:
    return self.device_memory - self.total


def _as_setup(config, devices: int | None) -> RunSpec:
  if isinstance(config, RunSpec):
    return config
  if devices is None:
    raise ValueError("estimate(config, devices): say how many devices")
  return RunSpec.from_config(config, devices)


def estimate(config, devices: int | None = None, device_memory: int = 0) -> Estimate:
  """Per-device memory of the train step of `config` (a config or a `RunSpec`) on `devices`."""
  s = _as_setup(config, devices)
  counts = param_counts(s)
  P, n = counts.total, s.batch * s.seq_len
  pb, cb, sb = (DTYPE_BYTES[d] for d in (s.param_dtype, s.compute_dtype, s.state_dtype))
  gb, ab = DTYPE_BYTES[s.reduce_dtype], DTYPE_BYTES[s.accum_dtype]
  D, F, L, V, T, b = s.d_model, s.d_ff, s.n_layers, s.vocab_size, s.seq_len, s.batch
  H, kv = s.n_heads, s.n_kv_heads * (s.d_model // s.n_heads)
  moments = {"adamw": 2, "lion": 1, "sgd": 1 if s.momentum else 0}[s.optimizer]
  rule = {"kahan": pb, "master": 4}.get(s.update_rule, 0)
  other = P - counts.layers
  # With release only the leaves outside the layer stack keep a gradient.
  conventional = dict(params=pb, gradients=(4 if s.update_rule == "master" else pb)
                      * (other / P if s.release else 1), optimizer=moments * sb + rule)
  # Release saves each layer's input and recomputes it in its backward loop whatever the
  # remat policy: the activations of remat 'full'.
  remat = "full" if s.release else s.remat

  behaviour = s.behaviour
  local = counts.local if behaviour.shards_opt_state else P  # Sharded state per device.
  # stage3.scan_layers (Llama under any remat): the fp32 params become the gradients.
  full = remat != "none" and s.model == "llama"
  comp = {"params": pb * (counts.local if behaviour.shards_params else P),
          "optimizer": moments * sb * local, "update buffer": rule * local,
          "batch": 4 * b * s.microbatches * (T + 1)}
  host, streamed = {}, 0
  if s.offload:  # In host memory, streamed to the device for the update (zerojax.offload):
    host = {k: comp.pop(k) for k in ("optimizer", "update buffer")}
    # one layer's state at a time and the other leaves' (embedding, head) at once when
    # the update runs layer by layer (leafwise rules); otherwise all of it together.
    stacked = counts.local_layers if behaviour.shards_opt_state else counts.layers
    moved = max(local - stacked, stacked // L)
    streamed = (moments * sb + rule) * moved
  state = sum(comp.values())
  # Gradients. Reduced in the gathers' backward: the model's scan takes fp32 local shards
  # and writes each layer's fp32 gradient into them (`stage3.scan_layers`; remat 'none'
  # keeps a second copy). Otherwise the scan's layer gradients come out stacked in
  # the param dtype, then each leaf is upcast and reduced: scattered per microbatch, or
  # once after the whole-gradient accumulation (scattered or all-reduced).
  in_gather = behaviour.grad_reduction == "psum_scatter_in_gather"
  layer_grads = 0 if in_gather else pb * counts.layers
  if s.release:  # The non-layer shards and one layer's, each in fp32 and its gradient.
    grads = gb * 2 * (counts.local - counts.local_layers + counts.local_layers // L)
  elif in_gather:
    grads = gb * (counts.local if full else counts.local + counts.local_layers)
  elif behaviour.grad_reduction == "psum_scatter_per_microbatch":
    grads = gb * (counts.local + counts.largest)
  else:  # Whole fp32 gradients, and the fp32 params they are taken against.
    grads = gb * (P + (other if full else P))
  # Release's microbatches (optimizer accumulation) fold into the moments: no accumulator.
  accum = ab * (counts.local if behaviour.shards_grads else P) if (
      s.microbatches > 1 and not s.release) else 0

  # Activations of one microbatch. Saved for the backward pass, per layer and token:
  if s.model == "mlp_lm":  # Rough: not calibrated.
    width = {"full": D, "dots": 2 * D + F, "none": (s.context + 4) * D + 3 * F}[remat]
  elif remat_policies.SAVED.get(remat) is not None:  # The layer input and the named values.
    width = D + remat_policies.saved_width(remat, D, H * (D // H), kv, F)
  else:  # none: also the norms' fp32 inputs and outputs (4 D of 4 bytes = 8 D of 2).
    width = {"dots": 3 * D + 2 * kv + 2 * F, "none": 3 * D + 2 * kv + 6 * F + 8 * D}[remat]
  saved = L * n * width * cb
  if remat == "none" and behaviour.shards_params:
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
  if behaviour.shards_params:
    # One layer gathered: in fp32 by XLA:CPU; by a GPU in the param dtype, two at the normal
    # step's peak (its pipelined gather), one at release's (XLA's GPU buffer assignment).
    gathered = counts.layers // L * (
        pb * (1 if s.release else 2) if zerojax_gpu.backend() == "gpu" else 4)
    # The head (or tied embedding) gathered, and a copy XLA makes; its fp32 gradient.
    vocab_gathered, head_grad, copies = 2 * pb * V * D, 4 * V * D, 0
  else:
    gathered = vocab_gathered = head_grad = 0
    copies = pb * V * D  # XLA:CPU copies the embedding (stages 0-2).
  temps = {"layer gradients": layer_grads, "gradients": grads, "accumulator": accum,
           "saved activations": saved, "working set": working, "gathered layer": gathered,
           "gathered head": vocab_gathered, "head gradient": head_grad, "loss chunk": loss,
           "embedding copy": copies, "streamed state": streamed}
  # The temporaries alive together in each phase of the step; the peak is the largest.
  # Gradients reduced in the gathers live through the backward; others appear at its end.
  during = ["layer gradients", "gradients", "accumulator", "saved activations",
            "gathered head", "embedding copy"]
  parts = {"layer backward": during + ["working set", "gathered layer"],
           "loss backward": during + ["loss chunk", "head gradient"]}
  if not in_gather:  # Activations are gone; the fp32 gradients are made and reduced.
    parts = {k: [x for x in v if x != "gradients"] for k, v in parts.items()}
    parts["end of backward"] = ["gradients", "accumulator", "embedding copy"]
  if s.offload:  # The update: the gradients and the state streamed in.
    parts["update"] = ["gradients", "accumulator", "streamed state"]
  comp.update(temps)
  comp = {k: int(v) for k, v in comp.items() if v}
  parts = {k: [x for x in v if x in comp] for k, v in parts.items()}
  return Estimate(s, P, conventional, comp, parts, int(state), int(device_memory),
                  {k: int(v) for k, v in host.items() if v})


# ----------------------------------------------------------------------- suggestions


@dataclasses.dataclass(frozen=True)
class Suggestion:
  """A change (config overrides) and the estimate it gives."""
  change: str
  overrides: tuple
  estimate: Estimate


_ACCUMULATE = ("optimizer.release_accumulation=optimizer",)


def _changes(s: RunSpec) -> list[list[tuple[str, tuple, dict]]]:
  """Changes that save memory, cheapest kind first; each kind's levels mildest first.

  Cost to training: Kahan matches fp32 master weights (WORKSPACE: stall table); a stage
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
  # What `validate._check_release` accepts: stage 3 over more than one shard, no float16;
  # several microbatches with optimizer accumulation.
  if (not s.release and s.behaviour.stage == 3
      and "float16" not in (s.param_dtype, s.compute_dtype)):
    kinds.append([("gradient release (stage 3, no global-norm clipping)",
                   ("optimizer.release=True", "optimizer.grad_clip=0", *_ACCUMULATE * (
                       s.microbatches > 1)), dict(release=True))])
  kinds.append([(f"{s.microbatches * k} microbatches of {s.batch // k} sequence(s) per device",
                 (f"train.microbatches={s.microbatches * k}",),
                 dict(microbatches=s.microbatches * k, batch=s.batch // k))
                for k in range(2, s.batch + 1) if s.batch % k == 0])
  if not s.offload:
    kinds.append([("optimizer state offloaded to host memory", ("optimizer.offload=host",),
                   dict(offload=True))])
  if s.optimizer == "adamw":
    kinds.append([("Lion instead of AdamW (one moment)", ("optimizer.name=lion",),
                   dict(optimizer="lion"))])
  return [k for k in kinds if k]


def fewest_devices(config, devices: int | None = None, device_memory: int = 0,
                   limit: int = 4096) -> Estimate | None:
  """The fewest devices of `device_memory` on which the step fits, at the same per-device
  batch and `mesh.data` (the ZeRO shards grow); None if none up to `limit` does."""
  s = _as_setup(config, devices)
  top = 1 << (limit // s.data).bit_length() - 1  # The most divisible count: if even it
  if not estimate(dataclasses.replace(s, fsdp=top), device_memory=device_memory).fits:
    return None  # does not fit, none does (indivisible leaves stay whole).
  for fsdp in range(1, top + 1):
    e = estimate(dataclasses.replace(s, fsdp=fsdp), device_memory=device_memory)
    if e.fits:
      return e
  return None


def suggestions(config, devices: int | None = None,
                device_memory: int = 0) -> list[Suggestion]:
  """Changes that make the step fit in `device_memory`, ranked cheapest first.

  Each kind of change (see `_changes`) at its mildest level that fits; if none fits
  alone, the kinds applied together, cheapest first, until it fits; last, the fewest
  devices of this size that fit the unchanged config.
  """
  s = _as_setup(config, devices)
  if estimate(s, device_memory=device_memory).fits or not device_memory:
    return []
  out, kinds = [], _changes(s)
  for levels in kinds:
    for change, overrides, fields in levels:
      e = estimate(dataclasses.replace(s, **fields), device_memory=device_memory)
      if e.fits:
        out.append(Suggestion(change, overrides, e))
        break
  changes, overrides, fields = [], (), {}
  for levels in kinds:  # Together, cheapest first, each kind at its strongest level.
    change, more, f = levels[-1]
    if fields.get("release") and "microbatches" in f and _ACCUMULATE[0] not in overrides:
      more = (*more, *_ACCUMULATE)  # Release's microbatches: optimizer accumulation.
    changes, overrides, fields = changes + [change], overrides + more, {**fields, **f}
    e = estimate(dataclasses.replace(s, **fields), device_memory=device_memory)
    if e.fits and not out:
      out.append(Suggestion(" + ".join(changes), overrides, e))
      break
  # The fewest devices: as it is, or else (nothing found so far) with every change above.
  tries = [(s, (), "")] + ([] if out else [(dataclasses.replace(s, **fields), overrides,
                                            " with " + " + ".join(changes))])
  for base, more, text in tries:
    e = fewest_devices(base, device_memory=device_memory)
    if e is not None:
      batch = e.setup.batch * e.setup.devices * e.setup.microbatches
      out.append(Suggestion(f"{e.setup.devices} devices of this size (same per-device batch)"
                            + text, more + (f"train.global_batch_size={batch}",), e))
      break
  return out


# ------------------------------------------------------------------ compiled truth


def attribute(s: RunSpec, buffers: list[tuple[int, str, str]]) -> dict:
  """Compiled temporaries at the peak, by estimate component, from their shapes."""
  V, D, L, T, b = s.vocab_size, s.d_model, s.n_layers, s.seq_len, s.batch
  local = functools.partial(_local_shape, s)
  leaves = _leaves(s)
  stacks = {x for x, layered, _ in leaves if layered} | {local(x, True) for x, l, _ in leaves if l}
  layer = {x[1:] for x, layered, _ in leaves if layered}
  vocab, vocab_local = {(V, D), (D, V)}, {local(x, False) for x, _, v in leaves if v}
  out, gathers = collections.Counter(), s.behaviour.shards_params
  for size, text, _ in buffers:
    m = re.match(r"(\w+)\[([\d,]*)\]", text)
    shape, f32 = tuple(int(x) for x in m.group(2).split(",") if x) if m else (), text[:3] == "f32"
    if not shape:
      key = "working set"
    elif shape in stacks:
      key = "gradients" if f32 else "layer gradients"
    elif shape in vocab:
      key = (("head gradient" if f32 else "gathered head") if gathers
             else "gradients" if f32 else "embedding copy")
    elif shape in vocab_local and f32:
      key = "gradients"
    elif len(shape) >= 3 and shape[0] == L and (b * T in shape or shape[1:3] == (b, T)):
      key = "saved activations"
    elif shape in layer:
      key = "gathered layer" if gathers else "working set"
    elif V in shape:
      key = "loss chunk"
    else:
      key = "working set"
    out[key] += size
  return dict(out)

