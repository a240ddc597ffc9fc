"""The window bound: a lower bound on the step time of every plan in a given op order."""

import pytest
from helpers import assert_no_plan_beats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from programs import op, program, random_programs, simple_hardware, value

from hyperoffload.analysis import memory_profile
from hyperoffload.analysis.window_bound import window_bound
from hyperoffload.ir import ValueKind
from hyperoffload.policies import POLICIES
from hyperoffload.simulate import simulate


def test_hand_computed_windows():
    """x (written by op0) idles until op4 reads it. At the peak (op2, which makes a large temporary) x must
    be away: it can leave only after op0 and before op2 starts, and return only after op2 and before
    op4. The windows of consecutive steps never meet, so the two copies add up."""
    values = [value(0, 0), value(1, 1000), value(2, 200), value(3, 4000), value(4, 100), value(5, 100)]
    ops = [op(0, [0], [1], flops=1000),  # x = value 1, 1000 bytes
           op(1, [0], [2], flops=2000),
           op(2, [2], [3], flops=3000),  # the peak: x + 200 + 4000
           op(3, [3], [4], flops=4000),
           op(4, [1, 4], [5], flops=5000)]
    prog = program(values, ops, [0], [5])
    hardware = simple_hardware(bw=1000.0)  # x takes 1 s each way; the ops take 1 to 5 us
    budget = memory_profile(prog).peak_bytes - 1000
    bound = window_bound(prog, hardware, budget)
    assert bound.peak_position == 2 and bound.excess_bytes == 1000
    assert bound.d2h_window_s == pytest.approx(2e-6)  # op1
    assert bound.h2d_window_s == pytest.approx(4e-6)  # op3
    assert bound.seconds == pytest.approx(15e-6 + (1.0 - 2e-6) + (1.0 - 4e-6), rel=1e-9)
    # The planner's plan is the bound plus 4 us: x cannot come back during op3 either (op3 is over the
    # budget with x too), which the bound, looking at the peak alone, does not know.
    plan = POLICIES["hyperoffload"](prog, hardware, budget)
    assert simulate(plan, hardware).figures.step_s == pytest.approx(bound.seconds + 4e-6, rel=1e-6)


def test_an_input_nothing_uses_leaves_no_window_to_pay_for():
    """x (12 B) is read by the only op; w (4 B) is an input nothing reads or writes. At a budget of 12 bytes w
    stays remote with no copy either way, so the bound is the compute time (an empty window once counted as
    negative, which asked for a stall)."""
    prog = program([value(0, 12, ValueKind.INPUT), value(1, 4, ValueKind.INPUT), value(2, 0)], [op(0, [0], [2])],
                   [0, 1], [2])
    hardware = simple_hardware(bw=1e3)
    bound = window_bound(prog, hardware, 12)
    assert bound.excess_bytes == 4 and bound.seconds == pytest.approx(bound.compute_s)
    assert bound.d2h_window_s == 0.0 and bound.h2d_window_s == 0.0
    _check_policies(prog, hardware, 12)


def _check_policies(prog, hardware, budget):
    assert_no_plan_beats(lambda order: window_bound(prog, hardware, budget, order).seconds, prog, hardware, budget)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.sampled_from([0.8, 0.6]), st.sampled_from([1e3, 1e6]), st.sampled_from([1.0, 0.6]))
def test_no_plan_of_any_policy_beats_the_bound(prog, share, bandwidth, duplex):
    hardware = simple_hardware(bw=bandwidth, duplex=duplex)
    _check_policies(prog, hardware, int(memory_profile(prog).peak_bytes * share))
