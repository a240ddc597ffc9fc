"""One rank's FSDP2-sharded training step, planned at budgets from 90% of its own no-offload peak down to the smallest
the planner meets (simulated), against the link bound extended to the network and the sharded baselines.

Each case is a workload sharded over a world of ranks of a multi-device profile (``WORKLOAD:WORLD:HARDWARE``). For
each it captures rank 0's step (``capture_workload(..., world=N)``, on a fake process group), then plans it with the
hyperoffload policy at each budget of ``--budgets`` (shares of the sharded step's no-offload peak, ``smallest`` for
the least the planner meets, ``device`` for the profile's device memory) and prints per budget: the planned peak,
the simulated step against ``link_bound_s`` (no plan in any order steps faster: the compute stream, the copies and
the network's collectives each bound it, ``analysis.link_bound``) and against the best bound of the plan's own op
order (``order_bound_s``: the largest of the link, traffic and flow bounds, ``analysis.flow_bound`` with
``--flow-bins`` bins; no plan in that order steps faster), the host memory a node needs, the planning time,
and each sharded baseline (``--baselines``, those registered: FSDP2's ``CPUOffloadPolicy`` as ``fsdp-cpu-offload``,
DeepSpeed ZeRO-3 with offload as ``zero-infinity``) at the same budget: its step, and whether it meets the budget.

    .venv/bin/python bench/sharded.py                                   # the four cases below, about 20 min
    .venv/bin/python bench/sharded.py --cases llama3-8b:8:dgx-h100 --budgets 90%,50%,smallest
    .venv/bin/python bench/sharded.py --cases tiny-llama:2:dgx-h100 --json

Progress goes to stderr with the time and load average, also when the output is piped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hyperoffload.analysis import flow_bound, memory_profile
from hyperoffload.compare import run_policy
from hyperoffload.hardware import get_hardware
from hyperoffload.host_memory import HostMemoryExceeded, host_memory_need
from hyperoffload.policies import POLICIES, InfeasibleBudget, minimum_budget
from hyperoffload.report.plan_report import plan_report
from hyperoffload.units import format_bytes, format_seconds
from hyperoffload.workloads import capture_workload, get_workload

CASES = "llama3-8b:8:dgx-h100,llama3-70b:8:dgx-h100,llama3-8b:4:gh200-nvl,llama3-70b:4:gh200-nvl"
BASELINES = ("fsdp-cpu-offload", "zero-infinity")


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {text}", file=sys.stderr, flush=True)


def parse_case(text: str) -> tuple[str, int, str]:
    """``WORKLOAD:WORLD:HARDWARE`` as its three parts, or SystemExit naming the case."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[1].isdigit():
        raise SystemExit(f"a case is WORKLOAD:WORLD:HARDWARE, such as llama3-8b:8:dgx-h100; got {text!r}")
    return parts[0], int(parts[1]), parts[2]


def budget_bytes(text: str, peak: int, smallest: int, device: int) -> int:
    """A budget of ``--budgets`` in bytes: a share of ``peak``, ``smallest`` or ``device``."""
    if text == "smallest":
        return smallest
    if text == "device":
        return device
    if text.endswith("%"):
        return int(peak * float(text[:-1]) / 100)
    raise SystemExit(f"a budget is a percentage of the peak, 'smallest' or 'device'; got {text!r}")


def baseline_row(program, hardware, budget: int, name: str) -> dict:
    """One baseline at ``budget``: its simulated step and whether it meets the budget (and the node's host
    memory)."""
    try:
        result = run_policy(program, hardware, budget, name)
    except (InfeasibleBudget, ValueError) as error:
        return {"policy": name, "error": str(error)}
    return {"policy": name, "step_s": result.step_s, "peak_bytes": result.timeline.figures.peak_bytes,
            "meets_budget": result.feasible, "note": result.note}


def order_bound_s(report, hardware, budget: int, bins: int) -> float:
    """The best bound of the plan's own op order (seconds): the largest of the link bound (every order), the traffic
    bound and the flow bound with ``bins`` bins of that order."""
    flow = flow_bound(report.plan.program, hardware, budget, report.plan.compute_order(), bins=bins).seconds
    return max(report.link_bound_s, report.traffic_bound_s or 0.0, flow)


