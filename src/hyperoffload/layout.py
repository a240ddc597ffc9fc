"""Static memory layout: every device-resident storage of a plan gets a fixed offset in one arena.

A plan allocates and frees device memory in instruction order (``check_plan``'s accounting): a
compute allocates the storages its outputs own, a prefetch allocates the storage it brings back,
a release and the automatic free after a storage's last use give memory back. Each stretch between
an allocation and its free is a *residency*; a storage that leaves and returns has several, and
each may sit at a different offset.

``assign_offsets`` places every residency so that two residencies that are live at the same
instruction never share a byte, in an arena as close to the plan's live-byte peak as a greedy
packing gets (TFLite's "greedy by size" arena planner: largest residency first, each at the lowest
offset that fits among the already placed residencies it overlaps in time). With every address
known before the step runs, no allocation can fail, wait for a cache flush, or fragment the
device: the arena is the only reservation, and ``check_layout`` proves the packing by replaying
the plan's allocations against it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np

from hyperoffload.plans import Kind, Plan, PlanCheck, check_plan

ALIGNMENT = 256
"""Bytes every slot's offset is a multiple of: what ``cudaMalloc`` guarantees, so kernels that need
aligned (vectorised) access see the same alignment in the arena as from the allocator."""


@dataclass(frozen=True, slots=True)
class Residency:
    """Storage ``storage`` occupies ``nbytes`` of device memory from instruction ``start`` (allocated
    as it begins; -1: before the step) up to instruction ``end`` (exclusive: the bytes are free for
    allocations made by instruction ``end`` and later; ``len(plan.instructions)``: held past the step)."""

    storage: int
    start: int
    end: int
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Offsets (bytes from the arena's base) of a plan's residencies, in ``residencies`` order."""

    residencies: tuple[Residency, ...]
    offsets: tuple[int, ...]
    arena_bytes: int
    """Bytes the arena reserves: the end of the highest placed residency."""
    live_peak_bytes: int
    """The plan's peak of live bytes (the smallest arena any layout could have)."""

    @property
    def overhead_bytes(self) -> int:
        """Arena bytes beyond the live-byte peak: what the layout loses to fragmentation."""
        return self.arena_bytes - self.live_peak_bytes


def residencies(plan: Plan, checked: PlanCheck | None = None) -> list[Residency]:
    """Every device residency of ``plan``'s storages, in the order they are allocated (``checked``:
    ``check_plan(plan)`` if the caller has it already)."""
    program, instrs = plan.program, plan.instructions
    values = program.values
    checked = check_plan(plan) if checked is None else checked
    n = len(instrs)
    open_at: dict[int, int] = {}
    result: list[Residency] = []

    def close(s: int, end: int) -> None:
        start = open_at.pop(s)
        if values[s].alloc_bytes > 0:
            result.append(Residency(s, start, end, values[s].alloc_bytes))

    for s in sorted({values[v].storage for v in (*program.inputs, *program.constants)} - plan.initial_remote):
        open_at[s] = -1
    for i, ins in enumerate(instrs):
        if ins.kind is Kind.COMPUTE:
            for o in program.ops[ins.target].outputs:
                if values[o].owns_storage:
                    open_at[o] = i
        elif ins.kind is Kind.PREFETCH:
            open_at[ins.target] = i
        elif ins.kind is Kind.RELEASE:
            close(ins.target, i + 1)  # a release allocates nothing: the bytes serve instruction i + 1 on
        for s in checked.frees_after[i]:
            close(s, i + 1)
    for s in list(open_at):
        close(s, n)
    result.sort(key=lambda r: (r.start, r.storage))
    return result


