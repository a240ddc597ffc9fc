"""Lifetime analysis: when each value and each storage is live, and the memory it takes.

Positions are indices into an execution order: position ``i`` is "while the
``i``-th op of the order runs". A value is live from the position of its
producer (0 for step inputs) to one past its last reader (end exclusive); step
inputs, constants and outputs stay live to the end of the step, because the caller holds
them. A storage is live while any value aliasing it is live. During an op its
inputs and its outputs are live together, which is what an executor that frees
each tensor right after its last use holds at that moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hyperoffload.ir import Program
from hyperoffload.memo import per_program


@dataclass(frozen=True, slots=True)
class LiveRange:
    """Positions ``[start, end)`` of an execution order (end exclusive)."""

    start: int
    end: int

    def __contains__(self, position: int) -> bool:
        return self.start <= position < self.end


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryProfile:
    """Device bytes live at each position of an execution order."""

    order: tuple[int, ...]
    """Op ids in execution order."""
    live_bytes: tuple[int, ...]
    """Bytes of storage live while the op at each position runs."""
    peak_bytes: int
    """Largest entry of ``live_bytes`` (the inputs' bytes for a program with no ops)."""
    peak_position: int
    """First position where the peak is reached (-1 for a program with no ops)."""
    peak_storages: tuple[int, ...]
    """Ids of the storage-owning values live at the peak, largest first."""
    storage_ranges: dict[int, LiveRange]
    """Live range of each storage, keyed by the owning value's id."""


def _order(program: Program, order: Sequence[int] | None) -> tuple[int, ...]:
    if order is None:
        return tuple(range(len(program.ops)))
    order = tuple(order)
    program.check_order(order)
    return order


def live_ranges(program: Program, order: Sequence[int] | None = None) -> dict[int, LiveRange]:
    """Live range of every value (keyed by value id) under ``order`` (default: captured order)."""
    order = _order(program, order)
    n = len(order)
    start = [0] * len(program.values)
    end = [0] * len(program.values)
    for position, op_id in enumerate(order):
        op = program.ops[op_id]
        for v in op.outputs:
            start[v] = position
            end[v] = max(end[v], position + 1)
        for v in op.inputs:
            end[v] = max(end[v], position + 1)
    held = (*program.inputs, *program.constants)
    for v in (*held, *program.outputs):
        end[v] = n
    for v in held:
        start[v] = 0
    return {v.id: LiveRange(start[v.id], max(end[v.id], start[v.id])) for v in program.values}


def storage_ranges(program: Program, order: Sequence[int] | None = None) -> dict[int, LiveRange]:
    """Live range of every storage (keyed by owner id): the union of its aliases' ranges."""
    ranges = live_ranges(program, order)
    merged: dict[int, LiveRange] = {}
    for value in program.values:
        r = ranges[value.id]
        if r.start == r.end and not value.owns_storage:
            continue
        old = merged.get(value.storage)
        merged[value.storage] = r if old is None else LiveRange(min(old.start, r.start), max(old.end, r.end))
    return merged


def memory_profile(program: Program, order: Sequence[int] | None = None) -> MemoryProfile:
    """Bytes live at every position of ``order``, the peak and the storages that make it up.

    The captured order's profile is computed once per program and shared: every simulation measures
    its plan's excess against it, and a planner simulates many plans of one program."""
    if order is None:
        cached = _captured_profile(program)
        # Every other field is immutable; the caller gets a dict of its own (a copy costs little next to the
        # analysis), so nothing it does reaches the next caller's profile.
        return replace(cached, storage_ranges=dict(cached.storage_ranges))
    return _memory_profile(program, order)


@per_program
def _captured_profile(program: Program) -> MemoryProfile:
    return _memory_profile(program, None)


def _memory_profile(program: Program, order: Sequence[int] | None) -> MemoryProfile:
    order = _order(program, order)
    n = len(order)
    ranges = storage_ranges(program, order)
    delta = [0] * (n + 1)
    for owner, r in ranges.items():
        size = program.values[owner].alloc_bytes
        delta[r.start] += size
        delta[r.end] -= size
    live, running = [], 0
    for position in range(n):
        running += delta[position]
        live.append(running)
    if n:
        peak = max(live)
        peak_position = live.index(peak)
    else:
        peak = sum(program.values[v].alloc_bytes for v in (*program.inputs, *program.constants))
        peak_position = -1
    at_peak = [s for s, r in ranges.items() if peak_position in r] if n else []
    at_peak.sort(key=lambda s: (-program.values[s].alloc_bytes, s))
    return MemoryProfile(order=order, live_bytes=tuple(live), peak_bytes=peak, peak_position=peak_position,
                         peak_storages=tuple(at_peak), storage_ranges=ranges)
