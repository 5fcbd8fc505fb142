"""The planner report's host side: param offload's caveat without release, the host
memory's verdict per node, and the host link's line (`zerojax.memory.bus`), for
`zerojax.memory_report`."""

from zerojax.memory import Estimate, bus
from zerojax.units import fmt_bytes


def host_lines(e: Estimate, link=None) -> list[str]:
  """Param offload without release's caveat, the host memory's verdict, the bus line
  (`link`: a `bus.Bus`)."""
  s, out = e.setup, []
  if s.param_offload and not s.release:
    out.append("param offload without gradient release: the step brings the whole param "
               "shard to the device (no device bytes saved; host memory between steps): pair "
               "it with --config.optimizer.release=True")
  if e.host_memory and e.host:
    over = e.host_per_node - e.host_memory
    out.append(f"host memory: {fmt_bytes(e.host_per_node)} per node of {s.per_node} "
               f"device(s) {'fits in' if over <= 0 else 'does NOT fit in'} "
               f"{fmt_bytes(e.host_memory)} (--host-memory): "
               f"{'headroom' if over <= 0 else 'short by'} {fmt_bytes(abs(over))}"
               + ("" if over <= 0 else "; offload less (the changes below), or spread the "
                  "run over more nodes / devices (smaller shards, fewer devices a node)"))
  if link is not None and link.line():
    out.append(link.line())
  return out


def host_link(e: Estimate, spec, bandwidth: float, peak: float, mfu: float) -> bus.Bus:
  """The bus terms of `e` over the target's host link (or `bandwidth`), at the target's
  peak bf16 FLOP/s (`metrics.PEAK_FLOPS`; or the config's train.peak_flops) x `mfu`."""
  # pylint: disable=import-outside-toplevel
  from zerojax import metrics
  from zerojax.gpu import host_link as links
  if spec:  # A Target has the device_kind peak_flops reads of a device.
    peak = metrics.peak_flops(spec.target, peak)
  return bus.bus(e.setup, e.host, spec and links.of(spec.target.name), bandwidth, peak, mfu)
