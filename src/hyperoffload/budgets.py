"""Budgets as users write them: bytes with units, a percentage of the no-offload peak, or "hideable"."""

from __future__ import annotations

import numpy as np

from hyperoffload.analysis import memory_profile
from hyperoffload.cost import op_times
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.hardware.profile import MAX_MEMORY_BYTES
from hyperoffload.ir import Program
from hyperoffload.units import format_bytes, parse_bytes, unitless


def hideable_budget(program: Program, hardware: Hardware | str) -> int:
    """The smallest budget whose ``bound_s`` equals ``compute_s`` (bytes): below it, moving the excess
    once each way at full link speed takes longer than the step's compute. When the link is so fast
    that this would be below the smallest budget the planner can meet, that budget instead (``hideable_note``
    says when)."""
    return _hideable(program, as_hardware(hardware))[0]


def hideable_note(program: Program, hardware: Hardware | str) -> str | None:
    """Why ``hideable_budget`` is the smallest feasible budget rather than the one ``bound_s`` defines, or
    None where it is the latter: a user who asked for "hideable" should know the link is not what sets it."""
    budget, clamped = _hideable(program, as_hardware(hardware))
    if not clamped:
        return None
    return (f"the link is fast enough to hide moving the excess of any feasible budget within the step's compute, "
            f"so 'hideable' is the smallest budget this planner can meet, {format_bytes(budget)}")


def _hideable(program: Program, hardware: Hardware) -> tuple[int, bool]:
    """(the hideable budget, whether the smallest feasible budget set it), bytes."""
    from hyperoffload.policies import minimum_budget

    peak = memory_profile(program).peak_bytes
    compute_s = sum(op_times(program, hardware))
    movable = int(compute_s * min(hardware.h2d_bw, hardware.d2h_bw))
    least = minimum_budget(program)[0]
    return max(peak - movable, least), peak - movable < least


def parse_budget(text: str | int, program: Program, hardware: Hardware | str) -> int:
    """``"40GiB"``, ``"60GB"``, ``"50%"`` (of the no-offload peak) or ``"hideable"`` -> bytes; a bare int is bytes
    already. A budget is at least one byte and at most ``MAX_MEMORY_BYTES`` (4 EiB): anything more would overflow
    the 64-bit integers the planners count bytes in, and no device comes near it."""
    if isinstance(text, int) and not isinstance(text, bool):
        return check_budget_bytes(text)
    if not isinstance(text, str):
        raise ValueError(f"a budget is text such as 40GiB, 60GB, 50% or hideable, or an int of bytes; got "
                         f"{type(text).__name__}")
    return check_budget_bytes(_parse(text.strip(), program, hardware), text.strip())


def check_budget_bytes(budget: int, text: str | None = None, *, least: int = 1) -> int:
    """``budget`` (bytes: an int, numpy's included) if it is ``least`` to ``MAX_MEMORY_BYTES``, else a ``ValueError``
    naming it as written (``text``, default the number). A planner takes ``least=0``: a budget it cannot meet is
    its own refusal, which names the smallest it can."""
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"a budget in bytes must be an int, got {type(budget).__name__} {budget!r}")
    budget = int(budget)
    text = str(budget) if text is None else text
    if budget < least:
        least_text = "one byte" if least == 1 else f"{least} bytes"
        raise ValueError(f"a budget of {text} is {budget} bytes; a budget must be at least {least_text}")
    if budget > MAX_MEMORY_BYTES:
        raise ValueError(f"a budget of {text} is more than {format_bytes(MAX_MEMORY_BYTES)} (2**62 bytes), more than "
                         f"any device has; give a size such as 40GiB or a share of the no-offload peak such as 50%")
    return budget


def _percentage(text: str) -> float:
    """The share of the no-offload peak a budget such as ``"50%"`` asks for, in percent (0, 100]."""
    try:
        share = float(text[:-1])
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a budget; write 40GiB, 60GB, 50% or hideable") from None
    if not 0 < share <= 100:
        raise ValueError(f"a budget percentage must be in (0, 100], got {text}")
    return share


def _parse(text: str, program: Program, hardware: Hardware | str) -> int:
    if text.lower() == "hideable":
        return hideable_budget(program, hardware)
    if text.endswith("%"):
        return int(memory_profile(program).peak_bytes * _percentage(text) / 100)
    bare = unitless(text)
    if bare is not None and 0 < bare <= 100:
        # A bare number is bytes, and no step fits in 100 bytes: a share of the peak was almost surely meant.
        raise ValueError(f"a budget of {text} reads as {text} bytes; for a share of the no-offload peak write {text}%, "
                         f"for a size add a unit (40GiB, 60GB)")
    try:
        return parse_bytes(text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a budget; write 40GiB, 60GB, 50% (of the no-offload peak) "
                         f"or hideable") from None


def check_budget_text(budget: int | str) -> None:
    """Raise ``ValueError`` unless ``budget`` reads as a budget: bytes, ``"40GiB"``, ``"50%"`` or ``"hideable"``
    (``TypeError`` if it is neither an int nor text).

    The bytes a percentage stands for are known only once the step is captured; this catches typos before
    (when a backend or a training step is made, when the command line is parsed).
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise TypeError(f"budget must be bytes (an int) or text such as '40GiB', '50%' or 'hideable', "
                         f"got {type(budget).__name__}")
    if isinstance(budget, int):
        check_budget_bytes(budget)
        return
    text = budget.strip()
    if text.lower() == "hideable":
        return
    if text.endswith("%"):
        _percentage(text)
        return
    try:
        parse_bytes(text)
    except ValueError:
        raise ValueError(f"cannot read {budget!r} as a budget; write 40GiB, 60GB, 50% (of the step's no-offload "
                         f"peak) or hideable") from None
