"""A hardware profile: the numbers the cost model and the simulator need, each with its source.

Profiles are data: TOML files (``presets/*.toml`` for the built-in ones, or a user's own file).
Quantities may be written with units (``"80GiB"``, ``"3.35TB/s"``, ``"989TFLOP/s"``, ``"8us"``)
or as bare numbers in base units (bytes, bytes/s, FLOP/s, seconds). A ``[sources]`` table says
where each number comes from.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import reprlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from hyperoffload.units import bare_number, parse_bandwidth, parse_bytes, parse_duration, parse_flops, unitless

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class HardwareError(ValueError):
    """A profile is unknown, malformed or inconsistent; the message says what to fix."""


MAX_MEMORY_BYTES = 2**62
"""The most device memory (and budget) accepted, bytes: 4 EiB, far beyond any device, and small enough that sums
of a few such sizes still fit the signed 64-bit integers the analyses count bytes in."""
MAX_DEVICES = 2**20
"""The most devices per node, nodes, or devices behind one host link accepted: about a million, beyond any machine
built, and small enough that a collective's per-step latency sum stays a handful of float operations."""
MAX_EVENT_S = 3600.0
"""The longest fixed cost of one event accepted (a copy's latency, a kernel launch, an issue), seconds: an hour
per copy is a slip of units (us, ms), and the simulator's clock keeps its resolution well past a step of such
events."""


class _Rule(NamedTuple):
    """What one numeric field must be: ``what`` completes "<field> must be ..."; ``ok`` is tested on a finite
    real number; ``whole`` asks for an integer."""

    what: str
    ok: Callable[[float], bool]
    whole: bool = False


_BANDWIDTH = _Rule("a finite number > 0 bytes/s", lambda v: v > 0)
_EVENT = _Rule(f"a finite number >= 0 s and at most {MAX_EVENT_S:g} s", lambda v: 0 <= v <= MAX_EVENT_S)
_SHARE = _Rule("in (0, 1]", lambda v: 0 < v <= 1)
_COUNT = _Rule(f"a whole number >= 1 and at most 2**20 ({MAX_DEVICES})", lambda v: 1 <= v <= MAX_DEVICES, whole=True)
_NETWORK = _Rule("a finite number >= 0 bytes/s (0: no such link)", lambda v: v >= 0)
_RULES: dict[str, _Rule] = {
    "memory_bytes": _Rule("a whole number of bytes > 0 and at most 2**62 (4 EiB)", lambda v: 0 < v <= MAX_MEMORY_BYTES,
                          whole=True),
    "hbm_bw": _BANDWIDTH, "h2d_bw": _BANDWIDTH, "d2h_bw": _BANDWIDTH,
    "h2d_latency_s": _EVENT, "d2h_latency_s": _EVENT, "launch_s": _EVENT, "issue_s": _EVENT,
    "duplex_share": _SHARE, "compute_efficiency": _SHARE, "memory_efficiency": _SHARE,
    "devices_per_node": _COUNT, "nodes": _COUNT, "host_link_shared_by": _COUNT,
    "intra_node_bw": _NETWORK, "inter_node_bw": _NETWORK,
    "intra_node_latency_s": _EVENT, "inter_node_latency_s": _EVENT,
    "host_memory_bytes": _Rule("a whole number of bytes >= 0 (0: not stated) and at most 2**62 (4 EiB)",
                               lambda v: 0 <= v <= MAX_MEMORY_BYTES, whole=True),
    "host_mem_bw": _Rule("a finite number >= 0 bytes/s (0: not stated)", lambda v: v >= 0),
}
"""Field name -> the rule its number follows (``peak_flops``, a table, has its own check)."""

_SHOWN = reprlib.Repr()  # keyword arguments to Repr() are Python 3.12's
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 2, 40, 40


def _shown(value: Any) -> str:
    """``value`` for an error message, cut short: a profile may hold a long string or a table nested deep."""
    plain = isinstance(value, (int, float)) and not isinstance(value, bool)
    return _SHOWN.repr(value) + ("" if plain else f" ({type(value).__name__}, not a number)")


