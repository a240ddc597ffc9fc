"""Planner tables: step time against the bound at budgets from 90% of the no-offload peak down to the
smallest feasible one, on the scenarios of docs/results.md (simulated; figures as in docs/figures.md).

Each row plans with the hyperoffload policy, verifies the plan (budget and invariants) and simulates it.
Columns: step_s / bound_s (the project's target is <= 1.05), step_s / lower_bound_s (against the plan's
own traffic), and step_s / duplex_bound_s, where duplex_bound_s (a simulator figure) also charges the
link's both-directions penalty: moving the excess E each way takes at least E * min(1 / duplex_share, 2) / bw,
and step_s / window_bound_s, the bound no plan in the same op order can beat (``analysis.window_bound``: the
excess must leave between its last write and the peak and return between the peak and its next use).
Column link/bound is link_bound_s / bound_s, the least step/bound any plan in any order can reach
(``analysis.link_bound``: the bytes live at the peak op in every order cross both ways, sharing the link, and
those the step makes go out before that op and come back after it); where it is above 1.05 the project's
target cannot be met. Column step/link is step_s / link_bound_s: how far the plan is from the best any plan in
any order could do (1.000 is optimal). ``--bounds-only`` prints just the bounds, in
seconds. With ``--flow``, also step_s / flow_bound_s (``analysis.flow_bound``: an LP over every storage's idle
stretches and every over-budget stretch of the order; about 10 s per row on an 8B step, hence the flag). With
``--traffic``, also step_s / traffic_bound_s of the plan's order and column traffic/bound: the least
traffic_bound_s / bound_s over the planner's candidate orders (``analysis.traffic_bound``: an LP over what has to
cross the link at all, at every op; where it is above 1.05 no plan in those orders meets the target; about 1 s
per order on an 8B step).

    .venv/bin/python bench/plan_tables.py                          # every scenario (several minutes)
    .venv/bin/python bench/plan_tables.py --scenario llama3-8b:h100-sxm
    .venv/bin/python bench/plan_tables.py --scenario llama3-8b:h100-sxm --flow     # adds step/flow
    .venv/bin/python bench/plan_tables.py --scenario llama3-8b:gh200 --traffic     # adds the traffic bound
    .venv/bin/python bench/plan_tables.py --bounds-only            # every scenario's bounds, no planning
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from hyperoffload.analysis import flow_bound, link_bound, memory_profile, traffic_bound, window_bound
from hyperoffload.budgets import hideable_budget
from hyperoffload.cost import op_times
from hyperoffload.hardware import get_hardware
from hyperoffload.policies import minimum_budget, plan_hyperoffload
from hyperoffload.policies.hyperoffload import candidate_orders, order_name
from hyperoffload.simulate import budget_bounds
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload

SCENARIOS = ("llama3-8b:h100-sxm", "llama3-8b:ascend-910c", "llama3-8b:gh200", "llama3-8b:a100-80g",
             "llama3-70b:h200")
SHARES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)


def traffic_by_order(program, hardware, budget: int) -> dict[tuple[int, ...], float]:
    """The traffic bound (seconds) of each of the planner's candidate orders at ``budget`` (inf where the order
    cannot meet it)."""
    return {order: traffic_bound(program, hardware, budget, order).seconds for order in candidate_orders(program)}


def table_budgets(program, hardware, shares=SHARES) -> list[tuple[str, int]]:
    """(label, bytes) of each row of a table: the hideable budget, each of ``shares`` of the no-offload peak that
    the planner can meet, and the smallest it can."""
    peak = memory_profile(program).peak_bytes
    least, _ = minimum_budget(program)
    return ([("hideable", hideable_budget(program, hardware))]
            + [(f"{share:.0%}", int(peak * share)) for share in shares if peak * share >= least] + [("smallest", least)])


def table_for(name: str, console: Console, *, flow: bool = False, traffic: bool = False,
              bounds_only: bool = False) -> None:
    workload, hardware_name = name.split(":")
    hardware = get_hardware(hardware_name)
    program = capture_workload(get_workload(workload), "train").program
    peak = memory_profile(program).peak_bytes
    budgets = table_budgets(program, hardware)
    table = Table(title=f"{workload} training (batch 1, seq 4096, bf16 / fp32 AdamW) on {hardware_name}: "
                        f"no-offload peak {peak / 2**30:.1f} GiB", title_justify="left")
    if bounds_only:
        compute_s = sum(op_times(program, hardware))
        for column in ("budget", "GiB", "compute_s", "bound_s", "duplex_bound_s", "link_bound_s", "link/bound",
                       *(("traffic_bound_s", "traffic/bound") if traffic else ())):
            table.add_column(column, justify="right")
        for label, budget in budgets:
            _, bound, duplex = budget_bounds(program, hardware, compute_s, budget)
            link = link_bound(program, hardware, budget).seconds
            least = min(traffic_by_order(program, hardware, budget).values()) if traffic else 0.0
            table.add_row(label, f"{budget / 2**30:.1f}", f"{compute_s:.3f}", f"{bound:.3f}", f"{duplex:.3f}",
                          f"{link:.3f}", f"{link / bound:.3f}",
                          *((f"{least:.3f}", f"{least / bound:.3f}") if traffic else ()))
        console.print(table)
        return
    for column in ("budget", "GiB", "step_s", "bound_s", "step/bound", "link/bound", "step/link", "step/lower",
                   "step/duplex",
                   "step/window",
                   *(("step/flow",) if flow else ()), *(("step/traffic", "traffic/bound") if traffic else ()),
                   "slowdown", "moved GiB", "stalls", "order", "plan_s"):
        table.add_column(column, justify="right")
    for label, budget in budgets:
        start = time.perf_counter()
        plan = plan_hyperoffload(program, hardware, budget)
        plan_s = time.perf_counter() - start
        f = verify(plan, hardware).figures
        order = plan.compute_order()
        window = window_bound(program, hardware, budget, order).seconds
        flows = (f"{f.step_s / flow_bound(program, hardware, budget, order).seconds:.3f}",) if flow else ()
        if traffic:
            by_order = traffic_by_order(program, hardware, budget)
            key = tuple(order)
            own = by_order[key] if key in by_order else traffic_bound(program, hardware, budget, order).seconds
            flows += (f"{f.step_s / own:.3f}", f"{min(by_order.values()) / f.bound_s:.3f}")
        link = link_bound(program, hardware, budget).seconds
        table.add_row(label, f"{budget / 2**30:.1f}", f"{f.step_s:.3f}", f"{f.bound_s:.3f}",
                      f"{f.step_s / f.bound_s:.3f}", f"{link / f.bound_s:.3f}", f"{f.step_s / link:.3f}",
                      f"{f.step_s / f.lower_bound_s:.3f}",
                      f"{f.step_s / f.duplex_bound_s:.3f}", f"{f.step_s / window:.3f}", *flows, f"{f.slowdown:.3f}",
                      f"{f.h2d_bytes / 2**30:.1f}", str(f.stalls), order_name(program, order), f"{plan_s:.1f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="workload:hardware (repeatable)")
    parser.add_argument("--flow", action="store_true", help="add step_s / flow bound (an LP: slow)")
    parser.add_argument("--traffic", action="store_true",
                        help="add step_s / traffic bound and the least traffic bound over the candidate orders (LPs)")
    parser.add_argument("--bounds-only", action="store_true", help="print the bounds at each budget; plan nothing")
    args = parser.parse_args()
    console = Console(width=164 + 14 * (args.flow + 2 * args.traffic))  # room for the optional columns' headers
    for name in args.scenario or SCENARIOS:
        table_for(name, console, flow=args.flow, traffic=args.traffic, bounds_only=args.bounds_only)


if __name__ == "__main__":
    main()
