"""Decode with the KV cache in remote memory: the paper's inference case, on deepseek-v2-lite.

For each hardware profile and budget (a share of the no-offload peak), every decode policy plans the
same step (deepseek-v2-lite, batch 32, context 32768, bf16): ``none`` (all KV on the device),
``kv-naive`` (whole KV remote, fetched in full), ``paged`` (KV remote behind the largest block pool the
budget allows, missed blocks fetched when attention reads them) and ``hyperoffload``. Each row gives the
peak, the simulated step time, ``step / bound`` (``bound_s``: compute, or the bytes the plan's program
must move at link speed, whichever is larger) and ``step / dep`` (``dependency_bound_s``: no order of
the program's ops is faster, since a block fetch starts only after selection and attention only after
the fetch), bytes fetched per decoded token, and the block pool. Then the step time of ``hyperoffload``
and ``paged`` against the NSA selection block (32 ... 256 tokens) at one budget; and each policy's plan of
``tiny-deepseek`` decode run for real on the CPU with the emulated link (wall time, simulated time,
measured peak, bytes in per token; ``diff`` is against the same form of the step unplanned, and a
remote-KV form's outputs equal the on-device cache's: ``tests/models/test_lane_runtime.py``).

How many of a step's selected blocks the pool already holds is a stated statistic
(``deepseek_remote.DEFAULT_RESELECTION``, measured on tiny-deepseek; ``--reselection`` to change it).

    .venv/bin/python bench/decode_kv.py                  # everything (a few minutes)
    .venv/bin/python bench/decode_kv.py --only budgets --hardware h200
    .venv/bin/python bench/decode_kv.py --only run       # tiny-deepseek for real on the emulated link
"""

from __future__ import annotations

import argparse

from hyperoffload.analysis import memory_profile
from hyperoffload.compare import run_policy
from hyperoffload.hardware import get_hardware
from hyperoffload.units import format_bytes
from hyperoffload.workloads import capture_workload, get_workload, with_nsa_block
from hyperoffload.workloads.deepseek_remote import DEFAULT_RESELECTION

WORKLOAD, BATCH, CONTEXT = "deepseek-v2-lite", 32, 32768
HARDWARE = ("h200", "gh200", "ascend-910c")
SHARES = (0.74, 0.60, 0.52)
POLICIES = ("none", "kv-naive", "paged", "hyperoffload")
BLOCKS = (32, 64, 128, 256)


def capture(block: int | None, reselection: float):
    workload = with_nsa_block(get_workload(WORKLOAD), block)
    return capture_workload(workload, "decode", batch=BATCH, context=CONTEXT, reselection=reselection).program


def row(program, hardware, budget: int, policy: str, peak: int) -> str:
    r = run_policy(program, hardware, budget, policy, peak)
    f = r.timeline.figures
    fits = "yes" if r.feasible else f"no ({format_bytes(f.peak_bytes)})"
    pool = r.plan.program.meta.get("pool_blocks", "-") if r.plan.program.meta.get("kv") == "remote" else "-"
    return (f"{policy:12} | {fits:18} | {format_bytes(f.peak_bytes):>10} | {f.peak_bytes / peak:5.2f} | "
            f"{f.step_s * 1e3:8.2f} ms | {f.step_s / f.bound_s:6.3f} | {f.step_s / f.dependency_bound_s:6.3f} | "
            f"{format_bytes(f.h2d_bytes // BATCH):>10} | {pool!s:>5} | {r.plan_s:5.1f} s")


HEADER = ("policy       | meets budget       |       peak | /none |      step_s | /bound |   /dep | in / token | "
          "pool  | plan")


def budgets(hardware_names, reselection: float) -> None:
    program = capture(None, reselection)
    peak = memory_profile(program).peak_bytes
    print(f"{WORKLOAD} decode, batch {BATCH}, context {CONTEXT}, bf16; no-offload peak {format_bytes(peak)}; "
          f"reselection {reselection}")
    for name in hardware_names:
        hardware = get_hardware(name)
        for share in SHARES:
            budget = int(peak * share)
            print(f"\n{name}, budget {share:.0%} = {format_bytes(budget)}")
            print(HEADER)
            for policy in POLICIES:
                print(row(program, hardware, budget, policy, peak))