def case_rows(workload: str, world: int, hardware_name: str, budgets: list[str], baselines: list[str],
              flow_bins: int = 50) -> dict:
    hardware = get_hardware(hardware_name)
    progress(f"capturing rank 0 of {world} of {workload} (train, FSDP2, fake process group)")
    start = time.perf_counter()
    program = capture_workload(get_workload(workload), "train", world=world).program
    capture_s = time.perf_counter() - start
    peak = memory_profile(program).peak_bytes
    smallest = minimum_budget(program)[0]
    rows = []
    for text in budgets:
        budget = budget_bytes(text, peak, smallest, hardware.memory_bytes)
        progress(f"{workload} x {world} on {hardware.name}: planning at {text} ({format_bytes(budget)})")
        try:
            report = plan_report(program, hardware, budget)
        except HostMemoryExceeded as error:  # a finding, not a failure: the node's host memory is too small
            rows.append({"budget": text, "budget_bytes": budget, "host_bytes_per_node": error.need.per_node,
                         "least_host_bytes_per_node": error.need.least_per_rank * error.need.ranks_per_node,
                         "error": str(error), "baselines": []})
            progress(f"  refused: {error}")
            continue
        f = report.figures
        progress(f"  bounding the plan's order (flow bound, {flow_bins} bins)")
        in_order = order_bound_s(report, hardware, budget, flow_bins)
        row = {"budget": text, "budget_bytes": budget, "peak_bytes": f.peak_bytes, "compute_s": f.compute_s,
               "network_s": f.network_s, "step_s": f.step_s, "link_bound_s": report.link_bound_s,
               "step / link_bound": f.step_s / report.link_bound_s, "order_bound_s": in_order,
               "step / order_bound": f.step_s / in_order, "h2d_bytes": f.h2d_bytes,
               "d2h_bytes": f.d2h_bytes, "host_bytes_per_node": host_memory_need(report.plan, hardware).per_node,
               "plan_s": report.plan_s, "fits_device": budget <= hardware.memory_bytes, "baselines": []}
        for name in baselines:
            progress(f"  {name} at {text}")
            base = baseline_row(program, hardware, budget, name)
            if "step_s" in base:
                base["hyperoffload / baseline"] = f.step_s / base["step_s"]
            row["baselines"].append(base)
        rows.append(row)
    return {"workload": workload, "world": world, "hardware": hardware.name, "capture_s": capture_s,
            "unplanned_peak_bytes": peak, "smallest_budget_bytes": smallest,
            "device_memory_bytes": hardware.memory_bytes, "host_memory_bytes": hardware.host_memory_bytes,
            "rows": rows}


def print_case(case: dict) -> None:
    names = next(([b["policy"] for b in r["baselines"]] for r in case["rows"] if r["baselines"]), [])
    print(f"{case['workload']} train, rank 0 of {case['world']} (FSDP2) on {case['hardware']}: no-offload peak "
          f"{format_bytes(case['unplanned_peak_bytes'])} per rank, smallest budget "
          f"{format_bytes(case['smallest_budget_bytes'])} ({format_bytes(case['device_memory_bytes'])} on the "
          f"device); captured in {case['capture_s']:.0f} s")
    head = (f"  {'budget':>8} {'peak':>11} {'step':>9} {'step/link':>9} {'step/order':>10} {'network':>9} "
            f"{'host/node':>10} {'plan_s':>6}")
    print(head + "".join(f"  {name:>24}" for name in names))
    for r in case["rows"]:
        if "error" in r:
            print(f"  {r['budget']:>8} refused: needs {format_bytes(r['host_bytes_per_node'])} of host memory a node "
                  f"(any plan at least {format_bytes(r['least_host_bytes_per_node'])}), more than the node has")
            continue
        line = (f"  {r['budget']:>8} {format_bytes(r['peak_bytes']):>11} {format_seconds(r['step_s']):>9} "
                f"{r['step / link_bound']:>9.3f} {r['step / order_bound']:>10.3f} {format_seconds(r['network_s']):>9} "
                f"{format_bytes(r['host_bytes_per_node']):>10} {r['plan_s']:>6.1f}")
        for b in r["baselines"]:
            if "step_s" not in b:
                cell = "refused"
            else:
                cell = f"{format_seconds(b['step_s'])} ({b['hyperoffload / baseline']:.2f}x)" + (
                    "" if b["meets_budget"] else " over")
            line += f"  {cell:>24}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES, help=f"comma-separated WORKLOAD:WORLD:HARDWARE (default {CASES})")
    parser.add_argument("--budgets", default="90%,70%,50%,device,smallest",
                        help="comma-separated budgets: shares of the peak, 'smallest', 'device'")
    parser.add_argument("--baselines", default=",".join(BASELINES),
                        help="comma-separated policies to run at each budget (those registered; '' for none)")
    parser.add_argument("--flow-bins", type=int, default=50,
                        help="bins of the flow bound of each plan's order (more: tighter and slower; default 50)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    baselines = [b for b in args.baselines.split(",") if b and b in POLICIES]
    missing = [b for b in args.baselines.split(",") if b and b not in POLICIES]
    if missing:
        progress(f"not registered, left out: {', '.join(missing)}")
    if args.flow_bins < 1:
        raise SystemExit(f"--flow-bins must be at least 1, got {args.flow_bins}")
    cases = [case_rows(*parse_case(c), args.budgets.split(","), baselines, args.flow_bins)
             for c in args.cases.split(",")]
    result = {"cases": cases, "load_avg": os.getloadavg()}
    if args.json:
        print(json.dumps(result))
        return 0
    for case in cases:
        print_case(case)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
