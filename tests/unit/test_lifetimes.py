from hypothesis import given, settings
from hypothesis import strategies as st

from hyperoffload.analysis import LiveRange, live_ranges, memory_profile, storage_ranges
from hyperoffload.ir import ValueKind
from helpers import random_valid_order
from programs import op, program, random_programs, value


def test_chain_profile_by_hand():
    # input x (100 B) held all step; a=op0(x) 10 B, b=op1(a) 20 B, c=op2(b) 30 B returned.
    values = [value(0, 100, ValueKind.INPUT), value(1, 10), value(2, 20), value(3, 30)]
    p = program(values, [op(0, [0], [1]), op(1, [1], [2]), op(2, [2], [3])], [0], [3])
    ranges = live_ranges(p)
    assert ranges == {0: LiveRange(0, 3), 1: LiveRange(0, 2), 2: LiveRange(1, 3), 3: LiveRange(2, 3)}
    prof = memory_profile(p)
    assert prof.live_bytes == (110, 130, 150)
    assert prof.peak_bytes == 150 and prof.peak_position == 2
    assert prof.peak_storages == (0, 3, 2)


def test_view_keeps_its_base_alive():
    # base (40 B) is read only through a view that is used late: the base stays live until then.
    values = [value(0, 4, ValueKind.INPUT), value(1, 40), value(2, 40, storage=1), value(3, 4), value(4, 4)]
    ops = [op(0, [0], [1]), op(1, [1], [2]), op(2, [0], [3]), op(3, [2, 3], [4])]
    p = program(values, ops, [0], [4])
    assert storage_ranges(p)[1] == LiveRange(0, 4)
    assert memory_profile(p).live_bytes == (44, 44, 48, 52)


def test_unused_output_lives_during_its_op_only():
    values = [value(0, 4, ValueKind.INPUT), value(1, 8), value(2, 16), value(3, 4)]
    ops = [op(0, [0], [1, 2]), op(1, [1], [3])]
    prof = memory_profile(program(values, ops, [0], [3]))
    assert prof.live_bytes == (28, 16)


def test_other_order_changes_the_profile():
    # x -> a (100 B) -> b (10 B); x -> c (50 B); d = f(b, c). Captured order frees a before c is
    # made: peak 1 + 100 + 10. Making c first keeps it live beside a and b: 1 + 50 + 100 + 10.
    values = [value(0, 1, ValueKind.INPUT), value(1, 100), value(2, 10), value(3, 50), value(4, 1)]
    ops = [op(0, [0], [1]), op(1, [1], [2]), op(2, [0], [3]), op(3, [2, 3], [4])]
    p = program(values, ops, [0], [4])
    assert memory_profile(p).live_bytes == (101, 111, 61, 62)
    assert memory_profile(p, [2, 0, 1, 3]).live_bytes == (51, 151, 161, 62)


def brute_force_live_bytes(p, order):
    """Bytes live at each position straight from the definition, without difference arrays."""
    n = len(order)
    pos = {op_id: i for i, op_id in enumerate(order)}
    live = []
    for i in range(n):
        owners = set()
        for v in p.values:
            producer = next((pos[o.id] for o in p.ops if v.id in o.outputs), None)
            start = 0 if producer is None else producer
            readers = [pos[o.id] for o in p.ops if v.id in o.inputs]
            end = max([start + 1, *(r + 1 for r in readers)])
            if v.id in p.inputs or v.id in p.outputs:
                end = n
            if start <= i < end:
                owners.add(v.storage)
        live.append(sum(p.values[s].alloc_bytes for s in owners))
    return tuple(live)


@settings(max_examples=150, deadline=None)
@given(random_programs(), st.integers(0, 10**6))
def test_profile_matches_definition_in_any_valid_order(p, seed):
    order = random_valid_order(p, seed)
    prof = memory_profile(p, order)
    assert prof.live_bytes == brute_force_live_bytes(p, order)
    assert prof.peak_bytes == max(prof.live_bytes)
    assert prof.peak_bytes >= sum(p.values[i].alloc_bytes for i in p.inputs)
    # the storages listed at the peak add up to the peak
    assert sum(p.values[s].alloc_bytes for s in prof.peak_storages) == prof.peak_bytes
