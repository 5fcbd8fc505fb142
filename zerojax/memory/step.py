"""The step's bytes: `estimate` (state, gradients, the activation terms, stage 3's gathers)
and `Estimate`, its per-device components and the phases they peak in."""

import dataclasses
import math

from zerojax.gpu import targets, xla_flags
from zerojax.memory.activations import activations, all_to_all_bytes
from zerojax.memory.bus import traffic
from zerojax.memory.spec import (
  DEVICES_PER_NODE,
  DTYPE_BYTES,
  RunSpec,
  _as_setup,
  _leaves,
  param_counts,
)
from zerojax.runtime import platform

__all__ = ["DEVICES_PER_NODE", "Estimate", "estimate"]

# Layers of parameter shards on the device with param offload and release: the layer in
# use, the next one arriving from host memory, the updated one being written back.
PARAM_OFFLOAD_LAYERS = 3


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
    host: name -> per-device bytes kept in host memory (params, optimizer state, saved
      activations: offload).
    all_to_all: bytes one device puts into sequence or expert parallelism's all-to-alls
      per layer and step (0 without either).
    host_memory: bytes of host memory per node to fit in (0: not given).
  """
  setup: RunSpec
  params: int
  conventional: dict
  components: dict
  parts: dict
  state: int
  device_memory: int = 0
  host: dict = dataclasses.field(default_factory=dict)
  all_to_all: int = 0
  host_memory: int = 0

  @property
  def one_device(self) -> bool:
    """Planned as release on one device with the layer stack in host memory
    (`streams_one_device`: `_one_device`'s components)."""
    return "streamed layers" in self.components

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
    """Per-device bytes of host memory the step takes (offload; 0 without)."""
    return sum(self.host.values())

  @property
  def host_per_node(self) -> int:
    """Host bytes of the devices of one node (`RunSpec.per_node` of them)."""
    return self.host_total * self.setup.per_node

  @property
  def pcie(self) -> dict:
    """Offload name -> (host-to-device, device-to-host) bytes per device per optimizer
    step over the host link (`bus.traffic`)."""
    return traffic(self.setup, self.host)

  @property
  def peak_phase(self) -> str:
    return max(self.phases, key=self.phases.get)

  @property
  def fits_device(self) -> bool:
    return bool(self.device_memory) and self.total <= self.device_memory

  @property
  def fits_host(self) -> bool:
    """Within the host memory per node (True when none is given)."""
    return not self.host_memory or self.host_per_node <= self.host_memory

  @property
  def fits(self) -> bool:
    return self.fits_device and self.fits_host

  @property
  def headroom(self) -> int:
    return self.device_memory - self.total


def estimate(config, devices: int | None = None, device_memory: int = 0,
             host_memory: int = 0, gpu_memory: int = 0) -> Estimate:
  """Per-device memory of the train step of `config` (a config or a `RunSpec`) on `devices`,
  judged against `device_memory` per device and `host_memory` per node (0: not judged);
  `gpu_memory`: the target GPU's whole memory, for XLA's scheduler limit (`RunSpec`'s)."""
  s = _as_setup(config, devices)
  if gpu_memory:
    s = dataclasses.replace(s, gpu_memory=gpu_memory)
  counts = param_counts(s)
  P = counts.total
  pb, sb = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.state_dtype]
  gb, ab = DTYPE_BYTES[s.reduce_dtype], DTYPE_BYTES[s.accum_dtype]
  D, L, V, T, b = s.d_model, s.n_layers, s.vocab_size, s.seq_len, s.batch
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
  if s.param_offload:  # The layer-stacked shards live in host memory (zero.param_offload).
    stack = pb * (counts.local_layers if behaviour.shards_params else counts.layers)
    host["params"] = stack
    if s.release:  # Streamed a layer ahead, each updated layer written straight back:
      # `PARAM_OFFLOAD_LAYERS` layers' shards on the device (an assumption, not compiled).
      comp["params"] -= stack - stack * min(PARAM_OFFLOAD_LAYERS, L) // L
    # Without release the step brings the whole shard to the device (it differentiates an
    # fp32 copy of it anyway): host memory between steps, no device bytes saved.
  if s.offload:  # In host memory, streamed to the device for the update (zerojax.streaming):
    host.update({k: comp.pop(k) for k in ("optimizer", "update buffer")})
    # one layer's state at a time and the other leaves' (embedding, head) at once when
    # the update runs layer by layer (leafwise rules); otherwise all of it together.
    stacked = counts.local_layers if behaviour.shards_opt_state else counts.layers
    moved = max(local - stacked, stacked // L)
    streamed = (moments * sb + rule) * moved
  if streams_one_device(s):  # Its offloaded state's buffers: moments and update buffer.
    buffers = [sb] * moments + ([rule] if rule else []) if s.offload else []
    return _one_device(s, counts, conventional, comp, host, buffers, int(device_memory),
                       int(host_memory))
  state = sum(comp.values())
  # Gradients. Reduced in the gathers' backward: the model's scan takes fp32 local shards
  # and writes each layer's fp32 gradient into them (`stage3.scan_layers`; remat 'none'
  # keeps a second copy). Otherwise the scan's layer gradients come out stacked in
  # the param dtype, then each leaf is upcast and reduced: scattered per microbatch, or
  # once after the whole-gradient accumulation (scattered or all-reduced).
  in_gather = behaviour.grad_reduction == "psum_scatter_in_gather"
  # Release (also on one shard, where nothing is gathered) updates each layer in its
  # backward: no stacked layer gradients, its gradients live through the backward.
  through = in_gather or s.release
  layer_grads = 0 if through else pb * counts.layers
  if s.release:  # The non-layer shards and one layer's: their fp32 gradients and the
    # fp32 copies they are taken against, except where XLA's GPU compiler fuses the cast
    # into a gather (Qwen3-32B on h100:4: 1.45 GiB compiled, the non-layer shards' fp32
    # bytes once). On one shard nothing is gathered: both (issue 35 calibrates it).
    copies = 1 if platform.backend() == "gpu" and s.gathers else 2
    grads = gb * copies * (counts.local - counts.local_layers + counts.local_layers // L)
  elif in_gather:
    grads = gb * (counts.local if full else counts.local + counts.local_layers)
  elif behaviour.grad_reduction == "psum_scatter_per_microbatch":
    grads = gb * (counts.local + counts.largest)
  else:  # Whole fp32 gradients, and the fp32 params they are taken against.
    grads = gb * (P + (other if full else P))
  # Release's microbatches (optimizer accumulation) fold into the moments: no accumulator.
  accum = ab * (counts.local if behaviour.shards_grads else P) if (
      s.microbatches > 1 and not s.release) else 0

  acts = activations(s, counts, remat)  # One microbatch's.
  host["saved activations"] = acts.pop("saved activations (host)")
  if behaviour.shards_params:
    # One layer gathered: in fp32 by XLA:CPU; by a GPU in the param dtype, two at the normal
    # step's peak (its pipelined gather), one at release's (XLA's GPU buffer assignment).
    gathered = counts.gathered // L * (
        pb * (1 if s.release else 2) if platform.backend() == "gpu" else 4)
    # The head (or tied embedding) gathered, and a copy XLA makes; its fp32 gradient.
    vocab_gathered, head_grad, copies = 2 * pb * V * D, 4 * V * D, 0
    if s.vocab_sharded:  # Used on its shard (`zerojax.vocab`): the shard's fp32 gradient
      # summed over the loss chunks (the sum so far and the chunk's) and the shard cast
      # to the compute dtype; nothing gathered.
      vocab_gathered, head_grad = 0, (2 * 4 + DTYPE_BYTES[s.compute_dtype]) * V * D // s.fsdp
  else:
    gathered = vocab_gathered = head_grad = 0
    copies = pb * V * D  # XLA:CPU copies the embedding (stages 0-2).
  # XLA's GPU scheduler, with room under its memory limit, starts the vocabulary work at
  # the step's start: the embedding and head gathered together before the forward's layer
  # loop, and the zero-initialized buffers of their gradients (the lookup's scatter, the
  # loss chunks' sum) beside them, live with the fp32 gradient shards, the saved-input
  # stack and the first layers' gathers (configs/70b_bf16.py on h100:64: four vocabulary
  # copies at its peak, 1.96 GiB each). Short of room it schedules them late: only what
  # fits under the limit is counted (0.79 of 3.91 GiB on 16 devices, below its peak).
  early = pb * sum(math.prod(shape) for shape, _, is_vocab, _ in _leaves(s) if is_vocab) if (
      in_gather and not s.release and platform.backend() == "gpu") else 0
  if early and s.vocab_sharded:  # The lookup's fp32 gradient shard, zero-initialized.
    early = 4 * V * D // s.fsdp
  if early:
    limit = _scheduler_limit(s, device_memory, state)
    if limit is not None:
      rest = grads + accum + acts["saved activations"] + gathered + vocab_gathered
      early = min(early, max(limit - rest, 0))
  # Written behind (a GPU reads ahead): the backward loop carries the last layer's updated
  # shards, params and state, to the next trip, which writes them back.
  behind = (pb + moments * sb + rule) * counts.local_layers // L if (
      s.write_behind and platform.backend() == "gpu") else 0
  temps = {"layer gradients": layer_grads, "gradients": grads, "accumulator": accum,
           "saved activations": acts["saved activations"], "working set": acts["working set"],
           "gathered layer": gathered, "gathered head": vocab_gathered, "head gradient": head_grad,
           "loss chunk": acts["loss chunk"], "embedding copy": copies, "streamed state": streamed,
           "written behind": behind, "vocab gradient buffers": early}
  # The temporaries alive together in each phase of the step; the peak is the largest.
  # Gradients reduced in the gathers live through the backward; others appear at its end.
  during = ["layer gradients", "gradients", "accumulator", "saved activations",
            "gathered head", "embedding copy"]
  # Written first, the carried update is gone before the layer's backward.
  # Release with experts over devices: XLA's GPU compiler keeps the loss chunk's logits
  # and the head's gradient shard beside the first backward trip's dispatch buffers
  # (Qwen3-30B-A3B at 4 layers on h100:8: `f32[4096, 18992]` x 2 at the layer-backward
  # peak); dense layers' backward does not overlap them (70b_8x4090 would read 1.106).
  overlaps = ["loss chunk", "head gradient"] if s.release and s.n_experts and s.expert > 1 else []
  parts = {"layer backward": during + ["working set", "gathered layer"] + (
               [] if s.writes_first else ["written behind"]) + overlaps,
           "loss backward": during + ["loss chunk", "head gradient"],
           "forward start": ["gradients", "accumulator", "saved activations", "gathered layer",
                             "gathered head", "vocab gradient buffers"]}
  if not through:  # Activations are gone; the fp32 gradients are made and reduced.
    parts = {k: [x for x in v if x != "gradients"] for k, v in parts.items()}
    parts["end of backward"] = ["gradients", "accumulator", "embedding copy"]
  if s.offload:  # The update: the gradients and the state streamed in.
    parts["update"] = ["gradients", "accumulator", "streamed state"]
  comp.update(temps)
  comp = {k: int(v) for k, v in comp.items() if v}
  parts = {k: [x for x in v if x in comp] for k, v in parts.items()}
  return Estimate(s, P, conventional, comp, parts, int(state), int(device_memory),
                  {k: int(v) for k, v in host.items() if v}, all_to_all_bytes(s, remat),
                  int(host_memory))


