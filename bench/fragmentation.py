"""Fragmentation: what each policy's plan reserves under a caching allocator against a static arena.

For every policy of the comparison, the plan at one budget is replayed through the caching
allocator model (``hyperoffload.allocator_model``: PyTorch's rounding, segments, best fit, splitting,
no compaction, free-and-retry) with the budget as the device limit, and packed into a static arena
(``hyperoffload.layout``). Policies that do not meet the budget show it as allocator failures.
Columns: the plan's live-byte peak, the arena and its overhead over that peak, the seconds packing
it took, the allocator's reserved peak, its free-and-retry stalls and out-of-memory failures. A final
row plans HyperOffload with ``--static-layout``, whose arena stays within the budget by construction.

    .venv/bin/python bench/fragmentation.py                   # llama3-8b training and decode (a few minutes)
    .venv/bin/python bench/fragmentation.py --plot fragmentation.png
    .venv/bin/python bench/fragmentation.py --greedy-by-size  # arenas packed greedy by size alone
    .venv/bin/python bench/fragmentation.py --cost            # what the static layout costs, 90% ... 10%

``--cost`` plans llama3-8b training at budgets from 90% to 10% of the no-offload peak twice, with the
live bytes and with the static arena within the budget, and prints both simulated step times, the
arena against the budget, and the planning times.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
from rich.console import Console
from rich.table import Table

from hyperoffload import layout as static_layout
from hyperoffload.allocator_model import fragmentation_figures
from hyperoffload.analysis import memory_profile
from hyperoffload.hardware import get_hardware
from hyperoffload.layout import assign_offsets
from hyperoffload.plans import check_plan
from hyperoffload.policies import POLICIES, PlannerConfig, plan_hyperoffload, policies_for
from hyperoffload.simulate import simulate
from hyperoffload.workloads import capture_workload, get_workload

SCENARIOS = (("llama3-8b", "train", {}, 0.5), ("llama3-8b", "decode", {"batch": 8, "context": 32768}, 0.5))
GiB = 2**30


def rows_for(workload: str, mode: str, sizes: dict, share: float, hardware, console: Console) -> list[dict]:
    program = capture_workload(get_workload(workload), mode, **sizes).program
    budget = int(memory_profile(program).peak_bytes * share)
    plans = [(name, lambda p=POLICIES[name]: p(program, hardware, budget)) for name in policies_for(program)]
    plans.append(("hyperoffload --static-layout",
                  lambda: plan_hyperoffload(program, hardware, budget, PlannerConfig(static_layout=True))))
    rows = []
    for name, make in plans:
        start = time.perf_counter()
        try:
            plan = make()
        except ValueError as error:  # a policy that refuses the budget says why
            console.print(f"[yellow]{name}: {error}[/yellow]")
            continue
        packing = None
        if plan.layout is None:  # the static-layout plan was packed while planning
            packed = time.perf_counter()
            plan = replace(plan, layout=assign_offsets(plan))
            packing = time.perf_counter() - packed
        figures = fragmentation_figures(plan, budget, simulate(plan, hardware))  # stream-ordered frees
        rows.append({"policy": name, "live": check_plan(plan).peak_bytes, "budget": budget, **figures,
                     "seconds": time.perf_counter() - start, "layout_seconds": packing})
    return rows


def layout_cost(hardware, console: Console) -> None:
    """Step time and planning time with the live bytes and with the static arena within each budget."""

    program = capture_workload(get_workload("llama3-8b"), "train").program
    peak = memory_profile(program).peak_bytes
    out = Table(title=f"llama3-8b train on {hardware.name}: what keeping the arena within the budget costs",
                title_justify="left")
    for column in ("budget", "step_s (live bytes)", "step_s (arena)", "cost", "arena / budget", "plan_s (live bytes)",
                   "plan_s (arena)"):
        out.add_column(column, justify="right")
    for share in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1):
        budget = int(peak * share)
        cells = []
        for config in (PlannerConfig(), PlannerConfig(static_layout=True)):
            start = time.perf_counter()
            plan = plan_hyperoffload(program, hardware, budget, config)
            cells.append((simulate(plan, hardware).figures.step_s, time.perf_counter() - start, plan.layout))
        (free, free_s, _), (packed, packed_s, layout) = cells
        out.add_row(f"{share:.0%}", f"{free:.3f}", f"{packed:.3f}", f"{packed / free - 1:+.1%}",
                    f"{layout.arena_bytes / budget:.3f}", f"{free_s:.1f}", f"{packed_s:.1f}")
    console.print(out)


def table(rows: list[dict], title: str) -> Table:
    out = Table(title=title, title_justify="left")
    for column in ("policy", "live GiB", "arena GiB", "arena overhead", "layout s", "allocator reserved GiB",
                   "allocator stalls", "allocator OOM", "within budget (arena / allocator)"):
        out.add_column(column, justify="right")
    for r in rows:
        out.add_row(r["policy"], f"{r['live'] / GiB:.2f}", f"{r['arena_bytes'] / GiB:.2f}",
                    f"{r['arena_bytes'] / r['live'] - 1:.1%}",
                    "in plan" if r["layout_seconds"] is None else f"{r['layout_seconds']:.2f}",
                    f"{r['allocator_reserved_bytes'] / GiB:.2f}",
                    str(r["allocator_stalls"]), str(r["allocator_failures"]),
                    f"{'yes' if r['arena_bytes'] <= r['budget'] else 'no'} / "
                    f"{'yes' if r['allocator_reserved_bytes'] <= r['budget'] else 'no'}")
    return out


def plot(results: list[tuple[str, list[dict]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(13, 4 * len(results)), squeeze=False)
    for (title, rows), (left, right) in zip(results, axes):
        names = [r["policy"] for r in rows]
        x = range(len(rows))
        width = 0.27
        left.bar([i - width for i in x], [r["live"] / GiB for r in rows], width, label="live peak")
        left.bar(list(x), [r["arena_bytes"] / GiB for r in rows], width, label="static arena")
        left.bar([i + width for i in x], [r["allocator_reserved_bytes"] / GiB for r in rows], width,
                 label="caching allocator reserved")
        left.axhline(rows[0]["budget"] / GiB, color="black", linestyle="--", linewidth=1, label="budget")
        left.set_ylabel("GiB")
        left.set_title(f"{title}: device memory")
        right.bar(x, [r["allocator_stalls"] for r in rows], label="allocator free-and-retry stalls")
        right.bar(x, [r["allocator_failures"] for r in rows], label="allocator out-of-memory", alpha=0.7)
        right.bar(x, [r["arena_stalls"] for r in rows], label="arena stalls (always 0)")
        right.set_title(f"{title}: stalls")
        for ax in (left, right):
            ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--plot", metavar="FILE", help="write the figure as PNG")
    parser.add_argument("--greedy-by-size", action="store_true",
                        help="pack every arena greedy by size alone (largest first, lowest gap), as the layout "
                             "did before it tried other packings: the baseline its overhead is measured against")
    parser.add_argument("--cost", action="store_true",
                        help="only the step-time and planning-time cost of the static layout, 90%% ... 10%% of the peak")
    args = parser.parse_args()
    if args.greedy_by_size:
        # Swapped in the module, so that the planner's static layout packs the same way as the other rows.
        static_layout.pack_blocks = lambda start, end, size: static_layout._first_fit(np.lexsort((start - end, -size)),
                                                                                      start, end, size)
    console = Console(width=160)
    hardware = get_hardware(args.hardware)
    if args.cost:
        layout_cost(hardware, console)
        return
    results = []
    for workload, mode, sizes, share in SCENARIOS:
        rows = rows_for(workload, mode, sizes, share, hardware, console)
        title = " ".join([workload, mode, *(f"{k} {v}" for k, v in sizes.items()),
                          f"at {share:.0%} on {hardware.name}"])
        console.print(table(rows, title))
        results.append((title, rows))
    if args.plot:
        plot(results, args.plot)
        console.print(f"figure written to {args.plot}")


if __name__ == "__main__":
    main()
