"""The host-optimizer form of a captured sharded training step (tiny-llama over two ranks) and the baselines that plan
it: ``fsdp-cpu-offload`` (FSDP2's CPUOffloadPolicy) and ``zero-infinity`` on a sharded step (DeepSpeed ZeRO-3 with
offload_param and offload_optimizer). The host lane itself is tested on steps built by hand in
tests/unit/test_host_lane.py."""

from __future__ import annotations

import json
import math

import pytest
from programs import two_peaks

from hyperoffload.analysis import memory_profile
from hyperoffload.cli import main
from hyperoffload.cost import HostBandwidthMissing
from hyperoffload.hardware import get_hardware
from hyperoffload.host_optimizer import NotShardedTraining, host_optimizer_form
from hyperoffload.ir import Phase, ValueKind
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import (
    HOST_COMPUTE,
    ZeroInfinityConfig,
    computes_on_host,
    plan_fsdp_cpu_offload,
    plan_zero_infinity,
    policies_for,
)
from hyperoffload.runtime import run_plan
from hyperoffload.simulate import simulate
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload

DGX = get_hardware("dgx-h100")
STATE = (ValueKind.PARAMETER, ValueKind.OPTIMIZER_STATE)


@pytest.fixture(scope="module")
def sharded():
    """rank 0's training step of tiny-llama over two ranks (FSDP2, fake process group)."""
    return capture_workload(get_workload("tiny-llama"), "train", world=2).program


def test_the_form_keeps_shards_and_moments_on_the_host(sharded):
    form = host_optimizer_form(sharded)
    values = form.program.values
    state = [v for v in (sharded.values[i] for i in sharded.inputs) if v.kind in STATE]
    names = {v.name for v in state}
    assert {"embed.weight", "exp_avg:embed.weight", "exp_avg_sq:embed.weight", "adamw_step"} <= names
    for v in state:  # the same value ids, now in host memory
        assert values[v.id].remote and values[v.id].alloc_bytes == 0, v.name
    assert form.host_state_bytes == sum(v.alloc_bytes for v in state)
    assert form.program.meta["host_optimizer"] and form.program.graph is None
    assert host_optimizer_form(sharded) is form  # made once per step


def test_each_shard_is_fetched_right_before_each_copy_in_that_reads_it(sharded):
    form = host_optimizer_form(sharded)
    prog = form.program
    producer = prog.producers()
    captured_copy_ins = [op for op in sharded.ops if op.target == "fsdp.all_gather_copy_in.default"]
    copy_ins = [op for op in prog.ops if op.target == "fsdp.all_gather_copy_in.default"]
    assert len(copy_ins) == len(captured_copy_ins) == 9  # five units in the forward, four again in the backward
    for captured, op in zip(captured_copy_ins, copy_ins):
        shards = [v for v in captured.inputs if sharded.values[sharded.values[v].storage].kind is ValueKind.PARAMETER]
        fetched = [v for v in op.inputs if producer[v] >= 0 and prog.ops[producer[v]].lane == "h2d"]
        assert len(fetched) == len(shards) > 0
        # The fetches are the ops right before the copy-in, each moving the bytes of the shard it stands for.
        assert sorted(producer[v] for v in fetched) == list(range(op.id - len(fetched), op.id))
        for v in fetched:
            shard = prog.ops[producer[v]].inputs[0]
            assert prog.values[shard].remote and prog.ops[producer[v]].transfer_bytes == prog.values[shard].nbytes
    assert len(form.fetches) == sum(1 for op in prog.ops if op.lane == "h2d")
    assert all(prog.ops[f.reader].target == "fsdp.all_gather_copy_in.default" for f in form.fetches)


def test_each_gradient_is_sent_to_the_host_after_its_reduce_scatter(sharded):
    prog = host_optimizer_form(sharded).program
    producer = prog.producers()
    sends = [op for op in prog.ops if op.lane == "d2h"]
    scatters = [op for op in prog.ops if op.collective is not None and op.collective.kind.value == "reduce_scatter"]
    scattered = {prog.values[op.outputs[0]].storage: op.id for op in scatters}
    sent_from = {}
    for send in sends:
        grad = prog.values[send.inputs[0]]
        assert grad.kind is ValueKind.GRADIENT and not grad.remote and send.transfer_bytes == grad.nbytes
        assert grad.storage in scattered and scattered[grad.storage] < send.id  # a view of a reduce-scatter's output
        made = producer[grad.id]  # sent right after the op making it (other sends between)
        assert all(prog.ops[k].lane == "d2h" for k in range(made + 1, send.id))
        sent_from[grad.storage] = send.id
        assert prog.values[send.outputs[0]].remote
    assert set(sent_from) == set(scattered)  # every reduce-scatter's gradients go to the host
    params = sum(1 for i in sharded.inputs if sharded.values[i].kind is ValueKind.PARAMETER)
    assert len(sends) == params  # one per parameter's gradient


