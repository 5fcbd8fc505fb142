"""What the planner reads of a config: `RunSpec` (one run resolved for a device count) and
the parameter counts of its model, sharded by the plan's rule."""

import collections
import dataclasses
import math

from zerojax import models, vocab
from zerojax.config.rules import resolve_mesh_shape
from zerojax.gpu import xla_flags
from zerojax.zero import EXPERTS_AXIS, StageBehaviour, local_shape, shard_dim

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Devices one node holds, for host memory per node when no target says (the common 8-GPU
# node; a run on fewer devices is counted as one node).
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
  fsdp: int  # ZeRO shards of every param but the experts': mesh.expert x mesh.fsdp.
  batch: int  # Sequences (whole, or their slices with sequence parallelism) per device per
  # microbatch.
  microbatches: int
  seq_len: int
  release: bool  # Gradient release (`zerojax.release`): stage 3, one microbatch.
  # The model's own (shape, logical axes) of every parameter leaf (`param_shapes()`).
  param_shapes: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]
  offload: bool = False  # The optimizer state in host memory (optimizer.offload='host').
  # Each sequence split by position over the 'fsdp' devices (mesh.sequence_parallel).
  sequence_parallel: bool = False
  mlp_chunk: int = 0  # Positions the MLP runs at a time (model.mlp_chunk; 0: all).
  # The saved residuals in host memory (model.activation_offload='host').
  activation_offload: bool = False
  # The layer-stacked parameter shards in host memory (zero.param_offload='host', stage 3).
  param_offload: bool = False
  # Devices a host (node) holds, for host memory per node: a --target's per-host count;
  # 0: all the run's devices, in nodes of at most `DEVICES_PER_NODE` (the common 8-GPU node).
  per_host: int = 0
  # The attention heads' width Dh (a family's explicit `model.head_size`, Qwen3 or Gemma 3);
  # 0: d_model / n_heads.
  head_size: int = 0
  # Norms on each sublayer's output (model.post_norms, Gemma): remat 'dots' then also
  # saves the down projection's output, the input of the norm after it.
  post_norms: bool = False
  # A mixture of experts (model.n_experts): E experts a layer, k a token, each F_e wide.
  n_experts: int = 0
  experts_per_token: int = 0
  expert_d_ff: int = 0
  expert: int = 1  # Devices the experts are split over (mesh.expert), within `fsdp`.
  # The expert-parallel exchange's size (model.expert_capacity_factor): 0 = dropless.
  capacity_factor: float = 0.0
  # Release writes each layer's update back during the next layer's trip
  # (optimizer.release_write_behind, with a layer stack in host memory).
  write_behind: bool = False
  # ... and writes it first in that trip, before the trip's reads
  # (optimizer.release_writes_first).
  writes_first: bool = False
  # XLA's GPU scheduler memory limit: the target GPU's whole memory (a --target's; 0: not
  # known, read back from the allocator's pool at train.py's fraction) and the slop
  # factor the run compiles at, in percent (`gpu.xla_flags.scheduler_slop` under the GPU
  # profile, XLA's 95 without it).
  gpu_memory: int = 0
  scheduler_slop: int = 95
  # The embedding and head kept sharded by vocabulary rows at stage 3 (zero.vocab_parallel,
  # a Llama): no whole vocabulary leaf or gradient (`zerojax.vocab`).
  vocab_parallel: bool = False

  @property
  def gathers(self) -> bool:
    """Stage 3's per-layer gathers run: params sharded over more than one device."""
    return self.behaviour.shards_params and self.fsdp > 1

  @property
  def vocab_sharded(self) -> bool:
    """The step uses the vocabulary leaves on their shards (`zero.make_plan`'s
    `vocab_parallel`: stage 3 over shards that divide the vocabulary)."""
    return (self.vocab_parallel and self.gathers and self.vocab_size % self.fsdp == 0
            and vocab.pays(self.batch * self.positions * self.fsdp, self.vocab_size))

  @property
  def mlp_width(self) -> int:
    """The feed-forward block's hidden width a token uses: d_ff, or k F_e with experts
    (its k experts' rows, the same [.., width] temporaries per token)."""
    return self.experts_per_token * self.expert_d_ff if self.n_experts else self.d_ff

  @classmethod
  def from_config(cls, config, devices: int) -> "RunSpec":
    """Raises ConfigError when the mesh does not fit `devices`."""
    m, p, o, t = config.model, config.precision, config.optimizer, config.train
    data, expert, fsdp = resolve_mesh_shape(config, devices)
    fsdp *= expert  # The ZeRO shards of every param but the experts' (`expert_shards`).
    shapes = models.from_config(config).param_shapes().values()
    sp = bool(config.mesh.sequence_parallel)  # The examples are split over 'data' only.
    behind = bool(o.get("release_write_behind", False))
    return cls(
        model=m.name, vocab_size=m.vocab_size, d_model=m.d_model, d_ff=m.d_ff,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, context=m.context,
        tie_embeddings=m.tie_embeddings, attention=m.attention,
        attention_block=m.attention_block, loss_chunk=m.loss_chunk, remat=m.remat,
        param_dtype=p.param_dtype, compute_dtype=p.compute_dtype, reduce_dtype=p.reduce_dtype,
        accum_dtype=p.accum_dtype, optimizer=o.name, state_dtype=o.state_dtype,
        update_rule=o.update_rule, momentum=o.momentum, stage=config.zero.stage,
        min_shard_size=config.zero.min_shard_size, data=data, fsdp=fsdp,
        batch=max(t.global_batch_size // (data * (1 if sp else fsdp) * t.microbatches), 1),
        microbatches=t.microbatches, seq_len=t.seq_len, release=o.release,
        param_shapes=tuple((tuple(shape), tuple(names)) for shape, names in shapes),
        offload=o.offload == "host", sequence_parallel=sp,
        # Keys newer than some configs: read with their defaults.
        mlp_chunk=int(m.get("mlp_chunk", 0)),
        activation_offload=m.get("activation_offload", "none") == "host",
        param_offload=config.zero.get("param_offload", "none") == "host",
        head_size=int(m.get("head_size", 0)) if m.name == "llama" else 0,
        post_norms=bool(m.get("post_norms", False)) and m.name == "llama",
        n_experts=int(m.get("n_experts", 0)) if m.name == "llama" else 0,
        experts_per_token=int(m.get("experts_per_token", 0)),
        expert_d_ff=int(m.get("expert_d_ff", 0)), expert=expert,
        capacity_factor=float(m.get("expert_capacity_factor", 0.0)),
        write_behind=behind, writes_first=bool(o.get("release_writes_first", False)),
        vocab_parallel=bool(config.zero.get("vocab_parallel", False)) and m.name == "llama",
        scheduler_slop=xla_flags.scheduler_slop(behind) if config.xla.get("gpu_profile", True)
        else xla_flags.DEFAULT_SLOP)

  @property
  def devices(self) -> int:
    return self.data * self.fsdp

  @property
  def head_dim(self) -> int:
    """Dh: `head_size`, else d_model / n_heads (as `LlamaConfig.head_dim`)."""
    return self.head_size or self.d_model // self.n_heads

  @property
  def per_node(self) -> int:
    """Devices of this run on one host: `per_host`, else `DEVICES_PER_NODE`; at most all."""
    return min(self.per_host or DEVICES_PER_NODE, self.devices)

  @property
  def example_shards(self) -> int:
    """Devices the examples are split over: all, or 'data' with sequence parallelism."""
    return self.data if self.sequence_parallel else self.devices

  @property
  def positions(self) -> int:
    """Positions of each sequence a device holds outside attention."""
    return self.seq_len // self.fsdp if self.sequence_parallel else self.seq_len

  @property
  def behaviour(self) -> StageBehaviour:
    """What the stage shards and how it reduces, as the plan would say (one rule)."""
    return StageBehaviour.of(self.stage, self.fsdp)


def _leaves(s: RunSpec) -> list[tuple[tuple[int, ...], bool, bool, tuple[int, ...]]]:
  """(shape, layer-stacked, vocab-sized, one device's shard) of every parameter leaf, as
  the model makes them and the plan shards them."""
  return [(shape, "layers" in names, "vocab" in names, _local_shape(s, shape, names))
          for shape, names in s.param_shapes]


def _local_shape(s: RunSpec, shape: tuple[int, ...],
                 names: tuple[str | None, ...]) -> tuple[int, ...]:
  """One device's shard of a leaf, by the plan's rule (`zero.make_plan`): an experts'
  kernel split over the `expert` devices by expert, then ZeRO over the rest."""
  shards = s.fsdp
  if EXPERTS_AXIS in names:
    shape = local_shape(shape, names.index(EXPERTS_AXIS), s.expert)
    shards //= s.expert
  return local_shape(shape, shard_dim(shape, names, shards, s.min_shard_size), shards)


class Counts(collections.namedtuple("Counts",
                                     "total layers local local_layers largest gathered")):
  """Parameter counts: all, layer-stacked, one device's shard (all, layer-stacked), the
  largest layer-stacked leaf, and the layer-stacked params a device gathers (each leaf
  whole, an experts' kernel only the E / ep experts the device holds)."""


def active_params(s: RunSpec) -> int:
  """Parameters a token's forward pass uses: all but the (E - k) / E of each layer's
  experts it is not routed to (`param_counts(s).total` without experts)."""
  total = param_counts(s).total
  if not s.n_experts:
    return total
  experts = sum(math.prod(shape) for shape, names in s.param_shapes
                if names[:2] == ("layers", "experts"))
  return total - experts * (s.n_experts - s.experts_per_token) // s.n_experts


def param_counts(s: RunSpec) -> Counts:
  total = layers = local = local_layers = largest = gathered = 0
  for (shape, layered, _, shard), (_, names) in zip(_leaves(s), s.param_shapes, strict=True):
    n, n_local = math.prod(shape), math.prod(shard)
    total, local = total + n, local + n_local
    if layered:
      layers, local_layers, largest = layers + n, local_layers + n_local, max(largest, n)
      gathered += n // s.expert if EXPERTS_AXIS in names else n
  return Counts(total, layers, local, local_layers, largest, gathered)



def _as_setup(config, devices: int | None) -> RunSpec:
  if isinstance(config, RunSpec):
    return config
  if devices is None:
    raise ValueError("estimate(config, devices): say how many devices")
  return RunSpec.from_config(config, devices)

