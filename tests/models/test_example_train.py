"""``examples/train_under_budget.py``, what ``make demo`` runs first, trains its decoder under half its step's peak:
the script exits 1 when the last step held more than the budget (the compiled step's fusions across cache operators
must stay within the plan's room), so its exit status is the check. Slow: it compiles the step with Inductor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_demo_trains_within_its_budget():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train_under_budget.py"), "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "step   2/2" in done.stdout and "against a budget of" in done.stdout
    assert "OVER" not in done.stdout
