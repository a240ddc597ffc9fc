"""The commands on one rank's step of an FSDP2-sharded tiny-llama: ``inspect --world`` reports the rank's
collectives and refuses what it cannot shard, ``plan --world`` plans on a multi-device profile, the same plan in
every process."""

import json
import re

import pytest
from cli_checks import TINY, user_error

from hyperoffload.cli import main
from hyperoffload.workloads import get_workload

BLOCKS = get_workload("tiny-llama").config.layers


def test_inspect_world_reports_the_ranks_collectives(capsys):
    assert main(["inspect", *TINY, "--world", "2", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["world"] == 2
    assert figures["collectives"]["all_gather"]["count"] == 1 + 2 * BLOCKS
    assert figures["collectives"]["reduce_scatter"]["count"] == 1 + BLOCKS
    assert main(["inspect", *TINY, "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 2" in out and "reduce-scatter" in out


@pytest.mark.parametrize("args, message", [
    (["--workload", "tiny-llama", "--mode", "decode", "--world", "2"], "decode step cannot be captured sharded"),
    ([*TINY, "--world", "2", "--verify"], "drop --verify or --world"),
    ([*TINY, "--world", "2", "--master-weights"], "master weights"),
])
def test_inspect_world_refuses_what_it_cannot_shard(capsys, args, message):
    assert message in user_error(capsys, ["inspect", *args])


def test_plan_world_plans_the_ranks_step_on_a_multi_device_profile(capsys):
    assert main(["plan", *TINY, "--world", "2", "--hardware", "dgx-h100", "--budget", "50%", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["world"] == 2 and figures["feasible"]
    assert figures["peak_bytes"] <= figures["budget_bytes"]
    assert figures["h2d_bytes"] > 0 and figures["step_s"] >= figures["compute_s"]
    error = user_error(capsys, ["simulate", *TINY, "--world", "2", "--hardware", "h100-sxm"])
    assert "one device with no network" in error and "dgx-h100" in error and "drop --world" in error


@pytest.mark.parametrize("command, args, message", [
    ("plan", ["--world", "12", "--hardware", "dgx-h100", "--budget", "50%"],
     "--world 12 ranks do not fill whole nodes of 8 devices of --hardware dgx-h100.*8 or 16"),
    ("simulate", ["--world", "512", "--hardware", "gh200-nvl"], "--world 512 is more ranks than the 32 devices"),
    ("compare", ["--world", "2", "--hardware", "h100-sxm", "--budget", "50%"],
     "--hardware h100-sxm describes one device.*drop --world"),
])
def test_a_world_the_profile_cannot_place_is_refused_before_the_capture(capsys, command, args, message):
    assert re.search(message, user_error(capsys, [command, *TINY, *args]))


def test_plan_json_says_the_remote_memory_of_a_rank_and_of_its_node(capsys):
    assert main(["plan", *TINY, "--world", "4", "--hardware", "dgx-h100", "--budget", "50%", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["remote_bytes"] >= figures["excess_bytes"] > 0
    assert figures["ranks_per_node"] == 4 and figures["remote_bytes_per_node"] == 4 * figures["remote_bytes"]
    assert figures["host_memory_bytes"] == 2 * 2**40


def test_a_plan_that_keeps_more_than_a_nodes_host_memory_is_refused_naming_what_would_fit(capsys):
    """--host-memory overrides the profile's. Just below what the fastest plan keeps, the planner finds one that keeps
    less; below what any plan must keep, the refusal says so, naming the plan's need per rank and per node in bytes
    a --host-memory can take, and a node of that much plans."""
    argv = ["plan", *TINY, "--world", "2", "--hardware", "dgx-h100", "--budget", "20%"]
    assert main([*argv, "--json"]) == 0
    need = json.loads(capsys.readouterr().out)["remote_bytes_per_node"]
    assert main([*argv, "--host-memory", str(need - 1), "--json"]) == 0  # at 20% such a plan exists
    assert json.loads(capsys.readouterr().out)["remote_bytes_per_node"] <= need - 1
    error = user_error(capsys, [*argv, "--host-memory", "1MiB"])
    assert "more than a node's" in error and "for the 2 ranks of a node" in error
    assert "no plan under this device budget keeps less than" in error and "larger device budget" in error
    kept = int(re.search(r"--host-memory (\d+), in bytes", error).group(1))
    assert main([*argv, "--host-memory", str(kept), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_memory_bytes"] == kept


def test_compare_and_sweep_world_run_every_policy_on_the_ranks_step(capsys):
    assert main(["compare", *TINY, "--world", "2", "--hardware", "dgx-h100", "--budget", "50%", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["world"] for row in rows} == {2} and len(rows) > 2
    ours = next(row for row in rows if row["policy"] == "hyperoffload")
    assert ours["feasible"] and ours["peak_bytes"] <= ours["budget_bytes"]
    assert main(["sweep", *TINY, "--world", "2", "--hardware", "dgx-h100", "--vary", "budget", "--values", "90%,50%",
                 "--policies", "hyperoffload,reactive"]) == 0
    assert "rank 0 of 2" in capsys.readouterr().out


def test_every_process_makes_the_same_plan_of_a_sharded_step():
    """Ranks plan independently from identical inputs: two processes (with different hash seeds) give the same
    digest, and another budget another one."""
    import os
    import subprocess
    import sys

    def digest(budget: str, seed: str) -> str:
        done = subprocess.run([sys.executable, "-m", "hyperoffload.cli", "plan", *TINY, "--world", "2", "--hardware",
                               "dgx-h100", "--budget", budget, "--json"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["plan_digest"]

    first = digest("50%", "1")
    assert first == digest("50%", "2") != digest("70%", "1")


def test_a_world_of_more_ranks_than_the_largest_parameter_has_rows_is_refused(capsys):
    # tiny-llama's largest parameters (the embedding and the output projection) have 512 rows.
    error = user_error(capsys, ["inspect", *TINY, "--world", "513"])
    assert "--world 513 is more ranks than the model can be sharded over" in error and "at most 512" in error
