"""Byte quantities: parse what users type, print what they can read."""

from __future__ import annotations

import math
import numbers
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15, "eb": 10**18,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _finite(value: float, text, what: str, example: str) -> float:
    """``value`` (read from ``text``), refused if it is infinite: a number too large for a float such as
    "1e400" reads as infinity."""
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large to be {what}; {example}")
    return value


def bare_number(value, what: str, example: str) -> float:
    """A quantity given as a number rather than text (a TOML number, an API argument): already in base units, so
    it needs only to be a finite number >= 0. A bool is refused, though Python counts it as an int (TOML's
    ``true`` would otherwise read as 1), and so is anything that is neither text nor a number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"a {type(value).__name__} is not {what}; {example}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{value!r} is not {what}: it must be a finite number >= 0; {example}")
    return float(value)


def _text(value, what: str, example: str) -> str:
    """``value``, which must be text by now (numbers were read by ``bare_number``)."""
    if not isinstance(value, str):
        raise TypeError(f"a {type(value).__name__} is not {what}; {example}")
    return value


def _size(text: str) -> float | None:
    """Bytes as a float (``inf`` for "1e400"), or None where ``text`` is not a size."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        return None
    return float(match.group(1)) * _UNITS[unit]


def unitless(text: str) -> float | None:
    """The number ``text`` is, if it is a bare number with no unit ("80", "1e3"); else None. A bare number
    reads as bytes, which is rarely what a short one meant: callers that can tell say so."""
    match = _SIZE.match(_text(text, "a size", "write a number with a unit such as 40GiB or 60GB"))
    return float(match.group(1)) if match and not match.group(2) else None


def parse_bytes(text: str) -> int:
    """``"40GiB"`` -> 42949672960, ``"60GB"`` -> 60000000000, ``"1024"`` -> 1024 (bytes)."""
    value = _size(_text(text, "a size", "write a number with a unit such as 40GiB, 60GB or 512MiB"))
    if value is None:
        raise ValueError(f"cannot read {text!r} as a size; write a number with a unit such as 40GiB, 60GB or 512MiB")
    # "1e400" reads as infinity, which int() cannot hold: refuse it here rather than with an OverflowError.
    return int(_finite(value, text, "a size", "write a number with a unit such as 40GiB or 60GB"))


def format_bytes(n: int | float) -> str:
    """Binary units with three significant digits: ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(value) < 1024 or unit == "EiB":
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


_RATE = re.compile(r"^\s*(.+?)\s*/\s*s\s*$", re.IGNORECASE)


def parse_bandwidth(text: str | float | int) -> float:
    """Bytes per second: ``"25GB/s"`` -> 2.5e10, ``"1.5GiB/s"``; a bare number is already bytes/s."""
    example = "write it like 25GB/s or 1.5GiB/s"
    if not isinstance(text, str):
        return bare_number(text, "a bandwidth", example)
    match = _RATE.match(text)
    value = _size(match.group(1)) if match else None
    # The messages name what was typed ("-5GB/s"), not the size inside it.
    if value is None:
        raise ValueError(f"cannot read {text!r} as a bandwidth; write it like 25GB/s or 1.5GiB/s")
    return float(int(_finite(value, text, "a bandwidth", example)))  # whole bytes per second, as before


_FLOP_UNITS = {"flop": 1, "kflop": 1e3, "mflop": 1e6, "gflop": 1e9, "tflop": 1e12, "pflop": 1e15}


def parse_flops(text: str | float | int) -> float:
    """FLOP per second: ``"989TFLOP/s"`` -> 9.89e14; a bare number is already FLOP/s."""
    if not isinstance(text, str):
        return bare_number(text, "a compute rate", "write it like 989TFLOP/s")
    match = re.match(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)\s*/\s*s\s*$", text, re.IGNORECASE)
    if not match or match.group(2).lower() not in _FLOP_UNITS:
        raise ValueError(f"cannot read {text!r} as a compute rate; write it like 989TFLOP/s")
    value = float(match.group(1)) * _FLOP_UNITS[match.group(2).lower()]
    # "1e400TFLOP/s" reads as infinity: every op would silently take no time.
    return _finite(value, text, "a compute rate", "write it like 989TFLOP/s")


_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divide: 10 / 1e6 is exactly 1e-05


def parse_duration(text: str | float | int) -> float:
    """Seconds: ``"10us"`` -> 1e-05, ``"2ms"``; a bare number is already seconds."""
    if not isinstance(text, str):
        return bare_number(text, "a duration", "write it like 10us, 2ms or 0.5s")
    match = re.match(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zµ]+)\s*$", text, re.IGNORECASE)
    if not match or match.group(2).lower() not in _PER_SECOND:
        raise ValueError(f"cannot read {text!r} as a duration; write it like 10us, 2ms or 0.5s")
    seconds = float(match.group(1)) / _PER_SECOND[match.group(2).lower()]
    # "1e400s" reads as infinity: a copy or launch that never ends would silently wreck every figure.
    return _finite(seconds, text, "a duration", "write it like 10us, 2ms or 0.5s")


def format_seconds(seconds: float) -> str:
    """``format_seconds(0.0123) == "12.3 ms"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale or unit == "us":
            return f"{seconds / scale:.3g} {unit}"
    raise AssertionError("unreachable")


def format_bandwidth(bytes_per_s: float) -> str:
    """``format_bandwidth(2.5e10) == "25 GB/s"`` (decimal units, as vendors quote links)."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"
