"""Static memory layout on a captured tiny-llama training step: the planner keeps its arena within the budget,
keeps the faster of early and just-in-time prefetches, aligns every slot, and moves prefetches no later."""

from dataclasses import replace

import pytest
from programs import simple_hardware

from hyperoffload.analysis import memory_profile
from hyperoffload.layout import assign_offsets, check_layout, prefetch_into_arena
from hyperoffload.plans import Kind, Plan, check_plan
from hyperoffload.policies import PlannerConfig, plan_hyperoffload
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload

LAYOUT = PlannerConfig(static_layout=True)


def test_tiny_llama_static_layout_at_half_the_peak():
    prog = capture_workload(get_workload("tiny-llama"), "train").program
    budget = int(memory_profile(prog).peak_bytes * 0.5)
    hardware = simple_hardware(bw=1e8)
    plan = plan_hyperoffload(prog, hardware, budget, LAYOUT)
    verify(plan, hardware)
    assert plan.layout.arena_bytes <= budget
    assert any(i.kind is Kind.PREFETCH for i in plan.instructions)
    free = plan_hyperoffload(prog, hardware, budget)
    assert free.layout is None
    # the arena promise is kept by planning for fewer live bytes than the budget when packing loses some
    assert check_plan(plan).peak_bytes <= check_plan(free).peak_bytes


@pytest.mark.parametrize("hardware_name, share", [("h100-sxm", 0.4), ("a100-80g", 0.3), ("h100-sxm", 0.6)])
def test_static_layout_keeps_the_faster_of_early_and_just_in_time_prefetches(hardware_name, share):
    """With a layout the planner plans twice, prefetching as early as the live bytes allow and just in time
    (then early only into free slots of the arena), and keeps the faster. On tiny-llama the just-in-time plan
    is the faster at 40% on h100-sxm and 30% on a100-80g."""
    from hyperoffload.hardware import get_hardware
    from hyperoffload.policies.hyperoffload import plan_in_arena
    from hyperoffload.simulate import simulate

    prog = capture_workload(get_workload("tiny-llama"), "train").program
    budget = int(memory_profile(prog).peak_bytes * share)
    hardware = get_hardware(hardware_name)
    plans = {"kept": plan_hyperoffload(prog, hardware, budget, LAYOUT),
             "early": plan_in_arena(prog, hardware, budget, LAYOUT)[0],
             "just in time": plan_in_arena(prog, hardware, budget, replace(LAYOUT, early_prefetch=False))[0]}
    step = {}
    for name, plan in plans.items():
        verify(plan, hardware)
        assert plan.layout.arena_bytes <= budget
        step[name] = simulate(plan, hardware).figures.step_s
    assert step["kept"] == min(step["early"], step["just in time"])


def test_static_layout_with_just_in_time_prefetches_only_is_a_plan():
    prog = capture_workload(get_workload("tiny-llama"), "train").program
    budget = int(memory_profile(prog).peak_bytes * 0.5)
    hardware = simple_hardware(bw=1e8)
    plan = plan_hyperoffload(prog, hardware, budget, replace(LAYOUT, early_prefetch=False))
    assert isinstance(plan, Plan) and plan.layout.arena_bytes <= budget
    verify(plan, hardware)


def test_prefetch_into_arena_moves_prefetches_no_later():
    prog = capture_workload(get_workload("tiny-llama"), "train").program
    budget = int(memory_profile(prog).peak_bytes * 0.6)
    hardware = simple_hardware(bw=1e8)
    plan = plan_hyperoffload(prog, hardware, budget)
    layout = assign_offsets(plan)
    plan = replace(plan, budget_bytes=layout.arena_bytes, layout=layout)
    moved, moved_layout = prefetch_into_arena(plan, layout)
    check_layout(moved_layout)
    verify(moved, hardware)

    def prefetch_positions(p):
        compute = 0
        at = []
        for ins in p.instructions:
            if ins.kind is Kind.COMPUTE:
                compute += 1
            elif ins.kind is Kind.PREFETCH:
                at.append((ins.target, compute))
        return sorted(at)

    before, after = prefetch_positions(plan), prefetch_positions(moved)
    assert [s for s, _ in before] == [s for s, _ in after]
    assert all(a <= b for (_, a), (_, b) in zip(after, before))
    assert sum(a < b for (_, a), (_, b) in zip(after, before)) > 0


def test_every_slot_is_aligned():
    from hyperoffload.layout import ALIGNMENT

    prog = capture_workload(get_workload("tiny-llama"), "train").program
    plan = plan_hyperoffload(prog, simple_hardware(bw=1e8), int(memory_profile(prog).peak_bytes * 0.6), LAYOUT)
    assert plan.layout.offsets and all(offset % ALIGNMENT == 0 for offset in plan.layout.offsets)
    assert plan.layout.arena_bytes % ALIGNMENT == 0
