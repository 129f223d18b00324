"""Memory sizes as people write them (`80GB`, `80GiB`, `8e10`) and as reports print them."""

from __future__ import annotations

import math
import re

__all__ = ["format_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_FORMS = "bytes (8e10), or a unit: 80GB = 80·10^9 bytes, 80GiB = 80·2^30 (kB … TB, KiB … TiB)"


def parse_size(text: str) -> int:
    """Bytes from `80GB` (10^9), `80GiB` (2^30), `8e10` or `85899345920`; `80G` is ambiguous."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match and unit in ("k", "m", "g", "t"):
        raise ValueError(
            f"memory size {text!r} is ambiguous: write {match.group(1)}{unit.upper()}B "
            f"(10^n bytes) or {match.group(1)}{unit.upper()}iB (2^n bytes)"
        )
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}: write {_FORMS}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(
            f"memory size {text!r} is beyond a float's range: give a finite size such as 80GB"
        )
    size = int(value)
    if size < 1:
        raise ValueError(f"memory size {text!r} is below one byte: give a positive size")
    return size


def format_size(nbytes: float) -> str:
    """Binary units, one decimal: `512 B`, `1.5 MiB`, `32.9 GiB`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
