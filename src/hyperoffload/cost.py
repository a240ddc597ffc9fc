"""Cost model: how long an op or a transfer takes on a hardware profile.

An op's time is a roofline: the larger of its FLOPs over the compute peak for its dtype and
its bytes over HBM bandwidth, each scaled by the profile's efficiency, plus the kernel launch
overhead. Ops that only make aliases (views) launch nothing and cost nothing. A collective of a sharded step
(``Op.collective``) runs on the network, beside the compute stream, as FSDP2 runs it on streams of its own: it
costs the compute stream nothing (``op_time`` 0) and takes its ring time on the interconnect
(``hyperoffload.collectives``) plus a kernel launch on the network lane (``side_op_time``). Per-op rules in
a registry override the default. A transfer takes a fixed latency plus bytes over the link
bandwidth; the simulator slows the data phase while both directions copy at once.

**Host ops.** An op on the host lane (``Op.lane`` ``"host"``: an optimizer step run on the CPU over host state, as
FSDP2's ``CPUOffloadPolicy`` and DeepSpeed's CPU Adam run it) takes the bytes it reads and writes over the host
memory bandwidth one rank gets, plus one eager op's dispatch on the CPU (``host_op_time``). FLOPs are ignored:
AdamW does a handful of FLOPs per 4-byte element it streams, far below what a server CPU computes per byte of
memory bandwidth, so it is memory-bound there. The bandwidth is the theoretical peak of the node's memory channels
(``Hardware.host_mem_bw``), shared by the node's ranks that step at the same time: the host ops come out faster
than a real CPU runs them, and a baseline that uses them is optimistic.

**Measured op costs.** A roofline describes an aten kernel; an operator implemented in Python (a
custom op running many aten calls and loops) costs far more than its FLOPs and bytes say. A profile
made by ``with_measured_op_costs`` charges such targets what they were measured to take on that
machine (``hyperoffload.runtime.measure.for_executor`` measures them on the CPU). The costs are part of
the profile (``Hardware.measured_op_s``), so every ``op_time``/``lane_op_time`` on that profile (or a
``replace`` of it) sees them, and no other profile does, whatever its name.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hyperoffload.collectives import collective_s
from hyperoffload.hardware import Hardware
from hyperoffload.ir import HOST_LANE, Op, Program
from hyperoffload.memo import per_program

CostRule = Callable[[Op, Program, Hardware], float]
_RULES: dict[str, CostRule] = {}


def register_cost_rule(*targets: str) -> Callable[[CostRule], CostRule]:
    """Register a rule (seconds) for the named aten overloads (``"aten.mm.default"``)."""

    def wrap(rule: CostRule) -> CostRule:
        for t in targets:
            _RULES[t] = rule
        return rule

    return wrap


def compute_dtype(op: Op, program: Program) -> str:
    """The dtype an op computes in: that of its largest input or output tensor."""
    tensors = [program.values[v] for v in (*op.inputs, *op.outputs)]
    if not tensors:
        return "float32"
    return max(tensors, key=lambda v: v.nbytes).dtype


def roofline_time(op: Op, program: Program, hardware: Hardware) -> float:
    """Default rule: max(compute time, memory time) + launch overhead, in seconds; 0 for views."""
    if op.is_view:
        return 0.0
    compute = op.flops / (hardware.flops_for(compute_dtype(op, program)) * hardware.compute_efficiency)
    memory = (op.bytes_read + op.bytes_written) / (hardware.hbm_bw * hardware.memory_efficiency)
    return max(compute, memory) + hardware.launch_s


MEASURED_SUFFIX = "+measured-ops-"
"""What ``with_measured_op_costs`` appends to a profile's name, before a digest of the costs it carries."""


def op_signature(op: Op, program: Program) -> str:
    """The op's target with the shapes and dtypes of its inputs and outputs, as ``with_measured_op_costs`` keys
    a cost measured for one op shape: ``"aten.mm.default(2x64:float32,64x64:float32)->(2x64:float32)"``. Ops
    of one signature do the same work (a layer's ops repeat in every layer, and in every form of a step)."""
    values = program.values

    def shapes(ids) -> str:
        return ",".join(f"{'x'.join(map(str, values[v].shape))}:{values[v].dtype}" for v in ids)

    return f"{op.target}({shapes(op.inputs)})->({shapes(op.outputs)})"


