"""Baseline policies: every plan is valid and verified, exact on real tensors, and each policy does what
the system it models does."""

from __future__ import annotations

import bisect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from programs import op, program, random_programs, simple_hardware, value

from hyperoffload.analysis import memory_profile
from hyperoffload.budgets import parse_budget
from hyperoffload.cost import op_times
from hyperoffload.hardware import get_hardware
from hyperoffload.ir import Phase, ValueKind
from hyperoffload.plans import Instr, Kind, check_plan
from hyperoffload.policies import (
    BASELINES,
    POLICIES,
    SHARDED_ONLY,
    DistanceConfig,
    ReactiveConfig,
    ZeroInfinityConfig,
    plan_distance,
    plan_layerwise,
    plan_reactive,
    plan_xla_hidden,
    plan_zero_infinity,
)
from hyperoffload.policies.common import elements
from hyperoffload.runtime import run_plan, run_reference
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload

H100 = get_hardware("h100-sxm")
# DeepSpeed's limits scaled to tiny-llama (its largest tensors have 65,536 elements), so that the policy
# moves parameters, gradients and optimizer state at all.
TINY_ZERO = ZeroInfinityConfig(persistence_threshold=10_000, prefetch_bucket_elements=100_000,
                               max_live_elements=400_000, max_reuse_distance=100_000)
VARIANTS = {
    **{name: POLICIES[name] for name in BASELINES if name not in SHARDED_ONLY},  # these steps are of one rank
    "reactive lookahead 3": lambda p, h, b: plan_reactive(p, h, b, ReactiveConfig(lookahead=3)),
    "zero-infinity scaled": lambda p, h, b: plan_zero_infinity(p, h, b, TINY_ZERO),
    "distance short": lambda p, h, b: plan_distance(p, h, b, DistanceConfig(select_distance=4, prefetch_distance=2,
                                                                           select_num=1000)),
}


@pytest.fixture(scope="module")
def tiny_train():
    return capture_workload(get_workload("tiny-llama"), "train", fake=False)


def redundant_offloads(plan) -> list[int]:
    """Indices of offloads of a storage whose remote copy is still current (not written since the last
    offload, or it started the step in remote memory)."""
    program = plan.program
    current = set(plan.initial_remote)
    redundant = []
    for i, ins in enumerate(plan.instructions):
        if ins.kind is Kind.OFFLOAD:
            if ins.target in current:
                redundant.append(i)
            current.add(ins.target)
        elif ins.kind is Kind.COMPUTE:
            o = program.ops[ins.target]
            current -= {program.values[v].storage for v in o.mutates}
    return redundant


def check_policy_plan(plan, hardware, budget):
    timeline = verify(plan, hardware)
    peak = check_plan(plan).peak_bytes
    if plan.budget_bytes is not None:  # it says it meets the budget: it must
        assert plan.budget_bytes == budget
        assert peak <= budget and timeline.figures.peak_bytes <= budget
    elif plan.policy != "none":  # it says it does not: it must not (``none`` never states a budget)
        assert peak > budget
    assert not redundant_offloads(plan)
    return timeline


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("share", [1.0, 0.7, 0.5, 0.3])
def test_tiny_llama_plans_are_valid_and_honest_about_the_budget(tiny_train, name, share):
    program = tiny_train.program
    budget = int(memory_profile(program).peak_bytes * share)
    check_policy_plan(VARIANTS[name](program, H100, budget), H100, budget)


@settings(max_examples=40, deadline=None)
@given(random_programs(), st.floats(0.2, 1.0), st.floats(0.5, 50.0), st.sampled_from(sorted(VARIANTS)))
def test_random_programs_plans_are_valid(prog, share, bandwidth, name):
    hardware = simple_hardware(bw=bandwidth * 100)
    budget = int(memory_profile(prog).peak_bytes * share)
    check_policy_plan(VARIANTS[name](prog, hardware, budget), hardware, budget)


@pytest.fixture(scope="module")
def tiny_reference(tiny_train):
    """The unplanned step's outputs and its inputs after the step (updated in place)."""
    inputs = [t.clone() for t in tiny_train.inputs]
    return run_reference(tiny_train.program, inputs).outputs, inputs


# ``none`` and ``zero-infinity`` with DeepSpeed's defaults move nothing on tiny-llama: nothing to check;
# ``distance short`` runs the same code as ``distance`` (its plans are checked above); ``kv-naive`` moves
# only a KV cache, which a training step has none of (its decode runs are checked below), and ``paged`` only
# a remote KV cache's blocks (tests/models/test_lane_runtime.py runs those).
MOVING = [name for name in VARIANTS if name not in ("none", "zero-infinity", "distance short", "kv-naive", "paged")]


