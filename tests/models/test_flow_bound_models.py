"""The flow bound on a captured tiny-llama training step: no policy's plan beats it on a slow link."""

import pytest
from helpers import assert_no_plan_beats_order_bound

from hyperoffload.analysis import flow_bound, memory_profile


def _check_policies(prog, hardware, budget, **kwargs):
    # The compute it counts is what the unplanned step in that order simulates to.
    assert_no_plan_beats_order_bound(lambda order: flow_bound(prog, hardware, budget, order, **kwargs), prog,
                                     hardware, budget)


@pytest.mark.parametrize("share", [0.7, 0.5])
def test_tiny_llama_plans_stay_above_the_bound(share):
    from hyperoffload.hardware import get_hardware
    from hyperoffload.workloads import capture_workload, get_workload

    prog = capture_workload(get_workload("tiny-llama"), "train").program
    hardware = get_hardware("h100-sxm").replace(h2d_bw=2e9, d2h_bw=2e9)  # a slow link: copies stall
    _check_policies(prog, hardware, int(memory_profile(prog).peak_bytes * share), bins=32)