def with_measured_op_costs(hardware: Hardware, costs: Mapping[str, float]) -> Hardware:
    """``hardware`` under a new name on which each op whose signature (``op_signature``) or else whose target
    (``"hyperoffload.nsa_select.default"``) is in ``costs`` is charged its measured seconds per call:

    * an op on the compute stream takes exactly ``costs[target]`` seconds (``op_time``), in place of its rule
      or roofline: the measurement includes whatever launch overhead the caller means to charge;
    * a lane op takes ``max(latency + bytes / bandwidth, costs[target])`` on its lane (``lane_op_time``):
      the measurement is its kernel's time on the thread that runs it, and a lane cannot finish the op
      before either the link has moved its bytes or the kernel has run (the emulated link's rule). The
      event simulation (``simulate.simulate``) still times a lane op as a copy of its ``transfer_bytes``;
      ``lane_op_time`` is what the dependency bound (``Figures.dependency_bound_s``) charges.

    Other targets cost what they cost on ``hardware``. Costs already attached to ``hardware`` are kept unless
    ``costs`` measures the same target again. The new profile carries them (``Hardware.measured_op_s``; a
    value out of range raises ``HardwareError``, a ``ValueError``) and is named after ``hardware``'s unmeasured
    name and a digest of them, so that two measurements (two machines, two runs) are told apart in reports.
    With no ``costs``, ``hardware`` itself is returned."""
    if not costs:
        return hardware
    measured = {**hardware.measured_op_s, **costs}
    base = hardware.name.partition(MEASURED_SUFFIX)[0] if hardware.measured_op_s else hardware.name
    sources = dict(hardware.sources)
    targets = sorted(key for key in measured if "(" not in key)
    shapes = len(measured) - len(targets)
    sources["measured_op_costs"] = (f"{len(measured)} op target(s) or op signature(s) charged their measured time "
                                    f"on this machine: {shapes} signatures"
                                    + (f"; targets {', '.join(targets)}" if targets else ""))
    profile = dataclasses.replace(hardware, measured_op_s=measured, sources=MappingProxyType(sources))
    return dataclasses.replace(profile, name=f"{base}{MEASURED_SUFFIX}{_digest(profile.measured_op_s)}")


def _digest(costs: Mapping[str, float]) -> str:
    """Eight hex digits that tell one table of measured costs from another (the same in every process)."""
    text = "\n".join(f"{op}={seconds!r}" for op, seconds in sorted(costs.items()))
    return hashlib.blake2s(text.encode(), digest_size=4).hexdigest()


def measured_op_costs(hardware: Hardware) -> Mapping[str, float]:
    """Seconds per call that ``hardware`` charges by measurement, keyed by op signature or target
    (``Hardware.measured_op_s``; empty for a profile not made by ``with_measured_op_costs``)."""
    return hardware.measured_op_s


def op_time(op: Op, program: Program, hardware: Hardware) -> float:
    """Seconds ``op`` takes on the compute stream of ``hardware``: its measured time if the profile carries one
    for its target (``with_measured_op_costs``), else by its registered rule or the roofline; 0 for a lane op or a
    collective, which run beside the compute stream instead (``side_op_time``)."""
    if op.lane is not None or op.collective is not None:
        return 0.0
    measured = hardware.measured_op_s
    if measured:
        seconds = measured.get(op_signature(op, program), measured.get(op.target))
        if seconds is not None:
            return seconds
    return _RULES.get(op.target, roofline_time)(op, program, hardware)


def lane_op_time(op: Op, hardware: Hardware) -> float:
    """Seconds a lane op occupies its copy lane when it has the link to itself: latency + bytes / bandwidth,
    or its measured kernel time if the profile carries a longer one (``with_measured_op_costs``)."""
    if op.lane == "h2d":
        link = transfer_time(op.transfer_bytes, hardware.h2d_bw, hardware.h2d_latency_s)
    elif op.lane == "d2h":
        link = transfer_time(op.transfer_bytes, hardware.d2h_bw, hardware.d2h_latency_s)
    else:
        raise ValueError(f"op {op.name} is not a lane op")
    measured = hardware.measured_op_s.get(op.target)
    if measured is not None:
        return max(link, measured)
    return link


def collective_op_time(op: Op, hardware: Hardware) -> float:
    """Seconds a collective occupies the network lane: its ring time on the profile's interconnect
    (``collectives.collective_s``) plus one kernel launch."""
    c = op.collective
    if c is None:
        raise ValueError(f"op {op.name} is not a collective")
    return collective_s(c.kind, hardware, c.full_bytes, c.group_size) + hardware.launch_s


@per_program
def _collectives(program: Program) -> tuple[Op, ...]:
    """The program's collective ops, found once per program."""
    return tuple(op for op in program.ops if op.collective is not None)


def network_time(program: Program, hardware: Hardware) -> float:
    """Seconds the program's collectives occupy the network lane one after another (0 without collectives): no
    plan of it steps faster, since every plan runs every collective and the network runs one at a time."""
    return float(sum(collective_op_time(op, hardware) for op in _collectives(program)))


