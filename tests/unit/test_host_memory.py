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
