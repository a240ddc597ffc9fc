"""The host lane: host ops (an optimizer step on the CPU over host memory) in the IR, the cost model and the
simulator, on steps built by hand with hand-computed times. The host-optimizer form of a captured sharded step and
its policies are in tests/models/test_host_optimizer.py."""

from __future__ import annotations

import dataclasses

import pytest

from hyperoffload.cost import HOST_DISPATCH_S, HostBandwidthMissing, host_op_time, host_time, op_time, side_op_time
from hyperoffload.hardware import HardwareError, get_hardware, load_hardware_file
from hyperoffload.ir import Op, Phase, Program, Value, ValueKind
from hyperoffload.plans import plan_without_offload
from hyperoffload.simulate import simulate
from hyperoffload.verify import verify
from programs import op, simple_hardware, value

GB = 10**9
HOST_BW = 8 * GB
"""The node's host memory bandwidth in these tests: two ranks share it, 4 GB/s each."""


def two_ranks(host_bw: float = HOST_BW):
    """``simple_hardware`` as two devices of one node with ``host_bw`` bytes/s of host memory bandwidth."""
    return dataclasses.replace(simple_hardware(bw=GB), devices_per_node=2, intra_node_bw=GB, host_mem_bw=host_bw)


def host_value(vid: int, nbytes: int, kind: ValueKind = ValueKind.TEMPORARY) -> Value:
    return dataclasses.replace(value(vid, nbytes, kind), alloc_bytes=0, remote=True)


def host_op(oid: int, inputs, outputs, nbytes: int, mutates=()) -> Op:
    """A host op reading and writing ``nbytes`` each (at 4 GB/s a rank: ``2 * nbytes / 4e9`` s and a dispatch)."""
    return Op(id=oid, name=f"host{oid}", target="test.host", inputs=tuple(inputs), outputs=tuple(outputs),
              mutates=tuple(mutates), phase=Phase.OPTIMIZER, bytes_read=nbytes, bytes_written=nbytes, lane="host")


def fetch(oid: int, inputs, outputs, nbytes: int) -> Op:
    return Op(id=oid, name=f"fetch{oid}", target="test.fetch", inputs=tuple(inputs), outputs=tuple(outputs),
              phase=Phase.FORWARD, bytes_read=nbytes, bytes_written=nbytes, lane="h2d", transfer_bytes=nbytes)


def step(values, ops, inputs, outputs, world: int = 2) -> Program:
    return Program(name="test", mode="train", values=tuple(values), ops=tuple(ops), inputs=tuple(inputs),
                   outputs=tuple(outputs), meta={"world": world})


def host_then_fetch_step():
    """op0: a host op updating the host state (4 GB each way: 2 s at 4 GB/s); op1: a fetch of its result (1 GB, 1 s
    at 1 GB/s); op2 (1 s) reads what was fetched; op3 (1 s) needs only x. Values: 0 host state, 1 x, 2 the host
    result, 3 the fetched copy, 4 y, 5 z."""
    values = [host_value(0, 64, ValueKind.OPTIMIZER_STATE), value(1, 64), host_value(2, 64), value(3, 64),
              value(4, 64), value(5, 64)]
    ops = [host_op(0, [0], [2], 4 * GB), fetch(1, [2], [3], GB), op(2, [3], [4], flops=GB), op(3, [1], [5], flops=GB)]
    return step(values, ops, [0, 1], [4, 5])


