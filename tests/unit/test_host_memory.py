"""``host_memory``: what a plan keeps in host memory per rank and per node (the ranks of a node share it), and a
plan that keeps more than a node has refused with the figures; a profile that states none limits nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hyperoffload.hardware import get_hardware
from hyperoffload.host_memory import HostMemoryExceeded, check_host_memory, host_memory_need
from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan
from programs import op, program, value


def _plan(world: int) -> Plan:
    """A step whose 4000-byte parameter starts in remote memory and comes to the device for its one op."""
    step = program([value(0, 4000, ValueKind.PARAMETER), value(1, 400)], [op(0, [0], [1])], [0], [1])
    step = replace(step, meta={"world": world})
    return Plan(program=step, policy="test", initial_remote=frozenset({0}),
                instructions=(Instr(Kind.PREFETCH, 0), Instr(Kind.WAIT, 0), Instr(Kind.COMPUTE, 0)))


def test_a_nodes_ranks_share_its_host_memory():
    node = get_hardware("dgx-h100")  # 8 devices a node
    need = host_memory_need(_plan(world=16), node.replace(host_memory_bytes=32_000))
    assert (need.per_rank, need.ranks_per_node, need.per_node, need.fits) == (4000, 8, 32_000, True)
    assert host_memory_need(_plan(world=2), node).ranks_per_node == 2


def test_more_than_a_node_holds_is_refused_with_what_would_fit():
    node = get_hardware("dgx-h100").replace(host_memory_bytes=31_999)
    with pytest.raises(HostMemoryExceeded, match="--host-memory 32000") as caught:
        check_host_memory(_plan(world=8), node)
    assert caught.value.need.per_node == 32_000 and not caught.value.need.fits


def test_a_profile_stating_no_host_memory_limits_nothing():
    assert check_host_memory(_plan(world=1), get_hardware("dgx-h100").replace(host_memory_bytes=0)).fits


def _one_rank_of_two():
    """x (1000 bytes, made by op0 and read by op1, so every order makes it before op2) idles until op4 reads it;
    op2 runs with x + 200 + 4000 bytes live; one rank of two."""
    values = [value(0, 0, ValueKind.INPUT), value(1, 1000), value(2, 200), value(3, 4000), value(4, 100),
              value(5, 100)]
    ops = [op(0, [0], [1], flops=1000), op(1, [0, 1], [2], flops=2000), op(2, [2], [3], flops=3000),
           op(3, [3], [4], flops=4000), op(4, [1, 4], [5], flops=5000)]
    return replace(program(values, ops, [0], [5]), meta={"world": 2})


def test_no_plan_keeps_less_in_host_memory_than_an_op_forces_off_the_device():
    from hyperoffload.host_memory import least_host_bytes
    from hyperoffload.planning import plan_checked

    step = _one_rank_of_two()
    assert least_host_bytes(step, 4200) == 1000  # op2's 5200 live bytes in every order, less the budget
    assert least_host_bytes(step, 6000) == 0
    node = get_hardware("dgx-h100").replace(host_memory_bytes=2 * 1000 - 2)  # 999 bytes a rank
    with pytest.raises(HostMemoryExceeded, match=r"no plan under this device budget keeps less than 1000 B per rank"):
        plan_checked(step, node, 4200)
    assert plan_checked(step, node.replace(host_memory_bytes=2000), 4200).plan.budget_bytes == 4200


def test_the_planner_keeps_within_a_ranks_share_of_host_memory_where_a_plan_does():
    """tiny-llama sharded over 2 ranks at 20%: with a node's host memory just below what the fastest plan keeps, the
    planner finds another that fits, no faster. (At this budget such a plan exists among those the planner tries; at
    others, 30% to 80%, none keeps less than the fastest, and the refusal says so.)"""
    from hyperoffload.planning import plan_checked
    from hyperoffload.workloads import capture_workload, get_workload

    step = capture_workload(get_workload("tiny-llama"), "train", world=2).program
    node = get_hardware("dgx-h100")
    free = plan_checked(step, node, "20%")
    need = host_memory_need(free.plan, node)
    tight = node.replace(host_memory_bytes=need.per_node - 1)
    kept = plan_checked(step, tight, "20%")
    assert host_memory_need(kept.plan, tight).fits and host_memory_need(kept.plan, tight).per_node < need.per_node
    assert kept.timeline.step_s >= free.timeline.step_s  # the fastest plan did not fit
    assert need.least_per_rank <= host_memory_need(kept.plan, tight).per_rank