def streams_one_device(s: RunSpec) -> bool:
  """Release on one shard with the layer stack in host memory, compiled for a GPU: the
  step `_one_device` plans (nothing is gathered or reduced, so no gradient is fp32)."""
  return s.release and s.param_offload and not s.gathers and platform.backend() == "gpu"


def _one_device(s: RunSpec, counts, conventional: dict, comp: dict, host: dict,
                buffers: list[int], device_memory: int, host_memory: int) -> Estimate:
  """The step of `streams_one_device`, as XLA's GPU compiler lays it out at its two peaks
  (docs/design/planner.md, "Release on one device"; read off the compiled buffers of
  eight one-device recipes, 8B to 405B, and of XLA's memory limit moved by its flag):

  - the layer loop: for each layer parameter, this layer's and the next one's slices of
    the host stacks in flight (the param and every offloaded state buffer: 2 (p + S)
    bytes; written behind, the next one's param alone, and the update carried to the
    next trip beside them unless it is written first) and its gradient in the param
    dtype (nothing reduces it, so nothing upcasts it); two copies of the largest
    vocabulary leaf (its gradient, from the loss's backward, and a copy of the param for
    the loss's value, which XLA computes after the layer loop and the leaf's update in
    place); the layer's MLP and residual values at its update (2 F + 6 D a position,
    compute dtype); the saved activations the device keeps. With stochastic rounding
    each leaf's update is two fusions, an fp32 value then its rounding: the layer's
    updates run after its whole backward, holding every gradient, every fp32 value (4
    bytes) and the new state beside the old (S more); the layer's activations are gone
    but for its input's cotangent (D a position); the vocabulary's one update waits for
    the embedding's gradient, after the loss's value: one copy of the leaf.
  - the update of the embedding and head after it: one leaf at a time, two copies of the
    leaf, the updated state of every vocabulary leaf and the state streamed in for the
    one being updated; with stochastic rounding all the vocabulary leaves in one fusion,
    each leaf's gradient, state in and out and fp32 value.

  Either peak over XLA's scheduler memory limit (`_scheduler_limit`) comes down to it, no
  further than XLA's schedule goes: in the layer loop by the layer's gradients (each one
  recomputed just before its update instead), in the vocabulary update to one leaf at a
  time with one state buffer streamed in at a time.

  The layer stack is host memory only: the arguments are the non-layer params (and the
  optimizer state, unless it is offloaded). `buffers`: the offloaded state's buffers,
  bytes per parameter each (none when it stays on the device); S is their sum.
  """
  pb, cb = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.compute_dtype]
  state, one = sum(buffers), max(buffers, default=0)  # One: what one host copy brings.
  fused = s.update_rule == "stochastic"  # Each leaf's update: fp32 value, then rounding.
  fp32 = 4 if fused else 0
  vocab = [math.prod(shape) for shape, _, is_vocab, _ in _leaves(s) if is_vocab]
  largest = max(vocab, default=0)
  layer = counts.layers // s.n_layers
  comp = dict(comp, params=pb * (counts.total - counts.layers))
  args = sum(comp.values())
  acts = activations(s, counts, "full")
  host["saved activations"] = acts["saved activations (host)"]
  positions = s.batch * s.seq_len
  # Written behind, a trip reads its own layer's state, not the next one's.
  ahead = 0 if s.write_behind else state
  streamed = layer * (2 * pb + state + ahead + pb + fp32 + (state if fused else 0))
  copies = (1 if fused else 2) * pb * largest
  leafwise = 2 * pb * largest + largest * (len(vocab) * state + state + fp32) - copies
  update = sum(vocab) * (pb + 2 * state + fp32) - copies if fused else leafwise
  temps = {
      "streamed layers": streamed,
      # Written behind: the last layer's update, params and state, carried to the next
      # trip; after its reads (not `writes_first`) it stays beside the trip's update.
      "written behind": layer * (pb + state) if s.write_behind else 0,
      "vocab copies": copies,
      "update activations": positions * (s.d_model if fused else
                                         2 * s.mlp_width + 6 * s.d_model) * cb,
      "saved activations": acts["saved activations"],
      "working set": acts["working set"] if s.write_behind else 0,
      # In the backward: the layer's params and state and the next layer's params (its
      # gradients grow as the working set goes; its update's values come after).
      "backward layers": layer * (2 * pb + state) if s.write_behind else 0,
      "vocab update": update}
  # Layer 0's update goes back after the loop, before the embedding's backward.
  behind = [] if s.writes_first else ["written behind"]
  parts = {"layer loop": ["streamed layers", *behind, "vocab copies", "update activations",
                          "saved activations"],
           "embedding and head update": ["vocab copies", "vocab update"]}
  if s.write_behind:  # Reads first, the next layer's slices land before the backward
    # (release's barrier), beside the layer's whole backward and the carried update.
    # Writes first, the update goes under the recompute: params and state, as many
    # bytes as the next layer's params and this one's state that replace it.
    parts["layer backward"] = ["backward layers", *behind, "vocab copies", "working set",
                               "saved activations"]
  limit = _scheduler_limit(s, device_memory, args)
  if limit is not None:  # Down to the limit, by what XLA's schedule can do without: the
    # layer's gradients; the fused update's other leaves and the state beyond one buffer in
    # flight.
    over = lambda part: max(sum(temps[x] for x in parts[part]) - limit, 0)  # noqa: E731
    temps["streamed layers"] -= min(over("layer loop"), pb * layer)
    temps["vocab update"] -= min(over("embedding and head update"),
                                 update - leafwise + largest * (state - one))
  comp = {k: int(v) for k, v in {**comp, **temps}.items() if v}
  parts = {k: [x for x in v if x in comp] for k, v in parts.items()}
  return Estimate(s, counts.total, conventional, comp, parts, int(args), device_memory,
                  {k: int(v) for k, v in host.items() if v}, all_to_all_bytes(s, "full"),
                  host_memory)


def _scheduler_limit(s: RunSpec, device_memory: int, arguments: int) -> int | None:
  """The temporaries XLA's GPU scheduler and rematerialization keep a step within, or
  None where the GPU's memory is not known: 80% of the GPU's whole memory (as XLA reads
  it from the device: `s.gpu_memory`, else inverted from the allocator's pool
  `device_memory` at train.py's fraction, `gpu.targets.budget`) less the step's
  arguments (donated: its outputs are the same buffers), times the slop factor the run
  compiles at (`s.scheduler_slop`; XLA's `GetSchedulerMemoryLimit`, flag
  xla_gpu_memory_limit_slop_factor: 95% by default, the GPU profile's
  `xla_flags.scheduler_slop`).
  Over it, XLA's schedule holds less than it would: the 70B on an RTX 4090, each layer
  written in its own trip, compiles to 18.34, 18.72, 19.27 and 20.21 GiB at slop factors
  80, 95, 105 and 120."""
  device = s.gpu_memory or (device_memory / float(xla_flags.MEMORY_FRACTION)
                            + targets.CONTEXT_BYTES if device_memory else 0)
  if not device:
    return None
  return max(int((0.8 * device - arguments) * s.scheduler_slop / 100), 0)
