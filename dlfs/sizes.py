"""Human-friendly byte sizes for flags such as --chunk-size 64M."""

from __future__ import annotations

import re
from decimal import Decimal

from dlfs.errors import UsageError

MAX_SIZE = 1 << 50  # 1 PiB: beyond any chunk, cache or bandwidth this takes
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse '64M', '1.5G', '4096', '512KiB' into bytes (binary units)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise UsageError(f"not a size: {text!r} (use e.g. 4096, 512K, 64M, 1G)")
    number, unit = match.groups()
    value = int(Decimal(number) * _UNITS[unit.upper()])  # exact: no float rounding
    if value > MAX_SIZE:
        raise UsageError(f"size too large: {text!r} (at most 1024T)")
    return value


def format_size(n: float) -> str:
    """Render a byte count with a binary unit, e.g. 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
