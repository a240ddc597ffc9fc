"""The ``run`` command with ``--static-layout``: the step runs from the plan's arena, and only the planner that lays
one out takes the flag."""

from __future__ import annotations

import json

from hyperoffload.cli import main


def test_run_command_with_static_layout_runs_from_the_arena(capsys):
    code = main(["run", "--workload", "tiny-llama", "--mode", "train", "--budget", "50%", "--link", "2GB/s",
                 "--steps", "1", "--warmup", "0", "--static-layout", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["static_layout"] is True
    assert result["max_abs_diff"] == 0.0
    assert 0 < result["measured_peak_bytes"] <= result["arena_bytes"] <= result["budget_bytes"]
    assert 0 < result["arena_copied_bytes"] < result["arena_bytes"]  # most op results go straight into slots


def test_run_command_refuses_static_layout_for_other_policies(capsys):
    code = main(["run", "--workload", "tiny-llama", "--mode", "train", "--budget", "50%", "--policy", "reactive",
                 "--static-layout"])
    assert code != 0
    assert "--static-layout" in capsys.readouterr().err
