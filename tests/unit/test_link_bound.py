"""The link bound: a lower bound on the step time of every plan, in every op order, under a budget."""

import dataclasses

import pytest
from helpers import assert_no_plan_beats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from programs import (op, program, random_programs, random_training_programs, simple_hardware, two_rank_hardware,
                      value)

from hyperoffload.analysis import link_bound, memory_profile
from hyperoffload.ir import Phase, ValueKind
from hyperoffload.policies import POLICIES
from hyperoffload.simulate import simulate


def _hand_program():
    """x (1000 B, made by op0 and read by op1, so every order makes it before the peak) idles until op4
    reads it; op2 peaks with x + 200 + 4000 bytes live."""
    values = [value(0, 0, ValueKind.INPUT), value(1, 1000), value(2, 200), value(3, 4000), value(4, 100),
              value(5, 100)]
    ops = [op(0, [0], [1], flops=1000), op(1, [0, 1], [2], flops=2000), op(2, [2], [3], flops=3000),
           op(3, [3], [4], flops=4000), op(4, [1, 4], [5], flops=5000)]
    return program(values, ops, [0], [5])


@pytest.mark.parametrize("duplex", [1.0, 0.8, 0.5, 0.3])
def test_hand_computed(duplex):
    """At a budget 1000 bytes under the peak, x must be away while op2 runs (op2's own input and output
    must stay): 1000 bytes out and 1000 back at 1000 B/s, 1 s each alone. x is made in the step, so it goes out
    before op2 starts and comes back after: the two cannot overlap, whatever the link shares, 2 s."""
    prog = _hand_program()
    hardware = simple_hardware(bw=1000.0, duplex=duplex)
    budget = memory_profile(prog).peak_bytes - 1000
    bound = link_bound(prog, hardware, budget)
    assert bound.peak_op == 2 and bound.forced_bytes == 5200 and bound.excess_bytes == 1000
    assert bound.d2h_bytes == bound.h2d_bytes == 1000
    assert bound.seconds == pytest.approx(2.0)
    assert_no_plan_beats(lambda order: bound.seconds, prog, hardware, budget)


def _state_program():
    """p (1000 B, a parameter) is read by op1 and updated in place by op4; op2 peaks with p + 200 + 4000 bytes
    live."""
    values = [value(0, 1000, ValueKind.PARAMETER), value(1, 100), value(2, 200), value(3, 4000), value(4, 100),
              value(5, 100)]
    ops = [op(0, [0], [1], flops=1000), op(1, [0, 1], [2], flops=2000),
           op(2, [2], [3], flops=3000), op(3, [3], [4], flops=4000), op(4, [0, 4], [5], mutates=[0], flops=5000)]
    return program(values, ops, [0], [5])


@pytest.mark.parametrize(("duplex", "copies_s"), [(1.0, 1.0), (0.8, 1.25), (0.5, 2.0), (0.3, 2.0)])
def test_state_copies_may_share_the_link(duplex, copies_s):
    """p must be away while op2 runs: 1000 bytes back after op2 (op4 reads it) and 1000 out after its update
    (in op4, so per step that offload may run at any time): both at once take 1 / share seconds; at a share of
    one half or less, one after the other (2 s) is no slower."""
    prog = _state_program()
    hardware = simple_hardware(bw=1000.0, duplex=duplex)
    budget = memory_profile(prog).peak_bytes - 1000
    bound = link_bound(prog, hardware, budget)
    assert bound.peak_op == 2 and bound.excess_bytes == 1000
    assert bound.d2h_bytes == bound.h2d_bytes == 1000
    assert bound.seconds == pytest.approx(copies_s, rel=1e-5)  # and the microseconds of compute before op2
    assert_no_plan_beats(lambda order: bound.seconds, prog, hardware, budget)


def test_bytes_that_need_no_copy_one_way_count_only_that_way():
    """w (400 B) is an input nothing writes and op2 reads; y (600 B, a step output made by op0) is read by
    nothing after the peak op, op1. At a budget 1000 bytes under the peak both are away while op1 runs:
    w needs no offload (its remote copy stays current) and y need not come back, so 600 bytes must go
    out (6 s at 100 B/s), before op1 starts, as y is made in the step, and 400 come back (4 s), after it:
    10 s, though the link does not share."""
    values = [value(0, 400, ValueKind.INPUT), value(1, 600), value(2, 2000), value(3, 0), value(4, 0)]
    ops = [op(0, [0], [1, 4], flops=1000),  # y, and an empty u that makes op0 come before op1 in every order
           op(1, [4], [2], flops=1000),  # the peak: w + y + a 2000-byte temporary
           op(2, [0, 2], [3], flops=1000)]
    prog = program(values, ops, [0], [1, 3])
    hardware = simple_hardware(bw=100.0)
    assert memory_profile(prog).peak_bytes == 3000
    bound = link_bound(prog, hardware, 2000)
    assert bound.peak_op == 1
    assert (bound.excess_bytes, bound.d2h_bytes, bound.h2d_bytes) == (1000, 600, 400)
    assert bound.seconds == pytest.approx(10.0)
    assert_no_plan_beats(lambda order: bound.seconds, prog, hardware, 2000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.sampled_from([0.8, 0.6]), st.sampled_from([1e3, 1e6]), st.sampled_from([1.0, 0.6, 0.4]))
