"""tiny-llama's FSDP2 training step run for real on two gloo ranks (two processes of this machine): each rank's
planned step is bit-identical to its unplanned one and within its budget; the ranks machinery gathers results in
rank order, and a rank that raises stops every rank. The command: tests/cli/test_sharded_run_cli.py."""

from __future__ import annotations

import math
import multiprocessing

import pytest
import torch

from hyperoffload.hardware import get_hardware
from hyperoffload.report.sharded_run_report import ShardedRunConfig, profile_fields, sharded_run_report
from hyperoffload.runtime.measure import RunConfig
from hyperoffload.runtime.ranks import RankFailed, RankSetup, run_on_ranks

pytestmark = pytest.mark.usefixtures("one_compute_thread")  # see tests/conftest.py


def _no_rank_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("hyperoffload-rank-")]


def test_two_gloo_ranks_run_the_planned_fsdp2_step_exactly_within_the_budget():
    link = get_hardware("cpu-emulated").replace(h2d_bw=2e9, d2h_bw=2e9, h2d_latency_s=50e-6, d2h_latency_s=50e-6)
    config = ShardedRunConfig(workload="tiny-llama", mode="train", world=2, budget="50%",
                              hardware=profile_fields(link), run_config=RunConfig(steps=1, warmup=0), warm_up_s=0.0,
                              timeout_s=120)
    lines: list[tuple[int, str]] = []
    report = sharded_run_report(config, on_line=lambda rank, text: lines.append((rank, text)))
    result = report.as_dict()
    assert result["world"] == 2 and result["workload"] == "tiny-llama" and result["mode"] == "train"
    assert result["policy"] == "hyperoffload" and result["link_bw"] == 2e9
    assert result["intra_node_bw"] > 0 and result["intra_node_latency_s"] >= 0
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        for key in ("measured_peak_bytes", "budget_bytes", "max_abs_diff", "wall_s", "sim_step_s", "sim_error",
                    "plan_digest"):
            assert key in rank
        assert rank["max_abs_diff"] == 0.0
        assert rank["measured_peak_bytes"] <= rank["budget_bytes"]
        assert isinstance(rank["sim_error"], float) and math.isfinite(rank["sim_error"])
        assert rank["h2d_bytes"] > 0  # half the peak needs offloading
    assert len({r["plan_digest"] for r in result["ranks"]}) == 1
    assert report.exact and report.feasible
    assert {rank for rank, _ in lines} == {0, 1}
    assert _no_rank_left()


@pytest.mark.parametrize("mode", ["train", "prefill"])
def test_a_step_captured_on_a_groups_mesh_holds_its_state_in_its_inputs(mode):
    """FSDP2 reads each shard through several tensors, which a real-tensor trace records as constants: captured on a
    mesh, each is a view of the shard's input (capture.input_views), so the Program is the fake capture's (a prefill
    step reads the shards through FSDP2's all-gather inputs alone)."""
    from hyperoffload.analysis import memory_profile
    from hyperoffload.capture.sharded import fake_world
    from hyperoffload.workloads import capture_workload, get_workload

    tiny = get_workload("tiny-llama")
    with fake_world(2) as mesh:  # a fake group stands in for the real one: nothing here runs a collective
        captured = capture_workload(tiny, mode, fake=False, world=2, mesh=mesh)
    program = captured.program
    assert not program.constants or not {t.untyped_storage().data_ptr() for t in captured.inputs} & {
        getattr(program.graph, n.target).untyped_storage().data_ptr() for n in program.graph.graph.nodes
        if n.op == "get_attr" and isinstance(getattr(program.graph, n.target), torch.Tensor)}
    fake = capture_workload(tiny, mode, world=2).program
    assert memory_profile(program).peak_bytes == memory_profile(fake).peak_bytes
    assert [program.values[v].name for v in program.inputs] == [fake.values[v].name for v in fake.inputs]


def _square(rank: int, offset: int, say) -> int:
    say(f"squaring {rank}")
    return rank * rank + offset


def _fail_on_rank_1(rank: int, payload, say) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits here for a rank that never comes
    return rank


def test_the_ranks_results_come_back_in_rank_order():
    lines: list[tuple[int, str]] = []
    assert run_on_ranks(_square, 10, RankSetup(world=2), on_line=lambda rank, text: lines.append((rank, text))) \
        == [10, 11]
    assert sorted(lines) == [(0, "squaring 0"), (1, "squaring 1")]
    assert _no_rank_left()


def test_a_rank_that_raises_stops_the_rank_waiting_for_it():
    with pytest.raises(RankFailed) as info:
        run_on_ranks(_fail_on_rank_1, None, RankSetup(world=2, timeout_s=120))
    assert info.value.rank == 1 and info.value.error_type == "ValueError"
    assert str(info.value).startswith("rank 1 failed: ValueError: rank 1 gives up (raised in ")
    assert "the other ranks were stopped" in str(info.value)
    assert _no_rank_left()
