"""One rank's FSDP2-sharded training step, planned at budgets from 90% of its own no-offload peak down (simulated).

Captures rank 0's step of ``--workload`` sharded over ``--world`` ranks (``capture_workload(..., world=N)``, on a
fake process group), then plans it with the hyperoffload policy on ``--hardware`` at each budget of ``--budgets``
(shares of the sharded step's no-offload peak) and prints, per budget: the rank's planned peak, the simulated
step against its compute time and against ``link_bound_s`` (the least step any plan in any order can reach,
``analysis.link_bound``), the bytes moved each way and the planning time. The collectives are charged their ring
time on the profile's interconnect, on the compute stream (``cost.op_time``).

    .venv/bin/python bench/sharded.py                                       # llama3-8b, 8 ranks of dgx-h100
    .venv/bin/python bench/sharded.py --workload llama3-70b --budgets 90%,50%
    .venv/bin/python bench/sharded.py --workload tiny-llama --world 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hyperoffload.analysis import memory_profile
from hyperoffload.hardware import get_hardware
from hyperoffload.report.plan_report import plan_report
from hyperoffload.units import format_bytes, format_seconds
from hyperoffload.workloads import capture_workload, get_workload


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="llama3-8b")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--hardware", default="dgx-h100")
    parser.add_argument("--budgets", default="90%,70%,50%", help="comma-separated budgets, e.g. 90%%,50%%,40GiB")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    hardware = get_hardware(args.hardware)
    progress(f"capturing rank 0 of {args.world} of {args.workload} (train, FSDP2, fake process group)")
    start = time.perf_counter()
    program = capture_workload(get_workload(args.workload), "train", world=args.world).program
    capture_s = time.perf_counter() - start
    peak = memory_profile(program).peak_bytes
    rows = []
    for budget in args.budgets.split(","):
        report = plan_report(program, hardware, budget, stage=progress)
        f = report.figures
        rows.append({"budget": budget, "budget_bytes": report.budget_bytes, "peak_bytes": f.peak_bytes,
                     "compute_s": f.compute_s, "step_s": f.step_s, "link_bound_s": report.link_bound_s,
                     "step / link_bound": f.step_s / report.link_bound_s, "step / compute": f.step_s / f.compute_s,
                     "h2d_bytes": f.h2d_bytes, "d2h_bytes": f.d2h_bytes, "plan_s": report.plan_s,
                     "fits_device": report.budget_bytes <= hardware.memory_bytes})
    result = {"workload": args.workload, "world": args.world, "hardware": hardware.name, "capture_s": capture_s,
              "unplanned_peak_bytes": peak, "rows": rows, "load_avg": os.getloadavg()}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.workload} train, rank 0 of {args.world} (FSDP2) on {hardware.name}: no-offload peak "
          f"{format_bytes(peak)} per rank ({format_bytes(hardware.memory_bytes)} on the device); captured in "
          f"{capture_s:.0f} s")
    print(f"  {'budget':>7} {'peak':>11} {'step':>9} {'step/compute':>12} {'step/link':>9} {'h2d':>11} "
          f"{'plan_s':>6}  fits")
    for r in rows:
        print(f"  {r['budget']:>7} {format_bytes(r['peak_bytes']):>11} {format_seconds(r['step_s']):>9} "
              f"{r['step / compute']:>12.3f} {r['step / link_bound']:>9.3f} {format_bytes(r['h2d_bytes']):>11} "
              f"{r['plan_s']:>6.1f}  {'yes' if r['fits_device'] else 'no'}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
