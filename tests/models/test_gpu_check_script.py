"""``bench/gpu_check.py`` keeps working where no GPU is: its ``--dry-run`` runs the same checks (the unplanned
step's noise floor, the planned step, the step from a static arena, donated timed steps, the allocator model's
figures) on the CPU with an emulated link, and every one must pass."""

from __future__ import annotations

import json

from helpers import load_bench_script


def test_dry_run_passes_every_check(capsys, one_compute_thread):
    status = load_bench_script("gpu_check").main(["--dry-run", "--steps", "2", "--warmup", "1", "--json"])
    (result,) = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert status == 0 and result["ok"]
    assert result["device"] == "cpu (dry run)" and result["workload"] == "tiny-llama"
    assert result["max_abs_diff"] == 0.0 and result["unplanned_noise"] == 0.0
    assert 0 < result["measured_peak_bytes"] <= result["budget_bytes"]
    assert result["max_memory_allocated"] is None  # no allocator statistics on the CPU
    assert result["model_fragmentation_bytes"] >= 0
    arena = result["arena"]
    assert arena["ok"] and arena["arena_bytes"] == arena["layout_arena_bytes"] <= arena["budget_bytes"]
    assert arena["max_abs_diff"] == 0.0 and arena["step_max_allocated_bytes"] is None
