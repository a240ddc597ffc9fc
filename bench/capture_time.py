"""Capture and lifetime-analysis time of full-size steps on fake tensors.

Targets (issue: foundation): LLaMA 3 8B training (batch 1, seq 4096) captured in under a minute,
LLaMA 3 70B in a few minutes, on a 2-core machine. Prints each step's wall time and its share of
that target, measured in this run.

    .venv/bin/python bench/capture_time.py            # 8B train/prefill/decode and 70B train
    .venv/bin/python bench/capture_time.py --quick    # 8B train only
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from hyperoffload.analysis import memory_profile
from hyperoffload.units import format_bytes
from hyperoffload.workloads import capture_workload, get_workload

TARGET_S = {"llama3-8b": 60.0, "llama3-70b": 180.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 8B training step")
    args = parser.parse_args()
    cases = [("llama3-8b", "train")]
    if not args.quick:
        cases += [("llama3-8b", "prefill"), ("llama3-8b", "decode"), ("llama3-70b", "train")]
    table = Table(title="Fake capture of full-size steps (batch 1, seq/context 4096, bf16)", title_justify="left")
    for column in ("workload", "mode", "ops", "peak, no offload", "capture s", "analysis s", "share of target"):
        table.add_column(column, justify="right", no_wrap=True)
    console = Console()
    for name, mode in cases:
        with console.status(f"capturing {name} {mode}..."):
            start = time.perf_counter()
            captured = capture_workload(get_workload(name), mode)
            captured_s = time.perf_counter() - start
            start = time.perf_counter()
            profile = memory_profile(captured.program)
            analysed_s = time.perf_counter() - start
        total = captured_s + analysed_s
        table.add_row(name, mode, f"{len(captured.program.ops):,}", format_bytes(profile.peak_bytes),
                      f"{captured_s:.1f}", f"{analysed_s:.2f}", f"{total / TARGET_S[name]:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
