"""The network lane: a sharded step's collectives run beside the compute stream and the copy lanes, one at a time,
in plan order; what reads their results waits for them (a network stall); views wait for nothing. On steps built by
hand, with hand-computed times."""

from __future__ import annotations

import dataclasses

import pytest

from hyperoffload.analysis.link_bound import link_bound
from hyperoffload.cost import network_time, op_time, side_op_time
from hyperoffload.ir import Collective, CollectiveKind, Op, Phase
from hyperoffload.plans import plan_without_offload
from hyperoffload.simulate import simulate
from hyperoffload.verify import verify
from programs import op, program, simple_hardware, value

GB = 10**9


def two_ranks(bw: float = GB):
    """``simple_hardware`` as two devices of one node, ``bw`` bytes/s between them, no latency: an all-gather of
    ``S`` bytes over both takes ``S / 2 / bw`` seconds."""
    return dataclasses.replace(simple_hardware(bw=GB), devices_per_node=2, intra_node_bw=bw)


def gather(oid, inputs, outputs, full_bytes):
    return Op(id=oid, name=f"gather{oid}", target="c10d._allgather_base_.default", inputs=tuple(inputs),
              outputs=tuple(outputs), phase=Phase.FORWARD, bytes_read=full_bytes // 2, bytes_written=full_bytes,
              collective=Collective(kind=CollectiveKind.ALL_GATHER, full_bytes=full_bytes, group_size=2))


def gather_step(full_bytes: int):
    """op0 (1 s) -> x; op1 gathers ``full_bytes`` from the shard; op3 (1 s) reads the gathered tensor through a
    view (op2); op4 (1 s) needs only x. Values: 0 shard, 1 x, 2 gathered, 3 the view, 4 y, 5 z."""
    values = [value(0, 64), value(1, 64), value(2, 1024), value(3, 1024, storage=2), value(4, 64), value(5, 64)]
    view = Op(id=2, name="view", target="aten.view.default", inputs=(2,), outputs=(3,), phase=Phase.FORWARD)
    ops = [op(0, [0], [1], flops=GB), gather(1, [0], [2], full_bytes), view, op(3, [3], [4], flops=GB),
           op(4, [1], [5], flops=GB)]
    return program(values, ops, [0], [4, 5])


def test_a_collective_runs_on_the_network_beside_compute_and_its_reader_waits():
    prog = gather_step(4 * GB)  # 4 GB over 2 ranks at 1 GB/s: 2 s
    hw = two_ranks()
    gathered = prog.ops[1]
    assert op_time(gathered, prog, hw) == 0.0 and side_op_time(gathered, hw) == pytest.approx(2.0)
    assert network_time(prog, hw) == pytest.approx(2.0)
    # The view (op2) comes right after the gather and waits for nothing.
    order = (0, 1, 2, 3, 4)
    timeline = simulate(plan_without_offload(prog, order=order), hw)
    # op0 [0, 1] while the gather runs [0, 2]; op3 waits 1 s on the network, runs [2, 3]; op4 [3, 4].
    net = next(iv for iv in timeline.intervals if iv.stream == "net")
    assert (net.start, net.end) == (pytest.approx(0.0), pytest.approx(2.0))
    f = timeline.figures
    assert f.step_s == pytest.approx(4.0) and f.compute_s == pytest.approx(3.0)
    assert f.stall_network_s == pytest.approx(1.0) and f.stall_copy_s == 0.0
    assert [s.cause for s in timeline.stalls] == ["network"]
    assert f.network_s == pytest.approx(2.0) and f.h2d_bytes == f.d2h_bytes == 0
    verify(plan_without_offload(prog, order=order), hw)
    # The view does not hold back the op after it: op4 runs [1, 2] while the gather lands, op3 [2, 3].
    after_view = simulate(plan_without_offload(prog, order=(0, 1, 2, 4, 3)), hw).figures
    assert after_view.step_s == pytest.approx(3.0) and after_view.stall_network_s == 0.0