def _bad_number(value: Any, whole: bool = False) -> bool:
    """Whether ``value`` is not a finite real number (a bool is not one: TOML's ``true`` would read as 1)."""
    kind = numbers.Integral if whole else numbers.Real
    return isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value)


def field_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the numeric field ``name`` (``"h2d_latency_s must be a finite number >= 0 s
    ..., got nan"``), or None where it is fine; every way a profile is built or changed goes through this."""
    rule = _RULES[name]
    if _bad_number(value, rule.whole) or not rule.ok(value):
        return f"{name} must be {rule.what}, got {_shown(value)}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """One accelerator and its link to remote memory, and the machine it sits in: how many such devices a node
    holds, how many nodes there are and the links between devices (the interconnect fields). The interconnect
    fields default to one device with no network, so a profile of a single device leaves them out."""

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
    measured_op_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Seconds per call measured on this machine for ops the roofline misjudges, keyed by op signature (target,
    input and output shapes: ``cost.op_signature``) or by op target (``"hyperoffload.nsa_select.default"``); the
    cost model charges such an op its measured time (``cost.with_measured_op_costs`` says how). Empty for a
    profile of nominal figures (every preset and profile file)."""
    devices_per_node: int = 1
    """Devices in one node: one machine with its own host memory (a DGX, a GH200 tray, a CloudMatrix node)."""
    nodes: int = 1
    """Nodes the profile describes (a cluster or scalable unit); ``devices_per_node * nodes`` devices in all."""
    intra_node_bw: float = 0.0
    """Bandwidth from one device to the others of its node, one direction (bytes/s; e.g. NVLink 4 through NVSwitch,
    450e9 on H100 SXM). 0: no such link, allowed only with one device per node."""
    intra_node_latency_s: float = 0.0
    """Fixed cost of one step of a collective between devices of one node (seconds)."""
    inter_node_bw: float = 0.0
    """Bandwidth from one device to devices of other nodes, one direction, per device (bytes/s; e.g. one 400 Gb/s
    NIC per GPU, 50e9). 0: no such link, allowed only with one node."""
    inter_node_latency_s: float = 0.0
    """Fixed cost of one step of a collective between devices of different nodes (seconds)."""
    host_memory_bytes: int = 0
    """Host memory of one node, shared by its devices (bytes). 0: not stated."""
    host_mem_bw: float = 0.0
    """Host memory bandwidth of one node, its CPUs' memory channels together (bytes/s; theoretical peak, e.g. two
    Xeon Platinum 8480C with eight DDR5-4800 channels each, 614.4e9). The ranks of a node that run their optimizer
    step on the host at once share it (``cost.host_op_time``). 0: not stated; a policy that computes on the host
    refuses such a profile."""
    host_link_shared_by: int = 1
    """Devices behind one host link (2 where two GPUs sit behind one PCIe switch; 1 on GH200, each with its own
    NVLink-C2C): ``h2d_bw`` and ``d2h_bw`` are one device's figures with its link to itself, and that many devices
    share them when all copy at once."""
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Where each field's number comes from, keyed by field name."""

    def __post_init__(self) -> None:
        # One rule per field, whoever built the profile (a TOML file, the API, a command-line override).
        for name in _RULES:
            value = getattr(self, name)
            problem = field_problem(name, value)
            if problem:
                raise HardwareError(f"{self.name}: {problem}")
            # Plain Python numbers from here on (a numpy integer would wrap around in the analyses' sums).
            object.__setattr__(self, name, int(value) if _RULES[name].whole else float(value))
        problem = _network_problem(self)
        if problem:
            raise HardwareError(f"{self.name}: {problem}")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise HardwareError(f"{self.name}: peak_flops needs a positive FLOP/s for at least one dtype, e.g. "
                                f"{{\"bfloat16\": 989e12}}")
        for dtype, rate in self.peak_flops.items():
            if not isinstance(dtype, str):
                raise HardwareError(f"{self.name}: peak_flops is keyed by dtype name (such as 'bfloat16'), got "
                                    f"{_shown(dtype)}")
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise HardwareError(f"{self.name}: peak_flops[{_SHOWN.repr(dtype)}] names no torch dtype (a typo would "
                                    f"leave the rate unused); write a name such as 'bfloat16', 'float16' or 'float32'")
            if _bad_number(rate) or not 0 < rate:
                raise HardwareError(f"{self.name}: peak_flops[{dtype!r}] must be a finite number > 0 FLOP/s, got "
                                    f"{_shown(rate)}")
        if not isinstance(self.measured_op_s, Mapping):
            raise HardwareError(f"{self.name}: measured_op_s must map op signatures or targets to seconds per call, "
                                f"got {_shown(self.measured_op_s)}")
        for op, seconds in self.measured_op_s.items():
            if not isinstance(op, str):
                raise HardwareError(f"{self.name}: measured_op_s is keyed by op signature or target (text), got "
                                    f"{_shown(op)}")
            if _bad_number(seconds) or seconds < 0:
                raise HardwareError(f"{self.name}: measured cost of {op} must be finite seconds >= 0, got {seconds!r}")
        # An immutable table of plain floats, whatever mapping the caller gave.
        object.__setattr__(self, "measured_op_s",
                           MappingProxyType({op: float(seconds) for op, seconds in self.measured_op_s.items()}))

    @property
    def device_count(self) -> int:
        """Devices the profile describes: ``devices_per_node * nodes`` (1 for a single device)."""
        return self.devices_per_node * self.nodes

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


def _network_problem(h: Hardware) -> str | None:
    """What is inconsistent between the interconnect fields (each already within its own rule), or None: more than
    one device per node needs a link between them, more than one node a link across nodes, and no more devices can
    share a host link than the node holds."""
    if h.devices_per_node > 1 and not h.intra_node_bw:
        return (f"devices_per_node = {h.devices_per_node} needs intra_node_bw, the bandwidth from one device to the "
                f"others of its node (bytes/s each way), e.g. intra_node_bw = \"450GB/s\"; or devices_per_node = 1")
    if h.nodes > 1 and not h.inter_node_bw:
        return (f"nodes = {h.nodes} needs inter_node_bw, the bandwidth from one device to other nodes (bytes/s each "
                f"way, per device), e.g. inter_node_bw = \"50GB/s\"; or nodes = 1")
    if h.host_link_shared_by > h.devices_per_node:
        return (f"host_link_shared_by = {h.host_link_shared_by} is more than the node's devices_per_node = "
                f"{h.devices_per_node}; give at most {h.devices_per_node}")
    return None


def _size_reader(key: str, example: str, *, zero_ok: bool = False) -> Callable[[Any], int]:
    """A reader for the size ``key``: a size with a unit, or a bare number (a TOML number or "80"), which is bytes;
    but "memory = 80" surely meant 80 GiB, not 80 bytes: a bare number under a mebibyte is refused rather than
    planned for a machine with no room. With ``zero_ok``, a bare 0 is allowed (a field where 0 says "not stated")."""
    def read(value: Any) -> int:
        if isinstance(value, str):
            bare = unitless(value)
        else:  # a TOML number (an int, or a float such as 8.6e10, inf or nan), never a bool or a table
            bare = bare_number(value, "a size", f'write it with a unit, e.g. {key} = "{example}"')
        if bare is None:
            return parse_bytes(value)
        if bare > MAX_MEMORY_BYTES:  # also int()'s limit: refuse it here, naming the key, not as an OverflowError
            raise ValueError(f"{bare:g} bytes is more than {MAX_MEMORY_BYTES} (4 EiB); write it with a unit, e.g. "
                             f'{key} = "{example}"')
        if bare == 0 and zero_ok:
            return 0
        if bare < 2**20:
            raise ValueError(f"a bare number is bytes, so {key} would be {bare:g} bytes; write the size with a "
                             f"unit, e.g. {key} = \"{bare:g}GiB\"")
        return int(bare)

    return read


_read_memory = _size_reader("memory", "80GiB")
"""``memory``: the device's memory."""
_read_host_memory = _size_reader("host_memory", "2TiB", zero_ok=True)
"""``host_memory``: one node's host memory; 0 says it is not stated."""


def _read_host_bandwidth(value: Any) -> float:
    """``host_mem_bw``: a bandwidth (``"614.4GB/s"``), or a bare 0, which says it is not stated."""
    if isinstance(value, str) and unitless(value) == 0 or not isinstance(value, (str, bool)) and value == 0:
        return 0.0
    return parse_bandwidth(value)


def _read_count(value: Any) -> int:
    """A count (``devices_per_node``, ``nodes``, ``host_link_shared_by``): a TOML integer, or text that is one
    ("8", as ``hyperoffload hardware NAME`` shows it); not a bool (``true`` would read as 1), nor 8.5."""
    if isinstance(value, str):
        number = unitless(value)
        if number is None or not number.is_integer():
            raise ValueError("a count is a whole number written without a unit, e.g. 8")
        return int(number)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a count is a whole number, e.g. 8; got {_shown(value)}")
    return value


def _read_share(value: Any) -> float:
    """A share (``duplex_share``, the efficiencies): a TOML number, or text that is one ("0.8", as ``hyperoffload
    hardware NAME`` shows it); not a bool (``true`` would read as 1), nor "nan" or "inf"."""
    number = unitless(value) if isinstance(value, str) else None
    if number is not None:
        return number
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a share is a number in (0, 1], e.g. 0.8; got {_shown(value)}")
    return float(value)


# How each TOML key is read: field name -> parser from a TOML value to the field's base unit.
_READERS = {
    "memory": ("memory_bytes", _read_memory),
    "hbm_bw": ("hbm_bw", parse_bandwidth),
    "h2d_bw": ("h2d_bw", parse_bandwidth),
    "d2h_bw": ("d2h_bw", parse_bandwidth),
    "h2d_latency": ("h2d_latency_s", parse_duration),
    "d2h_latency": ("d2h_latency_s", parse_duration),
    "duplex_share": ("duplex_share", _read_share),
    "launch": ("launch_s", parse_duration),
    "compute_efficiency": ("compute_efficiency", _read_share),
    "memory_efficiency": ("memory_efficiency", _read_share),
}
# Keys a profile may leave out (the field's default applies).
_OPTIONAL = {
    "issue": ("issue_s", parse_duration),
    # The interconnect: left out, a profile is one device with no network.
    "devices_per_node": ("devices_per_node", _read_count),
    "nodes": ("nodes", _read_count),
    "intra_node_bw": ("intra_node_bw", parse_bandwidth),
    "intra_node_latency": ("intra_node_latency_s", parse_duration),
    "inter_node_bw": ("inter_node_bw", parse_bandwidth),
    "inter_node_latency": ("inter_node_latency_s", parse_duration),
    "host_memory": ("host_memory_bytes", _read_host_memory),
    "host_mem_bw": ("host_mem_bw", _read_host_bandwidth),
    "host_link_shared_by": ("host_link_shared_by", _read_count),
}
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
    for key in ("name", "description"):
        if not isinstance(data.get(key, ""), str):
            raise HardwareError(f'{origin}: {key} must be text, e.g. {key} = "my-gpu", got {_shown(data[key])}')
    fields: dict[str, Any] = {"name": data["name"], "description": data.get("description", "")}
    for key, (name, read) in [*_READERS.items(), *_OPTIONAL.items()]:
        if key not in data:
            continue  # only optional keys can be missing here
        try:
            fields[name] = read(data[key])
        except (TypeError, ValueError) as error:
            raise HardwareError(f"{origin}: {key} = {_shown(data[key])}: {error}") from None
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
    except RecursionError:  # the parser recurses once per level of nested arrays or tables
        raise HardwareError(_too_deep(path)) from None
    try:
        return hardware_from_dict(data, origin=str(path))
    except RecursionError:  # nested just shallowly enough to parse
        raise HardwareError(_too_deep(path)) from None


def _too_deep(path: Path) -> str:
    return (f"{path} nests arrays or tables too deeply to be a hardware profile, which is key = value lines and two "
            f"flat tables (hyperoffload hardware NAME shows one)")
