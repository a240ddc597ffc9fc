"""Planner tables: step time against the bound at budgets from 90% of the no-offload peak down to the
smallest feasible one, on the issue's scenarios (simulated; BENCHMARKS.md figures).

Each row plans with the hyperoffload policy, verifies the plan (budget and invariants) and simulates it.
Columns: step_s / bound_s (the project's target is <= 1.05), step_s / lower_bound_s (against the plan's
own traffic), and step_s / duplex_bound_s, where duplex_bound_s (a simulator figure) also charges the
link's both-directions penalty: moving the excess E each way takes at least E * min(1 / duplex_share, 2) / bw,
and step_s / window_bound_s, the bound no plan in the same op order can beat (``analysis.window_bound``: the
excess must leave between its last write and the peak and return between the peak and its next use).
Column link/bound is link_bound_s / bound_s, the least step/bound any plan in any order can reach
(``analysis.link_bound``: the bytes live at the peak op in every order cross both ways, sharing the link);
where it is above 1.05 the project's target cannot be met. ``--bounds-only`` prints just the bounds, in
seconds. With ``--flow``, also step_s / flow_bound_s (``analysis.flow_bound``: an LP over every storage's idle
stretches and every over-budget stretch of the order; about 10 s per row on an 8B step, hence the flag).

    .venv/bin/python bench/plan_tables.py                          # every scenario (several minutes)
    .venv/bin/python bench/plan_tables.py --scenario llama3-8b:h100-sxm
    .venv/bin/python bench/plan_tables.py --scenario llama3-8b:h100-sxm --flow     # adds step/flow
    .venv/bin/python bench/plan_tables.py --bounds-only            # every scenario's bounds, no planning
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from hyperoffload.analysis import flow_bound, link_bound, memory_profile, window_bound
from hyperoffload.budgets import hideable_budget
from hyperoffload.cost import op_times
from hyperoffload.hardware import get_hardware
from hyperoffload.policies import minimum_budget, plan_hyperoffload
from hyperoffload.policies.hyperoffload import order_name
from hyperoffload.simulate import budget_bounds
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload

SCENARIOS = ("llama3-8b:h100-sxm", "llama3-8b:ascend-910c", "llama3-8b:gh200", "llama3-8b:a100-80g",
             "llama3-70b:h200")
SHARES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)


def table_for(name: str, console: Console, *, flow: bool = False, bounds_only: bool = False) -> None:
    workload, hardware_name = name.split(":")
    hardware = get_hardware(hardware_name)
    program = capture_workload(get_workload(workload), "train").program
    peak = memory_profile(program).peak_bytes
    least, _ = minimum_budget(program)
    hideable = hideable_budget(program, hardware)
    budgets = [("hideable", hideable)] + [(f"{share:.0%}", int(peak * share)) for share in SHARES
                                          if peak * share >= least] + [("smallest", least)]
    table = Table(title=f"{workload} training (batch 1, seq 4096, bf16 / fp32 AdamW) on {hardware_name}: "
                        f"no-offload peak {peak / 2**30:.1f} GiB", title_justify="left")
    if bounds_only:
        compute_s = sum(op_times(program, hardware))
        for column in ("budget", "GiB", "compute_s", "bound_s", "duplex_bound_s", "link_bound_s", "link/bound"):
            table.add_column(column, justify="right")
        for label, budget in budgets:
            _, bound, duplex = budget_bounds(program, hardware, compute_s, budget)
            link = link_bound(program, hardware, budget).seconds
            table.add_row(label, f"{budget / 2**30:.1f}", f"{compute_s:.3f}", f"{bound:.3f}", f"{duplex:.3f}",
                          f"{link:.3f}", f"{link / bound:.3f}")
        console.print(table)
        return
    for column in ("budget", "GiB", "step_s", "bound_s", "step/bound", "link/bound", "step/lower", "step/duplex",
                   "step/window",
                   *(("step/flow",) if flow else ()), "slowdown", "moved GiB", "stalls", "order", "plan_s"):
        table.add_column(column, justify="right")
    for label, budget in budgets:
        start = time.perf_counter()
        plan = plan_hyperoffload(program, hardware, budget)
        plan_s = time.perf_counter() - start
        f = verify(plan, hardware).figures
        order = plan.compute_order()
        window = window_bound(program, hardware, budget, order).seconds
        flows = (f"{f.step_s / flow_bound(program, hardware, budget, order).seconds:.3f}",) if flow else ()
        table.add_row(label, f"{budget / 2**30:.1f}", f"{f.step_s:.3f}", f"{f.bound_s:.3f}",
                      f"{f.step_s / f.bound_s:.3f}", f"{link_bound(program, hardware, budget).seconds / f.bound_s:.3f}",
                      f"{f.step_s / f.lower_bound_s:.3f}",
                      f"{f.step_s / f.duplex_bound_s:.3f}", f"{f.step_s / window:.3f}", *flows, f"{f.slowdown:.3f}",
                      f"{f.h2d_bytes / 2**30:.1f}", str(f.stalls), order_name(program, order), f"{plan_s:.1f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="workload:hardware (repeatable)")
    parser.add_argument("--flow", action="store_true", help="add step_s / flow bound (an LP: slow)")
    parser.add_argument("--bounds-only", action="store_true", help="print the bounds at each budget; plan nothing")
    args = parser.parse_args()
    console = Console(width=150)
    for name in args.scenario or SCENARIOS:
        table_for(name, console, flow=args.flow, bounds_only=args.bounds_only)


if __name__ == "__main__":
    main()
