"""The compare and sweep commands: a row per policy as JSON, a table and a plot, and bad input named."""

from __future__ import annotations

import json

import pytest
from output_checks import FIGURES

from hyperoffload.cli import main
from hyperoffload.policies import KV_ONLY, POLICIES, SHARDED_ONLY

STEP = ["--workload", "tiny-llama", "--mode", "train", "--hardware", "h100-sxm"]


def test_compare_command_json_table_and_plot(tmp_path, capsys):
    plot = tmp_path / "compare.png"
    assert main(["compare", *STEP, "--budget", "60%", "--json", "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == [n for n in POLICIES if n not in KV_ONLY | SHARDED_ONLY]
    for row in rows:
        assert set(FIGURES) <= set(row)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["compare", *STEP, "--budget", "60%", "--policies", "hyperoffload,none"]) == 0
    out = capsys.readouterr().out
    assert "hyperoffload" in out and "needs" in out  # none does not meet 60% and says what it needs


def test_compare_marks_a_policy_that_keeps_more_than_a_nodes_host_memory(capsys):
    argv = ["compare", *STEP, "--budget", "50%", "--policies", "hyperoffload,none"]
    assert main([*argv, "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)[0]
    assert ours["feasible"] and ours["host_memory_fits"]
    assert main([*argv, "--json", "--host-memory", "1MiB"]) == 0
    ours, none = json.loads(capsys.readouterr().out)
    assert not ours["feasible"] and not ours["host_memory_fits"] and "host memory" in ours["note"]
    assert none["host_memory_fits"]  # it keeps nothing there (and misses the device budget)
    assert main([*argv, "--host-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "does not meet this budget (keeps" in out


def test_sweep_command_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    assert main(["sweep", *STEP, "--budget", "60%", "--vary", "d2h-bw", "--values", "8GB/s,32GB/s",
                 "--policies", "hyperoffload,reactive", "--json", "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["value"], r["policy"]) for r in rows] == [("8GB/s", "hyperoffload"), ("8GB/s", "reactive"),
                                                         ("32GB/s", "hyperoffload"), ("32GB/s", "reactive")]
    assert all(set(FIGURES) <= set(r) for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["compare", *STEP, "--budget", "60%", "--policies", "hyperoffload,lru"], "unknown policy 'lru'"),
    (["sweep", *STEP, "--budget", "60%", "--vary", "d2h-bw", "--values", "fast"], "cannot read 'fast'"),
    (["sweep", *STEP, "--vary", "h2d-bw", "--values", "8GB/s"], "needs a --budget"),
])
def test_bad_input_names_the_problem(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_malformed_budget_is_refused_as_the_flags_are_read(capsys):
    """Before anything is captured: argparse's usage error, status 2, naming the flag and the forms it takes."""
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *STEP, "--budget", "lots"])
    assert exit_info.value.code == 2
    assert "argument --budget: cannot read 'lots' as a budget; write 40GiB" in capsys.readouterr().err