def test_collectives_run_one_at_a_time_in_plan_order():
    # Two gathers of 2 s each, both ready at the start; a reader of each (1 s).
    values = [value(0, 64), value(1, 64), value(2, 1024), value(3, 1024), value(4, 64), value(5, 64)]
    ops = [gather(0, [0], [2], 4 * GB), gather(1, [1], [3], 4 * GB), op(2, [2], [4], flops=GB),
           op(3, [3], [5], flops=GB)]
    prog = program(values, ops, [0, 1], [4, 5])
    hw = two_ranks()
    timeline = simulate(plan_without_offload(prog), hw)
    nets = sorted((iv.start, iv.end) for iv in timeline.intervals if iv.stream == "net")
    assert nets == [(pytest.approx(0.0), pytest.approx(2.0)), (pytest.approx(2.0), pytest.approx(4.0))]
    # op2 [2, 3], op3 waits for the second gather until 4: step 5 s; no plan beats the network's 4 s.
    assert timeline.figures.step_s == pytest.approx(5.0)
    assert timeline.figures.lower_bound_s == pytest.approx(4.0)
    bound = link_bound(prog, hw, 10**9)
    assert bound.network_s == pytest.approx(4.0) and bound.seconds == pytest.approx(4.0)
    # Each gather and its reader is a chain of 3 s; the two gathers are independent, so the chains do not add up.
    assert timeline.figures.dependency_bound_s == pytest.approx(3.0)


def test_the_network_does_not_share_the_copy_lanes():
    # An offload of 1 GB (1 s at 1 GB/s) while a gather of 2 s runs: both at full speed.
    values = [value(0, 64), value(1, GB), value(2, 1024), value(3, 64)]
    ops = [op(0, [0], [1], flops=1), gather(1, [0], [2], 4 * GB), op(2, [1, 2], [3], flops=GB)]
    prog = program(values, ops, [0], [3])
    from hyperoffload.plans import Instr, Kind, Plan

    instrs = (Instr(Kind.COMPUTE, 0), Instr(Kind.COMPUTE, 1), Instr(Kind.OFFLOAD, 1), Instr(Kind.WAIT, 1),
              Instr(Kind.RELEASE, 1), Instr(Kind.PREFETCH, 1), Instr(Kind.WAIT, 1), Instr(Kind.COMPUTE, 2))
    plan = Plan(program=prog, instructions=instrs, budget_bytes=None, policy="test")
    timeline = simulate(plan, two_ranks())
    lanes = {iv.stream: (iv.start, iv.end) for iv in timeline.intervals if iv.stream in ("d2h", "net")}
    assert lanes["net"] == (pytest.approx(0.0, abs=1e-6), pytest.approx(2.0))
    assert lanes["d2h"][1] - lanes["d2h"][0] == pytest.approx(1.0)


def test_a_hoisted_update_waits_one_module_for_its_reduction():
    """An optimizer op hoisted into the backward pass right after its gradient's reduce-scatter would wait for the
    reduction on the compute stream; the hoisted order runs it after the next collective instead, while the next
    module's backward hides the reduction."""
    from hyperoffload.ir import Collective, CollectiveKind
    from hyperoffload.policies.reorder import hoist_updates

    def reduce(oid, inputs, outputs):
        return Op(id=oid, name=f"rs{oid}", target="c10d._reduce_scatter_base_.default", inputs=tuple(inputs),
                  outputs=tuple(outputs), phase=Phase.BACKWARD, bytes_read=1024, bytes_written=512,
                  collective=Collective(kind=CollectiveKind.REDUCE_SCATTER, full_bytes=1024, group_size=2))

    values = [value(0, 64), value(1, 1024), value(2, 512), value(3, 1024), value(4, 512), value(5, 64),
              value(6, 64)]
    backward = [dataclasses.replace(op(0, [0], [1], flops=GB), phase=Phase.BACKWARD), reduce(1, [1], [2]),
                dataclasses.replace(op(2, [0], [3], flops=GB), phase=Phase.BACKWARD), reduce(3, [3], [4])]
    updates = [dataclasses.replace(op(4, [2], [5]), phase=Phase.OPTIMIZER),
               dataclasses.replace(op(5, [4], [6]), phase=Phase.OPTIMIZER)]
    prog = program(values, [*backward, *updates], [0], [5, 6])
    order = hoist_updates(prog)
    assert order.index(4) > order.index(3)  # after the next module's reduction, not right after its own
    timeline = simulate(plan_without_offload(prog, order=order), two_ranks())
    # The first reduction (0.5 us) lands while op2 (1 s) runs: only the last update waits on the network.
    assert timeline.figures.stall_network_s < 1e-5
