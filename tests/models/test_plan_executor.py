"""run_plan: planned steps on real tensors match the unplanned step bit for bit, and the measured
device bytes match check_plan's accounting at every instruction."""

from __future__ import annotations

import pytest
import torch
from runtime_checks import (assert_identical, compute_uses, longest_idle_gap, offload_trips, plan_bytes,
                            round_trip_plan, storage_named)
from torch.utils._pytree import tree_flatten

from hyperoffload.ir import ValueKind
from hyperoffload.plans import Kind, Plan, PlanError, check_plan, plan_without_offload
from hyperoffload.runtime import run_plan, run_reference


@pytest.fixture(scope="module")
def unplanned(captured):
    """run_reference and the eager step on clones of the inputs: (outputs, inputs after the step), each."""
    ref_inputs = [t.clone() for t in captured.inputs]
    ref = run_reference(captured.program, ref_inputs)
    eager_inputs = [t.clone() for t in captured.inputs]
    eager = [x for x in tree_flatten(captured.step(*eager_inputs))[0] if isinstance(x, torch.Tensor)]
    return ref, ref_inputs, eager, eager_inputs


def test_no_offload_plan_measures_what_run_reference_measures(captured, unplanned):
    ref, ref_inputs, _, _ = unplanned
    inputs = [t.clone() for t in captured.inputs]
    plan = plan_without_offload(captured.program)
    run = run_plan(plan, inputs)
    assert run.live_bytes == ref.live_bytes == check_plan(plan).live_bytes
    assert run.peak_bytes == ref.peak_bytes
    assert run.h2d_bytes == run.d2h_bytes == 0
    assert_identical(run.outputs, ref.outputs)
    assert_identical(inputs, ref_inputs)


def test_round_trips_give_the_unplanned_step_bit_for_bit_under_a_lower_peak(captured, unplanned):
    program = captured.program
    ref, ref_inputs, eager, eager_inputs = unplanned
    trips = offload_trips(program)
    kinds = {program.values[s].kind for s, _, _ in trips}
    assert {ValueKind.PARAMETER, ValueKind.OPTIMIZER_STATE, ValueKind.ACTIVATION} <= kinds
    plan = round_trip_plan(program, trips)
    check = check_plan(plan)

    inputs = [t.clone() for t in captured.inputs]
    originals = [t.untyped_storage().data_ptr() for t in inputs]
    run = run_plan(plan, inputs)

    assert_identical(run.outputs, ref.outputs)
    assert_identical(inputs, ref_inputs)
    assert_identical(run.outputs, eager)
    assert_identical(inputs, eager_inputs)
    # The caller's tensors themselves hold the update, not replacements.
    assert [t.untyped_storage().data_ptr() for t in inputs] == originals

    assert run.live_bytes == check.live_bytes
    assert run.peak_bytes == check.peak_bytes
    assert run.peak_bytes < ref.peak_bytes
    assert run.d2h_bytes == plan_bytes(plan, Kind.OFFLOAD) > 0
    assert run.h2d_bytes == plan_bytes(plan, Kind.PREFETCH) > 0


def test_storage_starting_in_remote_memory_is_prefetched_and_updated_in_the_callers_tensor(captured, unplanned):
    program = captured.program
    ref, ref_inputs, _, _ = unplanned
    state = storage_named(program, "exp_avg:output.weight")
    plan = round_trip_plan(program, [], initial_remote={state: compute_uses(program, state)[0]})
    check = check_plan(plan)
    inputs = [t.clone() for t in captured.inputs]
    run = run_plan(plan, inputs)
    assert run.live_bytes == check.live_bytes
    assert run.peak_bytes == check.peak_bytes < ref.peak_bytes
    assert run.d2h_bytes == 0 and run.h2d_bytes == program.values[state].alloc_bytes
    assert_identical(run.outputs, ref.outputs)
    assert_identical(inputs, ref_inputs)


@pytest.mark.parametrize("broken, message", [
    ("release without offload", "release of embed.weight loses its data"),
    ("no prefetch", "reads embed.weight, which is not on the device"),
])
def test_invalid_plan_raises_before_running(captured, broken, message):
    program = captured.program
    param = storage_named(program, "embed.weight")
    a, b = longest_idle_gap(program, param)
    instrs = round_trip_plan(program, [(param, a, b)]).instructions
    if broken == "release without offload":
        instrs = tuple(i for i in instrs if not (i.kind in (Kind.OFFLOAD, Kind.WAIT) and i.target == param))
    else:
        instrs = tuple(i for i in instrs if not (i.kind is Kind.PREFETCH and i.target == param))
        last_wait = max(n for n, i in enumerate(instrs) if i.kind is Kind.WAIT and i.target == param)
        instrs = instrs[:last_wait] + instrs[last_wait + 1:]
    inputs = [t.clone() for t in captured.inputs]
    before = [t.clone() for t in inputs]
    with pytest.raises(PlanError, match=message):
        run_plan(Plan(program=program, instructions=instrs), inputs)
    assert_identical(inputs, before)
