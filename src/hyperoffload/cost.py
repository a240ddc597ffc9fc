"""Cost model: how long an op or a transfer takes on a hardware profile.

An op's time is a roofline: the larger of its FLOPs over the compute peak for its dtype and
its bytes over HBM bandwidth, each scaled by the profile's efficiency, plus the kernel launch
overhead. Ops that only make aliases (views) launch nothing and cost nothing. Per-op rules in
a registry override the default. A transfer takes a fixed latency plus bytes over the link
bandwidth; the simulator slows the data phase while both directions copy at once.
"""

from __future__ import annotations

from collections.abc import Callable

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Op, Program

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


def op_time(op: Op, program: Program, hardware: Hardware) -> float:
    """Seconds ``op`` takes on the compute stream of ``hardware``, by its registered rule or the
    roofline; 0 for a lane op, which runs on a copy lane instead (``lane_op_time``)."""
    if op.lane is not None:
        return 0.0
    return _RULES.get(op.target, roofline_time)(op, program, hardware)


def lane_op_time(op: Op, hardware: Hardware) -> float:
    """Seconds a lane op occupies its copy lane when it has the link to itself: latency + bytes / bandwidth."""
    if op.lane == "h2d":
        return transfer_time(op.transfer_bytes, hardware.h2d_bw, hardware.h2d_latency_s)
    if op.lane == "d2h":
        return transfer_time(op.transfer_bytes, hardware.d2h_bw, hardware.d2h_latency_s)
    raise ValueError(f"op {op.name} is not a lane op")


def op_times(program: Program, hardware: Hardware) -> tuple[float, ...]:
    """Seconds of every op of ``program``, indexed by op id."""
    return tuple(op_time(op, program, hardware) for op in program.ops)


def transfer_time(nbytes: int, bandwidth: float, latency_s: float) -> float:
    """Seconds to copy ``nbytes`` over a link alone: latency + bytes / bandwidth."""
    return latency_s + nbytes / bandwidth
