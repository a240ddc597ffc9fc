"""The traffic bound: an LP lower bound on the copy time of every plan in a given op order."""

from dataclasses import replace

import pytest
from helpers import assert_no_plan_beats, assert_no_plan_beats_order_bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from programs import op, program, random_programs, random_training_programs, simple_hardware, two_peaks, value

from hyperoffload.analysis import flow_bound, memory_profile, traffic_bound
from hyperoffload.ir import Phase, ValueKind
from hyperoffload.policies import POLICIES
from hyperoffload.simulate import simulate


@pytest.mark.parametrize(("duplex", "copy_s"), [(1.0, 1.0), (0.8, 1.25), (0.5, 2.0), (0.3, 2.0)])
def test_the_one_storage_that_must_leave_crosses_both_ways(duplex, copy_s):
    """All of x (1000 B at 1000 B/s) must be off when op2 starts: one offload and one prefetch of 1 s each. With
    independent lanes they may overlap (1 s); sharing 0.8 both ways, the two rows give (0.8 + 0.2) / 0.8 = 1.25 s;
    at a share of one half or less, one after the other (2 s)."""
    prog = two_peaks()
    hardware = simple_hardware(bw=1000.0, duplex=duplex)
    budget = memory_profile(prog).peak_bytes - 1000
    bound = traffic_bound(prog, hardware, budget)
    assert bound.status == "optimal"
    assert bound.compute_s == pytest.approx(15e-6, rel=1e-12)
    assert bound.copy_s == pytest.approx(copy_s, rel=1e-6)
    assert bound.seconds == pytest.approx(copy_s, rel=1e-6)
    assert bound.h2d_bytes == pytest.approx(1000.0, rel=1e-6) and bound.d2h_bytes == pytest.approx(1000.0, rel=1e-6)
    plan = POLICIES["hyperoffload"](prog, hardware, budget)
    assert bound.seconds <= simulate(plan, hardware).figures.step_s


def _state_step():
    """A training-like step: parameter w (1000 B, a step input) is read by op0 (forward) and op3 (backward) and
    updated in place by op4; op1 and op2 make a 4000 B activation, so w must be off while op2 starts."""
    values = [value(0, 1000, ValueKind.PARAMETER), value(1, 0, ValueKind.INPUT), value(2, 100), value(3, 4000),
              value(4, 100), value(5, 100), value(6, 1000, ValueKind.PARAMETER, storage=0)]
    phases = [Phase.FORWARD, Phase.FORWARD, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
    ops = [op(0, [0, 1], [2], flops=1000),
           op(1, [2], [3], flops=1000),
           op(2, [3], [4], flops=1000),
           op(3, [0, 4], [5], flops=1000),
           op(4, [0, 5], [6], mutates=[0], flops=1000)]
    ops = [replace(o, phase=phase) for o, phase in zip(ops, phases)]
    return program(values, ops, [0, 1], [5])


def test_state_off_before_its_update_pays_the_offload_of_the_last_steps_update():
    """w is not written before op2 in the step, yet a copy of it in remote memory is a copy of what the last
    step's update wrote: per step, one offload after the update and one prefetch before op3. Sharing one half
    both ways that is 2 s, where the flow bound, which charges no offload before a write in the step, asks 1 s."""
    prog = _state_step()
    hardware = simple_hardware(bw=1000.0, duplex=0.5)
    budget = memory_profile(prog).peak_bytes - 1000
    bound = traffic_bound(prog, hardware, budget)
    assert bound.copy_s == pytest.approx(2.0, rel=1e-6)
    assert bound.d2h_bytes == pytest.approx(1000.0, rel=1e-6)
    assert flow_bound(prog, hardware, budget).seconds == pytest.approx(1.0, rel=1e-3)
    assert_no_plan_beats(lambda order: traffic_bound(prog, hardware, budget, order).seconds, prog, hardware, budget)


def test_a_budget_at_the_peak_gives_the_compute_time_and_one_below_it_nothing_can_meet_is_infeasible():
    prog = two_peaks()
    hardware = simple_hardware(bw=1000.0)
    peak = memory_profile(prog).peak_bytes
    fits = traffic_bound(prog, hardware, peak)
    assert fits.status == "fits" and fits.copy_s == 0.0 and fits.seconds == pytest.approx(15e-6, rel=1e-12)
    impossible = traffic_bound(prog, hardware, 100)
    assert impossible.status == "infeasible" and impossible.seconds == float("inf")


def _check_policies(prog, hardware, budget):
    assert_no_plan_beats_order_bound(lambda order: traffic_bound(prog, hardware, budget, order), prog, hardware,
                                     budget)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.sampled_from([0.9, 0.7, 0.5]), st.sampled_from([1e3, 1e6]),
       st.sampled_from([1.0, 0.6, 0.4]))
def test_no_plan_of_any_policy_beats_the_bound(prog, share, bandwidth, duplex):
    _check_policies(prog, simple_hardware(bw=bandwidth, duplex=duplex), int(memory_profile(prog).peak_bytes * share))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_training_programs(), st.sampled_from([0.9, 0.7, 0.5]), st.sampled_from([1e3, 1e6]),
       st.sampled_from([1.0, 0.7, 0.4]))
def test_no_plan_of_any_policy_beats_the_bound_on_training_like_steps(prog, share, bandwidth, duplex):
    """State updated in place and kept remote between steps (timed in steady state): the offload shared with the
    last step's update and the prefetch shared across the step boundary are exercised here."""
    _check_policies(prog, simple_hardware(bw=bandwidth, duplex=duplex), int(memory_profile(prog).peak_bytes * share))
