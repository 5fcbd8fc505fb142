"""Offload's other cost: the bytes each offload moves over the host link (PCIe) per
optimizer step and device (`traffic`), and their time beside the step's compute (`Bus`).

Per device and optimizer step, M microbatches, each offload's (host->device, device->host):

* params (`zero.param_offload`), with release: each microbatch's forward reads the stack's
  shard, its released backward reads it again and writes the updated shard back
  (optimizer accumulation updates every microbatch): (2 S M, S M), S the stack's shard
  bytes. Without release: the whole shard comes in once and goes back once: (S, S).
* optimizer state (`optimizer.offload`): read and written once per update: (O, O) at the
  normal step, (O M, O M) with release (each microbatch updates), O the state's shard.
* saved activations (`model.activation_offload`): each microbatch writes them and reads
  them back: (A M, A M), A one microbatch's.

The link is full duplex: the copies take max(host->device, device->host) / bandwidth.

More sequences a microbatch (the same length and microbatch count) hide the copies: the
model's and the optimizer state's bytes stay (under release they come once a microbatch
whatever its size), while the FLOPs and the saved activations' bytes grow with it
(`Bus.hiding_sequences`). More microbatches do not, under release: each moves the layers
again.
"""

import dataclasses
import math

from zerojax.memory.spec import RunSpec
from zerojax.models import MlpLM, llama

# The model FLOPs utilization a step's compute time assumes where none is given (the
# planner's --mfu).
DEFAULT_MFU = 0.4


def traffic(s: RunSpec, host: dict) -> dict:
  """Offload name -> (host-to-device, device-to-host) bytes per device per optimizer step,
  from an estimate's host bytes (`Estimate.host`)."""
  M, out = s.microbatches, {}
  if host.get("params"):
    S = host["params"]
    out["params"] = (2 * S * M, S * M) if s.release else (S, S)
  state = host.get("optimizer", 0) + host.get("update buffer", 0)
  if state:
    k = M if s.release else 1
    out["optimizer state"] = (state * k, state * k)
  if host.get("saved activations"):
    A = host["saved activations"]
    out["saved activations"] = (A * M, A * M)
  return out


def totals(traffic: dict) -> tuple[int, int]:
  """(host-to-device, device-to-host) bytes of `traffic` (`traffic`'s output), summed over
  its offloads."""
  return sum(x for x, _ in traffic.values()), sum(y for _, y in traffic.values())


def step_flops(s: RunSpec) -> tuple[float, float]:
  """(model FLOPs, remat's recomputed FLOPs) per device per optimizer step.

  Model FLOPs are the model's `flops_per_token` (6 N for the matmul params + attention's
  scores, causal half) x the tokens a device trains on per step, as train.py counts MFU.
  The recompute: remat 'full' (and release, which runs as 'full') runs each layer's
  forward again, a third of the layers' FLOPs; 'dots' and 'none' recompute no matmul;
  a by-name policy is counted as 'full' (at most that much).
  """
  T = s.seq_len
  tokens = s.batch * s.example_shards * s.microbatches * T / s.devices
  if s.model == "mlp_lm":
    model = MlpLM(vocab_size=s.vocab_size, d_model=s.d_model, d_ff=s.d_ff,
                  n_layers=s.n_layers, context=s.context)
  else:
    model = llama.LlamaLM(llama.LlamaConfig(
        vocab_size=s.vocab_size, d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads,
        n_kv_heads=s.n_kv_heads, d_ff=s.d_ff, tie_embeddings=s.tie_embeddings,
        head_size=s.head_size))
  per_token = model.flops_per_token(T)
  layers = per_token - 6.0 * s.d_model * s.vocab_size  # Less the head.
  remat = "full" if s.release else s.remat
  recompute = 0.0 if remat in ("none", "dots") else layers / 3
  return per_token * tokens, recompute * tokens


