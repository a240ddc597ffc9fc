"""A model of PyTorch's CUDA caching allocator, replaying a plan's allocations and frees.

Without a static layout, every allocation of a plan goes through the framework's caching
allocator. This module replays a plan's residencies (``layout.residencies``) through a model of
``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x defaults, one stream) to count what offloading
does to it:

* Requests are rounded up to a multiple of 512 bytes. Requests of at most 1 MiB come from the
  *small* pool, larger ones from the *large* pool.
* A request is served by the best-fitting cached free block of its pool (the smallest one that is
  large enough), split if the remainder is worth keeping (at least 512 bytes in the small pool,
  more than 1 MiB in the large pool). Freed blocks go back to the cache and merge with free
  neighbours of the same segment; blocks never move (no compaction).
* With no cached block large enough, a new segment is reserved from the device (``cudaMalloc``):
  2 MiB for small requests, 20 MiB for requests under 10 MiB, otherwise the request rounded up to
  2 MiB.
* If reserving that segment would take the device past its limit, the allocator frees every cached
  segment that is entirely free (``cudaFree``, which synchronises the device) and tries again: the
  *free-and-retry* path, counted as a **stall**. If the retry fails too, the request is an
  out-of-memory error, counted as a **failure**; the model then carries on as if the request had
  been granted, so one failure does not hide the rest.

``reserved_peak_bytes`` against the plan's live-byte peak is what fragmentation costs in reserved
memory. Given the plan's simulated timeline, a block an offload still reads is reusable only once the
copy has landed, as the allocator's ``record_stream`` bookkeeping has it (``stream_ordered_frees``).
Not modelled: the host issuing ahead of the device (which delays that reuse further), per-stream
pools (copies on side streams keep blocks per stream, which only adds fragmentation),
``max_split_size_mb`` and expandable segments (both off by default), and the cost of each
``cudaMalloc``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from hyperoffload.instructions import COPIES_OUT
from hyperoffload.layout import Residency, residencies
from hyperoffload.plans import Plan
from hyperoffload.simulate import COMPUTE, D2H, Timeline

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorReport:
    """What a plan's allocations cost under the caching allocator model (bytes, counts)."""

    stalls: int
    """Allocations that took the free-and-retry path (a device synchronisation each)."""
    failures: int
    """Allocations that failed even after freeing the cache (out of memory)."""
    segments: int
    """Segments reserved from the device over the step (``cudaMalloc`` calls)."""
    reserved_peak_bytes: int
    """Largest total of reserved segments at any point."""
    live_peak_bytes: int
    """Largest total of the plan's live storages (rounded requests excluded)."""
    limit_bytes: int | None
    """The device limit the replay ran under: the one asked for, else the plan's budget; None (no limit) only
    for a plan without a budget replayed with no limit asked for."""


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool
    small: bool


