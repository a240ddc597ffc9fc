"""Lane ops: a step's own transfers (a decode step's block fetches and remote writes) in the IR, the
simulator and the order refinement, on steps built by hand. The decode policies that use them on captured
DeepSeek steps are in tests/models/test_lane_ops_models.py, the commands in tests/cli/test_lane_ops_cli.py."""

from __future__ import annotations

import dataclasses

import pytest

from hyperoffload.ir import Op, Phase, ValueKind
from hyperoffload.plans import PlanError, plan_without_offload
from hyperoffload.policies.reorder import fetch_on_demand, overlap_lane_ops
from hyperoffload.simulate import simulate
from hyperoffload.verify import verify
from hyperoffload.workloads.deepseek_remote import expected_fetch_fraction
from programs import op, program, simple_hardware, value

GB = 10**9


def lane(oid, inputs, outputs, direction, nbytes):
    return Op(id=oid, name=f"lane{oid}", target="test.lane", inputs=tuple(inputs), outputs=tuple(outputs),
              phase=Phase.FORWARD, lane=direction, transfer_bytes=nbytes)


def fetch_step(fetch_bytes: int):
    """op0: 1 s -> x; a fetch of ``fetch_bytes`` from the remote cache, indexed by x; op2 reads the blocks
    (1 s); op3 (1 s) needs only x. Values: 0 remote cache, 1 weights, 2 x, 3 blocks, 4 y, 5 z."""
    remote = dataclasses.replace(value(0, 4 * GB, ValueKind.KV_CACHE), alloc_bytes=0, remote=True)
    values = [remote, value(1, 64, ValueKind.PARAMETER), value(2, 64), value(3, 1024), value(4, 64), value(5, 64)]
    ops = [op(0, [1], [2], flops=GB), lane(1, [0, 2], [3], "h2d", fetch_bytes), op(2, [3], [4], flops=GB),
           op(3, [2], [5], flops=GB)]
    return program(values, ops, [0, 1], [4, 5])


def test_a_fetch_runs_on_its_lane_after_its_index_and_its_reader_waits():
    prog = fetch_step(2 * GB)  # 2 s at 1 GB/s
    hw = simple_hardware(bw=GB, latency=0.0)
    captured = simulate(plan_without_offload(prog), hw)
    # op0 [0, 1]; fetch [1, 3]; op2 waits, runs [3, 4]; op3 [4, 5].
    assert captured.figures.step_s == pytest.approx(5.0)
    assert captured.figures.stall_copy_s == pytest.approx(2.0)
    assert captured.figures.h2d_bytes == 2 * GB and captured.figures.compute_s == pytest.approx(3.0)
    fetch = next(iv for iv in captured.intervals if iv.stream == "h2d")
    assert (fetch.start, fetch.end) == (pytest.approx(1.0), pytest.approx(3.0))
    # Overlapped: op3 runs while the blocks arrive; op2 waits one second less.
    order = overlap_lane_ops(prog)
    assert order == (0, 1, 3, 2)
    overlapped = simulate(plan_without_offload(prog, order=order), hw)
    assert overlapped.figures.step_s == pytest.approx(4.0)
    # No order beats the chain op0 -> fetch -> op2: 1 + 2 + 1 s.
    assert overlapped.figures.dependency_bound_s == pytest.approx(4.0)
    assert simulate(plan_without_offload(fetch_step(GB // 2)), hw).figures.dependency_bound_s == pytest.approx(3.0)
    verify(plan_without_offload(prog, order=order), hw)
    # The device never holds the remote cache; the fetched blocks count from when the fetch is issued.
    assert captured.figures.peak_bytes == 64 * 3 + 1024


def test_bound_counts_the_bytes_a_step_must_fetch():
    prog = fetch_step(8 * GB)
    plan = dataclasses.replace(plan_without_offload(prog, order=overlap_lane_ops(prog)), budget_bytes=10**6)
    figures = simulate(plan, simple_hardware(bw=GB)).figures
    assert figures.bound_s == pytest.approx(8.0)  # the fetch's 8 GB at 1 GB/s, not compute's 3 s
    assert figures.step_s == pytest.approx(1 + 8 + 1)


def test_fetch_on_demand_moves_a_fetch_to_its_reader():
    prog = fetch_step(GB)
    assert fetch_on_demand(prog, (0, 1, 3, 2)) == (0, 3, 1, 2)
    assert fetch_on_demand(prog) == (0, 1, 2, 3)


def test_remote_values_only_move_through_lane_ops():
    prog = fetch_step(GB)
    bad = list(prog.ops)
    bad[2] = op(2, [0, 3], [4], flops=GB)  # a compute op reading the remote cache
    with pytest.raises(ValueError, match="reads a remote value on the compute stream"):
        program(prog.values, bad, [0, 1], [4, 5])
    heavy = [dataclasses.replace(prog.values[0], alloc_bytes=8), *prog.values[1:]]
    with pytest.raises(ValueError, match="must take no device memory"):
        program(heavy, prog.ops, [0, 1], [4, 5])
    from hyperoffload.plans import Instr, Kind, Plan
    plan = plan_without_offload(prog)
    offload = Plan(program=prog, instructions=(Instr(Kind.OFFLOAD, 0), *plan.instructions))
    with pytest.raises(PlanError, match="lives in remote memory"):
        simulate(offload, simple_hardware())


@pytest.mark.parametrize("pool, valid, expected", [(None, 100, 1.0), (16, 100, 0.25), (58, 100, 0.125),
                                                   (100, 100, 0.0), (16, 10, 0.0)])
def test_expected_fetch_fraction(pool, valid, expected):
    assert expected_fetch_fraction(pool, 16, valid, reselection=0.75) == pytest.approx(expected)


def test_expected_fetch_fraction_rejects_bad_input():
    with pytest.raises(ValueError, match="at least nsa_top_n"):
        expected_fetch_fraction(8, 16, 100)
    with pytest.raises(ValueError, match="share between 0 and 1"):
        expected_fetch_fraction(16, 16, 100, reselection=1.5)


def test_dependency_bound_sums_the_compute_between_chained_fetches():
    """op0 -> fetch (2 s) -> {op3, op4} -> fetch (2 s) -> op7, and op1 and op6 independent of both
    fetches (every op 1 s). op3 and op4 are parallel branches, so the longest single path is 7 s; on one
    compute stream both run between the fetches: 1 + 2 + 2 + 2 + 1 = 8 s, and op1 and op6 hide in the
    fetches."""
    remote = dataclasses.replace(value(0, 4 * GB, ValueKind.KV_CACHE), alloc_bytes=0, remote=True)
    values = [remote, value(1, 64, ValueKind.PARAMETER), *(value(i, 64) for i in range(2, 10))]
    ops = [op(0, [1], [2], flops=GB), op(1, [1], [3], flops=GB), lane(2, [0, 2], [4], "h2d", 2 * GB),
           op(3, [4], [5], flops=GB), op(4, [4], [6], flops=GB),  # two branches between the fetches
           lane(5, [0, 5, 6], [7], "h2d", 2 * GB), op(6, [1], [8], flops=GB), op(7, [7], [9], flops=GB)]
    prog = program(values, ops, [0, 1], [3, 8, 9])
    hw = simple_hardware(bw=GB)
    from hyperoffload.analysis.dependency_bound import dependency_bound
    assert dependency_bound(prog, hw) == pytest.approx(8.0)
    best = simulate(plan_without_offload(prog, order=overlap_lane_ops(prog)), hw).figures
    assert best.step_s == pytest.approx(8.0) and best.compute_s == pytest.approx(6.0)
