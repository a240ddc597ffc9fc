"""Bytes a collective still holds after its position: a reduce-scatter's input stays on the device until the
network lane has finished it, and the planner's early prefetches leave that room alone. Hand-built steps with
hand-computed times."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from programs import op, program, simple_hardware, value

from hyperoffload.cost import op_times
from hyperoffload.ir import Collective, CollectiveKind, Op, Phase
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies.hyperoffload import plan_hyperoffload
from hyperoffload.policies.hyperoffload.context import back_to_back
from hyperoffload.policies.hyperoffload.in_flight import held_by_collectives
from hyperoffload.simulate import simulate

SECOND = 10**9
"""FLOPs of a one-second op on ``simple_hardware``."""


def two_ranks(*, link_bw: float, network_bw: float):
    """``simple_hardware`` as two devices of one node: a reduce-scatter of ``S`` bytes takes ``S / 2 / network_bw``
    seconds on the network lane."""
    return dataclasses.replace(simple_hardware(bw=link_bw), devices_per_node=2, intra_node_bw=network_bw)


def reduce_scatter(oid: int, source: int, result: int, full_bytes: int) -> Op:
    return Op(id=oid, name=f"rs{oid}", target="c10d._reduce_scatter_base_.default", inputs=(source,),
              outputs=(result,), phase=Phase.FORWARD, bytes_read=full_bytes, bytes_written=full_bytes // 2,
              collective=Collective(kind=CollectiveKind.REDUCE_SCATTER, full_bytes=full_bytes, group_size=2))


def held(prog, hw, order):
    times = np.asarray(op_times(prog, hw), dtype=np.float64)[list(order)]
    return held_by_collectives(prog, hw, order, back_to_back(times, np.zeros(len(order))).start)


def test_a_reduce_scatter_holds_its_input_until_the_network_has_finished_it():
    # op0 [0, 1] makes g (1000 bytes); the reduce-scatter of g (its last use) runs [1, 3] on the network while
    # op2 [1, 2] and op3 [2, 3] run; op4 starts at 3, as it ends.
    values = [value(0, 64), value(1, 1000), value(2, 500), value(3, 8), value(4, 8), value(5, 8), value(6, 8)]
    ops = [op(0, [0], [1], flops=SECOND), reduce_scatter(1, 1, 2, 4000), op(2, [0], [3], flops=SECOND),
           op(3, [0], [4], flops=SECOND), op(4, [0], [5], flops=SECOND), op(5, [2, 3, 4, 5], [6], flops=SECOND)]
    prog = program(values, ops, [0], [6])
    hw = two_ranks(link_bw=1e9, network_bw=1000.0)  # 4000 bytes over 2 ranks: 2 s
    assert held(prog, hw, (0, 1, 2, 3, 4, 5)).tolist() == [0, 0, 1000, 1000, 0, 0]
    # The simulator agrees: g is on the device until t = 3, when the network lane has finished with it.
    timeline = simulate(plan_without_offload(prog), hw)
    net = next(iv for iv in timeline.intervals if iv.stream == "net")
    assert (net.start, net.end) == (pytest.approx(1.0), pytest.approx(3.0))
    memory = dict(timeline.memory)
    assert max(b for t, b in memory.items() if 1.0 < t < 3.0) >= 1000 + 500
    assert max(b for t, b in memory.items() if t >= 3.0) < 1000


def test_collectives_hold_their_inputs_one_after_another_on_the_network():
    # Two reduce-scatters issued together at t = 1, 2 s each: the second runs [3, 5] and holds its input to then.
    values = [value(0, 64), value(1, 1000), value(2, 300), value(3, 500), value(4, 200)] + [
        value(i, 8) for i in range(5, 10)]
    ops = [op(0, [0], [1, 2], flops=SECOND), reduce_scatter(1, 1, 3, 4000), reduce_scatter(2, 2, 4, 4000),
           *(op(i, [0], [i + 2], flops=SECOND) for i in range(3, 7)), op(7, [3, 4, 5, 6, 7, 8], [9], flops=SECOND)]
    prog = program(values, ops, [0], [9])
    hw = two_ranks(link_bw=1e9, network_bw=1000.0)
    # Positions 1-3 start at 1, 4-7 at 2, 3, 4 and 5. The first input (1000) is held to 3, from the position after
    # its reduce-scatter (the second one's) on; the second (300) to 5.
    assert held(prog, hw, tuple(range(8))).tolist() == [0, 0, 1000, 1300, 1300, 300, 300, 0]


def test_early_prefetches_leave_the_room_a_reduce_scatter_still_holds():
    """a (1000 bytes) must be off the device while g (1000 bytes) is made: the budget, 1500 bytes, holds one of them.
    g's reduce-scatter frees it only at t = 5. Brought back as early as the order's live bytes allow (right after
    the reduce-scatter's position, t = 3), a would wait there for g's room until t = 5; brought back from t = 5, it
    lands (1 s) as op6 needs it, and nothing waits."""
    values = [value(0, 64), value(1, 1000), value(2, 8), value(3, 1000), value(4, 8)] + [value(i, 8)
                                                                                      for i in range(5, 9)]
    ops = [op(0, [0], [1], flops=SECOND),  # a, [0, 1]; its offload [1, 2]
           op(1, [0], [2], flops=SECOND),  # [1, 2]
           op(2, [0], [3], flops=SECOND),  # g, [2, 3]
           reduce_scatter(3, 3, 4, 4000),  # [3, 5] on the network
           op(4, [0], [5], flops=SECOND), op(5, [0], [6], flops=SECOND), op(6, [0], [7], flops=SECOND),  # [3, 6]
           op(7, [1, 2, 4, 5, 6, 7], [8], flops=SECOND)]  # [6, 7], reads a
    prog = program(values, ops, [0], [8])
    hw = two_ranks(link_bw=1000.0, network_bw=1000.0)
    timeline = simulate(plan_hyperoffload(prog, hw, 1500), hw)
    assert timeline.figures.stall_memory_s == 0.0
    assert timeline.figures.step_s == pytest.approx(7.0)
    assert timeline.peak_bytes <= 1500