def test_the_optimizer_step_runs_on_the_host_over_host_values(sharded):
    prog = host_optimizer_form(sharded).program
    optimizer = [op for op in prog.ops if op.phase is Phase.OPTIMIZER and not op.is_view]
    assert optimizer and all(op.lane == "host" for op in optimizer)
    assert all(prog.values[v].remote for op in optimizer for v in (*op.inputs, *op.outputs))
    assert not any(op.lane == "host" for op in prog.ops if op.phase is not Phase.OPTIMIZER)


def test_fsdp_cpu_offload_saves_about_the_state_on_the_device(sharded):
    form = host_optimizer_form(sharded)
    plan = plan_fsdp_cpu_offload(sharded, DGX, 10**12)
    assert plan.program is form.program and plan.compute_order() == list(range(len(form.program.ops)))
    figures = verify(plan, DGX).figures
    peak = memory_profile(sharded).peak_bytes
    saved = peak - figures.peak_bytes
    assert abs(saved - form.host_state_bytes) <= 0.1 * form.host_state_bytes, (saved, form.host_state_bytes)
    assert figures.host_s > 0 and math.isfinite(figures.step_s) and figures.step_s >= figures.host_s
    assert figures.h2d_bytes == sum(f.nbytes for f in form.fetches)
    # No budget knob: at a budget below its peak it is returned without one, its peak what it needs.
    assert plan_fsdp_cpu_offload(sharded, DGX, figures.peak_bytes - 1).budget_bytes is None
    assert simulate(plan_without_offload(sharded), DGX).figures.host_s == 0.0


def test_zero_infinity_on_a_sharded_step_fetches_ahead_within_its_bucket(sharded):
    form = host_optimizer_form(sharded)
    bucket = 40_000
    plan = plan_zero_infinity(sharded, DGX, 10**12, ZeroInfinityConfig(prefetch_bucket_elements=bucket))
    assert plan.program is form.program and plan.policy == "zero-infinity"
    verify(plan, DGX)
    position = {op: k for k, op in enumerate(plan.compute_order())}
    ahead = [f for f in form.fetches if position[f.reader] - position[f.op] > 1]
    assert ahead  # some fetches are issued well before their gather
    largest = max(f.elements for f in form.fetches)
    for k, op in enumerate(plan.compute_order()):  # elements fetched ahead and not yet read, after each op
        flying = sum(f.elements for f in ahead if position[f.op] <= k < position[f.reader])
        assert flying < bucket + largest, (k, flying)
    # DeepSpeed's default bucket (5e7 elements) holds the whole model: every fetch is issued early, and the step is
    # no slower than FSDP2's, fetching just in time.
    default = verify(plan_zero_infinity(sharded, DGX, 10**12), DGX).figures
    fsdp = simulate(plan_fsdp_cpu_offload(sharded, DGX, 10**12), DGX).figures
    assert default.step_s <= fsdp.step_s and default.peak_bytes >= fsdp.peak_bytes


def test_the_sharded_baselines_refuse_other_steps_and_profiles_without_host_bandwidth(sharded):
    step = two_peaks()  # one rank
    with pytest.raises(NotShardedTraining, match="--world"):
        plan_fsdp_cpu_offload(step, DGX, 10**9)
    assert not plan_zero_infinity(step, DGX, 10**9).program.has_host_ops()  # unsharded: as before
    assert "fsdp-cpu-offload" not in policies_for(step) and "fsdp-cpu-offload" in policies_for(sharded, DGX)
    assert computes_on_host("zero-infinity", sharded) and not computes_on_host("zero-infinity", step)
    pod = get_hardware("ascend-910c-superpod")
    for policy in (plan_fsdp_cpu_offload, plan_zero_infinity):
        with pytest.raises(HostBandwidthMissing, match=r"host_mem_bw.*hardware\.replace\(host_mem_bw=\.\.\.\)"):
            policy(sharded, pod, 10**12)
    assert not HOST_COMPUTE & set(policies_for(sharded, pod))
    assert plan_fsdp_cpu_offload(sharded, pod.replace(host_mem_bw=1e12), 10**12).program.has_host_ops()


def test_a_plan_with_host_ops_is_simulated_only(sharded):
    plan = plan_fsdp_cpu_offload(sharded, DGX, 10**12)
    with pytest.raises(ValueError, match="simulated only"):
        run_plan(plan, [])


def test_compare_lists_the_sharded_baselines_with_finite_step_times(capsys):
    argv = ["compare", "--workload", "tiny-llama", "--mode", "train", "--world", "2", "--hardware", "dgx-h100",
            "--budget", "50%", "--json"]
    assert main(argv) == 0
    rows = {row["policy"]: row for row in json.loads(capsys.readouterr().out)}
    assert {"none", "fsdp-cpu-offload", "zero-infinity"} <= set(rows)  # every policy of the step, these among them
    for name in ("fsdp-cpu-offload", "zero-infinity"):
        row = rows[name]
        assert math.isfinite(row["step_s"]) and row["host_s"] > 0 and row["world"] == 2, name
        assert row["peak_bytes"] < rows["none"]["peak_bytes"], name
    assert rows["none"]["host_s"] == 0
