"""The caching allocator model: hand-computed cases, its block invariants, and frees ordered by a hand-made
timeline's copies. Plans of a captured step replayed through it: tests/models/test_allocator_model_models.py."""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperoffload.allocator_model import CachingAllocatorModel

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