@dataclasses.dataclass(frozen=True)
class Bus:
  """The host link's time per step beside the compute's.

  Attributes:
    traffic: offload name -> (host-to-device, device-to-host) bytes per device and step.
    link: the link's name ('' unknown).
    bandwidth: bytes per second one direction achieves (0: unknown).
    flops: model FLOPs per device per step.
    recompute: remat's recomputed FLOPs per device per step (inside the MFU, as train.py
      measures MFU: model FLOPs over time).
    peak: the device's peak bf16 FLOP/s (0: unknown).
    mfu: the model FLOPs utilization the compute time assumes.
    sequences: sequences (or their slices) a device trains on per microbatch.
    global_batch: train.global_batch_size (`sequences` x the devices the examples are
      split over x microbatches).
    seq_len: train.seq_len.
  """
  traffic: dict
  link: str
  bandwidth: float
  flops: float
  recompute: float
  peak: float
  mfu: float
  sequences: int = 1
  global_batch: int = 1
  seq_len: int = 0

  @property
  def h2d(self) -> int:
    return totals(self.traffic)[0]

  @property
  def d2h(self) -> int:
    return totals(self.traffic)[1]

  @property
  def seconds(self) -> float:
    """The copies' time per step: full duplex, the larger direction (0: unknown link)."""
    return max(self.h2d, self.d2h) / self.bandwidth if self.bandwidth else 0.0

  @property
  def compute_seconds(self) -> float:
    """Model FLOPs / (peak x MFU), 0 where the peak is unknown."""
    return self.flops / (self.peak * self.mfu) if self.peak and self.mfu else 0.0

  @property
  def ratio(self) -> float:
    """Copy time / compute time: above 1 the step waits on the bus (0: unknown)."""
    return self.seconds / self.compute_seconds if self.seconds and self.compute_seconds else 0.0

  @property
  def hiding_sequences(self) -> int:
    """The fewest sequences a device per microbatch at which the copies take no longer
    than the compute (the same length and microbatches): the model's and the state's
    bytes stay, the FLOPs and the saved activations' bytes scale with the sequences.
    0 where unknown, or where the activations' own copies outrun the compute."""
    if not (self.bandwidth and self.compute_seconds):
      return 0
    per_sequence = self.compute_seconds * self.bandwidth / self.sequences  # Bytes' worth.
    need = 0.0
    for direction in (0, 1):  # Full duplex: each direction on its own.
      fixed = sum(v[direction] for k, v in self.traffic.items() if k != "saved activations")
      grows = self.traffic.get("saved activations", (0, 0))[direction] / self.sequences
      if fixed and per_sequence <= grows:
        return 0
      need = max(need, fixed / (per_sequence - grows) if fixed else 0.0)
    return max(1, math.ceil(need - 1e-9))

  def to_dict(self) -> dict:
    return dict(traffic={k: dict(h2d=a, d2h=b) for k, (a, b) in self.traffic.items()},
                h2d=self.h2d, d2h=self.d2h, link=self.link, bandwidth=self.bandwidth,
                seconds=self.seconds, flops=self.flops, recompute_flops=self.recompute,
                peak_flops=self.peak, mfu=self.mfu, compute_seconds=self.compute_seconds,
                ratio=self.ratio, hiding_sequences=self.hiding_sequences,
                hiding_global_batch=self.hiding_global_batch)

  @property
  def hiding_global_batch(self) -> int:
    """train.global_batch_size at `hiding_sequences` (0 where that is unknown)."""
    return self.global_batch * self.hiding_sequences // self.sequences

  def line(self) -> str:
    """"PCIe 12.3 GB per step per device: 0.49 s at 25 GB/s; compute 0.21 s at 40% MFU:
    bus-bound by 2.3x" (or "hidden behind compute (0.4x)"); "" without offload."""
    if not self.traffic:
      return ""
    gb = lambda n: f"{n / 1e9:.1f} GB"
    parts = "; ".join(f"{k} {gb(a)} in, {gb(b)} out" for k, (a, b) in self.traffic.items())
    text = (f"PCIe {gb(self.h2d + self.d2h)} per step per device ({parts}): ")
    if not self.bandwidth:
      return text + ("host link unknown (a --target with a known link, or "
                     "--host-bandwidth, gives its time)")
    text += (f"{self.seconds:.2f} s at {self.bandwidth / 1e9:g} GB/s"
             f"{' (' + self.link + ')' if self.link else ''} a direction, full duplex; ")
    if not self.compute_seconds:
      return text + "compute unknown (no peak FLOP/s for this device: train.peak_flops)"
    text += f"compute {self.compute_seconds:.2f} s at {self.mfu:.0%} MFU: "
    text += (f"bus-bound by {self.ratio:.1f}x" if self.ratio > 1
             else f"hidden behind compute ({self.ratio:.1f}x)")
    if self.hiding_sequences:
      batch = self.hiding_global_batch
      text += (f"; hidden from {batch * self.seq_len:,} tokens a step "
               f"({self.hiding_sequences} sequence(s) a device a microbatch: "
               f"--config.train.global_batch_size={batch})")
    return text


def bus(s: RunSpec, host: dict, link=None, bandwidth: float = 0.0, peak: float = 0.0,
        mfu: float = DEFAULT_MFU) -> Bus:
  """The bus terms of a step with `host` bytes offloaded (`Estimate.host`): over `link`
  (a `zerojax.gpu.host_link.HostLink`, or None), `bandwidth` bytes/s a direction winning
  when given, at `peak` FLOP/s x `mfu`."""
  flops, recompute = step_flops(s)
  return Bus(traffic(s, host), link.name if link and not bandwidth else "",
             bandwidth or (link.bandwidth if link else 0.0), flops, recompute, peak, mfu,
             s.batch, s.batch * s.example_shards * s.microbatches, s.seq_len)
