"""compare and sweep on a captured tiny-llama step: a row per policy at one budget, honest feasibility, the
figures' keys. The commands are in tests/cli/test_compare_cli.py."""

from __future__ import annotations

import pytest
from output_checks import FIGURES

from hyperoffload.analysis import memory_profile
from hyperoffload.budgets import parse_budget
from hyperoffload.compare import compare, sweep
from hyperoffload.hardware import get_hardware
from hyperoffload.policies import KV_ONLY, POLICIES, SHARDED_ONLY, minimum_budget
from hyperoffload.report.compare import compare_table, verdict
from hyperoffload.workloads import capture_workload, get_workload

H100 = get_hardware("h100-sxm")


@pytest.fixture(scope="module")
def tiny():
    return capture_workload(get_workload("tiny-llama"), "train").program


def test_compare_and_simulate_take_profile_names_and_budget_text_as_plan_does(tiny):
    from hyperoffload import HardwareError, plan, simulate

    by_name = [r.as_dict() for r in compare(tiny, "h100-sxm", "50%", policies=["hyperoffload", "reactive"])]
    by_value = [r.as_dict() for r in compare(tiny, H100, parse_budget("50%", tiny, H100),
                                             policies=["hyperoffload", "reactive"])]
    for named, valued in zip(by_name, by_value, strict=True):
        assert {k: v for k, v in named.items() if k != "plan_s"} == {k: v for k, v in valued.items() if k != "plan_s"}
    planned = plan(tiny, "h100-sxm", "50%")
    assert simulate(planned, "h100-sxm").figures == simulate(planned, H100).figures
    assert parse_budget("hideable", tiny, "h100-sxm") == parse_budget("hideable", tiny, H100)
    with pytest.raises(HardwareError, match="unknown hardware 'h100'"):
        simulate(planned, "h100")
    with pytest.raises(HardwareError, match="a Hardware profile or its name"):
        compare(tiny, 80e9, "50%")


def test_compare_has_a_row_per_policy_at_the_same_budget(tiny):
    budget = parse_budget("50%", tiny, H100)
    results = compare(tiny, H100, budget)
    # A training step of one rank: no cache, and no policy of sharded steps.
    assert [r.policy for r in results] == [n for n in POLICIES if n not in KV_ONLY | SHARDED_ONLY]
    peak = memory_profile(tiny).peak_bytes
    for r in results:
        row = r.as_dict()
        assert set(FIGURES) <= set(row)
        assert row["budget_bytes"] == budget and row["excess_bytes"] == peak - budget
        assert row["feasible"] == (row["peak_bytes"] <= budget)
        assert row["compute_s"] == results[0].as_dict()["compute_s"]  # the same step on the same profile
    by_name = {r.policy: r for r in results}
    assert not by_name["none"].feasible and by_name["none"].timeline.figures.peak_bytes == peak
    assert by_name["hyperoffload"].feasible and by_name["reactive"].feasible
    assert "hyperoffload" in verdict(results)
    assert compare_table(results, title="t").row_count == len(results)


def test_a_budget_the_planner_refuses_is_reported_not_raised(tiny):
    least, _ = minimum_budget(tiny)
    (result,) = compare(tiny, H100, least // 2, ["hyperoffload"])
    assert not result.feasible and "smallest" in result.note
    assert least // 2 < result.timeline.figures.peak_bytes <= result.plan.budget_bytes  # what it needs


def test_sweep_varies_one_quantity(tiny):
    points = sweep(tiny, H100, vary="d2h-bw", values=["8GB/s", "64GB/s"], budget="60%", policies=["reactive", "none"])
    assert [p.hardware.d2h_bw for p in points] == [8e9, 64e9]
    assert all(len(p.results) == 2 for p in points)
    slow, fast = (p.results[0].timeline.figures for p in points)
    assert slow.d2h_bytes == fast.d2h_bytes and slow.step_s > fast.step_s  # the same plan; its copies out take longer
    budgets = sweep(tiny, H100, vary="budget", values=["90%", "40%"], budget=None, policies=["hyperoffload"])
    assert budgets[0].results[0].budget_bytes > budgets[1].results[0].budget_bytes
    with pytest.raises(ValueError, match="cannot vary"):
        sweep(tiny, H100, vary="latency", values=["1us"], budget="60%")
    with pytest.raises(ValueError, match="needs a --budget"):
        sweep(tiny, H100, vary="h2d-bw", values=["8GB/s"], budget=None)
