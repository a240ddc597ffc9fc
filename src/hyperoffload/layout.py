"""Static memory layout: every device-resident storage of a plan gets a fixed offset in one arena.

A plan allocates and frees device memory in instruction order (``check_plan``'s accounting): a
compute allocates the storages its outputs own, a prefetch allocates the storage it brings back,
a release and the automatic free after a storage's last use give memory back. Each stretch between
an allocation and its free is a *residency*; a storage that leaves and returns has several, and
each may sit at a different offset.

``assign_offsets`` places every residency so that two residencies that are live at the same
instruction never share a byte, in an arena as close to the plan's live-byte peak (the least any
packing needs) as it finds. It tries several packings and keeps the smallest: TFLite's "greedy by
size" (largest residency first, each at the lowest offset that fits among the already placed
residencies it overlaps in time), skylines that stack residencies in time (one of them on the few
huge residencies placed first), and a sweep in time order that puts each residency next to a
neighbour that outlives it, from the floor or from the ceiling. Each is then compacted: turned
upside down and let fall, which never raises a residency. Training plans hold families of
equal-sized residencies whose lifetimes nest (saved activations) or cross (gradients that
accumulate while activations are freed); greedy by size stacks the smaller long-lived ones above
the envelope of the larger, which the time-ordered packings avoid. With every address known before
the step runs, no allocation can fail, wait for a cache flush, or fragment the device: the arena is
the only reservation, and ``check_layout`` proves the packing by replaying the plan's allocations
against it.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hyperoffload.instructions import ALLOCATES_TARGET, FREES_TARGET, allocated_storages
from hyperoffload.plans import Plan, PlanCheck, check_plan, owned_outputs

ALIGNMENT = 256
"""Bytes every slot's offset is a multiple of: what ``cudaMalloc`` guarantees, so kernels that need
aligned (vectorised) access see the same alignment in the arena as from the allocator."""


@dataclass(frozen=True, slots=True)
class Residency:
    """Storage ``storage`` occupies ``nbytes`` of device memory from instruction ``start`` (allocated
    as it begins; -1: before the step) up to instruction ``end`` (exclusive: the bytes are free for
    allocations made by instruction ``end`` and later; ``len(plan.instructions)``: held past the step).
    ``remote_layout`` uses it for a remote copy in host memory, ``start`` being its offload."""

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
    owned = owned_outputs(program)
    for i, ins in enumerate(instrs):  # what each instruction allocates and frees: ``instructions.RULES``
        for s in allocated_storages(ins, owned):
            open_at[s] = i
        if ins.kind in FREES_TARGET:
            close(ins.target, i + 1)  # a release allocates nothing: the bytes serve instruction i + 1 on
        for s in checked.frees_after[i]:
            close(s, i + 1)
    for s in list(open_at):
        close(s, n)
    result.sort(key=lambda r: (r.start, r.storage))
    return result


def assign_offsets(plan: Plan) -> Layout:
    """A static layout of ``plan``'s device memory: the smallest of several packings (see the module
    docstring), each settled by compaction."""
    found = residencies(plan)
    live_peak = _live_peak(found)
    if not found:
        return Layout(residencies=(), offsets=(), arena_bytes=0, live_peak_bytes=0)
    # Slots are whole multiples of ALIGNMENT, so every offset is aligned as a device allocation would be.
    offsets, arena_bytes = pack_aligned([r.start for r in found], [r.end for r in found], [r.nbytes for r in found],
                                        ALIGNMENT)
    return Layout(residencies=tuple(found), offsets=offsets, arena_bytes=arena_bytes, live_peak_bytes=live_peak)


def pack_aligned(start: Sequence[int], end: Sequence[int], nbytes: Sequence[int],
                 alignment: int) -> tuple[tuple[int, ...], int]:
    """``pack_blocks`` of blocks of ``nbytes`` each rounded up to a multiple of ``alignment`` (so every offset is
    one): the offsets and the arena's bytes (the highest block end)."""
    size = -(-np.asarray(nbytes, np.int64) // alignment) * alignment
    offsets = pack_blocks(np.asarray(start, np.int64), np.asarray(end, np.int64), size)
    return tuple(int(o) for o in offsets), int((offsets + size).max())


def pack_blocks(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Offsets (bytes) for blocks of ``size`` bytes live over instructions [``start``, ``end``) such that
    no two blocks live at once share a byte, with the arena (the highest block end) as small as the
    packings tried here get it; never larger than greedy by size's. Every block must live a while
    (``start < end``)."""
    if size.size == 0:
        return np.zeros(0, np.int64)
    if (end <= start).any():
        raise ValueError("every block must live over at least one instruction (start < end)")
    # Blocks live over the whole step sit below the others at no cost: the others' live peak plus theirs
    # is the step's, so whatever the packing loses, it loses on the others.
    whole = (start <= start.min()) & (end >= end.max())
    offsets = np.zeros(size.size, np.int64)
    offsets[whole] = np.cumsum(size[whole]) - size[whole]
    rest = np.flatnonzero(~whole)
    if rest.size:
        offsets[rest] = int(size[whole].sum()) + _pack_crossing(start[rest], end[rest], size[rest])
    greedy = _first_fit(np.lexsort((start - end, -size)), start, end, size)
    return greedy if _arena(greedy, size) < _arena(offsets, size) else offsets


def _pack_crossing(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """The smallest of a few packings, each compacted once, then the best compacted until it settles.

    Greedy by size stacks every smaller block above the larger ones it overlaps, so long-lived small
    blocks (saved activations, accumulating gradients) end up above the envelope of the large ones
    over their whole lifetime. The packings here instead follow time: skylines (stacking blocks as
    they are live together, preferring large area or long lifetime; or on top of the few huge blocks
    placed first) and a sweep that keeps blocks next to neighbours that outlive them. Which wins
    depends on the plan, so all are tried; each is a fraction of a second on an 8B training plan."""
    lower = _live_peak_arrays(start, end, size)
    longest = np.empty(size.size, np.int64)
    longest[np.lexsort((size, end - start))] = np.arange(size.size)  # by lifetime, then size
    area = size.astype(float) * (end - start)
    builders = (lambda: _skyline(start, end, size, area),
                lambda: _skyline(start, end, size, longest),
                lambda: _huge_first(start, end, size, area, lower // 20),
                lambda: _sweep(start, end, size, lower))
    best = None
    for build in builders:
        offsets = build()
        if offsets is None:
            continue
        offsets = _compact(offsets, start, end, size, rounds=1)
        if best is None or _arena(offsets, size) < _arena(best, size):
            best = offsets
        if _arena(best, size) == lower:  # nothing packs tighter than the live peak
            return best
    return _compact(best, start, end, size, rounds=8)


def _arena(offsets: np.ndarray, size: np.ndarray) -> int:
    return int((offsets + size).max())


def _first_fit(order: np.ndarray, start: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Offsets placing blocks in ``order``, each at the lowest gap left by those placed before it that
    overlap it in time (TFLite's greedy placement for a given order)."""
    n = size.size
    offsets = np.empty(n, np.int64)
    # The placed blocks (offset, end byte, first and last instruction), kept sorted by offset so that
    # those overlapping a block in time come out in offset order without a sort per block.
    placed = np.empty((4, n), np.int64)
    low, high, first, last = placed
    lows: list[int] = []  # the placed offsets again, where bisect finds a new block's column without numpy
    starts, ends, sizes = start.tolist(), end.tolist(), size.tolist()
    for m, i in enumerate(order.tolist()):  # m blocks placed so far
        s, e, need = starts[i], ends[i], sizes[i]
        offset = 0
        if m:
            hit = np.flatnonzero((first[:m] < e) & (last[:m] > s))
            if hit.size and low[hit[0]] < need:
                reach = np.maximum.accumulate(high[hit])  # the highest byte used by blocks up to here
                fits = low[hit[1:]] - reach[:-1] >= need
                k = int(fits.argmax()) if fits.size else 0
                offset = int(reach[k] if fits.size and fits[k] else reach[-1])
        offsets[i] = offset
        k = bisect.bisect_right(lows, offset)
        lows.insert(k, offset)
        placed[:, k + 1:m + 1] = placed[:, k:m]
        low[k], high[k], first[k], last[k] = offset, offset + need, s, e
    return offsets


def _compact(offsets: np.ndarray, start: np.ndarray, end: np.ndarray, size: np.ndarray, rounds: int) -> np.ndarray:
    """Turn the packing upside down and let every block fall to the lowest gap, lowest block first, up to
    ``rounds`` times or until two rounds in a row gain nothing.

    A block never lands above where it was (the blocks below it only fell, so its old place is still
    free), so the arena never grows; turning it over lets the other side settle, which is where the
    gains come from after the first round."""
    top = _arena(offsets, size)
    idle = 0
    for _ in range(rounds):
        flipped = top - (offsets + size)
        offsets = _first_fit(np.lexsort((-size, flipped)), start, end, size)
        settled = _arena(offsets, size)
        idle = idle + 1 if settled == top else 0
        top = settled
        if idle == 2:
            break
    return offsets


def _huge_first(start: np.ndarray, end: np.ndarray, size: np.ndarray, priority: np.ndarray,
                huge: int) -> np.ndarray | None:
    """Offsets with the blocks of at least ``huge`` bytes placed first (greedy by size among
    themselves) and a skyline of the others on top of them; None without both kinds.

    A skyline places a block only where its whole lifetime is the lowest stretch, which a block of a
    few GiB in a plateau of live bytes rarely finds: it ends up above everything. Placed first, the
    huge blocks (the caller's threshold is a twentieth of the live peak: an 8B model's fp32 embedding
    and its gradient, not its 1 GiB bf16 copies, whose placing first packed worse) shape the floor
    and the others fill around them."""
    first = size >= huge
    if first.all() or not first.any():
        return None
    big, rest = np.flatnonzero(first), np.flatnonzero(~first)
    offsets = np.empty(size.size, np.int64)
    offsets[big] = _first_fit(np.lexsort((start[big] - end[big], -size[big])), start[big], end[big], size[big])
    offsets[rest] = _skyline(start[rest], end[rest], size[rest], priority[rest],
                             under=(start[big], end[big], offsets[big] + size[big]))
    return offsets


def _skyline(start: np.ndarray, end: np.ndarray, size: np.ndarray, priority: np.ndarray,
             under: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Offsets from a skyline packing over time: repeatedly take the lowest stretch of the skyline (the
    top of the blocks placed so far at each instruction), put on it the unplaced block of highest
    ``priority`` whose lifetime lies within the stretch, or, if none does, raise the stretch to its
    lower neighbour (the bytes in between stay unused).

    Blocks are stacked as they are live together rather than by size, which keeps blocks that come and
    go with the same neighbours (a layer's activations, its gradients) in one column. ``under``: blocks
    already placed (first and last instruction, end byte) that the skyline starts on.

    The skyline is kept as its runs of equal height (a run per stretch, neighbours always differ) with
    a heap of (height, first span) over them, so finding the lowest stretch costs a heap look-up
    rather than a scan of every span; a tie goes to the first block in start order, as a scan would."""
    placed_first, placed_last, placed_top = under if under is not None else (start[:0], end[:0], size[:0])
    times = np.unique(np.concatenate((start, end, placed_first, placed_last)))
    s = np.searchsorted(times, start)
    e = np.searchsorted(times, end)
    spans = times.size - 1
    never = np.iinfo(np.int64).max
    height = np.zeros(spans + 1, np.int64)
    for lo, hi, top in zip(np.searchsorted(times, placed_first), np.searchsorted(times, placed_last), placed_top):
        np.maximum(height[lo:hi], top, out=height[lo:hi])
    height[spans] = never  # a sentinel run that ends every stretch
    run_end, run_height, run_before = _runs(height)
    heap = [(run_height[a], a) for a in range(spans) if run_end[a]]
    heapq.heapify(heap)
    # Candidates in start order (ties by index, as a stable sort leaves them); a placed block's end
    # becomes ``never`` so that it fits no stretch.
    by_start = np.argsort(s, kind="stable")
    # span -> the first candidate starting there or later
    first_from = np.searchsorted(s[by_start], np.arange(spans + 1)).tolist()
    ends = e[by_start]
    ranked = priority[by_start]
    block = by_start.tolist()
    s_list, e_list, size_list = s.tolist(), e.tolist(), size.tolist()
    offsets = np.empty(size.size, np.int64)
    left = size.size
    while left:
        level, lo = heap[0]
        if run_height[lo] != level or not run_end[lo]:  # a run since merged, split or raised
            heapq.heappop(heap)
            continue
        hi = run_end[lo]
        a, b = first_from[lo], first_from[hi]
        pick = _best_fit(ends, ranked, a, b, hi)
        if pick < 0:  # nothing fits: raise the stretch to its lower neighbour, which it joins
            before = run_before[lo]
            raised = min(run_height[before] if before >= 0 else never, run_height[hi])
            heapq.heappop(heap)
            _set_run(run_end, run_height, run_before, lo, hi, raised, heap, spans)
            continue
        i = block[pick]
        ends[pick] = never
        offsets[i] = level
        left -= 1
        si, ei = s_list[i], e_list[i]
        if ei < hi:  # the stretch's right part stays at its level
            run_end[ei], run_height[ei], run_before[ei] = hi, level, si
            if hi <= spans:
                run_before[hi] = ei
            heapq.heappush(heap, (level, ei))
            hi = ei
        if si > lo:  # and its left part
            run_end[lo] = si
            run_end[si], run_height[si], run_before[si] = hi, level, lo
            if hi <= spans:
                run_before[hi] = si
        _set_run(run_end, run_height, run_before, si, hi, level + size_list[i], heap, spans)
    return offsets


def _runs(height: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """The runs of equal height of ``height`` (its last entry a run of its own): for each index, the end
    (exclusive) of the run starting there, 0 where none starts; the run's height; the start of the run
    before it (-1 for the first)."""
    n = height.size
    starts = np.flatnonzero(np.concatenate(([True], height[1:] != height[:-1])))
    starts = np.union1d(starts, [n - 1])
    run_end = [0] * n
    run_height = [0] * n
    run_before = [-1] * n
    bounds = starts.tolist() + [n]
    for k, a in enumerate(bounds[:-1]):
        run_end[a] = bounds[k + 1]
        run_height[a] = int(height[a])
        run_before[a] = bounds[k - 1] if k else -1
    return run_end, run_height, run_before


def _set_run(run_end: list[int], run_height: list[int], run_before: list[int], lo: int, hi: int, level: int,
             heap: list[tuple[int, int]], spans: int) -> None:
    """Make spans [``lo``, ``hi``) one run at ``level``, joined to a neighbour run of the same height, and
    queue it. The run starting at ``lo``'s left neighbour and the one starting at ``hi`` are as before."""
    before = run_before[lo]
    if hi < spans and run_height[hi] == level:  # join the run on the right
        after = run_end[hi]
        run_end[hi] = 0
        hi = after
    if before >= 0 and run_height[before] == level and lo:  # join the run on the left
        run_end[lo] = 0
        run_end[before] = hi
        run_before[hi] = before
        return
    run_end[lo], run_height[lo], run_before[lo] = hi, level, before
    run_before[hi] = lo
    heapq.heappush(heap, (level, lo))


def _best_fit(ends: np.ndarray, ranked: np.ndarray, a: int, b: int, hi: int) -> int:
    """Of candidates ``a`` to ``b`` (in start order), the first of highest rank that ends by span ``hi``;
    -1 if none does."""
    fits = np.flatnonzero(ends[a:b] <= hi)
    if fits.size == 0:
        return -1
    return a + int(fits[np.argmax(ranked[a:b][fits])])


def _sweep(start: np.ndarray, end: np.ndarray, size: np.ndarray, ceiling: int) -> np.ndarray:
    """Offsets from placing blocks in start order among the blocks live then, in an arena of
    ``ceiling`` bytes (exceeded only where nothing fits), each against the neighbour whose end is the
    soonest after its own: on the block below a gap, at the gap's bottom, or under the block above it,
    at the gap's top; the arena's floor and ceiling never end. A tie goes to the smaller gap.

    Blocks then sit next to blocks that outlive them, so the bytes a block frees join its neighbour's
    when that ends too, instead of leaving a hole between longer-lived blocks. With the ceiling as a
    second floor, two families that cross in time (activations freed in the backward pass while
    gradients accumulate) grow from opposite ends instead of on top of each other."""
    n = size.size
    offsets = np.empty(n, np.int64)
    never = np.iinfo(np.int64).max
    # The m live blocks in offset order, laid out so that gap k (from below[k] to above[k], k <= m) reads
    # off without concatenation: above = low[:m + 1] (low[m]: the ceiling), below = high[:m + 1]
    # (high[0]: the floor), and the ends of the blocks under and over gap k are ends[k] and ends[k + 1]
    # (ends[0] and ends[m + 1]: the floor and ceiling, which never end).
    low = np.empty(n + 1, np.int64)
    high = np.zeros(n + 1, np.int64)
    ends = np.full(n + 2, never, np.int64)
    lows: list[int] = []  # low[:m] again, for bisect
    live_ends: list[int] = []  # a heap of the live blocks' ends: says when some block has ended
    starts, stops, sizes = start.tolist(), end.tolist(), size.tolist()
    m = 0
    for i in np.lexsort((-size, start)).tolist():
        s, e, need = starts[i], stops[i], sizes[i]
        if live_ends and live_ends[0] <= s:
            while live_ends and live_ends[0] <= s:
                heapq.heappop(live_ends)
            live = np.flatnonzero(ends[1:m + 1] > s)
            low[:live.size] = low[live]
            high[1:live.size + 1] = high[live + 1]
            ends[1:live.size + 1] = ends[live + 1]
            m = live.size
            ends[m + 1] = never
            lows = low[:m].tolist()
        top = int(high[m])
        low[m] = max(ceiling, top)
        gap = low[:m + 1] - high[:m + 1]
        fit = np.flatnonzero(gap >= need)
        if fit.size == 0:
            offset = top
        else:
            offset = _sweep_choice(fit, gap, low, high, ends, e, need, never)
        offsets[i] = offset
        k = bisect.bisect_right(lows, offset)
        lows.insert(k, offset)
        low[k + 1:m + 1] = low[k:m]
        high[k + 2:m + 2] = high[k + 1:m + 1]
        ends[k + 2:m + 2] = ends[k + 1:m + 1]
        low[k], high[k + 1], ends[k + 1] = offset, offset + need, e
        m += 1
        ends[m + 1] = never
        heapq.heappush(live_ends, e)
    return offsets


def _sweep_choice(fit: np.ndarray, gap: np.ndarray, low: np.ndarray, high: np.ndarray, ends: np.ndarray, e: int,
                  need: int, never: int) -> int:
    """``_sweep``'s offset among gaps ``fit`` (see there): the place whose neighbour ends soonest after
    ``e``, then the smaller gap, then bottom-aligned places before top-aligned ones, lower gaps first.
    Outliving the neighbour leaves a hole when it goes: worse than any neighbour that lasts."""
    f = fit.size
    fits, gaps, under, over = fit.tolist(), gap[fit].tolist(), ends[fit].tolist(), ends[fit + 1].tolist()
    best = None
    for k, neighbour in enumerate(under + over):  # bottom-aligned: the block under the gap; top: over it
        cost = neighbour - e if neighbour >= e else never // 2 + (e - neighbour)
        key = (cost, gaps[k % f], k)
        if best is None or key < best:
            best = key
    k = best[2]
    return int(high[fits[k]]) if k < f else int(low[fits[k - f]]) - need


def _live_peak_arrays(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> int:
    """The peak of live bytes over blocks [``start``, ``end``) of ``size`` bytes (frees first at a tie)."""
    times = np.concatenate((start, end))
    change = np.concatenate((size, -size))
    order = np.lexsort((change, times))
    return int(np.cumsum(change[order]).max())


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
        if r.start >= 0 and instrs[r.start].kind in ALLOCATES_TARGET:  # a copy in, which may move earlier
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


def arena_use(layout: Layout, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """While each instruction index of ``at`` (sorted) runs: the highest arena byte in use and the live
    bytes (both bytes; 0 where nothing is live). Where the first exceeds the second, the layout, not
    the live bytes, sets the memory the plan needs at that point."""
    at = np.asarray(at, dtype=np.int64)
    top = np.zeros(at.size, np.int64)
    live = np.zeros(at.size + 1, np.int64)
    for r, offset in zip(layout.residencies, layout.offsets):
        lo, hi = np.searchsorted(at, (r.start, r.end), side="left")
        if hi > lo:
            np.maximum(top[lo:hi], offset + r.nbytes, out=top[lo:hi])
            live[lo] += r.nbytes
            live[hi] -= r.nbytes
    return top, np.cumsum(live)[:-1]


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


__all__ = ["ALIGNMENT", "Layout", "LayoutError", "Residency", "arena_stalls", "arena_use", "assign_offsets", "check_layout",
           "pack_blocks", "prefetch_into_arena", "residencies"]
