"""The simulator on a captured tiny-llama training step: its unplanned step agrees with the lifetime analysis."""

import pytest

from hyperoffload.plans import plan_without_offload
from hyperoffload.simulate import simulate
from programs import simple_hardware as hardware


def test_no_offload_plan_matches_the_lifetime_analysis():
    from hyperoffload.analysis import memory_profile
    from hyperoffload.workloads import capture_workload, get_workload

    prog = capture_workload(get_workload("tiny-llama"), "train").program
    f = simulate(plan_without_offload(prog), hardware()).figures
    assert f.peak_bytes == memory_profile(prog).peak_bytes
    assert f.step_s == pytest.approx(f.compute_s) and f.stalls == 0 and f.h2d_bytes == f.d2h_bytes == 0
