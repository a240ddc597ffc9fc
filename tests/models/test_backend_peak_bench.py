"""``bench/backend_peak.py --json`` runs end to end: for the one compiler and budget asked for, the plan meets its
budget and the whole step's measured device bytes are reported (above the compiled graph's own plan here: the eager
loss and autograd's buffers are outside it). Slow: the script compiles a small model twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_backend_peak_reports_the_budget_the_plan_and_the_measured_whole_step():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "backend_peak.py"), "--compilers", "eager",
                           "--budgets", "50%", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert len(result["load_avg"]) == 3
    (row,) = result["rows"]
    assert row["compiler"] == "eager" and row["budget"] == "50%"
    assert 0 < row["planned_peak_bytes"] <= row["budget_bytes"] < row["unplanned_peak_bytes"]
    assert row["measured_peak_bytes"] > row["planned_peak_bytes"]
