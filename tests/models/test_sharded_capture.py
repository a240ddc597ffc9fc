"""One rank's step of an FSDP2-sharded model, captured on a fake process group: shards, collectives and lifetimes.
The commands on such a step: tests/cli/test_sharded_capture_cli.py."""

import json

import pytest
import torch
import torch.distributed as dist

from hyperoffload.analysis import memory_profile
from hyperoffload.capture import CaptureError, capture_sharded_train_step, fake_build
from hyperoffload.capture.sharded import fake_world
from hyperoffload.ir import CollectiveKind, Phase, ValueKind, kind_bytes
from hyperoffload.workloads import capture_workload, get_workload

TINY_LLAMA = get_workload("tiny-llama")
BLOCKS = TINY_LLAMA.config.layers


@pytest.fixture(scope="module")
def unsharded():
    return capture_workload(TINY_LLAMA, "train").program


@pytest.fixture(scope="module", params=[2, 4])
def sharded(request):
    return request.param, capture_workload(TINY_LLAMA, "train", world=request.param).program


def block_parameter_bytes(program) -> int:
    return sum(program.values[v].alloc_bytes for v, name in zip(program.inputs, _input_names(program))
               if name.startswith("layers."))


def _input_names(program):
    return [program.values[v].name for v in program.inputs]


def test_each_rank_holds_its_shard_of_the_parameters_gradients_and_optimizer_state(sharded, unsharded):
    world, program = sharded
    parameters = kind_bytes(unsharded, [ValueKind.PARAMETER])
    assert kind_bytes(program, [ValueKind.PARAMETER]) * world == parameters  # tiny-llama's rows divide evenly
    assert kind_bytes(program, [ValueKind.GRADIENT]) * world == kind_bytes(unsharded, [ValueKind.GRADIENT])
    moments = kind_bytes(unsharded, [ValueKind.OPTIMIZER_STATE]) - 4  # the step count is not sharded
    assert kind_bytes(program, [ValueKind.OPTIMIZER_STATE]) == moments // world + 4
    assert program.meta["world"] == world
    assert memory_profile(program).peak_bytes < memory_profile(unsharded).peak_bytes


def test_the_collectives_fsdp_runs_are_ops_with_the_whole_tensors_bytes(sharded, unsharded):
    """The forward gathers every unit (the root, then each block), the backward each block again (the root stays
    gathered after its forward), and the backward reduces every unit's gradients to this rank's shard."""
    world, program = sharded
    parameters = kind_bytes(unsharded, [ValueKind.PARAMETER])
    gathers = [op for op in program.ops if op.collective and op.collective.kind is CollectiveKind.ALL_GATHER]
    reductions = [op for op in program.ops if op.collective and op.collective.kind is CollectiveKind.REDUCE_SCATTER]
    assert len(gathers) == 1 + 2 * BLOCKS and len(reductions) == 1 + BLOCKS
    assert {op.collective.group_size for op in gathers + reductions} == {world}
    assert {op.phase for op in gathers[:1 + BLOCKS]} == {Phase.FORWARD}
    assert {op.phase for op in gathers[1 + BLOCKS:] + reductions} == {Phase.BACKWARD}
    blocks = block_parameter_bytes(program) * world
    assert 0 < blocks < parameters
    assert sum(op.collective.full_bytes for op in gathers) == parameters + blocks
    assert sum(op.collective.full_bytes for op in reductions) == parameters
    assert all(op.flops == 0 for op in gathers + reductions)


