"""The caching allocator model: hand-computed cases, its block invariants, and plans replayed through it."""

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from hyperoffload.allocator_model import CachingAllocatorModel, fragmentation_figures, replay_caching_allocator
from hyperoffload.analysis import memory_profile
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import plan_hyperoffload
from hyperoffload.workloads import capture_workload, get_workload
from programs import simple_hardware

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
