"""Byte quantities: parse what users type, print what they can read."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"40GiB"`` -> 42949672960, ``"60GB"`` -> 60000000000, ``"1024"`` -> 1024 (bytes)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write a number with a unit such as 40GiB, 60GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int | float) -> str:
    """Binary units with three significant digits: ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: int | float) -> str:
    """Large counts with SI prefixes: ``format_count(1.5e12) == "1.50 T"``."""
    value = float(n)
    for prefix in ("", " k", " M", " G", " T", " P"):
        if abs(value) < 1000 or prefix == " P":
            return f"{value:.0f}" if prefix == "" else f"{value:.2f}{prefix}"
        value /= 1000
    raise AssertionError("unreachable")
