"""Real planned steps on the emulated link against the simulator, at several link speeds (CPU only).

For ``tiny-llama`` training at a budget (default 50% of its peak), for each link speed: plan on the
``cpu-emulated`` profile at that speed (per-op cost measured through the executor, see
``hyperoffload.runtime.measure``), run the plan for real and print, all measured in this one run:

* ``wall/unpl``: the planned step's wall time over the unplanned step's through the same executor (what
  offloading costs for real);
* ``sim/wall``: the simulator's step time over the measured one, and ``sim_error`` (target <= 0.15 where
  transfers are partly hidden, ``docs/figures.md``), with the prediction from the uncalibrated
  profile (bare aten dispatch cost) next to it;
* ``simc/unpl``: how well the profile predicts the unplanned step (its compute alone);
* ``min err`` and ``min w/u``: the same against the fastest step of each kind (the least disturbed by other
  work; on a shared machine steps are often twice as slow when another process shares the core);
* the measured peak against the budget and ``max_abs_diff`` (must be 0).

Each speed is measured ``--repeats`` times (each a fresh executor and link, median of ``--steps`` steps
after warm-up) and the median of the repeats is reported, with the machine's load average before and
after: on a shared 2-core machine other work moves every wall time. Usage:
``.venv/bin/python bench/run_cpu.py [--links 2GB/s,1GB/s,...] [--budget 50%] [--repeats 3] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from hyperoffload.budgets import parse_budget
from hyperoffload.commands import cpu_cache_path
from hyperoffload.hardware import get_hardware
from hyperoffload.policies import get_policy
from hyperoffload.runtime import EmulatedLink
from hyperoffload.runtime.measure import RunConfig, executor_dispatch_s, executor_issue_s, for_executor, measure_run
from hyperoffload.simulate import simulate
from hyperoffload.units import parse_bandwidth, parse_duration
from hyperoffload.workloads import capture_workload, get_workload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tiny-llama")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--policy", default="hyperoffload")
    parser.add_argument("--links", default="4GB/s,2GB/s,1GB/s,500MB/s,250MB/s,100MB/s",
                        help="comma-separated link speeds, as run's --link takes one")
    parser.add_argument("--copy-latency", type=parse_duration, default="50us",
                        help="per copy, as run's --copy-latency (default 50us)")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = cpu_cache_path().with_name(f"cpu-calibration-{args.threads}-threads.json")
    base = get_hardware("cpu-emulated", cpu_cache=cache)
    captured = capture_workload(get_workload(args.workload), "train", fake=False)
    program = captured.program
    dispatch = executor_dispatch_s()
    issue = executor_issue_s()
    print(f"{args.workload} train, {args.policy} at {args.budget}, {args.threads} compute thread(s), "
          f"{len(program.ops)} ops; executor dispatch {dispatch * 1e6:.1f} us/op, "
          f"{issue * 1e6:.1f} us per cache instruction, bare aten call "
          f"{base.launch_s * 1e6:.1f} us; load average before {os.getloadavg()[0]:.2f}")
    print(f"{'link':>10} {'wall ms':>8} {'unpl ms':>8} {'sim ms':>7} {'wall/unpl':>9} {'sim/wall':>8} "
          f"{'sim_error':>9} {'uncal err':>9} {'simc/unpl':>9} {'min err':>8} {'min w/u':>8} {'peak/budget':>11} "
          f"{'diff':>5} {'load':>5}")
    errors = []
    # What ops cost through the executor does not depend on the link: measured once, for every speed (measured
    # costs stay with a profile through Hardware.replace, which keeps its name).
    base = base.replace(h2d_latency_s=args.copy_latency, d2h_latency_s=args.copy_latency)
    calibrated = for_executor(base, program, dispatch, issue, inputs=captured.inputs)
    for text in args.links.split(","):
        bw = parse_bandwidth(text)
        bare = base.replace(h2d_bw=bw, d2h_bw=bw)
        hardware = calibrated.replace(h2d_bw=bw, d2h_bw=bw)
        budget = parse_budget(args.budget, program, hardware)
        plan = get_policy(args.policy)(program, hardware, budget)
        runs = []
        for _ in range(args.repeats):
            with EmulatedLink.for_hardware(hardware) as link:
                runs.append(measure_run(plan, captured.inputs, link, hardware,
                                        RunConfig(steps=args.steps, warmup=args.warmup)))
        wall = statistics.median(r.wall_s for r in runs)
        unplanned = statistics.median(r.unplanned_wall_s for r in runs)
        fastest = min(r.wall_min_s for r in runs)
        fastest_unplanned = min(r.unplanned_min_s for r in runs)
        sim = runs[0].sim_step_s
        uncalibrated = simulate(plan, bare).figures.step_s
        peak = max(r.measured_peak_bytes for r in runs)
        diff = max(r.max_abs_diff for r in runs)
        error = abs(sim - wall) / wall
        errors.append((text, error))
        print(f"{text:>10} {wall * 1e3:8.1f} {unplanned * 1e3:8.1f} {sim * 1e3:7.1f} {wall / unplanned:9.3f} "
              f"{sim / wall:8.3f} {error:9.3f} {abs(uncalibrated - wall) / wall:9.3f} "
              f"{runs[0].sim_compute_s / unplanned:9.3f} {abs(sim - fastest) / fastest:8.3f} "
              f"{fastest / fastest_unplanned:8.3f} {peak / budget:11.4f} {diff:5g} {os.getloadavg()[0]:5.2f}")
    worst = max(errors, key=lambda e: e[1])
    met = sum(e <= 0.15 for _, e in errors)
    print(f"worst sim_error {worst[1]:.3f} at {worst[0]}; target <= 0.15 met at {met} of {len(errors)} speeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
