"""The GPU benchmark's derived numbers and markdown tables (`benchmarks/gpu.py`'s results)."""

import os

# Goals proposed here (the issue sets none for these): the update streams at >= 80% of
# the memory bandwidth; the planner is within 10% of the compiled per-device memory.
BANDWIDTH_GOAL, PLANNER_GOAL = 0.8, 0.10
GIB = 2 ** 30


def derive(res: dict) -> None:
  """MFU, bandwidth fraction and planner ratios from the raw child results (in place)."""
  bw = res.get("bandwidth") or {}
  info = bw.get("info") or next((r["info"] for r in res["mfu"] if r.get("info")), {})
  res["device"] = info
  cpu = res["cpu"]
  peak_flops = bw.get("measured_matmul_flops") if cpu else info.get("peak_flops")
  peak_bw = bw.get("measured_stream_bandwidth") if cpu else info.get("peak_bandwidth")
  res["peaks"] = dict(
      flops=peak_flops, bandwidth=peak_bw,
      source="measured on this CPU (bf16 1024^3 matmul; f32 elementwise stream)" if cpu
      else "datasheet (zerojax.run.metrics.PEAK_FLOPS, PEAK_BANDWIDTH here)")
  if bw.get("bytes_per_s") and peak_bw:
    bw["fraction_of_peak"] = bw["bytes_per_s"] / peak_bw
    bw["goal"] = BANDWIDTH_GOAL
    bw["met"] = bw["fraction_of_peak"] >= BANDWIDTH_GOAL
  for r in res["mfu"]:
    devices = (r.get("info") or {}).get("devices", 1)
    if r.get("model_flops_per_s") and peak_flops:
      r["mfu"] = r["model_flops_per_s"] / (peak_flops * devices)
    if r.get("planner_bytes"):
      r["compiled_over_planner"] = r["compiled_bytes"] / r["planner_bytes"]
      if r.get("device_peak_bytes"):
        r["device_peak_over_planner"] = r["device_peak_bytes"] / r["planner_bytes"]
      r["planner_met"] = abs(r["compiled_over_planner"] - 1) <= PLANNER_GOAL


def gib(b):
  return "—" if b is None else f"{b / GIB:.2f}" if b >= 0.01 * GIB else f"{b / 2 ** 20:.1f} MiB"


def report(res: dict) -> str:
  """The markdown tables of a result dict."""
  lines = []
  d, pk = res["device"], res["peaks"]
  fmt = lambda x, unit, scale: "—" if not x else f"{x / scale:,.1f} {unit}"
  lines.append(f"Device: {d.get('device_kind') or d.get('platform')} x {d.get('devices')}, "
               f"jax {d.get('jax')}; peak {fmt(pk['flops'], 'TFLOP/s', 1e12)}, "
               f"{fmt(pk['bandwidth'], 'GB/s', 1e9)} ({pk['source']}).\n")
  bw = res.get("bandwidth")
  if bw:
    lines += ["| update | params | bytes/param | ms/update | achieved GB/s | of peak "
              "| goal | met | XLA bytes accessed / counted |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    if bw.get("bytes_per_s"):
      frac, xla = bw.get("fraction_of_peak"), bw.get("xla_bytes_accessed")
      cells = ["bf16 Kahan AdamW, bf16 state, fp32 grads", f"{bw['params'] / 1e6:,.1f}M",
               f"{bw['bytes_per_param']:.0f}", f"{bw['seconds'] * 1e3:.2f}",
               f"{bw['bytes_per_s'] / 1e9:,.1f}", "—" if frac is None else f"{frac:.1%}",
               f"≥ {BANDWIDTH_GOAL:.0%}",
               "—" if frac is None else ("met" if bw["met"] else "**missed**"),
               "—" if not xla else f"{xla / bw['bytes']:.2f}"]
      lines.append("| " + " | ".join(cells) + " |")
    else:
      lines.append(f"| bf16 Kahan AdamW | {bw.get('status')}: {bw.get('error', '')[:120]} "
                   "| | | | | | | |")
    lines.append("")
  lines += ["| config | remat | batch x seq | params | status | ms/step | tokens/s | MFU "
            "| compiled GiB | device peak GiB | planner GiB | compiled / planner |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in res["mfu"]:
    ok = r.get("status") == "ok"
    ratio, mfu = r.get("compiled_over_planner"), r.get("mfu")
    cells = [os.path.basename(r.get("config", "?")), r.get("remat", "?"),
             f"{r['batch']} x {r['seq_len']}" if r.get("batch") else "—",
             (f"{r['params'] / 1e9:.2f}B" if r["params"] >= 1e9 else f"{r['params'] / 1e6:.2f}M")
             if r.get("params") else "—",
             "ok" if ok else f"{r.get('status')}: {str(r.get('error', ''))[:100]}",
             f"{r['step_s'] * 1e3:,.1f}" if ok else "—",
             f"{r['tokens_per_s']:,.0f}" if ok else "—",
             "—" if mfu is None else f"{mfu:.1%}",
             gib(r.get("compiled_bytes")), gib(r.get("device_peak_bytes")),
             gib(r.get("planner_bytes")), "—" if ratio is None else f"{ratio:.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
  phased = [r for r in res["mfu"] if any((p or {}).get("peak") is not None
                                          for p in (r.get("phases") or {}).values())]
  if phased:  # GPUs only: XLA:CPU keeps no allocator statistics.
    names = list(phased[0]["phases"])
    lines += ["", "Device peak / bytes in use (GiB) after each phase: the phase after which the "
              "peak jumps set it.", "",
              "| run | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for r in phased:
      cells = [f"{gib(p.get('peak'))} / {gib(p.get('in_use'))}"
               for p in (r["phases"].get(n) or {} for n in names)]
      lines.append(f"| {r.get('name', r.get('remat'))} | " + " | ".join(cells) + " |")
  for r in res["mfu"]:  # The whole-run rows: each phase's compiled bytes beside its peak.
    if r.get("compiled_phases"):
      lines.append(f"\n{r.get('name')}: compiled device bytes a phase (GiB), "
                   + ", ".join(f"{p} {gib(v)}" for p, v in r["compiled_phases"].items())
                   + f"; the largest: {r.get('compiled_peak_phase')}")
  notes = {r.get("planner_note") for r in res["mfu"] if r.get("planner_note")}
  lines += [f"\nplanner: {n}" for n in sorted(notes)]
  return "\n".join(lines)
