"""The reports the commands print, built through the library: ``plan``, ``compare``, ``sweep``, ``inspect`` and
``simulate`` print exactly what ``PlanReport``, ``PolicyResult``, ``SweepPoint``, ``StepInspection`` and the
report functions give, and a budget resolves one way for planning and for the notes."""

import io
import json
import re

import pytest
from helpers import results_of
from rich.console import Console

from hyperoffload.analysis import memory_profile
from hyperoffload.budgets import hideable_budget, hideable_note, parse_budget
from hyperoffload.cli import main
from hyperoffload.compare import compare, sweep
from hyperoffload.hardware import get_hardware
from hyperoffload.planning import plan_checked, resolve_budget
from hyperoffload.report.figures import no_offload_dict, no_offload_summary
from hyperoffload.report.inspect import inspect_step, verify_figures
from hyperoffload.report.plan_report import plan_report, plan_summary
from hyperoffload.units import format_bytes, format_seconds
from hyperoffload.workloads import capture_workload, get_workload

STEP = ["--workload", "tiny-llama", "--mode", "train"]
H100 = get_hardware("h100-sxm")
TIMED = ("plan_s", "capture_s")
"""Wall times: measured afresh by each run, so left out of the comparisons."""


@pytest.fixture(scope="module")
def captured():
    return capture_workload(get_workload("tiny-llama"), "train")


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMED}


def _cli_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _as_the_cli_prints(renderable) -> str:
    """``renderable`` as ``hyperoffload`` prints it to a pipe (160 columns)."""
    out = io.StringIO()
    Console(file=out, width=160).print(renderable)
    return out.getvalue()


def test_plan_json_is_the_plan_reports_dict(captured, capsys):
    report = plan_report(captured.program, H100, "50%")
    printed = _cli_json(capsys, "plan", *STEP, "--hardware", "h100-sxm", "--budget", "50%")
    assert list(printed) == list(report.as_dict())
    assert _untimed(printed) == _untimed(json.loads(json.dumps(report.as_dict())))
    assert printed["budget_bytes"] == memory_profile(captured.program).peak_bytes // 2


@pytest.mark.parametrize("policy", ["hyperoffload", "none"])
def test_plan_text_is_the_plan_summary(captured, capsys, policy):
    report = plan_report(captured.program, H100, "50%", policy=policy)
    assert main(["plan", *STEP, "--hardware", "h100-sxm", "--budget", "50%", "--policy", policy]) == 0
    printed = capsys.readouterr().out
    planned_in = re.compile(r"planned in \d+\.\d s")
    summary = _as_the_cli_prints(plan_summary(report))
    assert planned_in.sub("planned in", printed) == planned_in.sub("planned in", summary)
    line = " ".join(printed.split())  # as one line, whatever the console's wrapping
    memory, figures = report.memory, report.figures
    assert (f"memory: a static arena would take {format_bytes(memory['arena_bytes'])} ({memory['arena_stalls']} "
            f"stalls)") in line
    assert (f"the caching allocator model reserves {format_bytes(memory['allocator_reserved_bytes'])} with "
            f"{memory['allocator_stalls']} free-and-retry stalls and {memory['allocator_failures']} out-of-memory "
            f"failures at this budget") in line
    if policy == "none":  # the policy does not meet the budget: the summary says so instead of the bounds
        assert (f"policy none does not meet the budget: it needs {format_bytes(figures.peak_bytes)}, the budget is "
                f"{format_bytes(report.budget_bytes)}") in line
        assert "planned in" not in line
    else:
        assert (f"step_s / window_bound_s = {figures.step_s / report.window_bound_s:.3f} (no plan in this op order "
                f"can beat window_bound_s {format_seconds(report.window_bound_s)}, nor traffic_bound_s "
                f"{format_seconds(report.traffic_bound_s)}") in line
        assert (f"{report.bound_scope} can beat link_bound_s {format_seconds(report.link_bound_s)} (step_s / "
                f"link_bound_s = {figures.step_s / report.link_bound_s:.3f})") in line
        assert "does not meet" not in line


def test_compare_json_rows_are_the_policy_results_dicts(captured, capsys):
    results = compare(captured.program, H100, "60%", ["hyperoffload", "none"])
    printed = _cli_json(capsys, "compare", *STEP, "--hardware", "h100-sxm", "--budget", "60%",
                        "--policies", "hyperoffload,none")
    assert [_untimed(row) for row in printed] == [_untimed(r.as_dict()) for r in results]
    assert list(printed[0])[:4] == ["workload", "mode", "hardware", "policy"]
    assert {(row["workload"], row["mode"], row["hardware"]) for row in printed} == {("tiny-llama", "train", "h100-sxm")}


def test_sweep_json_rows_are_the_points_rows(captured, capsys):
    points = sweep(captured.program, H100, vary="d2h-bw", values=["8GB/s", "32GB/s"], budget="60%",
                   policies=["reactive"])
    printed = _cli_json(capsys, "sweep", *STEP, "--hardware", "h100-sxm", "--budget", "60%", "--vary", "d2h-bw",
                        "--values", "8GB/s,32GB/s", "--policies", "reactive")
    rows = [row for point in points for row in point.rows()]
    assert [_untimed(row) for row in printed] == [_untimed(row) for row in rows]
    assert list(printed[0])[:7] == ["workload", "mode", "hardware", "vary", "value", "x", "policy"]
    assert [(row["vary"], row["value"], row["x"]) for row in printed] == [("d2h-bw", "8GB/s", 8e9),
                                                                         ("d2h-bw", "32GB/s", 32e9)]


