"""Segments: the stretches of an execution order where a storage may be off the device, with what moving it
there costs (an offload after its last write, a prefetch before its next use), and the per-position profile
of the unplanned step in that order. The flow bound (``analysis.flow_bound``) and the traffic bound
(``analysis.traffic_bound``) are LPs over them."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyperoffload.analysis.uses import Uses, storage_uses
from hyperoffload.cost import op_times
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import check_plan, held_storages, plan_without_offload, state_storages


@dataclass(frozen=True, slots=True)
class OrderProfile:
    """The unplanned step in an execution order, per position."""

    order: list[int]
    times: np.ndarray
    """Seconds each op takes on the profile."""
    computing: np.ndarray
    """Whether the op runs on the compute stream: not a lane op, nor a collective (which runs on the network lane,
    where its start may lag the compute ops after it in the order)."""
    live: np.ndarray
    """Device bytes live at each position with no offload (``check_plan``'s accounting)."""


def order_profile(program: Program, hardware: Hardware, order: Sequence[int] | None = None) -> OrderProfile:
    """``OrderProfile`` of ``program`` run in ``order`` (default: as captured)."""
    order = list(range(len(program.ops))) if order is None else list(order)
    times = np.asarray(op_times(program, hardware), dtype=np.float64)[order] if order else np.zeros(0)
    computing = np.array([program.ops[o].stream == "compute" for o in order], dtype=bool)
    live = np.asarray(check_plan(plan_without_offload(program, order)).live_bytes, dtype=np.int64)
    return OrderProfile(order, times, computing, live)


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of positions ``(lo, hi)`` (open) where a storage of ``nbytes`` may be off the device."""

    storage: int
    lo: int
    hi: int
    nbytes: int
    epoch: int | None
    """Position of the last write before the segment (the D2H starts after it), or None: no write of the
    storage before the segment in this step."""
    returns: bool
    """Whether the storage must come back before position ``hi`` (a use in this step)."""


def segments(program: Program, order: list[int], uses: Uses | None = None) -> list[Segment]:
    """Every segment of every storage that takes device memory in ``order``: between two uses at least one
    position apart, before the first use of a storage the step starts with (an input or constant), after the
    last use of one the caller holds, and the whole step for a held storage no op touches. ``uses``: the
    order's ``storage_uses``, if already at hand."""
    values = program.values
    n = len(order)
    found = storage_uses(program, order) if uses is None else uses
    held = held_storages(program)
    at_start = state_storages(program)
    found_segments = []
    for s in sorted(held | set(found.positions)):
        size = values[s].alloc_bytes
        if size <= 0 or values[s].remote:
            continue
        positions = found.positions.get(s, [])
        writes = found.writes.get(s, [])
        if not positions:  # held but untouched: may be away the whole step for nothing
            found_segments.append(Segment(s, -1, n, size, None, False))
            continue
        if s in at_start:
            found_segments.append(Segment(s, -1, positions[0], size, None, True))
        for previous, following in itertools.pairwise(positions):
            if following - previous >= 2:
                found_segments.append(Segment(s, previous, following, size, last_write(writes, previous), True))
        if s in held:
            found_segments.append(Segment(s, positions[-1], n, size, last_write(writes, positions[-1]), False))
    return found_segments


def last_write(writes: list[int], position: int) -> int | None:
    """The last of ``writes`` (ascending positions) at or before ``position``, or None."""
    i = bisect.bisect_right(writes, position)
    return writes[i - 1] if i else None


__all__ = ["OrderProfile", "Segment", "last_write", "order_profile", "segments"]