def test_no_plan_of_any_policy_beats_the_bound(prog, share, bandwidth, duplex):
    hardware = simple_hardware(bw=bandwidth, duplex=duplex)
    budget = int(memory_profile(prog).peak_bytes * share)
    seconds = link_bound(prog, hardware, budget).seconds
    assert_no_plan_beats(lambda order: seconds, prog, hardware, budget)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_training_programs(), st.sampled_from([0.9, 0.7, 0.5]), st.sampled_from([1e3, 1e6]),
       st.sampled_from([1.0, 0.7, 0.4]))
def test_no_plan_of_any_policy_beats_the_bound_on_training_like_steps(prog, share, bandwidth, duplex):
    """State updated in place, kept remote between steps and timed in steady state: the D2H of written state and
    the bytes that need no copy one way are exercised here, which ``random_programs`` (read-only inputs) is not."""
    hardware = simple_hardware(bw=bandwidth, duplex=duplex)
    budget = int(memory_profile(prog).peak_bytes * share)
    seconds = link_bound(prog, hardware, budget).seconds
    assert_no_plan_beats(lambda order: seconds, prog, hardware, budget)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_training_programs(sharded=True), st.sampled_from([0.9, 0.6]), st.sampled_from([1e3, 1e6]),
       st.sampled_from([1e3, 1e5]))
def test_no_plan_of_any_policy_beats_the_bound_extended_to_the_network(prog, share, bandwidth, network_bw):
    """Steps with collectives on the network lane (one rank of a sharded step): the bound counts the network's own
    total; no policy's plan, in any order it tries, beats it, also timed in steady state."""
    hardware = two_rank_hardware(bw=bandwidth, network_bw=network_bw)
    budget = int(memory_profile(prog).peak_bytes * share)
    bound = link_bound(prog, hardware, budget)
    assert bound.seconds >= max(bound.network_s, bound.compute_s)
    assert_no_plan_beats(lambda order: bound.seconds, prog, hardware, budget)


def test_a_parameter_off_at_the_peak_and_at_a_later_large_op_comes_in_twice():
    """w (a 2000-byte parameter) is read in the forward pass (op0), in the backward pass (op2) and updated at the
    end (op4). Under a 6000-byte budget (op0 holds w and a, 6000 bytes, whatever leaves), 2100 bytes must be off
    at the peak, op1, so w must lose at least 100 even with all of the 2000-byte moment M off; at op3, which makes
    a 2500-byte temporary while it updates M, w is the only thing that can leave, and 600 of it must. Off at
    both, w comes back for op2 and again for the next step's op0. The least a step moves is then 4800 bytes (with
    600 of w off at both: 600 out and 1200 in for w, 1500 out and 1500 in for M) over a link that takes one
    direction at a time at 1000 B/s: 4.8 s, where op1 alone says 4.2 s (2100 bytes each way)."""
    values = [value(0, 2000, ValueKind.PARAMETER), value(1, 2000, ValueKind.OPTIMIZER_STATE),
              value(2, 0, ValueKind.INPUT), value(3, 4000, ValueKind.ACTIVATION), value(4, 100), value(5, 100),
              value(6, 2500), value(7, 2000, ValueKind.OPTIMIZER_STATE, storage=1),
              value(8, 2000, ValueKind.PARAMETER, storage=0), value(9, 0)]
    phases = [Phase.FORWARD, Phase.BACKWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.OPTIMIZER]
    ops = [op(0, [0, 2], [3], flops=1000),
           op(1, [3], [4], flops=1000),  # the peak: w, M, a and its output
           op(2, [4, 0], [5], flops=1000),  # w's backward use
           op(3, [5, 1], [6, 7], mutates=[1], flops=1000),  # M's update, with a large temporary
           op(4, [0, 6], [8, 9], mutates=[0], flops=1000)]  # w's update
    ops = [dataclasses.replace(o, phase=phase) for o, phase in zip(ops, phases)]
    prog = program(values, ops, [0, 1, 2], [9])
    hardware = simple_hardware(bw=1000.0, duplex=0.5)
    bound = link_bound(prog, hardware, 6000)
    assert (bound.peak_op, bound.second_op) == (1, 3)
    assert bound.seconds == pytest.approx(4.8, rel=1e-6)
    assert bound.d2h_bytes + bound.h2d_bytes == pytest.approx(4800, abs=2)
    plan = POLICIES["hyperoffload"](prog, hardware, 6000)  # a plan meets the budget: the check below means something
    assert simulate(plan, hardware).figures.peak_bytes <= 6000
    assert_no_plan_beats(lambda order: bound.seconds, prog, hardware, 6000)
