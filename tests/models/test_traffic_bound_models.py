"""The traffic bound on a captured tiny-llama training step: on a slow link the copies set it, and no policy's
plan beats it."""

import pytest
from helpers import assert_no_plan_beats_order_bound

from hyperoffload.analysis import memory_profile, traffic_bound
from hyperoffload.hardware import get_hardware
from hyperoffload.workloads import capture_workload, get_workload


def _check_policies(prog, hardware, budget):
    assert_no_plan_beats_order_bound(lambda order: traffic_bound(prog, hardware, budget, order), prog, hardware,
                                     budget)


@pytest.mark.parametrize("share", [0.7, 0.4])
def test_tiny_llama_training_plans_stay_above_the_bound(share):
    """On a 500 MB/s link that shares one half both ways (as NVLink-C2C does) the copies set the bound, and
    every policy's plan that meets the budget steps no faster."""
    prog = capture_workload(get_workload("tiny-llama"), "train").program
    hardware = get_hardware("gh200").replace(h2d_bw=5e8, d2h_bw=5e8)
    budget = int(memory_profile(prog).peak_bytes * share)
    bound = traffic_bound(prog, hardware, budget)
    assert bound.copy_s > bound.compute_s
    _check_policies(prog, hardware, budget)
