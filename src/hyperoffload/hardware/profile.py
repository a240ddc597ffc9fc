"""A hardware profile: the numbers the cost model and the simulator need, each with its source.

Profiles are data: TOML files (``presets/*.toml`` for the built-in ones, or a user's own file).
Quantities may be written with units (``"80GiB"``, ``"3.35TB/s"``, ``"989TFLOP/s"``, ``"8us"``)
or as bare numbers in base units (bytes, bytes/s, FLOP/s, seconds). A ``[sources]`` table says
where each number comes from.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hyperoffload.units import parse_bandwidth, parse_bytes, parse_duration, parse_flops, unitless

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class HardwareError(ValueError):
    """A profile is unknown, malformed or inconsistent; the message says what to fix."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """One accelerator and its link to remote memory."""

    name: str
    description: str
    memory_bytes: int
    """Device memory (bytes)."""
    peak_flops: Mapping[str, float]
    """Dense peak compute per dtype name (FLOP/s), e.g. ``{"bfloat16": 989e12, "float32": 67e12}``."""
    hbm_bw: float
    """Device memory bandwidth (bytes/s)."""
    h2d_bw: float
    """Remote-to-device copy bandwidth with one direction busy (bytes/s)."""
    d2h_bw: float
    """Device-to-remote copy bandwidth with one direction busy (bytes/s)."""
    h2d_latency_s: float
    """Fixed cost of one remote-to-device copy before data moves (seconds)."""
    d2h_latency_s: float
    """Fixed cost of one device-to-remote copy before data moves (seconds)."""
    duplex_share: float
    """Share of each direction's bandwidth left while both directions copy at once (0 < share <= 1)."""
    launch_s: float
    """Kernel launch overhead added to every op that runs a kernel (seconds)."""
    compute_efficiency: float
    """Achieved share of ``peak_flops`` on compute-bound ops (0 < e <= 1)."""
    memory_efficiency: float
    """Achieved share of ``hbm_bw`` on memory-bound ops (0 < e <= 1)."""
    issue_s: float = 0.0
    """Compute-stream time spent issuing each cache instruction (offload, prefetch, wait, release), for
    runtimes whose one thread both issues copies and runs the ops (seconds). 0 on accelerators, whose
    host issues copies ahead of the device stream."""
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Where each field's number comes from, keyed by field name."""

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "hbm_bw", "h2d_bw", "d2h_bw"):
            if not getattr(self, name) > 0:
                raise HardwareError(f"{self.name}: {name} must be positive, got {getattr(self, name)}")
        for name in ("h2d_latency_s", "d2h_latency_s", "launch_s", "issue_s"):
            if getattr(self, name) < 0:
                raise HardwareError(f"{self.name}: {name} must be >= 0 seconds, got {getattr(self, name)}")
        for name in ("duplex_share", "compute_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise HardwareError(f"{self.name}: {name} must be in (0, 1], got {getattr(self, name)}")
        if not self.peak_flops or any(not v > 0 for v in self.peak_flops.values()):
            raise HardwareError(f"{self.name}: peak_flops needs a positive FLOP/s for at least one dtype")

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; dtypes without a figure use float32's (or the slowest listed)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops.get("float32", min(self.peak_flops.values()))

    def replace(self, **changes: Any) -> Hardware:
        """A copy with ``changes``; the source of each changed field becomes "set by the user"."""
        sources = dict(self.sources)
        for name in changes:
            sources[name] = "set by the user"
        return dataclasses.replace(self, **changes, sources=MappingProxyType(sources))


def _read_memory(value: Any) -> int:
    """``memory``: a size with a unit, or a bare number (a TOML number or "80"), which is bytes; but
    "memory = 80" surely meant 80 GiB, not 80 bytes: a bare number under a mebibyte is refused rather than
    planned for a device with no room."""
    bare = unitless(value) if isinstance(value, str) else float(value)
    if bare is None:
        return parse_bytes(value)
    if bare < 2**20:
        raise ValueError(f"a bare number is bytes, so this device would have {bare:g} bytes; write the size with a "
                         f"unit, e.g. memory = \"{bare:g}GiB\"")
    return int(bare)


# How each TOML key is read: field name -> parser from a TOML value to the field's base unit.
_READERS = {
    "memory": ("memory_bytes", _read_memory),
    "hbm_bw": ("hbm_bw", parse_bandwidth),
    "h2d_bw": ("h2d_bw", parse_bandwidth),
    "d2h_bw": ("d2h_bw", parse_bandwidth),
    "h2d_latency": ("h2d_latency_s", parse_duration),
    "d2h_latency": ("d2h_latency_s", parse_duration),
    "duplex_share": ("duplex_share", float),
    "launch": ("launch_s", parse_duration),
    "compute_efficiency": ("compute_efficiency", float),
    "memory_efficiency": ("memory_efficiency", float),
}
# Keys a profile may leave out (the field's default applies).
_OPTIONAL = {"issue": ("issue_s", parse_duration)}
FILE_KEYS = {name: key for key, (name, _) in {**_READERS, **_OPTIONAL}.items()}
"""Field name -> the key a profile file gives it (``memory_bytes`` -> ``memory``)."""


def hardware_from_dict(data: Mapping[str, Any], *, origin: str) -> Hardware:
    """Build a profile from a parsed TOML document; ``origin`` names the file in error messages."""
    data = dict(data)
    unknown = set(data) - set(_READERS) - set(_OPTIONAL) - {"name", "description", "peak_flops", "sources"}
    if unknown:
        raise HardwareError(f"{origin}: unknown key(s) {sorted(unknown)}; known keys are "
                            f"{sorted([*_READERS, *_OPTIONAL, 'name', 'description', 'peak_flops', 'sources'])}")
    missing = [k for k in ("name", "peak_flops", *_READERS) if k not in data]
    if missing:
        raise HardwareError(f"{origin}: missing key(s) {missing}")
    fields: dict[str, Any] = {"name": str(data["name"]), "description": str(data.get("description", ""))}
    for key, (name, read) in [*_READERS.items(), *_OPTIONAL.items()]:
        if key not in data:
            continue  # only optional keys can be missing here
        try:
            fields[name] = read(data[key])
        except (TypeError, ValueError) as error:
            raise HardwareError(f"{origin}: {key} = {data[key]!r}: {error}") from None
    if not isinstance(data["peak_flops"], Mapping):
        raise HardwareError(f"{origin}: peak_flops must be a table of dtype = FLOP/s, e.g. bfloat16 = \"989TFLOP/s\"")
    try:
        fields["peak_flops"] = MappingProxyType({str(k): parse_flops(v) for k, v in data["peak_flops"].items()})
    except (TypeError, ValueError) as error:
        raise HardwareError(f"{origin}: peak_flops: {error}") from None
    sources = data.get("sources", {})
    if not isinstance(sources, Mapping):
        raise HardwareError(f"{origin}: sources must be a table of key = \"where the number comes from\"")
    # Sources are keyed by TOML key in the file and by field name in the dataclass.
    keys = {**_READERS, **_OPTIONAL}
    fields["sources"] = MappingProxyType({keys.get(k, (k,))[0]: str(v) for k, v in sources.items()})
    try:
        return Hardware(**fields)
    except HardwareError as error:  # a value out of range: name the file, as for every other mistake in it
        raise HardwareError(f"{origin}: {error}") from None


def load_hardware_file(path: str | Path) -> Hardware:
    """Read a profile from a TOML file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise HardwareError(f"no hardware file at {path}") from None
    except UnicodeDecodeError:
        raise HardwareError(f"{path} is not a text file; a hardware profile is a TOML file like the presets "
                            f"(hyperoffload hardware NAME shows one)") from None
    except OSError as error:  # a folder, a file this user may not read
        raise HardwareError(f"cannot read the hardware profile {path}: {error.strerror}; give a readable .toml "
                            f"file") from None
    except tomllib.TOMLDecodeError as error:
        raise HardwareError(f"{path} is not valid TOML: {error}") from None
    return hardware_from_dict(data, origin=str(path))
