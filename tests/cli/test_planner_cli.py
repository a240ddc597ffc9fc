"""The ``plan`` command on a built-in workload: its figures, its graph, and what it says of a budget it cannot meet
or of a policy that does not fit."""

from __future__ import annotations

import json

import pytest

from hyperoffload.cli import main


def test_policy_none_says_it_does_not_fit(capsys):
    assert main(["plan", "--workload", "tiny-llama", "--mode", "train", "--hardware", "h100-sxm", "--budget", "50%",
                 "--policy", "none", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["feasible"] is False and figures["peak_bytes"] > figures["budget_bytes"]
    assert main(["plan", "--workload", "tiny-llama", "--mode", "train", "--hardware", "h100-sxm", "--budget", "50%",
                 "--policy", "none"]) == 0
    assert "does not meet the budget" in capsys.readouterr().out


def test_plan_command_json_and_graph(tmp_path, capsys):
    graph = tmp_path / "planned.py"
    args = ["plan", "--workload", "tiny-llama", "--mode", "train", "--hardware", "h100-sxm", "--budget", "60%",
            "--json", "--graph", str(graph)]
    assert main(args) == 0
    figures = json.loads(capsys.readouterr().out)
    for key in ("compute_s", "step_s", "bound_s", "lower_bound_s", "excess_bytes", "peak_bytes", "budget_bytes",
                "plan_s", "policy", "exposed_s", "slowdown", "h2d_bytes", "d2h_bytes", "stalls"):
        assert key in figures
    assert figures["peak_bytes"] <= figures["budget_bytes"] and figures["policy"] == "hyperoffload"
    assert figures["feasible"] is True
    for bound in ("link_bound_s", "window_bound_s", "traffic_bound_s"):  # lower bounds: every order, the plan's order
        assert figures["compute_s"] * (1 - 1e-9) <= figures[bound] <= figures["step_s"] * (1 + 1e-9)
    code = graph.read_text()
    assert "hyperoffload.offload" in code and "hyperoffload.prefetch" in code and "hyperoffload.wait" in code


def test_plan_command_rejects_an_infeasible_budget(capsys):
    assert main(["plan", "--workload", "tiny-llama", "--mode", "train", "--hardware", "h100-sxm",
                 "--budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "below the smallest this planner can meet" in err


def test_plan_command_hideable_budget(capsys):
    assert main(["plan", "--workload", "tiny-llama", "--mode", "decode", "--hardware", "a100-80g",
                 "--budget", "hideable", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["bound_s"] == pytest.approx(figures["compute_s"])