@pytest.mark.parametrize("name", MOVING)
def test_plans_at_half_the_peak_run_bit_identically(tiny_train, tiny_reference, name):
    """The unplanned step's loss, gradients, parameters and AdamW state, bit for bit, and the executor's
    measured device bytes equal the plan's own accounting."""
    program = tiny_train.program
    budget = parse_budget("50%", program, H100)
    plan = VARIANTS[name](program, H100, budget)
    planned_inputs = [t.clone() for t in tiny_train.inputs]
    planned = run_plan(plan, planned_inputs)
    reference_outputs, reference_inputs = tiny_reference
    assert all(torch.equal(a, b) for a, b in zip(planned.outputs, reference_outputs))
    assert all(torch.equal(a, b) for a, b in zip(planned_inputs, reference_inputs))
    assert planned.live_bytes == check_plan(plan).live_bytes
    moved = sum(program.values[i.target].alloc_bytes for i in plan.instructions if i.kind is Kind.PREFETCH)
    assert planned.h2d_bytes == moved > 0


def lru_program():
    """Three 100-byte temporaries t0, t1, t2 made in turn, then read again: t0 (by op3), then t1 and t2."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 100), value(2, 100), value(3, 100), value(4, 4), value(5, 4)]
    ops = [op(0, [0], [1]), op(1, [0], [2]), op(2, [0], [3]), op(3, [1], [4]), op(4, [2, 3], [5])]
    return program(values, ops, [0], [4, 5])


def test_reactive_fetches_on_use_and_evicts_the_least_recently_used():
    prog = lru_program()
    budget = 4 + 200 + 8  # the input, two temporaries and the two small outputs
    plan = plan_reactive(prog, simple_hardware(), budget)
    check_policy_plan(plan, simple_hardware(), budget)
    released = [prog.values[i.target].name for i in plan.instructions if i.kind is Kind.RELEASE]
    assert released == ["v1", "v2"]  # t0 before op2 (t0 is least recent), then t1 before op3 fetches t0 back
    kinds = [i.kind for i in plan.instructions]
    for k, kind in enumerate(kinds):
        if kind is Kind.PREFETCH:  # blocking: the wait follows at once
            assert kinds[k + 1] is Kind.WAIT and plan.instructions[k + 1].target == plan.instructions[k].target


def test_reactive_lookahead_fetches_ahead():
    """a is evicted while b and c are made; once they are freed there is room to fetch a ahead of op5."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 100), value(2, 100), value(3, 100), value(4, 4), value(5, 4),
              value(6, 4)]
    ops = [op(0, [0], [1]), op(1, [0], [2]), op(2, [0], [3]), op(3, [2, 3], [4]), op(4, [0], [5]), op(5, [1], [6])]
    prog = program(values, ops, [0], [4, 5, 6])
    kinds = lambda plan: [i.kind for i in plan.instructions]
    on_demand = plan_reactive(prog, simple_hardware(), 212)
    ahead = plan_reactive(prog, simple_hardware(), 212, ReactiveConfig(lookahead=2))
    for plan in (on_demand, ahead):
        check_policy_plan(plan, simple_hardware(), 212)
    k_on_demand = [k for k, i in enumerate(on_demand.instructions) if i.kind is Kind.PREFETCH]
    k_ahead = [k for k, i in enumerate(ahead.instructions) if i.kind is Kind.PREFETCH]
    assert len(k_on_demand) == len(k_ahead) == 1
    assert kinds(on_demand)[k_on_demand[0] + 1] is Kind.WAIT  # blocking, right before op5
    assert ahead.instructions[k_ahead[0] + 1] == Instr(Kind.COMPUTE, 4)  # fetched before op4, waited before op5
    with pytest.raises(ValueError, match="lookahead"):
        plan_reactive(prog, simple_hardware(), 212, ReactiveConfig(lookahead=-1))


def test_reactive_below_one_ops_working_set_reports_what_it_needs():
    prog = lru_program()
    plan = plan_reactive(prog, simple_hardware(), 150)  # op4 alone reads 200 bytes
    assert plan.budget_bytes is None and check_plan(plan).peak_bytes > 150
    verify(plan, simple_hardware())


def test_reactive_state_is_the_same_at_the_start_and_end_of_a_step(tiny_train):
    """Step after step replays the same plan: the simulator times it in steady state without errors."""
    program = tiny_train.program
    plan = plan_reactive(program, H100, parse_budget("30%", program, H100))
    assert plan.initial_remote  # at 30% the parameters and moments do not all fit
    assert verify(plan, H100).figures.steady_state


