"""The run command on the emulated link: the figures it reports, its bad input named, and a summary that states the
simulator's own ratio and what moved each way."""

from __future__ import annotations

import json

import pytest

from hyperoffload.cli import main

pytestmark = pytest.mark.usefixtures("one_compute_thread")  # see tests/conftest.py


def test_run_command_reports_the_figures(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code = main(["run", "--workload", "tiny-llama", "--mode", "train", "--budget", "50%", "--link", "2GB/s",
                 "--steps", "1", "--warmup", "0", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("wall_s", "measured_peak_bytes", "budget_bytes", "max_abs_diff", "sim_step_s", "sim_error",
                "unplanned_wall_s", "h2d_bytes", "d2h_bytes"):
        assert key in result
    assert result["max_abs_diff"] == 0.0
    assert result["feasible"] and result["measured_peak_bytes"] <= result["budget_bytes"]
    assert result["h2d_bytes"] > 0
    assert result["sim_error"] == pytest.approx(abs(result["sim_step_s"] - result["wall_s"]) / result["wall_s"])


@pytest.mark.parametrize("argv, message", [
    (["--link", "fast"], "argument --link: cannot read 'fast' as a bandwidth; write it like 25GB/s"),
    (["--policy", "nope"], "unknown policy 'nope'"),
])
def test_run_command_bad_input(capsys, argv, message):
    base = ["run", "--workload", "tiny-llama", "--mode", "train", "--budget", "50%"]
    try:
        code = main(base + argv)
    except SystemExit as exit:  # argparse rejects a malformed rate itself
        code = exit.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_run_command_states_the_simulators_own_ratio(capsys, tmp_path, monkeypatch):
    """The summary compares the measured ratio (planned over unplanned wall time) with the simulator's own:
    its planned step over its unplanned one (the compute alone), not a simulated time over a measured one."""
    import dataclasses
    import re

    from hyperoffload.runtime import measure

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = measure.measure_run
    seen = []

    def slow_unplanned(*args, **kwargs):  # an unplanned step 100 s long would make a mixed ratio near 0
        figures = dataclasses.replace(real(*args, **kwargs), unplanned_wall_s=100.0)
        seen.append(figures)
        return figures

    monkeypatch.setattr(measure, "measure_run", slow_unplanned)
    assert main(["run", "--workload", "tiny-llama", "--mode", "train", "--budget", "50%", "--link", "2GB/s",
                 "--steps", "1", "--warmup", "0"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    predicted = float(re.search(r"the simulator predicted ([0-9.]+)x", out).group(1))
    assert predicted == pytest.approx(seen[0].sim_step_s / seen[0].sim_compute_s, abs=0.006)
    assert predicted >= 0.99


def test_run_command_says_what_moved_each_way(capsys, tmp_path, monkeypatch):
    """reactive's step moves more in than out (what it evicts unchanged needs no copy back): the summary gives
    both figures, not the inbound bytes as if they went both ways."""
    import re

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["run", "--workload", "tiny-llama", "--mode", "train", "--budget", "50%", "--link", "2GB/s",
                 "--policy", "reactive", "--steps", "1", "--warmup", "0"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    table = re.search(r"moved per step │ ([0-9.]+ \w+) in, ([0-9.]+ \w+) out", out)
    assert table and table.group(1) != table.group(2)
    assert f"Moving {table.group(1)} in and {table.group(2)} out per step" in out
