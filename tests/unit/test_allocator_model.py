"""The caching allocator model: hand-computed cases, its block invariants, and plans replayed through it."""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from programs import simple_hardware

from hyperoffload.allocator_model import CachingAllocatorModel, fragmentation_figures, replay_caching_allocator
from hyperoffload.analysis import memory_profile
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import plan_hyperoffload
from hyperoffload.workloads import capture_workload, get_workload

MiB = 1 << 20


def test_a_freed_block_is_reused_and_split():
    model = CachingAllocatorModel(limit_bytes=None)
    a = model.allocate(12 * MiB)  # 12 MiB >= 10 MiB: a segment of exactly 12 MiB
    model.free(a)
    b = model.allocate(4 * MiB)  # best fit: the cached 12 MiB block, split
    assert (model.reservations, model.reserved) == (1, 12 * MiB)
    assert b.size == 4 * MiB and b.offset == 0
    c = model.allocate(8 * MiB)  # the 8 MiB remainder
    assert model.reservations == 1 and c.offset == 4 * MiB


def test_small_requests_round_to_512_bytes_in_2_mib_segments():
    model = CachingAllocatorModel(limit_bytes=None)
    blocks = [model.allocate(1000) for _ in range(3)]
    assert [b.size for b in blocks] == [1024] * 3
    assert model.reserved == 2 * MiB and model.reservations == 1


def test_fragmentation_costs_a_free_and_retry_stall():
    """Two 12 MiB blocks, the first freed: 14 MiB fits in neither cached block, so under a 30 MiB limit the
    allocator frees its cache (a synchronisation) and retries."""
    model = CachingAllocatorModel(limit_bytes=30 * MiB)
    a = model.allocate(12 * MiB)
    model.allocate(12 * MiB)
    model.free(a)
    model.allocate(14 * MiB)
    assert (model.stalls, model.failures) == (1, 0)
    assert model.reserved == 26 * MiB


def test_out_of_memory_after_the_retry_is_a_failure():
    model = CachingAllocatorModel(limit_bytes=24 * MiB)
    a = model.allocate(12 * MiB)
    model.allocate(12 * MiB)
    model.free(a)
    model.allocate(14 * MiB)  # 12 live + 14 > 24, even with the cache emptied
    assert (model.stalls, model.failures) == (1, 1)


def _check_invariants(model: CachingAllocatorModel) -> None:
    free_keys = []
    for segment, blocks in model.blocks.items():
        ordered = sorted(blocks.values(), key=lambda b: b.offset)
        assert ordered[0].offset == 0
        assert sum(b.size for b in ordered) == model.segments[segment]  # blocks tile the segment
        for x, y in pairwise(ordered):
            assert x.offset + x.size == y.offset
            assert not (x.free and y.free)  # free neighbours are always merged
        free_keys += [(b.small, (b.size, b.segment, b.offset)) for b in ordered if b.free]
    pooled = [(small, key) for small, pool in model.pools.items() for key in pool.keys]
    assert sorted(free_keys) == sorted(pooled)
    assert model.reserved == sum(model.segments.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 24 * MiB)), min_size=1, max_size=60))
def test_blocks_tile_segments_and_free_neighbours_merge(steps):
    model = CachingAllocatorModel(limit_bytes=64 * MiB)
    live = []
    for allocate, nbytes in steps:
        if allocate or not live:
            live.append(model.allocate(nbytes))
        else:
            model.free(live.pop(nbytes % len(live)))
        _check_invariants(model)
    assert model.reserved_peak >= model.reserved


def test_replaying_plans_counts_what_fragmentation_costs():
    prog = capture_workload(get_workload("tiny-llama"), "train").program
    peak = memory_profile(prog).peak_bytes
    unlimited = replay_caching_allocator(plan_without_offload(prog))
    assert unlimited.limit_bytes is None and unlimited.stalls == unlimited.failures == 0
    assert unlimited.live_peak_bytes == peak
    assert unlimited.reserved_peak_bytes >= peak
    hardware = simple_hardware(bw=1e8)
    plan = plan_hyperoffload(prog, hardware, int(peak * 0.5))
    figures = fragmentation_figures(plan)
    assert figures["arena_stalls"] == 0
    assert figures["arena_bytes"] >= replay_caching_allocator(plan).live_peak_bytes
    # At a budget the live bytes just fit, the caching allocator's 2 and 20 MiB segments do not.
    assert figures["allocator_stalls"] >= 1 and figures["allocator_failures"] >= 1


