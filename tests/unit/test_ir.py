import pytest

from hyperoffload.ir import ValueKind, kind_bytes
from programs import op, program, value


def chain():
    # x -> a -> b -> c, each op reads the previous value.
    values = [value(0, 100, ValueKind.INPUT), value(1, 10), value(2, 20), value(3, 30)]
    ops = [op(0, [0], [1]), op(1, [1], [2]), op(2, [2], [3])]
    return program(values, ops, [0], [3])


def test_valid_program_builds():
    p = chain()
    assert p.producers() == (-1, 0, 1, 2)
    assert p.dependencies() == ((), (0,), (1,))
    assert kind_bytes(p, [ValueKind.INPUT]) == 100


def test_read_before_produce_is_rejected():
    values = [value(0, 4, ValueKind.INPUT), value(1, 4), value(2, 4)]
    with pytest.raises(ValueError, match="reads v2 before it is produced"):
        program(values, [op(0, [0, 2], [1]), op(1, [1], [2])], [0], [2])


def test_value_produced_twice_is_rejected():
    values = [value(0, 4, ValueKind.INPUT), value(1, 4)]
    with pytest.raises(ValueError, match="produced twice"):
        program(values, [op(0, [0], [1]), op(1, [0], [1])], [0], [1])


def test_alias_of_non_owner_is_rejected():
    values = [value(0, 4, ValueKind.INPUT), value(1, 4, storage=0), value(2, 4, storage=1)]
    with pytest.raises(ValueError, match="not a storage owner"):
        program(values, [op(0, [0], [1]), op(1, [1], [2])], [0], [2])


def test_orphan_value_is_rejected():
    values = [value(0, 4, ValueKind.INPUT), value(1, 4), value(2, 4)]
    with pytest.raises(ValueError, match="neither step inputs nor produced"):
        program(values, [op(0, [0], [1])], [0], [1])


def test_in_place_write_orders_readers_before_and_after():
    # p is an input; op0 reads p; op1 writes p in place (result v2 aliases p); op2 reads the new p.
    values = [value(0, 8, ValueKind.PARAMETER), value(1, 8), value(2, 8, storage=0), value(3, 8)]
    ops = [op(0, [0], [1]), op(1, [0, 1], [2], mutates=[0]), op(2, [2], [3])]
    p = program(values, ops, [0], [3])
    deps = p.dependencies()
    assert 0 in deps[1]  # the write waits for the earlier reader
    assert 1 in deps[2]  # the later reader waits for the write
    p.check_order([0, 1, 2])


def test_reader_moved_after_an_in_place_write_is_rejected():
    # op0 reads p and is independent of op1 by data, but op1 overwrites p.
    values = [value(0, 8, ValueKind.PARAMETER), value(1, 8), value(2, 8), value(3, 8, storage=0)]
    ops = [op(0, [0], [1]), op(1, [0, 2 - 2], [3], mutates=[0]), op(2, [1], [2])]
    p = program(values, ops, [0], [2, 3])
    with pytest.raises(ValueError, match="before op0"):
        p.check_order([1, 0, 2])


def test_check_order_rejects_missing_and_repeated_ops():
    p = chain()
    with pytest.raises(ValueError, match="exactly once"):
        p.check_order([0, 1])
    with pytest.raises(ValueError, match="exactly once"):
        p.check_order([0, 1, 1])
    with pytest.raises(ValueError, match="depends on"):
        p.check_order([1, 0, 2])
