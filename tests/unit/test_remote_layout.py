"""``remote_layout``: a remote copy lives from its offload until its last prefetch has landed (over the whole step
when the caller keeps the storage past it), copies never live at once share bytes of one host buffer, and what a
plan keeps in host memory is that buffer."""

from __future__ import annotations

from hypothesis import given, settings

from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan, check_plan
from hyperoffload.layout import Residency  # a remote copy is a residency of host memory
from hyperoffload.remote_layout import remote_bytes, remote_copies, remote_layout
from programs import op, program, random_training_programs, simple_hardware, value

C, O, P, W, R = Kind.COMPUTE, Kind.OFFLOAD, Kind.PREFETCH, Kind.WAIT, Kind.RELEASE


def _step():
    """x (input) -> a -> b; c from a; out from b and c: a and b (100 bytes each) both wait a while to be read."""
    values = [value(0, 40, ValueKind.INPUT), value(1, 100), value(2, 100), value(3, 200), value(4, 40)]
    ops = [op(0, [0], [1]), op(1, [1], [2]), op(2, [1], [3]), op(3, [2, 3], [4])]
    return program(values, ops, [0], [4])


def _plan(steps) -> Plan:
    plan = Plan(program=_step(), policy="test", instructions=tuple(Instr(k, t) for k, t in steps))
    check_plan(plan)
    return plan


def test_copies_never_live_at_once_share_their_bytes():
    plan = _plan([(C, 0), (O, 1), (W, 1), (R, 1), (P, 1), (W, 1),  # a's copy: instructions 1 to 5
                  (C, 1), (O, 2), (W, 2), (R, 2), (C, 2), (P, 2), (W, 2), (C, 3)])  # b's: 7 to 12
    assert remote_copies(plan) == (Residency(1, 1, 6, 100), Residency(2, 7, 13, 100))
    layout = remote_layout(plan)
    assert layout.offset_of == {1: 0, 7: 0} and layout.arena_bytes == 104  # 100 bytes, 8-byte aligned
    assert remote_bytes(plan) == 104


def test_a_copy_made_while_another_is_still_read_takes_bytes_of_its_own():
    plan = _plan([(C, 0), (O, 1), (W, 1), (R, 1), (P, 1), (W, 1), (C, 1), (R, 1),
                  (P, 1), (O, 2), (W, 1),  # b's copy is made while a's is read a second time
                  (W, 2), (R, 2), (C, 2), (P, 2), (W, 2), (C, 3)])
    assert remote_copies(plan) == (Residency(1, 1, 11, 100), Residency(2, 9, 16, 100))
    layout = remote_layout(plan)
    assert sorted(layout.offset_of.values()) == [0, 104] and remote_bytes(plan) == 208


def test_the_newest_copy_of_a_storage_the_caller_keeps_outlives_the_step():
    plan = _plan([(C, 0), (C, 1), (C, 2), (C, 3), (O, 4), (W, 4), (R, 4)])  # the output ends the step remote
    n = len(plan.instructions)
    assert remote_copies(plan) == (Residency(4, 4, n, 40),)
    assert remote_bytes(plan) == 40


def test_a_storage_starting_remote_is_its_own_copy_whatever_its_offloads():
    values = [value(0, 400, ValueKind.PARAMETER), value(1, 40)]
    step = program(values, [op(0, [0], [1], mutates=[0])], [0], [1])
    plan = Plan(program=step, policy="test", initial_remote=frozenset({0}), instructions=tuple(
        Instr(k, t) for k, t in [(P, 0), (W, 0), (C, 0), (O, 0), (W, 0), (R, 0)]))
    check_plan(plan)
    assert remote_copies(plan) == () and remote_bytes(plan) == 400


@settings(max_examples=60, deadline=None)
@given(random_training_programs())
def test_no_two_copies_live_at_once_share_a_byte_and_the_buffer_holds_them_all(step):
    import hyperoffload
    from hyperoffload.analysis import memory_profile
    from hyperoffload.policies.hyperoffload.minimum import minimum_budget

    smallest, peak = minimum_budget(step)[0], memory_profile(step).peak_bytes
    plan = hyperoffload.plan(step, simple_hardware(), max(smallest, peak * 6 // 10))
    layout = remote_layout(plan)
    n = len(plan.instructions)
    spans = []
    for copy in layout.copies:
        assert copy.start < copy.end <= n
        offset = layout.offset_of[copy.start]
        assert offset % 8 == 0 and offset + copy.nbytes <= layout.arena_bytes
        spans.append((-1 if copy.end == n else copy.start, copy.end, offset, offset + copy.nbytes))
    for k, (start, end, lo, hi) in enumerate(spans):
        for start2, end2, lo2, hi2 in spans[k + 1:]:
            assert not (start < end2 and start2 < end and lo < hi2 and lo2 < hi), "two live copies share bytes"
