"""Simulation speed on a full-size plan with transfers.

Builds, for LLaMA 3 70B training (batch 1, seq 4096, bf16), a plan that sends every saved
activation to remote memory across its longest idle span (offload and release after the use
before the span, prefetch at the end of it, no lookahead) and simulates it on h200. The target is
a few seconds for about 20,000 instructions on a 2-core machine.

    .venv/bin/python bench/simulate_time.py [--workload llama3-8b] [--hardware h100-sxm]
"""

from __future__ import annotations

import argparse
import time

from hyperoffload.hardware import get_hardware
from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan, check_plan
from hyperoffload.simulate import simulate
from hyperoffload.units import format_bytes, format_seconds
from hyperoffload.workloads import capture_workload, get_workload


def activation_round_trips(program) -> Plan:
    """Every saved activation leaves the device across its longest gap between device uses."""
    values = program.values
    uses: dict[int, list[int]] = {}
    for op in program.ops:
        for s in {values[v].storage for v in (*op.inputs, *op.outputs)}:
            uses.setdefault(s, []).append(op.id)
    after: dict[int, list[Instr]] = {}
    before: dict[int, list[Instr]] = {}
    for s, positions in uses.items():
        if values[s].kind is not ValueKind.ACTIVATION or len(positions) < 2:
            continue
        a, b = max(zip(positions, positions[1:]), key=lambda gap: gap[1] - gap[0])
        if b - a < 2:
            continue
        after.setdefault(a, []).extend([Instr(Kind.OFFLOAD, s), Instr(Kind.RELEASE, s)])
        before.setdefault(b, []).extend([Instr(Kind.WAIT, s), Instr(Kind.PREFETCH, s), Instr(Kind.WAIT, s)])
    instructions = []
    for op in program.ops:
        instructions.extend(before.get(op.id, []))
        instructions.append(Instr(Kind.COMPUTE, op.id))
        instructions.extend(after.get(op.id, []))
    return Plan(program=program, instructions=tuple(instructions), policy="activation-round-trips")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="llama3-70b")
    parser.add_argument("--hardware", default="h200")
    args = parser.parse_args()
    program = capture_workload(get_workload(args.workload), "train").program
    plan = activation_round_trips(program)
    hardware = get_hardware(args.hardware)
    start = time.perf_counter()
    check = check_plan(plan)
    checked_s = time.perf_counter() - start
    start = time.perf_counter()
    figures = simulate(plan, hardware).figures
    simulated_s = time.perf_counter() - start
    transfers = sum(1 for i in plan.instructions if i.kind is not Kind.COMPUTE)
    print(f"{args.workload} train on {args.hardware}: {len(plan.instructions):,} instructions "
          f"({transfers:,} cache instructions)")
    print(f"  check_plan {checked_s:.2f} s, simulate (check included) {simulated_s:.2f} s")
    print(f"  step {format_seconds(figures.step_s)} vs compute {format_seconds(figures.compute_s)} "
          f"(slowdown {figures.slowdown:.2f}); peak {format_bytes(figures.peak_bytes)} vs "
          f"{format_bytes(check.peak_bytes)} in plan order; {figures.stalls} stalls; "
          f"{format_bytes(figures.d2h_bytes)} offloaded")


if __name__ == "__main__":
    main()
