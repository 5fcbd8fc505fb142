"""The device mesh: axes ('data', 'expert', 'fsdp'), ordered so that 'fsdp' stays inside
a host.

ZeRO shards its state over the 'expert' and 'fsdp' axes and replicates it over 'data'.
Putting the fastest-varying axis ('fsdp') on devices of the same host keeps the
per-layer gathers and reduce-scatters on the fast intra-node links, and only the
(already sharded, fp32) gradient all-reduce crosses nodes: hybrid sharding. The batch is
split over all three.

'expert' is expert parallelism (size 1 without it): a mixture-of-experts block's kernels
are split over it by expert, each device holding its experts, and tokens travel to their
experts and back by all-to-all inside the block (`zerojax.models.moe`). For every other
param it is one more ZeRO axis.
"""

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# Axes in mesh order, slowest-varying first. A 'tensor' axis would go last, so that it
# lands on the most tightly linked devices.
MESH_AXES = ("data", "expert", "fsdp")
# The expert-parallel axis: the mixture-of-experts blocks' all-to-alls run over it.
EXPERT_AXIS = "expert"


class MeshShapeError(ValueError):
  """Mesh sizes that cannot cover the devices.

  Attributes:
    key: the size to change (one of the `names` given to `resolve_shape`), or None.
    fix: sizes that would work, or None.
  """

  def __init__(self, problem: str, key: str | None = None, fix: str | None = None):
    super().__init__(problem + (f" ({fix})" if fix else ""))
    self.problem, self.key, self.fix = problem, key, fix


def resolve_shape(sizes: Sequence[int], num_devices: int,
                  names: Sequence[str] = MESH_AXES) -> tuple[int, ...]:
  """Fills in a single -1 with the devices left over.

  The one place mesh sizes are resolved: `make_mesh` and the config's checks
  (`zerojax.config.rules.resolve_mesh_shape`, which passes its keys as `names`).

  Args:
    sizes: one size per mesh axis; at most one may be -1.
    num_devices: how many devices the mesh must cover.
    names: what the error messages call each size.

  Returns:
    The sizes with -1 resolved.

  Raises:
    MeshShapeError: if the sizes cannot cover exactly `num_devices` devices.
  """
  sizes = tuple(int(s) for s in sizes)
  say = lambda i: f"{names[i]}={sizes[i]}"
  divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if num_devices < 1:
    raise MeshShapeError(f"there are {num_devices} devices; the mesh needs at least one.")
  if len(free) > 1:
    both = "both" if len(free) == 2 else "all"
    raise MeshShapeError(f"{' and '.join(names[i] for i in free)} are {both} -1; at most one "
                         "may take the devices left over.",
                         fix=f"give one of them a size, e.g. {names[free[0]]}=1")
  bad = [i for i, s in enumerate(sizes) if s == 0 or s < -1]
  if bad:
    raise MeshShapeError(f"{say(bad[0])}: mesh sizes must be positive or -1.", key=names[bad[0]])
  known = math.prod(s for s in sizes if s != -1)
  if free:
    fixed = [i for i in range(len(sizes)) if i not in free]
    if num_devices % known:
      raise MeshShapeError(
          f"{' x '.join(map(say, fixed))} does not divide the {num_devices} devices evenly, so "
          f"{names[free[0]]}=-1 cannot take the rest.", key=names[fixed[0]],
          fix=f"{names[fixed[0]]} sizes that work with {num_devices} devices: "
              + ", ".join(map(str, divisors)))
    return tuple(num_devices // known if s == -1 else s for s in sizes)
  if known != num_devices:
    pairs = ", ".join(f"{names[0]}={d} {names[1]}={num_devices // d}" for d in divisors)
    raise MeshShapeError(
        f"{' x '.join(map(say, range(len(sizes))))} = {known} devices, but {num_devices} "
        "devices are available.", key=names[0],
        fix=f"set {names[-1]}=-1 to use the rest" + (f", or one of: {pairs}"
                                                     if len(sizes) == 2 else ""))
  return sizes


def make_mesh(data: int = 1, fsdp: int = -1, *, expert: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the ('data', 'expert', 'fsdp') mesh with `Auto` axis types.

  Devices are sorted by (process, id) and laid out row-major, so each 'fsdp' group is a
  run of consecutive devices: inside one host whenever `fsdp` divides the devices per
  host (hybrid sharding); across hosts only when asked to be larger. An 'expert' group
  is `fsdp` apart: with expert x fsdp devices a host, inside it too.

  Args:
    data: replicas; -1 for the devices left over.
    fsdp: devices the ZeRO state is sharded over besides 'expert'; -1 for the rest.
    expert: devices the mixture-of-experts blocks' experts are split over; -1 for the
      rest.
    devices: the devices to use; all of `jax.devices()` by default.

  Returns:
    A `jax.sharding.Mesh` with axes `MESH_AXES`.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_shape((data, expert, fsdp), len(devices))
  devices.sort(key=lambda d: (d.process_index, d.id))
  grid = np.array(devices, dtype=object).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_from_config(config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh of a validated config (`config.mesh.data`, `.expert`, `.fsdp`) over
  `devices` (default: all)."""
  return make_mesh(config.mesh.data, config.mesh.fsdp, expert=config.mesh.expert,
                   devices=devices)


def processes_per_group(mesh: Mesh, axis: str = "fsdp") -> int:
  """How many processes (hosts) one group of devices along `axis` spans; 1 = inside one.

  With the default `data=1, fsdp=-1` on several processes the ZeRO state is sharded over
  every device of every host (`fsdp` spans all processes); hybrid sharding keeps each
  `fsdp` group inside a host (`data` = the number of hosts, `fsdp=-1`).
  """
  grid = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1)
  groups = grid.reshape(-1, grid.shape[-1])
  return max(len({d.process_index for d in group}) for group in groups)
