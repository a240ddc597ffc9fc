"""The collective cost model: the ring formulas on small numbers worked by hand, the hierarchical split across
nodes, its properties over many sizes and groups, and the errors for what a profile cannot run."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperoffload.collectives import (CollectiveError, RingStage, all_gather_s, all_reduce_s, collective_s,
                                      reduce_scatter_s, ring_stages)
from hyperoffload.hardware import get_hardware
from hyperoffload.ir import CollectiveKind
from programs import simple_hardware


def cluster(devices_per_node=4, nodes=2, intra_bw=100.0, intra_latency_s=1.0, inter_bw=10.0, inter_latency_s=5.0):
    """A profile with small round numbers: bandwidths in bytes/s, latencies in seconds."""
    return simple_hardware().replace(devices_per_node=devices_per_node, nodes=nodes, intra_node_bw=intra_bw,
                                     intra_node_latency_s=intra_latency_s, inter_node_bw=inter_bw,
                                     inter_node_latency_s=inter_latency_s)


def test_one_node_ring_by_hand():
    h = cluster()
    # 4 ranks, 800 bytes: each rank sends 3/4 * 800 = 600 bytes at 100 B/s (6 s) in 3 steps of 1 s
    assert all_gather_s(h, 800, 4) == pytest.approx(6 + 3)
    assert reduce_scatter_s(h, 800, 4) == pytest.approx(9)
    assert all_reduce_s(h, 800, 4) == pytest.approx(18)
    # 2 ranks: 1/2 * 800 / 100 + 1 * 1
    assert all_gather_s(h, 800, 2) == pytest.approx(5)


def test_across_nodes_the_ring_is_hierarchical_by_hand():
    h = cluster()
    # 8 ranks, 4 per node on 2 nodes, 800 bytes. Inside a node: 3/4 * 800 / 100 + 3 * 1 = 9 s. Across nodes:
    # 4 rings of 2 in parallel, each over 800 / 4 = 200 bytes: 1/2 * 200 / 10 + 1 * 5 = 15 s.
    stages = ring_stages(h, 800, 8)
    assert stages == (RingStage(ranks=4, nbytes=800, bw=100, latency_s=1), RingStage(ranks=2, nbytes=200, bw=10,
                                                                                     latency_s=5))
    assert all_gather_s(h, 800, 8) == pytest.approx(24)
    assert all_reduce_s(h, 800, 8) == pytest.approx(48)
    # One rank per node: only the network, over the whole tensor: 1/2 * 800 / 10 + 5 = 45 s
    assert all_gather_s(h, 800, 2, ranks_per_node=1) == pytest.approx(45)
    # Two per node on two nodes: 1/2 * 800 / 100 + 1, then 1/2 * 400 / 10 + 5
    assert all_gather_s(h, 800, 4, ranks_per_node=2) == pytest.approx(5 + 25)


def test_the_hierarchical_split_moves_the_flat_rings_bytes():
    """Per rank, the two stages together move (N-1)/N of the tensor, as one flat ring would."""
    h = cluster(devices_per_node=8, nodes=4)
    for group, per_node in ((32, 8), (16, 4), (8, 2), (4, 1)):
        moved = sum((s.ranks - 1) / s.ranks * s.nbytes for s in ring_stages(h, 1000, group, ranks_per_node=per_node))
        assert moved == pytest.approx((group - 1) / group * 1000)


def test_dgx_h100_figures():
    """8 GPUs on NVLink: 7/8 of 1 GiB at 450 GB/s plus 7 steps of 3.4 us; two DGX add a network ring over 1/8."""
    h = get_hardware("dgx-h100")
    gib = 2**30
    one_node = 7 / 8 * gib / 450e9 + 7 * 3.4e-6
    assert all_gather_s(h, gib, 8) == pytest.approx(one_node)
    assert all_gather_s(h, gib, 16) == pytest.approx(one_node + 1 / 2 * gib / 8 / 50e9 + 14e-6)
    assert all_reduce_s(h, gib, 8) == pytest.approx(2 * one_node)


def test_collective_s_takes_each_kind():
    h = cluster()
    assert collective_s(CollectiveKind.ALL_GATHER, h, 800, 4) == all_gather_s(h, 800, 4)
    assert collective_s(CollectiveKind.REDUCE_SCATTER, h, 800, 4) == reduce_scatter_s(h, 800, 4)
    assert collective_s(CollectiveKind.ALL_REDUCE, h, 800, 4) == all_reduce_s(h, 800, 4)
    with pytest.raises(CollectiveError, match="kind must be a CollectiveKind"):
        collective_s("all_gather", h, 800, 4)


# -- properties ------------------------------------------------------------------------------------------------

PROFILES = st.builds(cluster, devices_per_node=st.integers(1, 8), nodes=st.integers(1, 6),
                     intra_bw=st.floats(1e6, 1e12), intra_latency_s=st.floats(0, 1e-3),
                     inter_bw=st.floats(1e6, 1e12), inter_latency_s=st.floats(0, 1e-3))
SIZES = st.floats(0, 1e12)


@st.composite
def placed_groups(draw):
    """A profile and a group on it: ``ranks_per_node`` ranks on each of ``spanned`` nodes."""
    h = draw(PROFILES)
    per_node = draw(st.integers(1, h.devices_per_node))
    spanned = draw(st.integers(1, h.nodes))
    return h, per_node * spanned, per_node


@settings(max_examples=200, deadline=None)
@given(placed_groups(), SIZES, SIZES)
def test_more_bytes_never_cost_less(placed, a, b):
    h, group, per_node = placed
    small, large = sorted((a, b))
    for cost in (all_gather_s, reduce_scatter_s, all_reduce_s):
        assert cost(h, small, group, ranks_per_node=per_node) <= cost(h, large, group, ranks_per_node=per_node)


@settings(max_examples=200, deadline=None)
@given(placed_groups(), SIZES)
def test_all_reduce_is_a_reduce_scatter_then_an_all_gather(placed, nbytes):
    h, group, per_node = placed
    both = reduce_scatter_s(h, nbytes, group, ranks_per_node=per_node) + all_gather_s(h, nbytes, group,
                                                                                      ranks_per_node=per_node)
    assert all_reduce_s(h, nbytes, group, ranks_per_node=per_node) == pytest.approx(both, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(placed_groups(), SIZES)
def test_never_faster_than_the_ring_bytes_over_the_faster_link(placed, nbytes):
    h, group, per_node = placed
    fastest = max(h.intra_node_bw, h.inter_node_bw)
    bound = (group - 1) / group * nbytes / fastest
    for cost in (all_gather_s, reduce_scatter_s):
        assert cost(h, nbytes, group, ranks_per_node=per_node) >= bound * (1 - 1e-12)
    assert all_reduce_s(h, nbytes, group, ranks_per_node=per_node) >= 2 * bound * (1 - 1e-12)


@settings(max_examples=100, deadline=None)
@given(PROFILES, SIZES)
def test_a_group_of_one_costs_nothing(h, nbytes):
    for cost in (all_gather_s, reduce_scatter_s, all_reduce_s):
        assert cost(h, nbytes, 1) == 0.0
    assert ring_stages(h, nbytes, 1) == ()


def test_a_group_of_one_costs_nothing_on_a_single_device():
    assert all_reduce_s(get_hardware("h100-sxm"), 2**30, 1) == 0.0


def test_within_one_node_the_model_is_the_plain_ring_formula():
    h = cluster(devices_per_node=8, nodes=1, intra_bw=7e9, intra_latency_s=2e-6)
    for n in range(2, 9):
        assert all_gather_s(h, 1e9, n) == pytest.approx((n - 1) / n * 1e9 / 7e9 + (n - 1) * 2e-6)


# -- errors ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [-1, math.nan, math.inf, True, "8"])
def test_bad_bytes_are_refused(nbytes):
    with pytest.raises(CollectiveError, match="nbytes must be a finite number of bytes >= 0"):
        all_gather_s(cluster(), nbytes, 4)


@pytest.mark.parametrize("group", [0, -2, 2.0, True])
def test_bad_group_sizes_are_refused(group):
    with pytest.raises(CollectiveError, match="group_size must be a whole number of ranks >= 1"):
        all_gather_s(cluster(), 800, group)


def test_a_single_device_profile_has_no_network():
    with pytest.raises(CollectiveError, match="h100-sxm describes one device with no network.*dgx-h100"):
        all_gather_s(get_hardware("h100-sxm"), 800, 2)


def test_a_group_larger_than_the_profile_is_refused():
    with pytest.raises(CollectiveError, match=r"a group of 9 ranks is more than the 8 devices of test \(4 per node x 2"):
        all_gather_s(cluster(), 800, 9)
    with pytest.raises(CollectiveError, match="more than the 256 devices of dgx-h100"):
        all_reduce_s(get_hardware("dgx-h100"), 800, 512)


@pytest.mark.parametrize("group, per_node, message", [
    (6, None, r"a group of 6 ranks does not fill whole nodes of 4 devices; give ranks_per_node.*\[1, 2, 3\]"),
    (4, 5, "ranks_per_node = 5 is more than the 4 devices of a node"),
    (6, 4, r"cannot put ranks_per_node = 4 on every node.*\[1, 2, 3\]"),
    (4, 1, "spans 4 nodes, more than the 2 of test"),
    (4, 0, "ranks_per_node must be a whole number of ranks >= 1"),
])
def test_a_placement_the_profile_cannot_hold_is_refused(group, per_node, message):
    with pytest.raises(CollectiveError, match=message):
        all_gather_s(cluster(), 800, group, ranks_per_node=per_node)


def test_every_multi_device_preset_prices_its_whole_machine():
    for name in ("dgx-h100", "hgx-h200", "gh200-nvl", "ascend-910c-superpod"):
        h = get_hardware(name)
        whole = all_reduce_s(h, 2**30, h.device_count)
        one_node = all_reduce_s(h, 2**30, h.devices_per_node)
        assert whole > one_node > 0, name
