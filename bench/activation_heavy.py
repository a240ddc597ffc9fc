"""Activation-heavy training steps: the planner with and without its state-first start.

Where the storages a step makes (saved activations) hold much of the peak, spans of activations and of the
step's state often relieve the same over-budget stretch and tie; activations can leave only in the forward pass
and come back only in the backward pass, one direction at a time, while the state's copies can run beside them.
``PlannerConfig.state_first`` plans once more taking the state first on ties (where activations hold at least
``PlannerConfig.state_first_from`` of the peak) and keeps the faster plan. Each row plans the step both ways, verifies both
plans and prints ``step_s / bound_s`` and ``step_s / link_bound_s`` (the least any plan in any op order could
reach, ``analysis.link_bound``; 1.000 is optimal) without and with the start, and the planning time (a real CPU
timing, this machine's).

    .venv/bin/python bench/activation_heavy.py                       # every scenario (about ten minutes)
    .venv/bin/python bench/activation_heavy.py --scenario llama3-8b:h100-sxm:4
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from hyperoffload.analysis import link_bound, memory_profile
from hyperoffload.hardware import get_hardware
from hyperoffload.policies import PlannerConfig, plan_hyperoffload
from hyperoffload.policies.hyperoffload import made_share
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload
from plan_tables import table_budgets  # bench/, on the path when this script runs

SCENARIOS = ["llama3-8b:h100-sxm:2", "llama3-8b:h100-sxm:4", "deepseek-v2-lite:mi300x:0"]
"""workload:hardware:batch (0: the workload's own; deepseek-v2-lite trains at batch 32, seq 4096)."""
SHARES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
"""Shares of the no-offload peak, one row each where the planner can meet it (``plan_tables``'s go on to 5%)."""


def table_for(scenario: str, console: Console) -> None:
    workload, hardware_name, batch = scenario.split(":")
    hardware = get_hardware(hardware_name)
    program = capture_workload(get_workload(workload), "train", batch=int(batch) or None).program
    peak = memory_profile(program).peak_bytes
    budgets = table_budgets(program, hardware, SHARES)
    table = Table(title=f"{workload} training, batch {batch if int(batch) else 'default'}, on {hardware_name}: peak "
                        f"{peak / 2**30:.1f} GiB, {made_share(program):.0%} of it made by the step",
                  title_justify="left")
    for column in ("budget", "GiB", "step/bound without", "with", "step/link without", "with", "plan_s without",
                   "with"):
        table.add_column(column, justify="right")
    for label, budget in budgets:
        link = link_bound(program, hardware, budget).seconds
        row = []
        for config in (PlannerConfig(state_first=False), PlannerConfig()):
            start = time.perf_counter()
            plan = plan_hyperoffload(program, hardware, budget, config)
            row.append((verify(plan, hardware).figures, time.perf_counter() - start))
        (off, off_s), (on, on_s) = row
        table.add_row(label, f"{budget / 2**30:.1f}", f"{off.step_s / off.bound_s:.3f}", f"{on.step_s / on.bound_s:.3f}",
                      f"{off.step_s / link:.3f}", f"{on.step_s / link:.3f}", f"{off_s:.1f}", f"{on_s:.1f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="workload:hardware:batch (repeatable)")
    args = parser.parse_args()
    console = Console(width=140)
    for scenario in args.scenario or SCENARIOS:
        table_for(scenario, console)


if __name__ == "__main__":
    main()
