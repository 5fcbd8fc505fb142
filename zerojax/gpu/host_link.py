"""The link between each GPU target and its host: what an offload's copies run at.

Bytes per second in one direction that a copy between pinned host memory and the device
can be expected to reach: about 80% of the link's theoretical rate (packet headers, flow
control and DMA setup take the rest), a planning figure, not measured here. The link is
full duplex: host-to-device and device-to-host copies each run at this rate, at the same
time.
"""

from typing import NamedTuple


class HostLink(NamedTuple):
  """A host link: its name and the bytes per second one direction achieves."""
  name: str
  bandwidth: float


# PCIe 4.0 x16: 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s (~32) a direction in theory.
PCIE4_X16 = HostLink("PCIe 4.0 x16", 25e9)
# PCIe 5.0 x16: 32 GT/s x 16 lanes x 128b/130b = 63 GB/s (~64) a direction in theory.
PCIE5_X16 = HostLink("PCIe 5.0 x16", 50e9)

# Target name (`zerojax.gpu.targets.names`) -> its host link (the vendors' datasheets: the
# SXM modules' host interface, and the cards' slot).
LINKS = {
    "rtx4090": PCIE4_X16, "l40s": PCIE4_X16, "a100_40gb": PCIE4_X16, "a100_80gb": PCIE4_X16,
    "h100": PCIE5_X16, "h200": PCIE5_X16,
}


def of(name: str) -> HostLink | None:
  """The host link of the target `name` (a `Target.name`), None where unknown."""
  return LINKS.get(name)
