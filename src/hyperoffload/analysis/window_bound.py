"""A lower bound on the step time of any plan that runs a step's ops in a given order under a budget.

``bound_s`` (docs/figures.md) lets the excess cross the link at any time. It cannot: at the op where
the unplanned step peaks, at least ``excess`` bytes of the storages live there must be off the device
(in the simulator, their memory is returned only once their offload has landed), and each of them:

* was offloaded after its last write before the peak (a storage never written in the step needs no
  offload: its remote copy stays current), in this step or, for state kept remote between steps,
  the previous one: the *D2H window* runs from the earliest such write to the peak;
* comes back after the peak and before its next use (in this step, or the next one for state used
  only before the peak): the *H2D window* runs from the peak to the latest such use.

The windows are fixed stretches of the op order. Their compute time is known; any time the copies
need beyond it is a stall that lengthens the step. Where the windows of consecutive steps overlap,
both directions copy at once and share the link (``duplex_share``). The bound is the compute time
plus the least stall that lets ``excess`` bytes (less those the step never writes) leave within the
D2H window and ``excess`` bytes (less the step's outputs, which may stay remote, and storages
nothing reads again) return within the H2D window; it takes the widest windows any storage live at
the peak has, so it holds for every plan in that order, whatever it moves. It is exact about the
structure it sees and says nothing of budgets below the peak elsewhere (a plan must also meet
those), so real plans sit above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyperoffload.analysis.uses import storage_uses
from hyperoffload.cost import op_times
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import check_plan, plan_without_offload, state_storages


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowBound:
    """The bound and what sets it (seconds, bytes, op positions in the order)."""

    seconds: float
    """No plan in this order under this budget steps faster (simulator semantics)."""
    compute_s: float
    peak_position: int
    """Position (in the order) of the op where the unplanned step peaks."""
    excess_bytes: int
    d2h_window_s: float
    """Compute time of the D2H window (from the earliest last write before the peak to the peak)."""
    h2d_window_s: float
    """Compute time of the H2D window (from the peak to the latest next use)."""
    overlap_s: float
    """Compute time in which the two windows of consecutive steps overlap (both directions copy)."""
    free_budget_bytes: int
    """The smallest budget at which this bound still equals ``compute_s`` (``free_offload_budget``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Windows:
    """What the bound needs that does not depend on the budget (seconds, bytes)."""

    compute: float
    peak_position: int
    live_at_peak: int
    movable: int
    """Bytes of the storages live at the peak that the peak op does not use (what can be away)."""
    read_only: int
    returned: int
    d_window: float
    h_window: float
    overlap: float
    meet: bool


def _windows(program: Program, hardware: Hardware, order: list[int]) -> _Windows | None:
    """The windows at the unplanned peak of ``order``, or None for a step with no ops."""
    times = np.asarray(op_times(program, hardware), dtype=np.float64)[order]
    compute = float(times.sum())
    checked = check_plan(plan_without_offload(program, order))
    live = np.asarray(checked.live_bytes, dtype=np.int64)
    if live.size == 0:
        return None
    p = int(live.argmax())
    n = len(order)
    values = program.values
    found = storage_uses(program, order)
    uses, writes = found.positions, found.writes
    held_at_start = state_storages(program)
    outputs = {values[v].storage for v in program.outputs}
    working = {values[v].storage for v in (*program.ops[order[p]].inputs, *program.ops[order[p]].outputs)}
    candidates = [s for s in _live_at(program, checked, order, p, held_at_start) if s not in working]
    read_only = sum(values[s].alloc_bytes for s in candidates if s not in writes)
    # Outputs may stay in remote memory at the end of the step, and a storage nothing reads again
    # need not come back at all.
    returned = sum(values[s].alloc_bytes for s in candidates if s in outputs or not uses.get(s))
    d_start, h_end = p, p  # positions; d_start may be negative (previous step), h_end past n (next step)
    for s in candidates:
        w = writes.get(s)
        if w:
            before = [x for x in w if x < p]
            d_start = min(d_start, before[-1] if before else w[-1] - n)
        after = [x for x in uses.get(s, []) if x > p]
        if after:
            h_end = max(h_end, after[0])
        elif uses.get(s):
            h_end = max(h_end, uses[s][0] + n)
    cumulative = np.concatenate(([0.0], np.cumsum(times)))  # time at the start of each position

    def at(position: int) -> float:  # wrapped positions map onto neighbouring steps
        k, r = divmod(position, n)
        return k * compute + cumulative[r]

    # The offload starts after the writing op has finished; the prefetch is allocated after the peak op and
    # lands before the use. Where nothing at the peak was written (or is read again), the window is empty,
    # not negative: those bytes need no copy that way at all.
    d_window = max(0.0, at(p) - at(d_start + 1))
    h_window = max(0.0, at(h_end) - at(p + 1))
    # The next step's D2H window begins where this step's H2D window may still be open: if they meet,
    # a stall there lengthens both, and the two directions can copy at once (sharing the link).
    # Otherwise every second a copy needs beyond its own window is a stall of its own.
    overlap = d_window + h_window - (compute - float(times[p]))
    return _Windows(compute=compute, peak_position=p, live_at_peak=int(live[p]),
                    movable=sum(values[s].alloc_bytes for s in candidates), read_only=read_only, returned=returned,
                    d_window=d_window, h_window=h_window, overlap=max(0.0, overlap), meet=overlap >= 0.0)


def _extra(w: _Windows, hardware: Hardware, excess: int) -> float:
    """Stall (seconds) the copies of ``excess`` bytes need beyond the compute in their windows."""
    d_need = max(0.0, (excess - w.read_only) / hardware.d2h_bw - (w.d_window - w.overlap))
    h_need = max(0.0, (excess - w.returned) / hardware.h2d_bw - (w.h_window - w.overlap))
    share = hardware.duplex_share
    if not w.meet:
        return d_need + h_need
    together = min(d_need, h_need) / share + abs(d_need - h_need) if share > 0.5 else d_need + h_need
    return max(0.0, together - w.overlap)


def window_bound(program: Program, hardware: Hardware, budget_bytes: int,
                 order: Sequence[int] | None = None) -> WindowBound:
    """The window bound of ``program`` run in ``order`` (default: as captured) under ``budget_bytes``."""
    order = list(range(len(program.ops))) if order is None else list(order)
    w = _windows(program, hardware, order)
    if w is None:
        return WindowBound(seconds=0.0, compute_s=0.0, peak_position=-1, excess_bytes=0, d2h_window_s=0.0,
                           h2d_window_s=0.0, overlap_s=0.0, free_budget_bytes=0)
    free = _free_budget(w, hardware)
    if w.live_at_peak <= budget_bytes:
        return WindowBound(seconds=w.compute, compute_s=w.compute, peak_position=-1, excess_bytes=0,
                           d2h_window_s=0.0, h2d_window_s=0.0, overlap_s=0.0, free_budget_bytes=free)
    excess = w.live_at_peak - budget_bytes
    return WindowBound(seconds=w.compute + _extra(w, hardware, excess), compute_s=w.compute,
                       peak_position=w.peak_position, excess_bytes=excess, d2h_window_s=w.d_window,
                       h2d_window_s=w.h_window, overlap_s=w.overlap, free_budget_bytes=free)


def free_offload_budget(program: Program, hardware: Hardware, order: Sequence[int] | None = None) -> int:
    """The smallest budget (bytes) at which the window bound of ``order`` still equals the compute time:
    below it no plan in that order can offload for free; at or above it, one might. (The window-bound
    counterpart of the *hideable budget* of docs/figures.md, which lets copies run at any time.)"""
    order = list(range(len(program.ops))) if order is None else list(order)
    w = _windows(program, hardware, order)
    return 0 if w is None else _free_budget(w, hardware)


def _free_budget(w: _Windows, hardware: Hardware) -> int:
    """The largest excess whose copies need no stall, as a budget (bisection: the stall grows with it)."""
    lo, hi = 0, w.movable  # excess bytes: lo is free, and more than `movable` cannot be away at the peak
    if _extra(w, hardware, hi) == 0.0:
        return w.live_at_peak - hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _extra(w, hardware, mid) == 0.0:
            lo = mid
        else:
            hi = mid
    return w.live_at_peak - lo


def _live_at(program: Program, checked, order: list[int], p: int, held_at_start: set[int]) -> list[int]:
    """Storages allocated on the device while the op at position ``p`` runs, in the unplanned order."""
    values = program.values
    live = set(held_at_start)
    for position in range(p + 1):
        op = program.ops[order[position]]
        live.update(o for o in op.outputs if values[o].owns_storage)
        if position < p:
            live.difference_update(checked.frees_after[position])
    return sorted(s for s in live if values[s].alloc_bytes > 0)


__all__ = ["WindowBound", "free_offload_budget", "window_bound"]