def test_a_block_gathered_for_its_forward_is_not_held_until_its_backward(sharded):
    """FSDP2 frees a block's gathered parameters after its forward and gathers them again for its backward: each
    gather writes a buffer of its own, which the forward's last reader of it frees."""
    _, program = sharded
    values, ops = program.values, program.ops
    last_use: dict[int, int] = {}
    for op in ops:
        for v in (*op.inputs, *op.outputs):
            last_use[values[v].storage] = op.id
    copies = [op for op in ops if op.target == "fsdp.split_with_sizes_copy.default"]
    forward = [op for op in copies if op.phase is Phase.FORWARD]
    assert len(forward) == 1 + BLOCKS
    for op in forward[1:]:  # the root's parameters (the first gather) stay gathered, as FSDP2 leaves the root
        storages = {values[v].storage for v in op.mutates}
        assert storages and all(ops[last_use[s]].phase is Phase.FORWARD for s in storages)
        assert all(values[s].alloc_bytes > 0 for s in storages)
    backward = {values[v].storage for op in copies if op.phase is Phase.BACKWARD for v in op.mutates}
    assert not backward & {values[v].storage for op in forward for v in op.mutates}


def test_a_prefill_step_gathers_each_unit_once_and_reduces_nothing():
    program = capture_workload(TINY_LLAMA, "prefill", world=2).program
    kinds = [op.collective.kind for op in program.ops if op.collective]
    assert kinds == [CollectiveKind.ALL_GATHER] * (1 + BLOCKS)


def test_the_fake_group_is_gone_after_a_capture_and_a_real_one_is_not_touched():
    capture_workload(TINY_LLAMA, "prefill", world=2)
    assert not dist.is_initialized()
    with fake_world(2):
        with pytest.raises(CaptureError, match="already exists"):
            capture_workload(TINY_LLAMA, "prefill", world=2)
        assert dist.get_world_size() == 2
    assert not dist.is_initialized()


@pytest.mark.parametrize("world, message", [(1, "unsharded step"), (0, "whole number"), (2.5, "whole number")])
def test_a_world_that_is_not_a_count_of_ranks_is_refused(world, message):
    with fake_build():
        model = TINY_LLAMA.model(TINY_LLAMA.config)
        tokens = torch.randint(0, 8, (1, 8))
    with pytest.raises(CaptureError, match=message):
        capture_sharded_train_step(model, (tokens,), tokens, world=world)


def test_a_collective_costs_its_time_on_the_network_lane_not_the_compute_stream(sharded):
    from hyperoffload.collectives import collective_s
    from hyperoffload.cost import network_time, op_time, side_op_time
    from hyperoffload.hardware import get_hardware

    world, program = sharded
    dgx = get_hardware("dgx-h100")
    collectives = [op for op in program.ops if op.collective]
    for op in collectives:
        network = collective_s(op.collective.kind, dgx, op.collective.full_bytes, world)
        assert network > 0 and side_op_time(op, dgx) == network + dgx.launch_s
        assert op_time(op, program, dgx) == 0.0 and op.stream == "net"
    assert network_time(program, dgx) == pytest.approx(sum(side_op_time(op, dgx) for op in collectives))


def test_the_sharded_bench_plans_each_budget_within_it():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "sharded.py"), "--cases", "tiny-llama:2:dgx-h100",
                           "--budgets", "90%,50%,smallest", "--json"], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    case, = json.loads(done.stdout)["cases"]
    assert case["world"] == 2 and len(case["rows"]) == 3
    assert case["rows"][2]["budget_bytes"] == case["smallest_budget_bytes"] < case["rows"][1]["budget_bytes"]
    for row in case["rows"]:
        assert row["peak_bytes"] <= row["budget_bytes"] < case["unplanned_peak_bytes"]
        assert row["step / link_bound"] >= 1 - 1e-9 and row["step_s"] >= row["compute_s"] * (1 - 1e-9) > 0
        # The best bound of the plan's own order is at least the link bound, and the plan does not beat it.
        assert row["order_bound_s"] >= row["link_bound_s"] and row["step / order_bound"] >= 1 - 1e-9
        assert row["step_s"] >= row["network_s"] > 0
        for base in row["baselines"]:  # every registered sharded baseline, at the same budget
            assert base["step_s"] > 0 and base["hyperoffload / baseline"] == row["step_s"] / base["step_s"]
    assert case["rows"][1]["h2d_bytes"] > case["rows"][0]["h2d_bytes"]