def chain_program(length: int):
    """x -> a (200 B) -> ``length`` ops on small temporaries -> read a again."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 200)]
    ops = [op(0, [0], [1])]
    for k in range(length):
        values.append(value(len(values), 4))
        ops.append(op(len(ops), [len(values) - 2 if k else 0], [len(values) - 1]))
    values.append(value(len(values), 4))
    ops.append(op(len(ops), [1, len(values) - 2], [len(values) - 1]))
    return program(values, ops, [0], [len(values) - 1])


@pytest.mark.parametrize("length, offloaded", [(150, True), (60, False)])
def test_distance_offloads_only_gaps_longer_than_select_distance(length, offloaded):
    prog = chain_program(length)
    plan = plan_distance(prog, simple_hardware(), 10**6)
    check_policy_plan(plan, simple_hardware(), 10**6)
    instrs = plan.instructions
    prefetches = [k for k, i in enumerate(instrs) if i.kind is Kind.PREFETCH]
    assert bool(prefetches) == offloaded
    if offloaded:
        position = sum(1 for i in instrs[:prefetches[0]] if i.kind is Kind.COMPUTE)
        assert position == length + 1 - 50  # prefetch_distance ops before the reader
        release = next(k for k, i in enumerate(instrs) if i.kind is Kind.RELEASE)
        assert sum(1 for i in instrs[:release] if i.kind is Kind.COMPUTE) == 1  # right after the last use


def test_distance_takes_at_most_select_num_tensors(tiny_train):
    program = tiny_train.program
    config = DistanceConfig(select_distance=4, select_num=3)
    plan = plan_distance(program, H100, 10**9, config)
    assert len({i.target for i in plan.instructions if i.kind is Kind.RELEASE}) == 3


def test_layerwise_offloads_every_saved_activation_and_reloads_it_at_first_backward_use(tiny_train):
    program = tiny_train.program
    plan = plan_layerwise(program, H100, 10**9)
    check_policy_plan(plan, H100, 10**9)
    values = program.values
    saved = {v.id for v in values if v.owns_storage and v.kind is ValueKind.ACTIVATION and v.alloc_bytes >= 1024
             and any(o.phase is Phase.BACKWARD and v.id in {values[x].storage for x in o.inputs}
                     for o in program.ops)}
    offloaded = [i.target for i in plan.instructions if i.kind is Kind.OFFLOAD]
    assert sorted(offloaded) == sorted(saved) and saved
    instrs = plan.instructions
    for k, ins in enumerate(instrs):
        if ins.kind is Kind.PREFETCH:  # then only other reloads, and waits, before the op that needs it
            nxt = next(j for j in range(k, len(instrs)) if instrs[j].kind is Kind.COMPUTE)
            o = program.ops[instrs[nxt].target]
            assert o.phase is Phase.BACKWARD and ins.target in {values[x].storage for x in o.inputs}


def test_xla_hidden_offloads_only_what_the_compute_between_uses_hides(tiny_train):
    program = tiny_train.program
    budget = parse_budget("80%", program, H100)
    plan = plan_xla_hidden(program, H100, budget)
    check_policy_plan(plan, H100, budget)
    times = op_times(program, H100)
    start = [0.0]
    for t in times:
        start.append(start[-1] + t)
    position = 0
    last_use: dict[int, int] = {}
    chosen = []
    for ins in plan.instructions:
        if ins.kind is Kind.COMPUTE:
            o = program.ops[ins.target]
            for s in {program.values[v].storage for v in (*o.inputs, *o.outputs)}:
                last_use[s] = position
            position += 1
        elif ins.kind is Kind.RELEASE:
            chosen.append((ins.target, last_use[ins.target]))
    assert chosen
    for s, first in chosen:
        uses = [o.id for o in program.ops if s in {program.values[v].storage for v in (*o.inputs, *o.outputs)}]
        nxt = uses[bisect.bisect_right(uses, first)]
        size = program.values[s].alloc_bytes
        copies = 2 * H100.h2d_latency_s + size / H100.d2h_bw + size / H100.h2d_bw
        assert start[nxt] - start[first + 1] >= copies


def test_xla_hidden_offloads_nothing_over_a_slow_link(tiny_train):
    program = tiny_train.program
    slow = H100.replace(h2d_bw=1e3, d2h_bw=1e3)
    plan = plan_xla_hidden(program, slow, parse_budget("80%", program, slow))
    assert all(i.kind is Kind.COMPUTE for i in plan.instructions) and plan.budget_bytes is None


def test_zero_infinity_keeps_state_remote_and_prefetches_within_its_limits(tiny_train):
    program = tiny_train.program
    plan = plan_zero_infinity(program, H100, 10**9, TINY_ZERO)
    timeline = check_policy_plan(plan, H100, 10**9)
    assert timeline.figures.steady_state
    values = program.values
    big_state = {v.id for v in values if v.owns_storage and v.id in {values[i].storage for i in program.inputs}
                 and v.kind in (ValueKind.PARAMETER, ValueKind.OPTIMIZER_STATE) and elements(v) >= 10_000}
    assert plan.initial_remote == big_state
    instrs = plan.instructions
    ahead: dict[int, int] = {}  # fetched before the op that needs it: elements, not yet in use
    group: list = []  # the cache instructions before one compute
    for ins in instrs:
        if ins.kind is not Kind.COMPUTE:
            group.append(ins)
            continue
        waited = {i.target for i in group if i.kind is Kind.WAIT}
        for s in waited:
            ahead.pop(s, None)  # its op starts now: no longer ahead
        for i in group:
            if i.kind is Kind.PREFETCH and i.target not in waited:
                # DeepSpeed checks the limit before each fetch, so one fetch may pass it.
                assert sum(ahead.values()) < TINY_ZERO.prefetch_bucket_elements
                ahead[i.target] = elements(values[i.target])
        group = []
    assert any(i.kind is Kind.PREFETCH for i in instrs)
    gradients = {i.target for i in plan.instructions if i.kind is Kind.OFFLOAD
                 and values[i.target].kind is ValueKind.GRADIENT}
    assert gradients  # moved off the device as the backward pass produces them


def test_zero_infinity_defaults_leave_small_tensors_on_the_device(tiny_train):
    program = tiny_train.program
    plan = plan_zero_infinity(program, H100, 10**9)  # every tiny-llama tensor is under 1e5 elements
    assert not plan.initial_remote and all(i.kind is Kind.COMPUTE for i in plan.instructions)


def test_kv_naive_fetches_the_whole_cache_each_decode_step_and_runs_exactly():
    from hyperoffload.ir import ValueKind
    from hyperoffload.plans import plan_without_offload
    from hyperoffload.policies import plan_kv_naive
    from hyperoffload.runtime import run_plan
    from hyperoffload.simulate import simulate
    from hyperoffload.workloads import capture_workload, get_workload

    captured = capture_workload(get_workload("tiny-llama"), "decode", fake=False)
    prog = captured.program
    hardware = get_hardware("h100-sxm")
    unplanned_peak = memory_profile(prog).peak_bytes
    plan = plan_kv_naive(prog, hardware, unplanned_peak)
    verify(plan, hardware)
    cache = {prog.values[v].storage for v in prog.inputs if prog.values[v].kind is ValueKind.KV_CACHE}
    cache_bytes = sum(prog.values[s].alloc_bytes for s in cache)
    figures = simulate(plan, hardware).figures
    assert figures.steady_state
    assert figures.h2d_bytes == cache_bytes and figures.d2h_bytes == cache_bytes  # all in, all written back
    assert figures.peak_bytes < unplanned_peak
    planned_inputs = [t.clone() for t in captured.inputs]
    reference_inputs = [t.clone() for t in captured.inputs]
    planned = run_plan(plan, planned_inputs)
    reference = run_plan(plan_without_offload(prog), reference_inputs)
    assert all(torch.equal(a, b) for a, b in zip(planned.outputs, reference.outputs))
    assert all(torch.equal(a, b) for a, b in zip(planned_inputs, reference_inputs))  # the cache, updated


def test_kv_naive_is_the_captured_step_without_a_cache_and_compare_leaves_it_out():
    from hyperoffload.compare import compare
    from hyperoffload.plans import Kind
    from hyperoffload.policies import plan_kv_naive
    from hyperoffload.workloads import capture_workload, get_workload

    hardware = get_hardware("h100-sxm")
    train = capture_workload(get_workload("tiny-llama"), "train").program
    plan = plan_kv_naive(train, hardware, memory_profile(train).peak_bytes)
    assert all(i.kind is Kind.COMPUTE for i in plan.instructions)
    budget = memory_profile(train).peak_bytes
    assert "kv-naive" not in [r.policy for r in compare(train, hardware, budget, None)]
    decode = capture_workload(get_workload("tiny-llama"), "decode").program
    assert "kv-naive" in [r.policy for r in compare(decode, hardware, memory_profile(decode).peak_bytes, None)]
