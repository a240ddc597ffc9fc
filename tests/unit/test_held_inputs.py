"""Plan passes for steps whose caller keeps its own tensors (``hyperoffload.compile.held_inputs``)."""

from __future__ import annotations

from hyperoffload.compile.held_inputs import start_released_inputs_remote, without_current_offloads
from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan, check_plan
from programs import op, program, value

W = 0  # a parameter: read by op0 and op2, updated in place by op3


def _step():
    values = [value(W, 1000, ValueKind.PARAMETER), value(1, 400), value(2, 400), value(3, 400), value(4, 1000, storage=W)]
    ops = [op(0, [W], [1]), op(1, [1], [2]), op(2, [W, 2], [3]), op(3, [W, 3], [4], mutates=[W])]
    return program(values, ops, [W], [3])


def _instructions(*spec):
    return tuple(Instr(kind, target) for kind, target in spec)


C, O, P, WT, R = Kind.COMPUTE, Kind.OFFLOAD, Kind.PREFETCH, Kind.WAIT, Kind.RELEASE


def test_an_offload_of_what_remote_memory_already_holds_is_dropped_with_its_wait():
    prog = _step()
    plan = Plan(program=prog, policy="test", initial_remote=frozenset({W}), instructions=_instructions(
        (P, W), (WT, W), (C, 0), (O, W), (WT, W), (R, W), (C, 1), (P, W), (WT, W), (C, 2), (C, 3), (O, W)))
    check_plan(plan)
    dropped = without_current_offloads(plan)
    assert dropped.instructions == _instructions(
        (P, W), (WT, W), (C, 0), (R, W), (C, 1), (P, W), (WT, W), (C, 2), (C, 3), (O, W))  # written by op3: sent
    check_plan(dropped)
    assert without_current_offloads(dropped) is dropped


def test_an_input_released_on_the_device_starts_remote_and_its_first_offload_goes():
    prog = _step()
    plan = Plan(program=prog, policy="test", instructions=_instructions(
        (C, 0), (O, W), (R, W), (C, 1), (P, W), (WT, W), (C, 2), (C, 3)))
    check_plan(plan)
    held = start_released_inputs_remote(plan)
    assert held.initial_remote == frozenset({W}) and held.instructions[:2] == _instructions((P, W), (WT, W))
    dropped = without_current_offloads(held)
    assert (O, W) not in [(i.kind, i.target) for i in dropped.instructions]
    assert check_plan(dropped).peak_bytes <= check_plan(held).peak_bytes
