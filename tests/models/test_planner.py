"""The HyperOffload planner: valid, within budget, exact on real tensors, clear about infeasible budgets."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hyperoffload
from hyperoffload.analysis import memory_profile
from hyperoffload.budgets import hideable_budget, parse_budget
from hyperoffload.hardware import get_hardware
from hyperoffload.ir import ValueKind
from hyperoffload.plans import Kind, check_plan
from hyperoffload.policies import InfeasibleBudget, PlannerConfig, minimum_budget, plan_hyperoffload
from hyperoffload.policies.hyperoffload import made_share
from hyperoffload.runtime import run_plan, run_reference
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload
from helpers import results_of
from programs import op, program, random_programs, simple_hardware, value

TINY = get_workload("tiny-llama")
DEFAULTS = PlannerConfig()
H100 = get_hardware("h100-sxm")


@pytest.fixture(scope="module")
def tiny_train():
    return capture_workload(TINY, "train", fake=False)


@pytest.mark.parametrize("share", [0.9, 0.7, 0.5])
def test_tiny_plans_meet_their_budget(tiny_train, share):
    program = tiny_train.program
    budget = int(memory_profile(program).peak_bytes * share)
    plan = plan_hyperoffload(program, H100, budget)
    timeline = verify(plan, H100)
    assert check_plan(plan).peak_bytes <= budget
    assert timeline.figures.peak_bytes <= budget
    assert timeline.figures.h2d_bytes > 0


def test_planned_step_at_half_the_peak_is_bit_identical_on_real_tensors(tiny_train):
    """The project's correctness check: tiny-llama training at 50% of its no-offload peak, run with
    synchronous copies, gives the unplanned step's loss, gradients and updated state bit for bit."""
    program = tiny_train.program
    budget = parse_budget("50%", program, H100)
    plan = hyperoffload.plan(program, H100, budget)
    planned_inputs = [t.clone() for t in tiny_train.inputs]
    reference_inputs = [t.clone() for t in tiny_train.inputs]
    planned = run_plan(plan, planned_inputs)
    reference = run_reference(program, reference_inputs)
    assert all(torch.equal(a, b) for a, b in zip(planned.outputs, reference.outputs))  # the loss
    assert all(torch.equal(a, b) for a, b in zip(planned_inputs, reference_inputs))  # parameters and AdamW state
    assert planned.peak_bytes <= budget < reference.peak_bytes
    assert planned.h2d_bytes > 0 and planned.d2h_bytes > 0


def test_no_offload_needed_gives_the_captured_step(tiny_train):
    program = tiny_train.program
    plan = plan_hyperoffload(program, H100, memory_profile(program).peak_bytes)
    verify(plan, H100)
    assert all(i.kind is Kind.COMPUTE for i in plan.instructions)


def test_infeasible_budget_names_the_smallest_one(tiny_train):
    program = tiny_train.program
    least, why = minimum_budget(program)
    assert 0 < least < memory_profile(program).peak_bytes
    with pytest.raises(InfeasibleBudget, match="below the smallest this planner can meet") as error:
        plan_hyperoffload(program, H100, least - 1)
    assert error.value.min_budget_bytes == least
    assert "needs" in str(error.value) and why.split()[1] in str(error.value)  # names the op that sets it
    verify(plan_hyperoffload(program, H100, least), H100)  # and that budget itself works


