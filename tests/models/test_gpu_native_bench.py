"""``bench/gpu_native.py`` keeps working where no GPU is: its ``--smoke`` run (a tiny float32 model on the CPU) goes
through every row, writes the JSON object with each row's fields, finds ``train_step``'s updated parameters close to
the eager step's, records as text why the rows that need CUDA or torchao could not run, and reports no memory peaks.
Without CUDA and without ``--smoke`` the script says so and exits 0. Slow: the smoke run compiles three steps with
Inductor (about a minute on 2 cores)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_native.py"

ROWS = ("eager", "compile", "train_step@1", "compile+activation_offload", "compile+activation_offload_streams",
        "save_on_cpu", "fsdp2_cpu_offload", "torchao_cpu_offload_optimizer")
FIELDS = ("name", "method", "budget", "budget_bytes", "step_ms", "build_s", "first_step_s", "max_memory_allocated",
          "max_memory_reserved", "max_abs_diff", "error")
RUN_ON_A_CPU = ("eager", "compile", "train_step@1", "save_on_cpu")
"""Rows that must measure on the CPU (the others may record why not)."""

LR = 1e-3
"""The script's AdamW learning rate: one update moves a parameter by about that much at most."""

pytestmark = pytest.mark.slow


def script_env() -> dict[str, str]:
    """This checkout's sources first on the path, and no ``$OUT`` (the script would write there too)."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """The JSON object of one ``--smoke --json PATH`` run."""
    path = tmp_path_factory.mktemp("gpu_native") / "gpu_native.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(path)], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "train_step@1" in done.stdout  # the table
    return json.loads(path.read_text())


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def rows_by_name(result: dict) -> dict[str, dict]:
    return {row["name"]: row for row in result["rows"]}


def test_smoke_run_reports_every_row_with_every_field(smoke):
    assert smoke["smoke"] is True and smoke["complete"] is True
    assert smoke["gpu"] is None and smoke["device"] == "cpu" and smoke["torch"]
    assert [row["name"] for row in smoke["rows"]] == list(ROWS)
    for row in smoke["rows"]:
        assert set(FIELDS) <= set(row), (row["name"], sorted(set(FIELDS) - set(row)))
    assert smoke["budgets"] == [{"share": 1.0, "bytes": None, "text": "100% of the step's unplanned peak"}]
    assert smoke["model"]["parameters"] > 0 and smoke["model"]["dtype"] == "float32"


def test_rows_that_run_on_a_cpu_measure_and_report_no_memory_peaks(smoke):
    rows = rows_by_name(smoke)
    for name in RUN_ON_A_CPU:
        row = rows[name]
        assert row["error"] is None, (name, row["error"])
        assert positive(row["step_ms"]) and positive(row["first_step_s"]) and positive(row["build_s"]), name
        assert isinstance(row["max_abs_diff"], float) and 0 <= row["max_abs_diff"], name
    for row in smoke["rows"]:
        assert row["max_memory_allocated"] is None and row["max_memory_reserved"] is None, row["name"]
    assert smoke["reference_max_memory_allocated"] is None
    assert rows["eager"]["max_abs_diff"] == 0.0 and rows["save_on_cpu"]["max_abs_diff"] == 0.0


def test_train_step_updates_the_parameters_as_the_eager_step_does(smoke):
    row = rows_by_name(smoke)["train_step@1"]
    assert row["budget"] == 1.0 and row["budget_bytes"] is None
    assert row["max_abs_diff"] < LR / 5, row["max_abs_diff"]  # kernels' rounding only, not a different update


def test_rows_that_cannot_run_say_why_as_text(smoke):
    rows = rows_by_name(smoke)
    assert "needs CUDA" in rows["compile+activation_offload_streams"]["error"]
    if importlib.util.find_spec("torchao") is None:
        assert "not installed" in rows["torchao_cpu_offload_optimizer"]["error"]
    for row in smoke["rows"]:
        if row["error"] is not None:
            assert isinstance(row["error"], str) and row["error"].strip(), row["name"]
            assert row["step_ms"] is None, row["name"]
        else:
            assert positive(row["step_ms"]), row["name"]


def test_without_cuda_and_without_smoke_it_says_so_and_exits_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the script would measure")
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1"], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device" in done.stdout
