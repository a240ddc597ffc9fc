"""``bench/gpu_compare.py`` keeps working where no GPU is: its ``--dry-run`` runs the same planning, execution and
simulation code on the CPU (tiny-llama, an emulated link) and must find every planned step equal to the unplanned
one and within its budget."""

from __future__ import annotations

import json

from helpers import load_bench_script


def test_dry_run_runs_every_feasible_policy_exactly_and_within_its_budget(capsys, one_compute_thread):
    args = ["--dry-run", "--budgets", "80%", "--rounds", "1", "--steps", "1", "--json"]
    status = load_bench_script("gpu_compare").main(args)
    device, figures = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert status == 0
    assert device["device"] == "cpu (dry run)" and device["link"]["h2d_bw"] == 2e9
    rows = {row["policy"]: row for row in figures["rows"]}
    assert rows["none"]["feasible"] and rows["hyperoffload"]["feasible"]
    assert set(rows) >= {"none", "hyperoffload", "reactive", "distance", "zero-infinity", "layerwise", "xla-hidden",
                         "hyperoffload+arena"}
    arena = rows["hyperoffload+arena"]
    assert arena["feasible"] and 0 < arena["measured_peak_bytes"] <= arena["arena_bytes"] <= figures["budget_bytes"]
    for row in rows.values():
        if row["feasible"]:
            assert row["max_abs_diff"] == 0.0
            assert row["within_budget"] and row["wall_s"] > 0
            if row["policy"] != "none":
                assert 0 < row["measured_peak_bytes"] <= figures["budget_bytes"]
                assert row["h2d_bytes"] > 0
        else:
            assert row["why"]
