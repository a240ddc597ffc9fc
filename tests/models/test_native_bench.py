"""``bench/native.py --quick --json`` runs end to end and reports every figure with a sane value: positive step
times, a simulated step, the interpreter's time or why it has none, the measured peak within the budget and the
planned step exactly equal to the unplanned one. Wall-clock ratios are not checked: on a shared machine other work
moves them. Slow: the script compiles four steps with Inductor (about a minute and a half on 2 cores, longer while
Inductor's cache is cold)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "native.py"

TIMES = ("eager_s", "inductor_s", "train_step_100_s", "train_step_50_s", "sim_50_s")
KEYS = (*TIMES, "interpreter_50_s", "interpreter_error", "measured_peak_bytes", "budget_bytes", "max_abs_diff",
        "load_avg", "link_bw", "exposed_50_s", "stall_copy_50_s", "compile_s", "breakdown_s", "page_faults", "ratios",
        "targets", "sim_50_planned_s", "compute_scale_timed")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick() -> dict:
    """The JSON object of one ``--quick --json`` run."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_quick_run_reports_tiny_llama_with_every_key(quick):
    assert list(quick["models"]) == ["tiny-llama"]
    record = quick["models"]["tiny-llama"]
    assert all(key in record for key in KEYS), sorted(set(KEYS) - set(record))
    assert len(quick["load_avg"]) == 3 and all(x >= 0 for x in quick["load_avg"]) and record["load_avg"] >= 0
    assert quick["config"]["steps"] >= 1


def test_times_are_positive_and_the_link_hides_the_simulated_copies(quick):
    record = quick["models"]["tiny-llama"]
    assert all(positive(record[key]) for key in TIMES), {key: record[key] for key in TIMES}
    assert positive(record["link_bw"]) and 0 <= record["exposed_50_s"] <= record["sim_50_s"]
    assert 0 <= record["stall_copy_50_s"] <= record["exposed_50_s"] * (1 + 1e-9)  # the same sum, rounded apart
    assert all(isinstance(n, (int, float)) and n >= 0 for n in record["page_faults"].values())
    assert sorted(record["blocked_50_s"]) == ["releases", "waits"]
    assert all(0 <= s < record["train_step_50_s"] for s in record["blocked_50_s"].values())
    assert all(positive(s) for s in record["compile_s"].values())
    assert sorted(record["breakdown_s"]) == sorted(["same_plan_no_copies", "same_plan_python_kernels", "same_plan_sync_copies",
                                                    "same_plan_fast_link", "same_plan_python_link"])
    assert all(positive(s) for s in record["breakdown_s"].values())
    assert record["cache_instructions"] > 0 and record["in_step_issue_s"] >= 0
    assert positive(record["sim_50_in_step_issue_s"]) and record["sim_error_in_step_issue"] >= 0
    assert all(positive(x) for x in record["ratios"].values())
    assert all(isinstance(ok, bool) for ok in record["targets"].values())


def test_the_profile_is_fitted_to_the_compiled_step(quick):
    record = quick["models"]["tiny-llama"]
    # tiny-llama's step has matrix products of several shapes and attention forward and backward, each measured
    assert record["extern_op_signatures"] >= 3
    assert positive(record["compute_scale"]) and positive(record["isolated_issue_s"])
    assert quick["config"]["in_step_issue"] is True
    assert positive(record["link_latency_s"]) and positive(record["breakdown_train_step_100_s"])
    # the measured in-step copy rate is positive, and the link was set from it (not from the profile's calibration)
    assert positive(record["copy_rate_in_step"]) and record["link_bw"] == record["copy_rate_in_step"] / 2


def test_the_interpreter_reports_a_time_or_why_not(quick):
    record = quick["models"]["tiny-llama"]
    if record["interpreter_50_s"] is None:
        assert isinstance(record["interpreter_error"], str) and record["interpreter_error"]
    else:
        assert positive(record["interpreter_50_s"]) and record["interpreter_error"] is None


def test_planned_step_equals_the_unplanned_step(quick):
    record = quick["models"]["tiny-llama"]
    assert record["max_abs_diff"] == 0 and record["max_abs_diff_state"] == 0


def test_measured_peak_stays_within_the_budget(quick):
    record = quick["models"]["tiny-llama"]
    assert isinstance(record["measured_peak_bytes"], int) and isinstance(record["budget_bytes"], int)
    assert 0 < record["measured_peak_bytes"] <= record["budget_bytes"] < record["unplanned_peak_bytes"]