def assign_offsets(plan: Plan) -> Layout:
    """A static layout of ``plan``'s device memory (greedy by size; see the module docstring)."""
    found = residencies(plan)
    live_peak = _live_peak(found)
    if not found:
        return Layout(residencies=(), offsets=(), arena_bytes=0, live_peak_bytes=0)
    start = np.fromiter((r.start for r in found), np.int64, len(found))
    end = np.fromiter((r.end for r in found), np.int64, len(found))
    # Slots are whole multiples of ALIGNMENT, so every offset is aligned as a device allocation would be.
    size = np.fromiter((-(-r.nbytes // ALIGNMENT) * ALIGNMENT for r in found), np.int64, len(found))
    # Largest first, longest-lived first among equals: big, long residencies fix the arena's shape and
    # small ones fill the gaps they leave. (Ordering by bytes x lifetime, by lifetime, or by start, and
    # best-fit gaps instead of the lowest, all packed llama3-8b training plans worse.)
    offsets = _pack(np.lexsort((start - end, -size)), start, end, size)
    return Layout(residencies=tuple(found), offsets=tuple(int(o) for o in offsets),
                  arena_bytes=int((offsets + size).max()), live_peak_bytes=live_peak)


def _pack(order: np.ndarray, start: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Offsets placing residencies in ``order``, each at the lowest gap left by those placed before it
    that overlap it in time."""
    offsets = np.full(size.size, -1, dtype=np.int64)
    placed = np.zeros(size.size, dtype=bool)
    for i in order:
        overlapping = np.flatnonzero(placed & (start < end[i]) & (end > start[i]))
        offsets[i] = _lowest_gap(offsets[overlapping], size[overlapping], int(size[i]))
        placed[i] = True
    return offsets


def _lowest_gap(offsets: np.ndarray, sizes: np.ndarray, need: int) -> int:
    """The lowest offset with ``need`` free bytes among blocks [offset, offset + size)."""
    if offsets.size == 0:
        return 0
    by_offset = np.argsort(offsets, kind="stable")
    lo = offsets[by_offset]
    reach = np.maximum.accumulate(lo + sizes[by_offset])  # highest byte used by blocks up to here
    before = np.concatenate(([0], reach[:-1]))
    fits = np.flatnonzero(lo - before >= need)
    return int(before[fits[0]]) if fits.size else int(reach[-1])


def _live_peak(found: list[Residency]) -> int:
    events: dict[int, int] = {}
    for r in found:
        events[r.start] = events.get(r.start, 0) + r.nbytes
        events[r.end] = events.get(r.end, 0) - r.nbytes
    live = peak = 0
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak


def prefetch_into_arena(plan: Plan, layout: Layout) -> tuple[Plan, Layout]:
    """Move each prefetch as early as the bytes of its slot in ``layout`` are free, in deadline order.

    The static layout's counterpart of "prefetch as early as the budget allows": a prefetch may start
    once every residency that shares bytes with its slot and comes before it has been freed (and after
    the release of its own storage's previous residency). Residencies keep their offsets, so the moved
    plan's layout is valid by construction and its live bytes stay within the same arena. Prefetches
    keep their relative order, so the H2D lane still serves the first due first.
    """
    found = layout.residencies
    if not found:
        return plan, layout
    instrs = plan.instructions
    offsets = np.asarray(layout.offsets, dtype=np.int64)
    start = np.fromiter((r.start for r in found), np.int64, len(found))
    end = np.fromiter((r.end for r in found), np.int64, len(found))
    size = np.fromiter((r.nbytes for r in found), np.int64, len(found))
    top = offsets + size
    previous_end: dict[int, int] = {}  # storage -> end of its residency before the current one
    moved_to: dict[int, int] = {}  # prefetch instruction index -> index it now precedes
    floor = 0
    for k in np.argsort(start, kind="stable"):
        r = found[k]
        if r.start >= 0 and instrs[r.start].kind is Kind.PREFETCH:
            before = (start < r.start) & (offsets < top[k]) & (top > offsets[k])
            earliest = max(int(end[before].max(initial=0)), previous_end.get(r.storage, 0), floor)
            if earliest < r.start:
                moved_to[r.start] = earliest
            floor = max(floor, min(earliest, r.start))
        previous_end[r.storage] = r.end
    if not moved_to:
        return plan, layout
    arrivals: dict[int, list[int]] = {}
    for i, k in sorted(moved_to.items()):
        arrivals.setdefault(k, []).append(i)
    new: list = []
    for i, ins in enumerate(instrs):
        new.extend(instrs[j] for j in arrivals.get(i, ()))
        if i not in moved_to:
            new.append(ins)
    moved = replace(plan, instructions=tuple(new), layout=None)
    # Same residencies, new instruction indices: carry each storage's n-th offset over.
    slots: dict[tuple[int, int], int] = {}
    seen: dict[int, int] = {}
    for r, offset in sorted(zip(found, layout.offsets), key=lambda pair: (pair[0].start, pair[0].storage)):
        slots[(r.storage, seen.get(r.storage, 0))] = offset
        seen[r.storage] = seen.get(r.storage, 0) + 1
    seen.clear()
    now = residencies(moved)
    new_offsets = []
    for r in now:
        new_offsets.append(slots[(r.storage, seen.get(r.storage, 0))])
        seen[r.storage] = seen.get(r.storage, 0) + 1
    moved_layout = Layout(residencies=tuple(now), offsets=tuple(new_offsets), arena_bytes=layout.arena_bytes,
                          live_peak_bytes=_live_peak(now))
    return replace(moved, layout=moved_layout), moved_layout


class LayoutError(AssertionError):
    """A layout places two residencies that are live at once on the same bytes, or outside its arena."""


def arena_stalls(layout: Layout) -> int:
    """Replay the layout's allocations in instruction order against its offsets and count those that
    could not be served in place: bytes still held by a live residency, or past the arena's end. A
    valid layout has none (the allocation would otherwise have to wait or fail)."""
    events = sorted([(r.start, 1, k) for k, r in enumerate(layout.residencies)]
                    + [(r.end, 0, k) for k, r in enumerate(layout.residencies)])
    starts: list[int] = []  # offsets of live residencies, sorted; they never overlap (conflicts are not kept)
    ends: dict[int, int] = {}
    conflicts = 0
    for _, is_alloc, k in events:  # at one instruction, frees come before allocations
        lo = layout.offsets[k]
        if not is_alloc:
            if lo in ends and ends[lo][1] == k:
                starts.pop(bisect.bisect_left(starts, lo))
                del ends[lo]
            continue
        hi = lo + layout.residencies[k].nbytes
        j = bisect.bisect_left(starts, lo)
        clash = (lo < 0 or hi > layout.arena_bytes
                 or (j < len(starts) and starts[j] < hi)
                 or (j > 0 and ends[starts[j - 1]][0] > lo))
        if clash:
            conflicts += 1
            continue
        starts.insert(j, lo)
        ends[lo] = (hi, k)
    return conflicts


def check_layout(layout: Layout) -> None:
    """Raise ``LayoutError`` unless every allocation of the layout is served in place."""
    conflicts = arena_stalls(layout)
    if conflicts:
        raise LayoutError(f"{conflicts} allocations of the layout land on bytes still in use or past its "
                          f"{layout.arena_bytes}-byte arena")


__all__ = ["ALIGNMENT", "Layout", "LayoutError", "Residency", "arena_stalls", "assign_offsets", "check_layout",
           "prefetch_into_arena", "residencies"]