def blocks(hardware_names, reselection: float, share: float) -> None:
    for name in hardware_names:
        hardware = get_hardware(name)
        print(f"\n{name}, budget {share:.0%} of each block size's no-offload peak: step against the NSA selection block")
        print("block | policy       | step_s      | /bound | /dep   | compute_s")
        for block in BLOCKS:
            program = capture(block, reselection)
            peak = memory_profile(program).peak_bytes
            for policy in ("paged", "hyperoffload"):
                f = run_policy(program, hardware, int(peak * share), policy, peak).timeline.figures
                print(f"{block:5} | {policy:12} | {f.step_s * 1e3:8.2f} ms | {f.step_s / f.bound_s:6.3f} | "
                      f"{f.step_s / f.dependency_bound_s:6.3f} | {f.compute_s * 1e3:.2f} ms")


def real_runs(link: str, share: float) -> None:
    """Each decode policy's plan of tiny-deepseek decode run for real on the CPU with the emulated link."""
    import os

    import torch

    from hyperoffload.commands import cpu_cache_path
    from hyperoffload.runtime import EmulatedLink
    from hyperoffload.runtime.measure import (RunConfig, executor_dispatch_s, executor_issue_s, for_executor,
                                              measure_run)
    from hyperoffload.units import parse_bandwidth
    from hyperoffload.variants import find_captured

    threads = max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    base = get_hardware("cpu-emulated", cpu_cache=cpu_cache_path().with_name(f"cpu-calibration-{threads}-threads.json"))
    rate = parse_bandwidth(link)
    captured = capture_workload(get_workload("tiny-deepseek"), "decode", batch=2, context=3000, fake=False)
    program = captured.program
    bare = base.replace(h2d_bw=rate, d2h_bw=rate, h2d_latency_s=50e-6, d2h_latency_s=50e-6)
    hardware = for_executor(bare, program, executor_dispatch_s(), executor_issue_s(), inputs=captured.inputs)
    peak = memory_profile(program).peak_bytes
    budget = int(peak * share)
    print(f"\ntiny-deepseek decode (float32, batch 2, context 3000) for real on the CPU, emulated link {link} each way, "
          f"budget {share:.0%} = {format_bytes(budget)} of {format_bytes(peak)}; load {os.getloadavg()[0]:.1f}")
    print("policy       | form            | wall_s    | sim_step_s | sim_error | measured peak | meets | in / token | diff")
    for policy in POLICIES:
        r = run_policy(program, hardware, budget, policy, peak)
        form = find_captured(r.plan.program, program) or captured
        with EmulatedLink.for_hardware(hardware) as emulated:
            f = measure_run(r.plan, form.inputs, emulated, hardware, RunConfig(steps=7, warmup=2))
        meta = r.plan.program.meta
        kind = "device KV" if meta.get("kv") != "remote" else "speculative" if meta.get("speculative") else \
            f"pool {meta['pool_blocks']}" if meta.get("pool_blocks") else "remote, no pool"
        print(f"{policy:12} | {kind:15} | {f.wall_s * 1e3:6.2f} ms | {f.sim_step_s * 1e3:7.2f} ms | {f.sim_error:9.3f} | "
              f"{format_bytes(f.measured_peak_bytes):>13} | {'yes' if f.measured_peak_bytes <= budget else 'no':5} | "
              f"{format_bytes(f.h2d_bytes // 2):>10} | {f.max_abs_diff:g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("budgets", "blocks", "run"))
    parser.add_argument("--link", default="500MB/s", help="emulated link speed of the real runs")
    parser.add_argument("--run-share", type=float, default=0.6, help="budget share of the real runs")
    parser.add_argument("--hardware", help="comma-separated profiles (default: h200,gh200,ascend-910c)")
    parser.add_argument("--reselection", type=float, default=DEFAULT_RESELECTION)
    parser.add_argument("--share", type=float, default=0.74, help="budget share for the block sweep")
    args = parser.parse_args()
    names = args.hardware.split(",") if args.hardware else HARDWARE
    if args.only in (None, "budgets"):
        budgets(names, args.reselection)
    if args.only in (None, "blocks"):
        blocks(names, args.reselection, args.share)
    if args.only in (None, "run"):
        real_runs(args.link, args.run_share)


if __name__ == "__main__":
    main()
