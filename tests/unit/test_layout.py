"""Static memory layout: residencies, packing, arena checks, and the planner's arena promise, on programs built
by hand. On a captured tiny-llama step: tests/models/test_layout_models.py."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperoffload.analysis import memory_profile
from hyperoffload.ir import ValueKind
from hyperoffload.layout import (ALIGNMENT, Layout, LayoutError, Residency, _first_fit, arena_stalls, arena_use,
                                 assign_offsets, check_layout, pack_blocks, prefetch_into_arena, residencies)
from hyperoffload.plans import Instr, Kind, Plan, check_plan, plan_without_offload
from hyperoffload.policies import InfeasibleBudget, PlannerConfig, plan_hyperoffload
from hyperoffload.verify import VerificationError, verify
from programs import op, program, random_programs, simple_hardware, value

LAYOUT = PlannerConfig(static_layout=True)


def chain():
    """x -> a -> b -> c, each op reading the previous value; x is a step input."""
    values = [value(0, 512), value(1, 1024), value(2, 512), value(3, 1024)]  # whole slots (ALIGNMENT)
    ops = [op(0, [0], [1]), op(1, [1], [2]), op(2, [2], [3])]
    return program(values, ops, [0], [3])


def test_residencies_follow_allocations_and_frees():
    prog = chain()
    found = residencies(plan_without_offload(prog))
    by_storage = {r.storage: (r.start, r.end) for r in found}
    # the input is on the device before the step and held past it; the output is held past it;
    # intermediates live from their producer to their last reader
    assert by_storage == {0: (-1, 3), 1: (0, 2), 2: (1, 3), 3: (2, 3)}


def test_a_released_and_prefetched_storage_has_two_residencies():
    values = [value(0, 400), value(1, 400), value(2, 400), value(3, 400)]
    ops = [op(0, [0], [1]), op(1, [1], [2]), op(2, [2], [3]), op(3, [1, 3], [])]
    prog = program(values, ops, [0], [])
    c, o, r, p, w = Kind.COMPUTE, Kind.OFFLOAD, Kind.RELEASE, Kind.PREFETCH, Kind.WAIT
    instrs = [Instr(c, 0), Instr(c, 1), Instr(o, 1), Instr(r, 1), Instr(c, 2), Instr(p, 1), Instr(w, 1), Instr(c, 3)]
    plan = Plan(program=prog, instructions=tuple(instrs))
    spans = [(x.start, x.end) for x in residencies(plan) if x.storage == 1]
    assert spans == [(0, 4), (5, 8)]  # the release frees the bytes for the instruction after it


def test_lifo_lifetimes_pack_without_overhead():
    layout = assign_offsets(plan_without_offload(chain()))
    assert layout.arena_bytes == layout.live_peak_bytes == check_plan(plan_without_offload(chain())).peak_bytes
    check_layout(layout)


def greedy_by_size(start, end, size):
    """The arena of the old packing: largest block first (longest-lived among equals), each at the lowest gap."""
    offsets = _first_fit(np.lexsort((start - end, -size)), start, end, size)
    return int((offsets + size).max())


def live_peak(start, end, size):
    return max(sum(int(z) for s, e, z in zip(start, end, size) if s <= t < e) for t in range(min(start), max(end)))


def test_equal_sized_chain_packs_at_the_live_peak_where_greedy_by_size_did_not():
    # a -> b -> c -> d, all the same size, each read a while after it is made: at most two are live at
    # once. Greedy by size places the longest-lived first (d, then a, both at 0), then b above a and c
    # above b: three slots. Placing them as they come in time needs two.
    values = [value(0, 0, ValueKind.INPUT), *(value(v, 2 * ALIGNMENT) for v in (1, 2, 3, 4))]
    ops = [op(0, [0], [1]), op(1, [1], []), op(2, [1], []), op(3, [1], [2]), op(4, [2], [3]), op(5, [3], [4]),
           *(op(k, [4], []) for k in (6, 7, 8, 9))]
    plan = plan_without_offload(program(values, ops, [0], [4]))
    layout = assign_offsets(plan)
    spans = [(r.start, r.end) for r in layout.residencies]
    assert spans == [(0, 4), (3, 5), (4, 6), (5, 10)]
    start, end = (np.array(x) for x in zip(*spans))
    size = np.full(4, 2 * ALIGNMENT)
    assert greedy_by_size(start, end, size) == 3 * 2 * ALIGNMENT
    assert layout.arena_bytes == layout.live_peak_bytes == check_plan(plan).peak_bytes == 2 * 2 * ALIGNMENT
    check_layout(layout)


@st.composite
def blocks(draw):
    """Random blocks: (start, end, bytes), any of which may live over the whole step, many of a few equal sizes."""
    n = draw(st.integers(1, 40))
    horizon = draw(st.integers(2, 60))
    sizes = st.sampled_from([1, 256, 512, 768, 4096]) | st.integers(1, 10_000)
    start, end, size = [], [], []
    for _ in range(n):
        s = draw(st.integers(-1, horizon - 1))
        start.append(s)
        end.append(draw(st.integers(s + 1, horizon)))
        size.append(draw(sizes))
    return np.array(start, np.int64), np.array(end, np.int64), np.array(size, np.int64)


@settings(max_examples=300, deadline=None)
@given(blocks())
def test_packing_random_blocks_never_overlaps_live_blocks(drawn):
    start, end, size = drawn
    offsets = pack_blocks(start, end, size)
    arena = int((offsets + size).max())
    assert (offsets >= 0).all()
    for i in range(size.size):
        for j in range(i):
            if start[i] < end[j] and start[j] < end[i]:  # live at once: disjoint bytes
                assert offsets[i] + size[i] <= offsets[j] or offsets[j] + size[j] <= offsets[i]
    assert arena >= live_peak(start, end, size)
    assert arena <= greedy_by_size(start, end, size)
    found = tuple(Residency(k, int(s), int(e), int(z)) for k, (s, e, z) in enumerate(zip(start, end, size)))
    check_layout(Layout(residencies=found, offsets=tuple(int(o) for o in offsets), arena_bytes=arena,
                        live_peak_bytes=live_peak(start, end, size)))


def test_a_block_that_never_lives_is_refused():
    with pytest.raises(ValueError, match="start < end"):
        pack_blocks(np.array([0, 3]), np.array([2, 3]), np.array([256, 256]))


def test_a_layout_with_two_live_storages_on_the_same_bytes_is_caught():
    plan = plan_without_offload(chain())
    layout = assign_offsets(plan)
    broken = replace(layout, offsets=(0,) * len(layout.offsets))
    assert arena_stalls(broken) > 0
    with pytest.raises(LayoutError, match="land on bytes still in use"):
        check_layout(broken)
    with pytest.raises(VerificationError, match="bytes still in use"):
        verify(replace(plan, layout=broken))
    top = max(o + r.nbytes for o, r in zip(layout.offsets, layout.residencies))
    assert arena_stalls(replace(layout, arena_bytes=top - 1)) > 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.sampled_from([1.0, 0.8, 0.6]))
def test_random_plans_pack_validly(prog, share):
    budget = int(memory_profile(prog).peak_bytes * share)
    hardware = simple_hardware(bw=1e9)
    try:
        plan = plan_hyperoffload(prog, hardware, budget)
    except InfeasibleBudget:
        return
    layout = assign_offsets(plan)
    assert layout.arena_bytes >= layout.live_peak_bytes == check_plan(plan).peak_bytes
    assert arena_stalls(layout) == 0
    # Prefetching into the arena keeps live bytes within the arena (which may be over a budget the
    # plan was made for without a layout: the planner only does this when the arena fits).
    arena_plan = replace(plan, budget_bytes=max(budget, layout.arena_bytes), layout=layout)
    moved, moved_layout = prefetch_into_arena(arena_plan, layout)
    verify(moved, hardware)
    assert moved_layout.arena_bytes == layout.arena_bytes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.sampled_from([0.9, 0.7]))
def test_static_layout_plans_keep_their_arena_within_budget(prog, share):
    budget = int(memory_profile(prog).peak_bytes * share)
    hardware = simple_hardware(bw=1e9)
    try:
        plan = plan_hyperoffload(prog, hardware, budget, LAYOUT)
    except InfeasibleBudget as error:
        assert error.min_budget_bytes > budget or error.min_budget_bytes < 0
        return
    assert plan.layout is not None and plan.layout.arena_bytes <= budget
    verify(plan, hardware)


def test_empty_layout():
    prog = program([value(0, 0)], [], [0], [0])
    layout = assign_offsets(plan_without_offload(prog))
    assert layout == Layout(residencies=(), offsets=(), arena_bytes=0, live_peak_bytes=0)


def test_arena_use_gives_the_top_byte_and_the_live_bytes_at_each_instruction():
    # A lives over instructions 0-1 at the bottom, B over 1-3 above it, C over 2-3 back at the bottom:
    # at instruction 2 only 300 bytes are live but B still sits at 256, so the top is 512.
    found = (Residency(0, 0, 2, 256), Residency(1, 1, 4, 256), Residency(2, 2, 4, 44))
    layout = Layout(residencies=found, offsets=(0, 256, 0), arena_bytes=512, live_peak_bytes=512)
    top, live = arena_use(layout, np.array([0, 1, 2, 3]))
    assert top.tolist() == [256, 512, 512, 512]
    assert live.tolist() == [256, 512, 300, 300]