def test_inspect_json_is_the_step_inspections_dict(captured, capsys):
    inspection = inspect_step(captured, top=3)
    printed = _cli_json(capsys, "inspect", *STEP, "--top", "3")
    assert _untimed(printed) == _untimed(json.loads(json.dumps(inspection.as_dict())))
    assert list(printed) == list(inspection.as_dict())
    assert len(printed["peak_values"]) == 3 and "verify" not in printed


def test_a_failed_verification_names_what_differs(captured):
    from hyperoffload.runtime.reference import EagerComparison

    inspection = inspect_step(captured)
    peak = inspection.peak_bytes

    def check(**figures):
        return verify_figures(EagerComparison(**{"identical": True, "max_abs_diff": 0.0, "mismatched": (),
                                                 "measured_peak_bytes": peak, "analysed_peak_bytes": peak,
                                                 "live_bytes_agree": True, **figures}))

    assert inspection.verified(check()).verify_failure is None
    assert inspection.verified(check()).as_dict()["verify"] == {
        "identical_to_eager": True, "max_abs_diff": 0.0, "measured_peak_bytes": peak, "analysed_peak_bytes": peak,
        "live_bytes_agree": True}
    rounding = check(identical=False, max_abs_diff=3e-7, mismatched=("output 0",), measured_peak_bytes=peak + 1,
                     live_bytes_agree=False)
    assert inspection.verified(rounding).verify_failure == (
        "the measured live bytes differ from the analysis; the results differ from eager by up to 3e-07 (the size "
        "of float rounding: the graph may run other kernels than eager for some ops)")
    wrong = check(identical=False, max_abs_diff=0.5, mismatched=("output 0",))
    assert inspection.verified(wrong).verify_failure == "the results differ from eager by up to 0.5"


def test_simulate_prints_the_no_offload_report(captured, capsys):
    from hyperoffload.plans import plan_without_offload
    from hyperoffload.simulate import simulate

    small = H100.replace(memory_bytes=2**20)
    figures = simulate(plan_without_offload(captured.program), small).figures
    printed = _cli_json(capsys, "simulate", *STEP, "--hardware", "h100-sxm", "--device-memory", "1MiB")
    assert printed == json.loads(json.dumps(no_offload_dict(captured.program, small, figures)))
    assert printed["fits"] is False
    assert main(["simulate", *STEP, "--hardware", "h100-sxm", "--device-memory", "1MiB"]) == 0
    text = capsys.readouterr().out
    assert text == _as_the_cli_prints(no_offload_summary(captured.program, small, figures))
    assert "It does not fit without offloading." in " ".join(text.split())


def test_a_budget_resolves_once_for_planning_and_for_its_notes(captured):
    program = captured.program
    half = resolve_budget(" 50% ", program, H100)
    assert half.text == "50%" and half.budget_bytes == parse_budget("50%", program, H100)
    assert half.hideable_note is None and not half.over_device
    assert plan_checked(program, H100, "50%", simulate=False).budget_bytes == half.budget_bytes
    assert resolve_budget(half.budget_bytes, program, "h100-sxm").as_dict() == {
        "budget": str(half.budget_bytes), "budget_bytes": half.budget_bytes,
        "device_memory_bytes": H100.memory_bytes, "over_device": False, "hideable_note": None}
    # h100-sxm's link hides any feasible budget's excess in tiny-llama's compute: the note says so
    hideable = resolve_budget("Hideable", program, H100)
    assert hideable.budget_bytes == hideable_budget(program, H100)
    assert hideable.hideable_note == hideable_note(program, H100) and hideable.hideable_note
    assert resolve_budget("50%", program, H100.replace(memory_bytes=2**20)).over_device
    with pytest.raises(ValueError, match="cannot read '5x0GB' as a budget"):
        resolve_budget("5x0GB", program, H100)


def test_compare_plans_every_policy_for_the_resolved_budget(captured):
    program = captured.program
    budget = resolve_budget("hideable", program, H100).budget_bytes
    (by_text,) = compare(program, H100, "hideable", ["reactive"])
    (by_bytes,) = compare(program, H100, budget, ["reactive"])
    assert by_text.budget_bytes == by_bytes.budget_bytes == budget
    points = sweep(program, H100, vary="budget", values=["90%", "hideable"], budget=None, policies=["reactive"])
    assert [p.x for p in points] == [float(resolve_budget(v, program, H100).budget_bytes) for v in ("90%", "hideable")]


def test_run_text_is_the_run_summary(capsys, monkeypatch):
    from hyperoffload.report import run_report as module

    reports = results_of(monkeypatch, module, "run_report")
    assert main(["run", *STEP, "--budget", "50%", "--steps", "1", "--warmup", "0", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    (report,) = reports
    assert printed == _as_the_cli_prints(module.run_summary(report, budget_text="50%"))
    line = " ".join(printed.split())  # as one line, whatever the console's wrapping
    figures = report.figures
    assert f"hyperoffload, budget {format_bytes(report.budget_bytes)} (50%), emulated link 2 GB/s each way" in line
    assert f"sim_error │ {figures.sim_error:.3f} │ {figures.sim_error_min:.3f} against the fastest step" in line
    assert "max_abs_diff │ 0 │ bit-identical to the unplanned step" in line
    assert (f"kept the step at {format_bytes(figures.measured_peak_bytes)} "
            f"({figures.measured_peak_bytes / memory_profile(report.captured.program).peak_bytes:.0%} of its ") in line
    assert (f"{figures.wall_s / figures.unplanned_wall_s:.2f}x the unplanned step's time; the simulator predicted "
            f"{figures.sim_step_s / figures.sim_compute_s:.2f}x") in line