class _Pool:
    """Free blocks of one pool, ordered by (size, segment, offset) for best-fit search."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int, int]] = []

    def add(self, block: _Block) -> None:
        bisect.insort(self.keys, (block.size, block.segment, block.offset))

    def remove(self, block: _Block) -> None:
        self.keys.pop(bisect.bisect_left(self.keys, (block.size, block.segment, block.offset)))

    def best_fit(self, size: int) -> tuple[int, int] | None:
        k = bisect.bisect_left(self.keys, (size, -1, -1))
        return None if k == len(self.keys) else self.keys[k][1:]


class CachingAllocatorModel:
    """The allocator's state: segments, their blocks (by segment and offset), the free pools."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit = limit_bytes
        self.segments: dict[int, int] = {}  # segment id -> bytes
        self.blocks: dict[int, dict[int, _Block]] = {}  # segment id -> offset -> block
        self.pools = {True: _Pool(), False: _Pool()}
        self.reserved = self.reserved_peak = 0
        self.stalls = self.failures = self.reservations = 0
        self._next_segment = 0

    def allocate(self, nbytes: int) -> _Block:
        size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
        small = size <= SMALL_REQUEST
        found = self.pools[small].best_fit(size)
        if found is None:
            found = self._reserve(size, small)
        block = self.blocks[found[0]][found[1]]
        self.pools[small].remove(block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_REQUEST:
            rest = _Block(block.segment, block.offset + size, remaining, True, small)
            self.blocks[block.segment][rest.offset] = rest
            self.pools[small].add(rest)
            block.size = size
        block.free = False
        return block

    def free(self, block: _Block) -> None:
        block.free = True
        blocks = self.blocks[block.segment]
        pool = self.pools[block.small]
        after = blocks.get(block.offset + block.size)
        if after is not None and after.free:
            pool.remove(after)
            del blocks[after.offset]
            block.size += after.size
        before = next((b for b in blocks.values() if b.free and b.offset + b.size == block.offset), None)
        if before is not None:
            pool.remove(before)
            del blocks[block.offset]
            before.size += block.size
            block = before
        pool.add(block)

    def _reserve(self, size: int, small: bool) -> tuple[int, int]:
        segment_bytes = (SMALL_SEGMENT if small else LARGE_SEGMENT if size < MIN_LARGE_ALLOC
                         else -(-size // ROUND_LARGE) * ROUND_LARGE)
        if self.limit is not None and self.reserved + segment_bytes > self.limit:
            self.stalls += 1
            self._release_cached_segments()
            if self.reserved + segment_bytes > self.limit:
                self.failures += 1
        segment = self._next_segment
        self._next_segment += 1
        self.segments[segment] = segment_bytes
        block = _Block(segment, 0, segment_bytes, True, small)
        self.blocks[segment] = {0: block}
        self.pools[small].add(block)
        self.reserved += segment_bytes
        self.reservations += 1
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        return segment, 0

    def _release_cached_segments(self) -> None:
        """``release_cached_blocks``: give every entirely free segment back to the device."""
        for segment, blocks in list(self.blocks.items()):
            if len(blocks) == 1 and blocks[0].free and blocks[0].size == self.segments[segment]:
                self.pools[blocks[0].small].remove(blocks[0])
                del self.blocks[segment]
                self.reserved -= self.segments.pop(segment)


def replay_caching_allocator(plan: Plan, limit_bytes: int | None = None,
                             timeline: Timeline | None = None) -> AllocatorReport:
    """Replay ``plan``'s device allocations and frees, in instruction order, through the caching
    allocator model with a device limit of ``limit_bytes`` (None: the plan's budget; pass the device's memory,
    ``Hardware.memory_bytes``, for the allocator as it runs with nothing but the device to limit it).

    ``timeline``: a simulation of ``plan`` (``simulate(plan, hardware)``), for stream-ordered frees (see
    ``stream_ordered_frees``). A timeline of two consecutive steps (a plan that keeps state remote) replays
    those two steps."""
    limit = plan.budget_bytes if limit_bytes is None else limit_bytes
    if timeline is None:
        return _replay(residencies(plan), limit)
    found = residencies(timeline.plan)
    return _replay(found, limit, stream_ordered_frees(timeline, found))


def stream_ordered_frees(timeline: Timeline, found: Sequence[Residency]) -> list[tuple[float, float]]:
    """When each residency of ``timeline.plan`` is allocated and when its block can serve another request
    (seconds of the simulated step), for the allocator model.

    A storage released (or freed after its last use) while its offload still reads it goes back to the
    allocator at once, but the allocator holds its block until the copy stream's work on it is done
    (``record_stream``: the block is reusable from the first request after the copy's event completes), so
    requests in between get new segments. Measured on an H200 (``bench/gpu_compare.py``), the instruction-order
    model (a released block reusable at once) predicted 18.3 GiB reserved for ``layerwise`` where the allocator
    reserved 57.8 GiB, and 24 GiB for ``hyperoffload`` at 50% where it reserved 37.8 GiB.

    An instruction's time is when the compute stream starts the last compute op issued up to it (its host
    issue, were the host in step with the device); a block is free from its residency's end, or from the
    landing of its last offload within the residency if later. The host running ahead of the device delays
    reuse further, which this does not model: it is a lower bound on what the stream-ordered allocator
    reserves."""
    plan = timeline.plan
    n = len(plan.instructions)
    compute_start: dict[int, float] = {}
    landed: dict[int, float] = {}
    for iv in timeline.intervals:
        if iv.stream == COMPUTE:
            compute_start[iv.instruction] = min(iv.start, compute_start.get(iv.instruction, iv.start))
        elif iv.stream == D2H:
            landed[iv.instruction] = max(iv.end, landed.get(iv.instruction, iv.end))
    at = [0.0] * (n + 1)
    now = 0.0
    for i in range(n):
        now = at[i] = compute_start.get(i, now)
    at[n] = math.inf
    offloads: dict[int, list[int]] = {}  # storage -> its offloads' (``COPIES_OUT``) instruction indices, in order
    for i, ins in enumerate(plan.instructions):
        if ins.kind in COPIES_OUT and i in landed:
            offloads.setdefault(ins.target, []).append(i)

    def reusable(r: Residency) -> float:
        """From the residency's end, or its last offload's landing if later (released or freed after it)."""
        free = at[min(r.end, n)]
        mine = offloads.get(r.storage, ())
        k = bisect.bisect_left(mine, r.end) - 1
        return max(free, landed[mine[k]]) if k >= 0 and mine[k] >= r.start else free

    return [(-math.inf if r.start < 0 else at[r.start], reusable(r)) for r in found]


def _replay(found: Sequence[Residency], limit: int | None,
            times: Sequence[tuple[float, float]] | None = None) -> AllocatorReport:
    """Residencies, allocated and freed in instruction order (or at ``times``: (allocated, reusable) per
    residency, as ``stream_ordered_frees`` gives), through the model under ``limit``."""
    if times is None:
        times = [(r.start, r.end) for r in found]
    # Ties in time keep instruction order: a residency is allocated before it is freed, and frees come before
    # the allocations of the same instruction.
    events = sorted([(t[0], r.start, 1, k) for k, (r, t) in enumerate(zip(found, times, strict=True))]
                    + [(t[1], r.end, 0, k) for k, (r, t) in enumerate(zip(found, times, strict=True))])
    model = CachingAllocatorModel(limit)
    held: dict[int, _Block] = {}
    live = live_peak = 0
    for _, _, is_alloc, k in events:
        if is_alloc:
            held[k] = model.allocate(found[k].nbytes)
            live += found[k].nbytes
            live_peak = max(live_peak, live)
        else:
            model.free(held.pop(k))
            live -= found[k].nbytes
    return AllocatorReport(stalls=model.stalls, failures=model.failures, segments=model.reservations,
                           reserved_peak_bytes=model.reserved_peak, live_peak_bytes=live_peak, limit_bytes=limit)




def fragmentation_figures(plan: Plan, limit_bytes: int | None = None,
                          timeline: Timeline | None = None) -> dict[str, int]:
    """What fragmentation costs ``plan`` either way (bytes, counts): the caching allocator model with a
    device limit of ``limit_bytes`` (default: the plan's budget), with stream-ordered frees given the
    plan's ``timeline`` (``replay_caching_allocator``), and a static arena (the plan's own layout, or one
    ``assign_offsets`` finds)."""
    from hyperoffload.layout import arena_stalls, assign_offsets

    layout = plan.layout if plan.layout is not None else assign_offsets(plan)
    limit = plan.budget_bytes if limit_bytes is None else limit_bytes
    if timeline is None:
        # The layout holds the plan's residencies already: replay those rather than derive them again.
        report = _replay(layout.residencies, limit)
    else:
        report = replay_caching_allocator(plan, limit, timeline)
    return {"arena_bytes": layout.arena_bytes, "arena_stalls": arena_stalls(layout),
            "allocator_stalls": report.stalls, "allocator_failures": report.failures,
            "allocator_reserved_bytes": report.reserved_peak_bytes}


__all__ = ["AllocatorReport", "CachingAllocatorModel", "fragmentation_figures", "replay_caching_allocator",
           "stream_ordered_frees"]