HOST_DISPATCH_S = 3e-6
"""Seconds of host CPU time each host op costs beside its memory traffic: the dispatch of one eager PyTorch op on
the CPU (a CPU AdamW with ``foreach`` off, the default for CPU tensors, dispatches a handful of ops per parameter).
PyTorch's operator micro-benchmarks time a split of an 8x8 CPU tensor, almost all dispatch, at 3.3-3.5 us
(pytorch/pytorch#32194, docs/references.md); 3 us."""


class HostBandwidthMissing(ValueError):
    """A host op was to be timed on a profile that states no host memory bandwidth (``Hardware.host_mem_bw`` 0)."""


def missing_host_bandwidth(hardware: Hardware,
                           what: str = "a host op runs on the host CPU, which") -> HostBandwidthMissing:
    """The error for timing host ops on ``hardware`` without a host memory bandwidth (``what`` begins the message and
    ends on "which"): names the field and how to give it."""
    return HostBandwidthMissing(
        f"{what} the profile {hardware.name!r} gives no memory bandwidth for "
        f"(host_mem_bw = 0, not stated): give one with hardware.replace(host_mem_bw=...) (bytes/s, the node's memory "
        f"channels together, e.g. 614.4e9 for two Xeon Platinum 8480C), or host_mem_bw = \"614.4GB/s\" in a "
        f"profile file")


def host_ranks(program: Program, hardware: Hardware) -> int:
    """Ranks of ``program``'s world (``meta["world"]``, 1 unsharded) on one node of ``hardware``: those that run
    their optimizer step on the host at the same time and share the node's host memory bandwidth,
    ``min(world, devices_per_node)`` (as ``host_memory.ranks_per_node`` shares its capacity)."""
    return max(1, min(int(program.meta.get("world", 1)), hardware.devices_per_node))


def host_op_time(op: Op, hardware: Hardware, ranks: int = 1) -> float:
    """Seconds a host op (``Op.lane`` ``"host"``) occupies the host lane: the bytes it reads and writes over the
    bandwidth one of ``ranks`` ranks gets of the node's host memory (``host_mem_bw / ranks``), plus
    ``HOST_DISPATCH_S``; FLOPs ignored (module docstring). Raises ``HostBandwidthMissing`` on a profile with no
    ``host_mem_bw``."""
    if op.lane != HOST_LANE:
        raise ValueError(f"op {op.name} is not a host op")
    if not hardware.host_mem_bw:
        raise missing_host_bandwidth(hardware, f"host op {op.name} ({op.target}) runs on the host CPU, which")
    return (op.bytes_read + op.bytes_written) * ranks / hardware.host_mem_bw + HOST_DISPATCH_S


@per_program
def _host_ops(program: Program) -> tuple[Op, ...]:
    """The program's host ops, found once per program."""
    return tuple(op for op in program.ops if op.lane == HOST_LANE)


def host_time(program: Program, hardware: Hardware) -> float:
    """Seconds the program's host ops occupy the host lane one after another (0 without host ops): no plan of it
    steps faster, since the host lane runs one at a time."""
    ops = _host_ops(program)
    if not ops:
        return 0.0
    ranks = host_ranks(program, hardware)
    return float(sum(host_op_time(op, hardware, ranks) for op in ops))


def side_op_time(op: Op, hardware: Hardware, host_ranks: int = 1) -> float:
    """Seconds an op that runs beside the compute stream occupies its own stream alone: a lane op its copy lane
    (``lane_op_time``), a host op the host lane (``host_op_time``, ``host_ranks`` sharing the node's host memory),
    a collective the network (``collective_op_time``)."""
    if op.collective is not None:
        return collective_op_time(op, hardware)
    return host_op_time(op, hardware, host_ranks) if op.lane == HOST_LANE else lane_op_time(op, hardware)


def op_times(program: Program, hardware: Hardware) -> tuple[float, ...]:
    """Seconds of every op of ``program``, indexed by op id; computed once per program and profile object
    (a planner simulates many plans of one program on one profile); only the latest profile's are kept."""
    latest = _latest_op_times(program)
    if latest.hardware is not hardware:
        latest.times = tuple(op_time(op, program, hardware) for op in program.ops)
        latest.hardware = hardware
    return latest.times


@dataclass(slots=True)
class _OpTimes:
    """The op times (seconds, by op id) of one program on the profile object they were last computed on. Keyed
    by the profile's identity, not its name: ``Hardware.replace`` keeps the name and may change what ops cost.
    Mutable on purpose: another profile's times replace them."""

    hardware: Hardware | None = None
    times: tuple[float, ...] = ()


@per_program
def _latest_op_times(program: Program) -> _OpTimes:
    return _OpTimes()


def transfer_time(nbytes: int, bandwidth: float, latency_s: float) -> float:
    """Seconds to copy ``nbytes`` over a link alone: latency + bytes / bandwidth."""
    return latency_s + nbytes / bandwidth