@pytest.mark.parametrize("freed_by", ["RELEASE", "COMPUTE"])
def test_a_block_an_offload_still_reads_is_reused_only_once_the_copy_has_landed(freed_by):
    """A 12 MiB storage offloaded and then released (or freed after its last use), then a 12 MiB result made
    while the offload is still copying (it lands at 5 s): in instruction order the allocator would reuse the
    freed block, but the copy stream still reads it, so the request gets a second segment."""
    from types import SimpleNamespace

    from hyperoffload.allocator_model import _replay, stream_ordered_frees
    from hyperoffload.layout import Residency
    from hyperoffload.plans import Kind
    from hyperoffload.simulate import Interval, Timeline

    kinds = [Kind.COMPUTE, Kind.OFFLOAD, Kind[freed_by], Kind.COMPUTE, Kind.COMPUTE]
    plan = SimpleNamespace(instructions=[SimpleNamespace(kind=k, target=0) for k in kinds])
    intervals = (Interval("compute", 0.0, 1.0, 0, "make a"), Interval("d2h", 1.0, 5.0, 1, "offload a"),
                 Interval("compute", 1.0, 2.0, 3, "make b"), Interval("compute", 2.0, 3.0, 4, "use b"))
    timeline = Timeline(intervals=intervals, memory=(), stalls=(), figures=None, plan=plan)
    found = [Residency(0, 0, 3, 12 * MiB), Residency(1, 3, 5, 12 * MiB)]
    times = stream_ordered_frees(timeline, found)
    assert times[0] == (0.0, 5.0)  # reusable when the offload lands, not when released (1 s)
    assert times[1][0] == 1.0 and times[1][1] == float("inf")  # held past the step
    in_order, stream_ordered = _replay(found, None), _replay(found, None, times)
    assert (in_order.segments, in_order.reserved_peak_bytes) == (1, 12 * MiB)
    assert (stream_ordered.segments, stream_ordered.reserved_peak_bytes) == (2, 24 * MiB)
    assert stream_ordered.live_peak_bytes == 24 * MiB


def test_stream_ordered_frees_of_a_plan_wait_for_every_offload_to_land():
    """On a slow link, every storage ``layerwise`` offloads and releases is reusable no earlier than its
    offload lands in the simulation, and the live bytes the allocator sees are never fewer than in
    instruction order."""
    from hyperoffload.allocator_model import stream_ordered_frees
    from hyperoffload.layout import residencies
    from hyperoffload.plans import Kind
    from hyperoffload.policies import get_policy
    from hyperoffload.simulate import simulate

    prog = capture_workload(get_workload("tiny-llama"), "train").program
    hardware = simple_hardware(bw=1e8)
    plan = get_policy("layerwise")(prog, hardware, memory_profile(prog).peak_bytes)
    timeline = simulate(plan, hardware)
    found = residencies(plan)
    times = stream_ordered_frees(timeline, found)
    landed = {iv.instruction: iv.end for iv in timeline.intervals if iv.stream == "d2h"}
    offload = {}
    delayed = 0
    for i, ins in enumerate(plan.instructions):
        if ins.kind is Kind.OFFLOAD:
            offload[ins.target] = i
        elif ins.kind is Kind.RELEASE:
            (k,) = [k for k, r in enumerate(found) if r.storage == ins.target and r.end == i + 1]
            assert times[k][1] >= landed[offload[ins.target]]
            delayed += times[k][1] == landed[offload[ins.target]]
    assert delayed > 0
    ordered = replay_caching_allocator(plan)
    streamed = replay_caching_allocator(plan, timeline=timeline)
    assert streamed.live_peak_bytes >= ordered.live_peak_bytes