def test_a_host_op_takes_its_bytes_over_a_ranks_share_of_host_bandwidth():
    prog = host_then_fetch_step()
    hw = two_ranks()
    host = prog.ops[0]
    # 8 GB read and written over 8 GB/s shared by the node's two ranks: 2 s, and one dispatch.
    assert host_op_time(host, hw, 2) == pytest.approx(8 * GB / (HOST_BW / 2) + HOST_DISPATCH_S)
    assert host_op_time(host, hw, 1) == pytest.approx(1.0 + HOST_DISPATCH_S)
    assert op_time(host, prog, hw) == 0.0 and side_op_time(host, hw, 2) == host_op_time(host, hw, 2)
    assert host_time(prog, hw) == pytest.approx(2.0 + HOST_DISPATCH_S)  # meta["world"] = 2: two ranks share it
    # One rank alone on its node has the whole bandwidth.
    alone = step(prog.values, prog.ops, prog.inputs, prog.outputs, world=1)
    assert host_time(alone, hw) == pytest.approx(1.0 + HOST_DISPATCH_S)


def test_a_host_op_runs_beside_compute_and_what_depends_on_it_waits():
    prog = host_then_fetch_step()
    hw = two_ranks()
    timeline = verify(plan_without_offload(prog, order=(0, 1, 3, 2)), hw)
    spans = {iv.stream: (iv.start, iv.end) for iv in timeline.intervals if iv.stream != "compute"}
    t_host = 2.0 + HOST_DISPATCH_S
    assert spans["host"] == (pytest.approx(0.0), pytest.approx(t_host))
    assert spans["h2d"] == (pytest.approx(t_host), pytest.approx(t_host + 1.0))  # the fetch waits for the host op
    compute = sorted((iv.start, iv.end) for iv in timeline.intervals if iv.stream == "compute")
    # op3 runs at once, beside the host op; op2 waits for the fetch.
    assert compute == [(pytest.approx(0.0), pytest.approx(1.0)),
                       (pytest.approx(t_host + 1.0), pytest.approx(t_host + 2.0))]
    f = timeline.figures
    assert f.step_s == pytest.approx(t_host + 2.0) and f.compute_s == pytest.approx(2.0)
    assert f.host_s == pytest.approx(t_host) and f.lower_bound_s == pytest.approx(t_host)
    assert f.stall_copy_s == pytest.approx(t_host) and f.stall_host_s == 0.0
    assert f.h2d_bytes == GB and f.peak_bytes == 64 * 4  # host memory takes no device bytes


def test_host_ops_run_one_at_a_time_in_plan_order():
    # Two independent host ops, 1 GB each way (0.5 s each at 4 GB/s), and a compute op of 2 s.
    values = [host_value(0, 64, ValueKind.OPTIMIZER_STATE), host_value(1, 64, ValueKind.OPTIMIZER_STATE),
              value(2, 64), value(3, 64)]
    ops = [host_op(0, [0], [], GB, mutates=[0]), host_op(1, [1], [], GB, mutates=[1]), op(2, [2], [3], flops=2 * GB)]
    prog = step(values, ops, [0, 1, 2], [3])
    timeline = verify(plan_without_offload(prog), two_ranks())
    hosts = sorted((iv.start, iv.end) for iv in timeline.intervals if iv.stream == "host")
    t = 0.5 + HOST_DISPATCH_S
    assert hosts == [(pytest.approx(0.0), pytest.approx(t)), (pytest.approx(t), pytest.approx(2 * t))]
    assert timeline.figures.step_s == pytest.approx(2.0)  # both host ops hide behind the compute op


def test_a_host_op_is_issued_when_the_compute_stream_reaches_it():
    # op0 and op1 (1 s each) on the compute stream; op2 a host op (0.5 s) independent of both.
    values = [value(0, 64), value(1, 64), value(2, 64), host_value(3, 64, ValueKind.OPTIMIZER_STATE)]
    ops = [op(0, [0], [1], flops=GB), op(1, [1], [2], flops=GB), host_op(2, [3], [], GB, mutates=[3])]
    prog = step(values, ops, [0, 3], [2])
    for order, start in (((0, 1, 2), 1.0), ((2, 0, 1), 0.0)):  # reached when op1 starts, or at once
        timeline = simulate(plan_without_offload(prog, order=order), two_ranks())
        host = next(iv for iv in timeline.intervals if iv.stream == "host")
        assert host.start == pytest.approx(start), order
        assert timeline.figures.step_s == pytest.approx(2.0), order


