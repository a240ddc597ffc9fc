"""The window bound on a captured tiny-llama training step: the compute time when nothing must move, no policy's
plan beats it on a slow link, and the largest budget at which offloading is free."""

import pytest
from helpers import assert_no_plan_beats

from hyperoffload.analysis import memory_profile
from hyperoffload.analysis.window_bound import window_bound
from hyperoffload.hardware import get_hardware
from hyperoffload.workloads import capture_workload, get_workload


def _check_policies(prog, hardware, budget):
    assert_no_plan_beats(lambda order: window_bound(prog, hardware, budget, order).seconds, prog, hardware, budget)


def test_nothing_to_move_gives_the_compute_time():
    prog = capture_workload(get_workload("tiny-llama"), "train").program
    hardware = get_hardware("h100-sxm")
    bound = window_bound(prog, hardware, memory_profile(prog).peak_bytes)
    assert bound.seconds == bound.compute_s and bound.excess_bytes == 0


@pytest.mark.parametrize("share", [0.7, 0.5])
def test_tiny_llama_plans_stay_above_the_bound(share):
    prog = capture_workload(get_workload("tiny-llama"), "train").program
    hardware = get_hardware("h100-sxm").replace(h2d_bw=2e9, d2h_bw=2e9)  # a slow link: copies stall
    _check_policies(prog, hardware, int(memory_profile(prog).peak_bytes * share))


def test_free_offload_budget_is_where_the_bound_leaves_the_compute_time():
    from hyperoffload.analysis.window_bound import free_offload_budget

    prog = capture_workload(get_workload("tiny-llama"), "train").program
    hardware = get_hardware("h100-sxm").replace(h2d_bw=2e9, d2h_bw=2e9)
    free = free_offload_budget(prog, hardware)
    assert 0 < free < memory_profile(prog).peak_bytes
    at = window_bound(prog, hardware, free)
    below = window_bound(prog, hardware, free - 1)
    assert at.seconds == at.compute_s and below.seconds > below.compute_s
    # a faster link can hide more: the free budget only falls
    assert free_offload_budget(prog, hardware.replace(h2d_bw=2e10, d2h_bw=2e10)) <= free