def test_a_large_step_moves_activation_sized_storages_where_its_budget_needs_them():
    """Candidates are storages from 1/10,000 of the peak up, and near the smallest budget those meet, in a second
    set of starts, from ``PlannerConfig.small_storage_bytes`` up: on a step peaking at hundreds of GiB
    (``llama3-70b``), a 20 MiB activation is worth moving when nothing else would do."""
    x, y = 20 * 2**20, 100 * 2**20
    values = [value(0, 0, ValueKind.INPUT), value(1, x), value(2, 200), value(3, 300 * 2**30), value(4, 100),
              value(5, 100), value(6, y)]
    ops = [op(0, [0], [1, 6]), op(1, [0], [2]), op(2, [2], [3]), op(3, [3], [4]), op(4, [1, 4, 6], [5])]
    prog = program(values, ops, [0], [5])
    peak = memory_profile(prog).peak_bytes
    assert y > peak // 10_000 > x > DEFAULTS.small_storage_bytes
    hardware = simple_hardware(bw=1e10)
    least, _ = minimum_budget(prog)
    assert least == peak - x - y  # both leave while op2 and op3 run
    assert minimum_budget(prog, PlannerConfig(min_span_bytes=peak // 10_000))[0] == peak - y  # the share alone
    offloaded = {}
    for budget in (least, peak - y):
        plan = plan_hyperoffload(prog, hardware, budget)
        assert verify(plan, hardware).figures.peak_bytes <= budget
        offloaded[budget] = {i.target for i in plan.instructions if i.kind is Kind.OFFLOAD}
    assert offloaded == {least: {1, 6}, peak - y: {6}}  # moving y alone is as fast: no second copy
    # The static layout's re-plans keep the small storages where its budget needs them (a MiB over the smallest,
    # where packing the 100-byte values loses a few bytes to alignment).
    budget = least + 2**20
    arena = plan_hyperoffload(prog, hardware, budget, PlannerConfig(static_layout=True))
    assert arena.layout.arena_bytes <= budget and verify(arena, hardware).figures.peak_bytes <= budget
    assert {i.target for i in arena.instructions if i.kind is Kind.OFFLOAD} == {1, 6}


def test_budget_parsing(tiny_train):
    program = tiny_train.program
    peak = memory_profile(program).peak_bytes
    assert parse_budget("50%", program, H100) == peak // 2
    assert parse_budget("3MiB", program, H100) == 3 * 2**20
    assert parse_budget("hideable", program, H100) == hideable_budget(program, H100)
    for bad in ("lots", "0%", "150%"):
        with pytest.raises(ValueError):
            parse_budget(bad, program, H100)


@settings(max_examples=60, deadline=None)
@given(random_programs(), st.floats(0.3, 1.0), st.floats(0.5, 50.0))
def test_random_programs_plans_are_valid_and_within_budget(program, share, bandwidth):
    hardware = simple_hardware(bw=bandwidth * 100)
    peak = memory_profile(program).peak_bytes
    budget = int(peak * share)
    config = PlannerConfig(min_span_bytes=1)
    least, _ = minimum_budget(program, config)
    if budget < least:
        with pytest.raises(InfeasibleBudget):
            plan_hyperoffload(program, hardware, budget, config)
        return
    plan = plan_hyperoffload(program, hardware, budget, config)
    timeline = verify(plan, hardware)
    assert timeline.figures.peak_bytes <= budget
    assert redundant_offloads(plan) == []


def test_an_input_used_once_can_stay_remote_for_the_whole_step():
    """Its cyclic span starts and ends at the same op: it covers every other position, so the smallest
    budget is never above the peak (it once counted the input twice there)."""
    from programs import op, program, value

    from hyperoffload.ir import ValueKind

    prog = program([value(0, 4, ValueKind.INPUT), value(1, 0), value(2, 0)], [op(0, [0], [1]), op(1, [1], [2])],
                   [0], [1])
    config = PlannerConfig(min_span_bytes=1)
    least, _ = minimum_budget(prog, config)
    assert least == 4 == memory_profile(prog).peak_bytes  # op 0 reads it, so 4 bytes must be there then
    verify(plan_hyperoffload(prog, simple_hardware(), least, config), simple_hardware())


@pytest.mark.parametrize("bandwidth", [1e3, 1e6])
def test_a_budget_only_the_eager_order_meets_is_planned_in_it(bandwidth):
    """A small training-like step (found by fuzzing) where, at 80% of its peak, only the eager refined order is
    feasible and the link is too slow for it to offload for free: the planner skipped that order's pass and
    was left with no order at all (``min()`` of nothing). It must plan in the eager order instead."""
    import dataclasses

    from programs import op, program, value

    from hyperoffload.ir import Phase, ValueKind

    state, act, grad = ValueKind.OPTIMIZER_STATE, ValueKind.ACTIVATION, ValueKind.GRADIENT
    values = [value(0, 172, state), value(1, 172, state, 0), value(2, 172, state, 0), value(3, 124),
              value(4, 72, act), value(5, 188, act), value(6, 72, act, 4), value(7, 172, state, 0),
              value(8, 172, state, 0), value(9, 152, grad), value(10, 36, grad), value(11, 72, act, 4),
              value(12, 160, grad), value(13, 172, state, 0)]
    forward, backward, optimizer = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER
    shape = [((0,), (1, 2, 3), (0,), forward, 1000, False), ((1, 3), (4, 5), (), forward, 1, False),
             ((0, 4), (6,), (4,), forward, 10, True), ((0, 2), (7, 8), (), forward, 100, False),
             ((3,), (9,), (), backward, 10000, True), ((0, 6, 9), (10,), (), backward, 1, False),
             ((6, 8), (11, 12), (), optimizer, 10000, False), ((1, 2, 10), (13,), (2,), optimizer, 10000, False)]
    ops = [dataclasses.replace(op(i, ins, outs, mutates, flops), phase=phase, random=random)
           for i, (ins, outs, mutates, phase, flops, random) in enumerate(shape)]
    prog = program(values, ops, [0], [3, 9])
    hardware = simple_hardware(bw=bandwidth)
    budget = int(memory_profile(prog).peak_bytes * 0.8)
    plan = plan_hyperoffload(prog, hardware, budget)
    verify(plan, hardware)
    assert check_plan(plan).peak_bytes <= budget


def redundant_offloads(plan) -> list[str]:
    """Offloads of a storage whose remote copy is already current: one from earlier in the step, or, for a
    storage kept remote between steps (``plan.initial_remote``), the last step's, with no write since."""
    program = plan.program
    values = program.values
    current = set(plan.initial_remote)
    found = []
    for ins in plan.instructions:
        if ins.kind is Kind.OFFLOAD:
            if ins.target in current:
                found.append(values[ins.target].name)
            current.add(ins.target)
        elif ins.kind is Kind.COMPUTE:
            op = program.ops[ins.target]
            current -= {values[v].storage for v in op.mutates} | {v for v in op.outputs if values[v].owns_storage}
    return found


@pytest.mark.parametrize("hardware", ["h100-sxm", "gh200"])
def test_a_storage_goes_out_once_per_write(tiny_train, hardware):
    """A parameter kept in remote memory between steps comes back for its forward use and leaves again
    after it with no second copy out: the one sent after its update last step is current until this
    step's update."""
    program = tiny_train.program
    hw = get_hardware(hardware)
    peak = memory_profile(program).peak_bytes
    kept_remote = 0
    for budget in (int(peak * 0.5), int(peak * 0.3), minimum_budget(program)[0]):
        plan = plan_hyperoffload(program, hw, budget)
        verify(plan, hw)
        assert redundant_offloads(plan) == []
        kept_remote += sum(program.values[s].kind.value == "parameter" for s in plan.initial_remote)
    assert kept_remote, "no parameter was kept remote between steps: the case goes unexercised"


def test_planning_pauses_the_garbage_collector_and_restores_it(tiny_train):
    """The collector is off while the planner runs (it walks the whole captured program and finds nothing),
    on again after it, also when planning fails; a caller that turned it off keeps it off."""
    import gc
    import importlib

    from hyperoffload.gc_pause import collector_paused

    hyperoffload_policy = importlib.import_module("hyperoffload.policies.hyperoffload.driver")
    seen = []
    original = hyperoffload_policy._plan_forms

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    program = tiny_train.program
    peak = memory_profile(program).peak_bytes
    assert gc.isenabled()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hyperoffload_policy, "_plan_forms", spy)
        verify(plan_hyperoffload(program, "h100-sxm", peak // 2), "h100-sxm")
        with pytest.raises(InfeasibleBudget):
            plan_hyperoffload(program, "h100-sxm", 1)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        plan_hyperoffload(program, "h100-sxm", peak // 2)
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_state_first_start_where_saved_activations_are_much_of_the_peak():
    """tiny-deepseek training holds half its peak in storages it makes. On a slow link at 80% of the peak, taking
    state (cyclic spans) first where spans tie is 9% faster; the planner refines that start on its own and keeps
    the faster, so it is never slower than without it."""
    prog = capture_workload(get_workload("tiny-deepseek"), "train").program
    assert made_share(prog) >= DEFAULTS.state_first_from
    hardware = H100.replace(h2d_bw=5e8, d2h_bw=5e8, duplex_share=0.8)
    peak = memory_profile(prog).peak_bytes
    for share in (0.8, 0.6, 0.4):
        budget = int(peak * share)
        with_it = verify(plan_hyperoffload(prog, hardware, budget), hardware).figures
        without = verify(plan_hyperoffload(prog, hardware, budget, PlannerConfig(state_first=False)), hardware).figures
        assert with_it.peak_bytes <= budget and with_it.step_s <= without.step_s * (1 + 1e-12)
        if share == 0.8:
            assert with_it.step_s < 0.95 * without.step_s


def test_no_state_first_start_where_the_state_is_most_of_the_peak(tiny_train):
    """tiny-llama training (its saved activations under 40% of the peak) is planned as without the start."""
    program = tiny_train.program
    assert made_share(program) < DEFAULTS.state_first_from
    budget = memory_profile(program).peak_bytes // 2
    hardware = H100.replace(h2d_bw=5e8, d2h_bw=5e8, duplex_share=0.8)
    plans = [plan_hyperoffload(program, hardware, budget, PlannerConfig(state_first=on)) for on in (True, False)]
    assert plans[0].instructions == plans[1].instructions


def _kept_away_across_the_turn(plan, storage: int) -> bool:
    """Whether ``plan`` drops ``storage`` after its last read in the forward pass with no offload of its own and
    prefetches it for its next read after the forward pass."""
    program, instructions = plan.program, plan.instructions
    reads = [k for k, instr in enumerate(instructions) if instr.kind is Kind.COMPUTE
             and storage in {program.values[v].storage for v in program.ops[instr.target].inputs}]
    forward = [k for k in reads if program.ops[instructions[k].target].phase.value == "forward"]
    later = [k for k in reads if forward and k > forward[-1]]
    if not later:
        return False
    between = [i.kind for i in instructions[forward[-1] + 1:later[0]]
               if i.kind is not Kind.COMPUTE and i.target == storage]
    return Kind.OFFLOAD not in between and Kind.RELEASE in between and Kind.PREFETCH in between


def test_the_state_first_start_at_the_turn_keeps_parameter_shards_away_with_no_offload(monkeypatch):
    """tiny-llama sharded over 2 ranks: each parameter shard is read by an all-gather in the forward pass and again
    in the backward pass, and written by its update after. The state-first start at the turn
    (``PlannerConfig.state_first_turn``) keeps such shards in remote memory between steps and away from their
    forward read to their backward read with no offload of their own (the copy from the last step is current);
    its plans are valid and within the budget. Without the setting no such start is planned."""
    from hyperoffload.policies.hyperoffload import order_search

    prog = capture_workload(TINY, "train", world=2).program
    assert made_share(prog) >= DEFAULTS.state_first_from
    hardware = get_hardware("dgx-h100")
    budget = memory_profile(prog).peak_bytes // 2
    tried = results_of(monkeypatch, order_search, "_attempt")
    plan_hyperoffload(prog, hardware, budget, PlannerConfig(state_first_turn=False))
    assert tried and not any(t.turn for t in tried)
    tried.clear()
    plan_hyperoffload(prog, hardware, budget)
    turned = [t for t in tried if t.turn]
    assert turned and all(t.state_first for t in turned)
    shards = {s for s in (prog.values[v].storage for v in prog.inputs) if prog.values[s].kind is ValueKind.PARAMETER}
    for t in turned:
        assert check_plan(t.plan).peak_bytes <= budget
        away = [s for s in t.plan.initial_remote & shards if _kept_away_across_the_turn(t.plan, s)]
        assert len(away) >= len(shards) // 2, (len(away), len(shards))
