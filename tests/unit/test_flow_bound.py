"""The flow bound: an LP lower bound on the step time of every plan in a given op order."""

import pytest
from helpers import assert_no_plan_beats, assert_no_plan_beats_order_bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from programs import (op, program, random_programs, random_training_programs, simple_hardware, two_peaks,
                      two_rank_hardware, value)

from hyperoffload.analysis import flow_bound, memory_profile, window_bound
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import POLICIES
from hyperoffload.simulate import simulate


def test_hand_computed_flows():
    """One op per bin, so each bin's instant is the start of its op (the bin's first slot is empty, its second
    holds the op). x must be wholly off when op2 starts: its offload may move data from the slot of its write
    (op0) until op2 starts, 1 s of link against 3 us of compute (op0, op1). 900 bytes must still be off when
    op3 starts, so they come back after that and before op4 starts: 0.9 s against op3's 4 us. The other 100
    bytes may come back from op2's start: 0.1 s against its 3 us. The lanes are independent (duplex 1.0)
    and the three stretches are disjoint, so the stalls add up to (1 - 3e-6) + (0.1 - 3e-6) + (0.9 - 4e-6):
    2 s + 5 us in all. (The window bound, which knows the offload starts after op0 ends, says 2 s + 9 us.)"""
    prog = two_peaks()
    hardware = simple_hardware(bw=1000.0)
    budget = memory_profile(prog).peak_bytes - 1000
    bound = flow_bound(prog, hardware, budget)
    assert bound.status == "optimal" and bound.bins == 5
    assert bound.need_bytes == (0, 0, 1000, 900, 0)
    compute = 15e-6
    stall = (1.0 - 3e-6) + (0.1 - 3e-6) + (0.9 - 4e-6)
    assert bound.compute_s == pytest.approx(compute, rel=1e-12)
    assert bound.seconds == pytest.approx(compute + stall, rel=1e-7)
    assert bound.d2h_bytes == pytest.approx(1000.0) and bound.h2d_bytes == pytest.approx(1000.0)
    plan = POLICIES["hyperoffload"](prog, hardware, budget)
    assert bound.seconds <= simulate(plan, hardware).figures.step_s


def test_one_bin_and_the_default_bins_both_charge_the_offload():
    """With one bin the offload must cross before the bin's instant (at least 1 s of link); the default bins
    give a bound at least as high here."""
    prog = two_peaks()
    hardware = simple_hardware(bw=1000.0, duplex=0.5)
    budget = memory_profile(prog).peak_bytes - 1000
    one = flow_bound(prog, hardware, budget, bins=1)
    assert one.seconds >= 1.0  # D2H of x before the instant
    assert flow_bound(prog, hardware, budget).seconds >= one.seconds * (1 - 1e-9)  # finer bins only tighten


def test_duplex_share_charges_copies_that_must_cross_together():
    """x (1000 B) must be off while op1 and op2 start and back for op3, which reads it; y (1000 B), made by op2,
    must be off when op3 starts. One op per bin: x comes back and y goes out in the same slot (op2's), so the
    two copies run together there. Apart from x's offload before op2 (1 s) and y's return for op4 (1 s), that
    slot takes 1 s with independent lanes and 2 s when each gets half the link."""
    values = [value(0, 0), value(1, 1000), value(2, 4000), value(3, 1000), value(4, 4000), value(5, 0)]
    ops = [op(0, [0], [1], flops=1000), op(1, [0], [2], flops=1000), op(2, [2], [3], flops=1000),
           op(3, [1], [4], flops=1000), op(4, [3, 4], [5], flops=1000)]
    prog = program(values, ops, [0], [5])
    budget = memory_profile(prog).peak_bytes - 1000
    seconds = {}
    for duplex in (1.0, 0.5):
        hardware = simple_hardware(bw=1000.0, duplex=duplex)
        seconds[duplex] = flow_bound(prog, hardware, budget).seconds
        assert_no_plan_beats(lambda order, hw=hardware: flow_bound(prog, hw, budget, order).seconds, prog, hardware,
                             budget)
    assert seconds[1.0] == pytest.approx(3.0, abs=1e-5)
    assert seconds[0.5] == pytest.approx(4.0, abs=1e-5)


def test_budget_at_the_peak_gives_the_compute_time():
    """At the unplanned peak nothing has to move: the bound is the ops' compute, 15 us (1000 to 5000 FLOPs at
    1 GFLOP/s), as the window bound says too. One byte less and one byte of x must be off when op2 starts: out
    after op0 (1 ms of link against op0 and op1's 3 us) and back during op2 and op3 (1 ms against their 7 us),
    so the bound is 15 us + 2 ms - 10 us."""
    prog = two_peaks()
    hardware = simple_hardware(bw=1000.0)
    peak = memory_profile(prog).peak_bytes
    bound = flow_bound(prog, hardware, peak)
    assert bound.status == "fits" and bound.seconds == pytest.approx(15e-6, rel=1e-12)
    assert bound.seconds == pytest.approx(window_bound(prog, hardware, peak).seconds, rel=1e-12)
    below = flow_bound(prog, hardware, peak - 1)
    assert below.status == "optimal" and below.need_bytes == (0, 0, 1, 0, 0)
    assert below.seconds == pytest.approx(15e-6 + (1e-3 - 3e-6) + (1e-3 - 7e-6), rel=1e-6)


def test_a_budget_nothing_can_meet_is_infeasible():
    prog = two_peaks()
    bound = flow_bound(prog, simple_hardware(bw=1000.0), 100)
    assert bound.status == "infeasible" and bound.seconds == float("inf")


def _check_policies(prog, hardware, budget, **kwargs):
    # The compute it counts is what the unplanned step in that order simulates to.
    assert_no_plan_beats_order_bound(lambda order: flow_bound(prog, hardware, budget, order, **kwargs), prog,
                                     hardware, budget)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.sampled_from([0.9, 0.7, 0.5]), st.sampled_from([1e3, 1e6]),
       st.sampled_from([1.0, 0.6, 0.4]), st.sampled_from([1, 3, 128]))
def test_no_plan_of_any_policy_beats_the_bound(prog, share, bandwidth, duplex, bins):
    hardware = simple_hardware(bw=bandwidth, duplex=duplex)
    _check_policies(prog, hardware, int(memory_profile(prog).peak_bytes * share), bins=bins)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs())
def test_the_bound_is_the_compute_time_at_the_peak(prog):
    hardware = simple_hardware(bw=1e3)
    bound = flow_bound(prog, hardware, memory_profile(prog).peak_bytes)
    assert bound.status == "fits"
    assert bound.seconds == pytest.approx(simulate(plan_without_offload(prog), hardware).figures.compute_s,
                                          rel=1e-9, abs=1e-15)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_training_programs(sharded=True), st.sampled_from([0.9, 0.6, 0.3]), st.sampled_from([1e3, 1e6]),
       st.sampled_from([1e3, 1e5]), st.sampled_from([1, 3, 128]))
def test_no_plan_beats_the_bound_of_its_order_on_a_sharded_step(prog, share, bandwidth, network_bw, bins):
    """Steps with collectives on the network lane (one rank of a sharded step): a collective takes no compute-stream
    time, so the bound counts it as nothing, and no policy's plan in an order beats that order's bound, also timed
    in steady state."""
    hardware = two_rank_hardware(bw=bandwidth, network_bw=network_bw)
    _check_policies(prog, hardware, int(memory_profile(prog).peak_bytes * share), bins=bins)
