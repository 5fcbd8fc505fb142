"""Byte counts as people write them: one parser for the command lines, one formatter
for every report."""

import re

MiB, GiB = 2 ** 20, 2 ** 30


def parse_bytes(text: str) -> int:
  """'80GiB', '80GB' (1e9), '141G' (1e9), '512MiB', '1e9' -> bytes.

  Raises:
    ValueError: not a size.
  """
  m = re.fullmatch(r"\s*([\d.e+]+)\s*([kmgt]?)(i?)b?\s*", str(text).lower())
  if not m:
    raise ValueError(f"not a size: {text!r} (write e.g. 80GiB or 141GB)")
  power = " kmgt".index(m.group(2) or " ")
  return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def fmt_bytes(n: float) -> str:
  """'512 B', '1.50 KiB', ... '26.92 GiB', '1.20 TiB': binary units, two decimals."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")
