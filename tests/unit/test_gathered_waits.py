"""``gathered_waits``: each wait moves up to the nearest op Inductor cannot fuse across, never above its own transfer
or another wait, and the plan stays valid with the same peak."""

from __future__ import annotations

from dataclasses import replace

from hyperoffload.compile.gathered_waits import gathered_waits
from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan, check_plan
from programs import op, program, value

C, P, W = Kind.COMPUTE, Kind.PREFETCH, Kind.WAIT


def _step():
    """A matrix product, then an elementwise run reading two prefetched states (``m``, ``v``) one after the other."""
    values = [value(0, 400, ValueKind.INPUT), value(1, 400, ValueKind.OPTIMIZER_STATE),
              value(2, 400, ValueKind.OPTIMIZER_STATE), value(3, 400), value(4, 400), value(5, 400), value(6, 400)]
    ops = [op(0, [0], [3]), op(1, [3], [4]), op(2, [4, 1], [5]), op(3, [5, 2], [6])]
    ops[0] = replace(ops[0], target="aten.mm.default")
    return program(values, ops, [0, 1, 2], [6])


def _plan(*spec) -> Plan:
    return Plan(program=_step(), policy="test", initial_remote=frozenset({1, 2}),
                instructions=tuple(Instr(kind, target) for kind, target in spec))


def test_waits_move_up_to_the_matrix_product_in_order():
    plan = _plan((P, 1), (P, 2), (C, 0), (C, 1), (W, 1), (C, 2), (W, 2), (C, 3))
    gathered = gathered_waits(plan)
    assert [(i.kind, i.target) for i in gathered.instructions] == [
        (P, 1), (P, 2), (C, 0), (W, 1), (W, 2), (C, 1), (C, 2), (C, 3)]
    assert check_plan(gathered).peak_bytes == check_plan(plan).peak_bytes
    assert gathered_waits(gathered) is gathered


def test_a_wait_stays_below_its_own_prefetch():
    plan = _plan((P, 1), (W, 1), (C, 0), (C, 1), (P, 2), (C, 2), (W, 2), (C, 3))
    gathered = gathered_waits(plan)
    order = [(i.kind, i.target) for i in gathered.instructions]
    assert order.index((W, 2)) == order.index((P, 2)) + 1
    check_plan(gathered)
