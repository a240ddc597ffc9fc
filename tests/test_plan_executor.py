"""run_plan: planned steps on real tensors match the unplanned step bit for bit, and the measured
device bytes match check_plan's accounting at every instruction."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten

from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan, PlanError, check_plan, plan_without_offload
from hyperoffload.runtime import run_reference
from hyperoffload.runtime.plan_executor import run_plan

START = -1
"""A round trip leaving at START is offloaded before the first op runs."""
END = None
"""A round trip returning at END is never prefetched: the step leaves the storage in remote memory."""


@pytest.fixture(scope="module")
def unplanned(captured):
    """run_reference and the eager step on clones of the inputs: (outputs, inputs after the step), each."""
    ref_inputs = [t.clone() for t in captured.inputs]
    ref = run_reference(captured.program, ref_inputs)
    eager_inputs = [t.clone() for t in captured.inputs]
    eager = [x for x in tree_flatten(captured.step(*eager_inputs))[0] if isinstance(x, torch.Tensor)]
    return ref, ref_inputs, eager, eager_inputs


def compute_uses(program, storage: int) -> list[int]:
    """Positions (captured order) of the ops that read or write ``storage``."""
    return [op.id for op in program.ops
            if storage in {program.values[v].storage for v in (*op.inputs, *op.outputs)}]


def longest_idle_gap(program, storage: int) -> tuple[int, int]:
    """The consecutive uses ``(a, b)`` of ``storage`` farthest apart. Nothing touches the storage strictly
    between them, so it is not mutated across the gap."""
    uses = compute_uses(program, storage)
    return max(zip(uses, uses[1:]), key=lambda ab: ab[1] - ab[0])


def idle_ops(program, storage: int) -> int:
    a, b = longest_idle_gap(program, storage)
    return b - a


def storage_named(program, name: str) -> int:
    value = next(v for v in program.values if v.name == name)
    assert value.owns_storage
    return value.id


def round_trip_plan(program, trips, initial_remote: dict[int, int] | None = None) -> Plan:
    """The captured order plus, for each ``(storage, after, before)``: offload, wait and release right after
    the op at ``after`` (or before any op, for START), and prefetch and wait right before the op at
    ``before`` (never, for END). ``initial_remote`` maps storages that start in remote memory to the op
    before which they are prefetched."""
    initial_remote = initial_remote or {}
    leave: dict[int, list[int]] = {}
    arrive: dict[int, list[int]] = {}
    for s, before in initial_remote.items():
        arrive.setdefault(before, []).append(s)
    for s, after, before in trips:
        leave.setdefault(after, []).append(s)
        if before is not END:
            arrive.setdefault(before, []).append(s)
    instrs: list[Instr] = []
    for s in leave.get(START, []):
        instrs += [Instr(Kind.OFFLOAD, s), Instr(Kind.WAIT, s), Instr(Kind.RELEASE, s)]
    for position in range(len(program.ops)):
        for s in arrive.get(position, []):
            instrs += [Instr(Kind.PREFETCH, s), Instr(Kind.WAIT, s)]
        instrs.append(Instr(Kind.COMPUTE, position))
        for s in leave.get(position, []):
            instrs += [Instr(Kind.OFFLOAD, s), Instr(Kind.WAIT, s), Instr(Kind.RELEASE, s)]
    return Plan(program=program, instructions=tuple(instrs), policy="hand", initial_remote=frozenset(initial_remote))


def offload_trips(program):
    """Round trips for several large storages across long idle gaps: parameters idle between their
    forward and backward / optimizer uses, optimizer state idle from the step's start to the optimizer
    (and one left in remote memory after its update), activations saved for the backward pass, and the
    returned loss, left in remote memory."""
    trips = []
    for name in ("embed.weight", "layers.0.attn.wq.weight", "output.weight"):
        param = storage_named(program, name)
        trips.append((param, *longest_idle_gap(program, param)))
    for name in ("exp_avg:embed.weight", "exp_avg_sq:embed.weight", "exp_avg:layers.0.ffn.w1.weight"):
        state = storage_named(program, name)
        trips.append((state, START, compute_uses(program, state)[0]))
    last_state = storage_named(program, "exp_avg_sq:output.weight")
    trips.append((last_state, compute_uses(program, last_state)[-1], END))
    loss = program.values[program.outputs[0]].storage
    trips.append((loss, compute_uses(program, loss)[-1], END))
    activations = [v.id for v in program.values
                   if v.owns_storage and v.kind is ValueKind.ACTIVATION and v.alloc_bytes >= 32768]
    activations.sort(key=lambda s: (-idle_ops(program, s), s))
    for s in activations[:6]:
        trips.append((s, *longest_idle_gap(program, s)))
    return trips


def plan_bytes(plan: Plan, kind: Kind) -> int:
    return sum(plan.program.values[i.target].alloc_bytes for i in plan.instructions if i.kind is kind)


def assert_identical(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


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
