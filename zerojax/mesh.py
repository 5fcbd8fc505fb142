"""The device mesh: axes ('data', 'fsdp'), ordered so that 'fsdp' stays inside a host.

ZeRO shards its state over the 'fsdp' axis and replicates it over 'data'. Putting the
fastest-varying axis ('fsdp') on devices of the same host keeps the per-layer gathers
and reduce-scatters on the fast intra-node links, and only the (already sharded, fp32)
gradient all-reduce crosses nodes: hybrid sharding.
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# Axes in mesh order, slowest-varying first. A 'tensor' axis would go last, so that it
# lands on the most tightly linked devices.
MESH_AXES = ("data", "fsdp")


def resolve_shape(sizes: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Fills in a single -1 with the devices left over.

  Args:
    sizes: one size per mesh axis; at most one may be -1.
    num_devices: how many devices the mesh must cover.

  Returns:
    The sizes with -1 resolved.

  Raises:
    ValueError: if the sizes cannot cover exactly `num_devices` devices.
  """
  sizes = tuple(int(s) for s in sizes)
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh sizes must be positive or -1, got {sizes}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
          f"mesh {sizes} cannot cover {num_devices} devices: {num_devices} is not "
          f"divisible by {known}")
    sizes = tuple(num_devices // known if s == -1 else s for s in sizes)
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(
        f"mesh {sizes} has {int(np.prod(sizes))} devices but {num_devices} are "
        f"available")
  return sizes


def make_mesh(data: int = 1, fsdp: int = -1, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the ('data', 'fsdp') mesh with `Auto` axis types.

  Devices are sorted by (process, id) and laid out row-major, so each 'fsdp' group is a
  run of consecutive devices: inside one host whenever `fsdp` divides the devices per
  host (hybrid sharding); across hosts only when asked to be larger.

  Args:
    data: replicas; -1 for the devices left over.
    fsdp: devices the ZeRO state is sharded over; -1 for the rest.
    devices: the devices to use; all of `jax.devices()` by default.

  Returns:
    A `jax.sharding.Mesh` with axes `MESH_AXES`.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_shape((data, fsdp), len(devices))
  devices.sort(key=lambda d: (d.process_index, d.id))
  grid = np.array(devices, dtype=object).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_from_config(config) -> Mesh:
  """The mesh of a validated config (`config.mesh.data`, `config.mesh.fsdp`)."""
  return make_mesh(config.mesh.data, config.mesh.fsdp)


def processes_per_group(mesh: Mesh, axis: str = "fsdp") -> int:
  """How many processes (hosts) one group of devices along `axis` spans; 1 = inside one.

  With the default `data=1, fsdp=-1` on several processes the ZeRO state is sharded over
  every device of every host (`fsdp` spans all processes); hybrid sharding keeps each
  `fsdp` group inside a host (`data` = the number of hosts, `fsdp=-1`).
  """
  grid = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1)
  groups = grid.reshape(-1, grid.shape[-1])
  return max(len({d.process_index for d in group}) for group in groups)
