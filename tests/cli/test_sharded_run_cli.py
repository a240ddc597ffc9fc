"""``run --world N``: tiny-llama's FSDP2 step run on N gloo ranks, one JSON object with a row per rank; a rank that
fails mid-step stops every rank and the command names it; what cannot run that way is refused up front."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os

import pytest
from cli_checks import TINY, user_error

from hyperoffload import commands
from hyperoffload.cli import main
from hyperoffload.report import sharded_run_report as sharded

pytestmark = pytest.mark.usefixtures("one_compute_thread")  # see tests/conftest.py

RUN = ["run", *TINY, "--world", "2", "--budget", "50%", "--link", "2GB/s", "--steps", "1", "--warmup", "0"]


def test_run_world_prints_every_ranks_figures(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code = main([*RUN, "--threads", "2", "--json"])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert code == 0
    assert {"world": 2, "workload": "tiny-llama", "mode": "train", "policy": "hyperoffload", "link_bw": 2e9,
            "threads_per_rank": 1}.items() <= result.items()
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        assert rank["max_abs_diff"] == 0.0 and rank["measured_peak_bytes"] <= rank["budget_bytes"]
        assert math.isfinite(rank["sim_error"]) and rank["wall_s"] > 0
    assert "rank 0: capturing" in err and "rank 1: capturing" in err  # progress on stderr, also when piped


def test_a_rank_that_fails_mid_step_stops_every_rank_and_is_named(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = sharded.sharded_run_report
    monkeypatch.setattr(sharded, "sharded_run_report", lambda config, **kwargs: real(
        dataclasses.replace(config, fault_rank=1, warm_up_s=0.0, timeout_s=120), **kwargs))
    code = main([*RUN, "--json"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""  # nothing half-written
    assert "run failed: rank 1 failed: InjectedFault: injected fault on rank 1 as its first planned step starts" \
        in " ".join(err.split())
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("hyperoffload-rank-")]


@pytest.mark.parametrize("extra, message", [
    (["--world", str((os.cpu_count() or 1) + 1)], "more than this machine's"),
    (["--mode", "decode"], "decode step cannot be captured sharded"),
    (["--master-weights"], "master weights"),
    (["--policy", "fsdp-cpu-offload"], "it is simulated only"),
    (["--policy", "zero-infinity"], "it is simulated only"),
])
def test_run_world_refuses_what_it_cannot_run(capsys, extra, message):
    argv = ["run", "--workload", "tiny-llama", "--mode", "train", "--world", "2", "--budget", "50%", *extra]
    assert message in user_error(capsys, argv)


def test_run_world_refuses_a_hugging_face_model(capsys, tmp_path):
    from hf_configs import LLAMA

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    error = user_error(capsys, ["run", "--workload", f"hf:{tmp_path}", "--mode", "train", "--world", "2", "--budget",
                                "50%"])
    assert "--world shards the built-in workloads only" in error


def test_run_world_1_is_the_unsharded_run(capsys, monkeypatch):
    def ranks(*args):
        raise AssertionError("--world 1 started ranks")

    monkeypatch.setattr(commands, "_run_world", ranks)
    assert "unknown policy 'nope'" in user_error(capsys, ["run", *TINY, "--world", "1", "--budget", "50%", "--policy",
                                                          "nope"])
