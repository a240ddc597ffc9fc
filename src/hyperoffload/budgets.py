"""Budgets as users write them: bytes with units, a percentage of the no-offload peak, or "hideable"."""

from __future__ import annotations

from hyperoffload.analysis import memory_profile
from hyperoffload.cost import op_times
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.ir import Program
from hyperoffload.units import parse_bytes


def hideable_budget(program: Program, hardware: Hardware | str) -> int:
    """The smallest budget whose ``bound_s`` equals ``compute_s`` (bytes): below it, moving the excess
    once each way at full link speed takes longer than the step's compute. When the link is so fast
    that this would be below the smallest budget the planner can meet, that budget instead."""
    from hyperoffload.policies import minimum_budget

    hardware = as_hardware(hardware)
    peak = memory_profile(program).peak_bytes
    compute_s = sum(op_times(program, hardware))
    movable = int(compute_s * min(hardware.h2d_bw, hardware.d2h_bw))
    return max(peak - movable, minimum_budget(program)[0])


def parse_budget(text: str, program: Program, hardware: Hardware | str) -> int:
    """``"40GiB"``, ``"60GB"``, ``"50%"`` (of the no-offload peak) or ``"hideable"`` -> bytes."""
    text = text.strip()
    if text.lower() == "hideable":
        return hideable_budget(program, hardware)
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise ValueError(f"cannot read {text!r} as a budget; write 40GiB, 60GB, 50% or hideable") from None
        if not 0 < share <= 100:
            raise ValueError(f"a budget percentage must be in (0, 100], got {text}")
        return int(memory_profile(program).peak_bytes * share / 100)
    try:
        return parse_bytes(text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a budget; write 40GiB, 60GB, 50% (of the no-offload peak) "
                         f"or hideable") from None