def test_the_ir_keeps_remote_memory_to_lane_ops_and_views():
    remote = host_value(0, 64, ValueKind.PARAMETER)
    view = Op(id=0, name="view", target="aten.view.default", inputs=(0,), outputs=(1,), phase=Phase.FORWARD)
    viewed = dataclasses.replace(value(1, 64, storage=0), remote=True)
    step([remote, viewed, value(2, 64)], [view, fetch(1, [1], [2], 64)], [0], [2])  # a view of host memory: fine
    with pytest.raises(ValueError, match="mark it remote"):
        step([remote, value(1, 64, storage=0), value(2, 64)], [view, fetch(1, [1], [2], 64)], [0], [2])
    with pytest.raises(ValueError, match="reads a remote value on the compute stream"):
        step([remote, value(1, 64)], [op(0, [0], [1])], [0], [1])
    with pytest.raises(ValueError, match="touches device values"):
        step([remote, value(1, 64)], [host_op(0, [0], [1], 64)], [0], [1])
    with pytest.raises(ValueError, match="makes remote storage"):
        step([value(0, 64), host_value(1, 64)], [op(0, [0], [1])], [0], [1])
    with pytest.raises(ValueError, match="a lane is 'h2d', 'd2h', 'host' or None"):
        step([remote, host_value(1, 64)], [dataclasses.replace(host_op(0, [0], [1], 64), lane="cpu")], [0], [1])
    # A host op's result is host memory of its own: no step input needed.
    prog = step([remote, host_value(1, 64)], [host_op(0, [0], [1], 64)], [0], [1])
    assert prog.has_host_ops() and prog.ops[0].stream == "host"


def test_host_bandwidth_is_a_sourced_profile_field_and_its_absence_is_refused(tmp_path):
    dgx, h200, nvl = get_hardware("dgx-h100"), get_hardware("hgx-h200"), get_hardware("gh200-nvl")
    assert dgx.host_mem_bw == h200.host_mem_bw == 2 * 8 * 38.4e9  # two Xeon 8480C, 8 channels of DDR5-4800 each
    assert nvl.host_mem_bw == 2 * 500e9  # two GH200 per node, 500 GB/s of LPDDR5X each
    for h in (dgx, h200, nvl):
        assert "8480C" in h.sources["host_mem_bw"] or "LPDDR5X" in h.sources["host_mem_bw"], h.name
    pod = get_hardware("ascend-910c-superpod")
    assert pod.host_mem_bw == 0 and "Not published" in pod.sources["host_mem_bw"]
    assert get_hardware("h100-sxm").host_mem_bw == 0
    with pytest.raises(HardwareError, match="host_mem_bw must be a finite number >= 0"):
        dgx.replace(host_mem_bw=-1.0)
    host = host_op(0, [0], [], GB, mutates=[0])
    with pytest.raises(HostBandwidthMissing, match=r"host_mem_bw = 0.*hardware\.replace\(host_mem_bw=\.\.\.\)"):
        host_op_time(host, pod)
    path = tmp_path / "mine.toml"
    path.write_text(_profile_text('host_mem_bw = "100GB/s"'))
    assert load_hardware_file(path).host_mem_bw == 100e9
    path.write_text(_profile_text("host_mem_bw = 0"))
    assert load_hardware_file(path).host_mem_bw == 0


def _profile_text(extra: str) -> str:
    return f'''name = "mine"
memory = "80GiB"
hbm_bw = "3TB/s"
h2d_bw = "50GB/s"
d2h_bw = "50GB/s"
h2d_latency = "8us"
d2h_latency = "8us"
duplex_share = 0.8
launch = "5us"
compute_efficiency = 0.75
memory_efficiency = 0.85
{extra}
[peak_flops]
bfloat16 = "989TFLOP/s"
'''
