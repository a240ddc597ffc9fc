"""GPU comparison: the host link measured, then every training policy run for real on a bf16 LLaMA whose transfers
are gigabytes, each step's measured time beside the simulator's.

Where CUDA exists:

* **link**: pinned host <-> GPU copies of ``--link-bytes`` on side streams, each direction alone and both at
  once, timed with CUDA events (median of ``--repeats``): ``h2d_bw``, ``d2h_bw`` (bytes/s) and the duplex share
  (both rates together over the two alone, the ``duplex_share`` of a hardware profile);
* **matmul**: an 8192^3 product in bfloat16 and float32 (TF32 off), FLOP/s (median of ``--repeats``);
* **policies**: ``medium-llama`` (16 layers, hidden 2048, bf16, batch 1, seq 4096; AdamW moments fp32) captured on
  the GPU with real weights and planned at each of ``--budgets`` by every training policy on the matching profile
  *with the measured link* (bandwidths and duplex share replaced by the figures above). Each feasible plan runs
  ``--steps`` donated steps (after ``--warmup``) with the CUDA runtime, in ``--rounds`` rounds that take the
  policies in turn, so all see the same machine. Per policy: ``wall_s`` (median over rounds of the mean step
  period, one synchronize per round), the slowdown against the unplanned step measured the same way, the
  simulator's ``step_s`` and slowdown on the measured-link profile and on the nominal one, ``sim_error``,
  the executor's measured peak against the budget, the caching allocator's peak allocated and reserved bytes
  over the timed steps from an empty cache (beyond what the script held before placing the state:
  ``allocated_bytes``, ``reserved_bytes``; ``model_reserved_bytes`` and ``model_stream_reserved_bytes``: what
  ``allocator_model`` predicts the allocator reserves for the plan, with the device's memory as its limit, frees
  in instruction order and ordered by the simulated copies), and ``max_abs_diff`` of the first step's state against the
  unplanned first step (``noise``: the unplanned step against itself). One more row, ``hyperoffload+arena``,
  is the planner with a static layout run from its arena (``arena_bytes``): what the budget promises about
  reserved memory (its state placed in the arena first: ``AsyncExecutor.place``).

With ``--json`` it prints one JSON object for the link and matmul figures, then one per budget as each is
measured. ``--dry-run`` runs the same code on the CPU: tiny-llama with an emulated link, no link or matmul
measurement (the tests use it so this script keeps working where no GPU is). Usage:
``PYTHONPATH=src python3 bench/gpu_compare.py [--budgets 50%,80%] [--batch B] [--json]`` with a Python that has a
CUDA build of PyTorch (``make gpu-check`` runs it after ``gpu_check.py``). Without CUDA (and without
``--dry-run``) it says so and exits 0; exit status 1 if a plan's measured peak passes its budget or a planned step
differs from the unplanned one by more than the noise floor.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hyperoffload.allocator_model import replay_caching_allocator
from hyperoffload.budgets import parse_budget
from hyperoffload.hardware import Hardware, get_hardware
from hyperoffload.plans import Plan, check_plan, plan_without_offload
from hyperoffload.policies import InfeasibleBudget, PlannerConfig, get_policy, plan_hyperoffload, policies_for
from hyperoffload.runtime import AsyncExecutor
from hyperoffload.runtime.measure import max_abs_diff
from hyperoffload.simulate import simulate
from hyperoffload.units import format_bytes
from hyperoffload.workloads import LlamaConfig, Workload, capture_workload, get_workload

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import DRY_RUN_BW, CudaDevice, DryRunDevice, matching_profile  # the sibling script, by the path above

MEDIUM = Workload(name="medium-llama",
                  description="16-layer LLaMA-style decoder, hidden 2048, bf16 (GPU comparison: gigabytes cross the "
                              "link each step)",
                  config=LlamaConfig(vocab_size=32000, hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8),
                  dtype=torch.bfloat16, batch=1, seq=4096, context=4096,
                  source="project-defined for the GPU comparison; LLaMA-3.2-1B-like widths with a 32k vocabulary")


ARENA = "hyperoffload+arena"
"""The row of the planner with a static layout, run from its arena (``PlannerConfig(static_layout=True)``)."""


def _median_ms(fn: Callable[[], tuple], repeats: int) -> list[float]:
    """Median over ``repeats`` of each elapsed time (ms) that ``fn`` returns, after one untimed call."""
    fn()
    samples = [fn() for _ in range(repeats)]
    return [statistics.median(s[i] for s in samples) for i in range(len(samples[0]))]


def measure_link(nbytes: int, repeats: int) -> dict:
    """Pinned host <-> GPU copy rates (bytes/s): each direction alone on its own stream, then both at once."""
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()

    def copies(up: bool, down: bool) -> tuple:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for stream, go, dst, src in ((h2d, up, dev_in, host_in), (d2h, down, host_out, dev_out)):
            if not go:
                continue
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            ends.append(end)
        torch.cuda.synchronize()
        return tuple(start.elapsed_time(e) for e in ends)

    (h2d_ms,) = _median_ms(lambda: copies(True, False), repeats)
    (d2h_ms,) = _median_ms(lambda: copies(False, True), repeats)
    both_h2d_ms, both_d2h_ms = _median_ms(lambda: copies(True, True), repeats)
    alone = nbytes / h2d_ms + nbytes / d2h_ms
    together = nbytes / both_h2d_ms + nbytes / both_d2h_ms
    return {"bytes": nbytes, "h2d_bw": nbytes / h2d_ms * 1e3, "d2h_bw": nbytes / d2h_ms * 1e3,
            "duplex_h2d_bw": nbytes / both_h2d_ms * 1e3, "duplex_d2h_bw": nbytes / both_d2h_ms * 1e3,
            "duplex_share": min(1.0, together / alone)}


def _timed_mm(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """Elapsed time (ms) of one ``a @ b`` on the GPU, by CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.mm(a, b)
    end.record()
    torch.cuda.synchronize()
    return (start.elapsed_time(end),)


def measure_matmul(n: int, repeats: int) -> dict:
    """FLOP/s of an ``n``^3 matrix product in bfloat16 and in float32 with TF32 off (the profiles' float32 rate)."""
    rates = {}
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for dtype in (torch.bfloat16, torch.float32):
            a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
            (ms,) = _median_ms(functools.partial(_timed_mm, a, b), repeats)
            rates[str(dtype).removeprefix("torch.")] = 2 * n**3 / ms * 1e3
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return rates


def with_link(hardware: Hardware, link: dict) -> Hardware:
    """``hardware`` with the measured link's bandwidths and duplex share."""
    return hardware.replace(name=f"{hardware.name}+measured-link", h2d_bw=link["h2d_bw"], d2h_bw=link["d2h_bw"],
                            duplex_share=link["duplex_share"])


def _start_memory(dev: CudaDevice) -> tuple[int, int]:
    """Empty the allocator's cache, reset its peaks and return (allocated, reserved) bytes now."""
    dev.synchronize()
    dev.empty_cache()
    dev.reset_peaks()
    return dev.allocated(), dev.reserved()


def _peak_memory(dev: CudaDevice) -> tuple[int, int]:
    """The allocator's (allocated, reserved) peaks since ``_start_memory``."""
    dev.synchronize()
    return dev.max_allocated(), dev.max_reserved()


def first_step(executor: AsyncExecutor, dev: CudaDevice, plan: Plan, inputs: Sequence[torch.Tensor],
               arena: bool = False) -> list:
    """The outputs and state after one step of ``plan`` from fresh copies of ``inputs``, on the compute device."""
    run = executor.step(plan, executor.place(plan, inputs, arena=arena), arena=arena)
    executor.synchronize()
    dev.synchronize()
    executor.release_arena()  # the caller's copy below holds the arena until compared, the executor no longer
    return [t.to(dev.type) for t in (*run.outputs, *run.state)]


def timed_steps(executor: AsyncExecutor, dev: CudaDevice, plan: Plan, inputs: Sequence[torch.Tensor], steps: int,
                warmup: int, arena: bool = False) -> tuple[float, float, int, tuple[int, int]]:
    """Mean step period (s) of ``steps`` donated steps after ``warmup`` (from a static arena with ``arena``); the
    mean time (s) the caller's thread spends issuing a step; the executor's largest measured device-tier peak
    (bytes) over all of them; and the allocator's peak (allocated, reserved) bytes over them beyond what was
    allocated and reserved before the state was placed, from an empty cache (zeros where not measured).

    On CUDA a step returns once issued, so an issue time well below the period means the GPU or the link sets
    the pace. One near the period says little by itself: the host also blocks when CUDA's launch queue is full
    (a step of thousands of kernels fills it whenever the GPU is the slower side) and when an allocation waits
    for an offload to free memory under the budget."""
    allocated, reserved = _start_memory(dev)
    state = executor.place(plan, inputs, arena=arena)  # the state in its arena slots: one arena, not two
    peak = 0
    issue = 0.0
    for k in range(warmup + steps):
        if k == warmup:
            executor.synchronize()
            dev.synchronize()
            start = time.perf_counter()
        issued = time.perf_counter()
        run = executor.step(plan, state, arena=arena)
        if k >= warmup:
            issue += time.perf_counter() - issued
        peak = max(peak, run.peak_bytes)
        state = list(run.state)
        del run
    executor.synchronize()
    dev.synchronize()
    executor.release_arena()  # with the state, below: nothing of this plan's stays on the device
    period = (time.perf_counter() - start) / steps
    max_allocated, max_reserved = _peak_memory(dev)
    return period, issue / steps, peak, (max_allocated - allocated, max_reserved - reserved)


def plan_policies(program, hardware: Hardware, budget_bytes: int, names: Sequence[str]) -> dict[str, Plan | str]:
    """Each policy's plan at ``budget_bytes``, or why it has none (the peak it needs, or the planner's error)."""
    plans: dict[str, Plan | str] = {}
    for name in names:
        try:
            plan = get_policy(name)(program, hardware, budget_bytes)
        except InfeasibleBudget as error:
            plans[name] = str(error)
            continue
        if plan.budget_bytes is None:  # the policy's plan does not fit: say what it needs
            plans[name] = f"needs {format_bytes(check_plan(plan).peak_bytes)}"
        else:
            plans[name] = plan
    return plans


def compare_policies(workload_name: str, captured, nominal: Hardware, hardware: Hardware, budget: str,
                     dev: CudaDevice, steps: int, warmup: int, rounds: int, progress: Callable[[str], None]) -> dict:
    """Every training policy's plan of the ``captured`` step (of workload ``workload_name``) at ``budget`` on
    ``hardware``, run for real on ``dev`` and simulated on ``hardware`` and ``nominal``. Returns the figures
    (see the module docstring)."""
    program, inputs = captured.program, captured.inputs
    budget_bytes = parse_budget(budget, program, hardware)
    names = [n for n in policies_for(program) if n != "none"]
    progress(f"planning {', '.join(names)} at {budget} ({budget_bytes / 2**30:.2f} GiB)")
    start = time.perf_counter()
    plans = plan_policies(program, hardware, budget_bytes, names)
    plan_s = time.perf_counter() - start
    # The planner with a static layout, run from its arena: what the budget promises about reserved memory.
    names.append(ARENA)
    try:
        plans[ARENA] = plan_hyperoffload(program, hardware, budget_bytes, config=PlannerConfig(static_layout=True))
    except InfeasibleBudget as error:
        plans[ARENA] = str(error)
    runnable = {"none": plan_without_offload(program), **{n: p for n, p in plans.items() if isinstance(p, Plan)}}

    walls: dict[str, list[float]] = {n: [] for n in runnable}
    issues: dict[str, list[float]] = {n: [] for n in runnable}
    peaks: dict[str, int] = dict.fromkeys(runnable, 0)
    memory: dict[str, tuple[int, int]] = dict.fromkeys(runnable, (0, 0))
    with AsyncExecutor(dev.transfers(hardware)) as executor:
        for name, plan in runnable.items():
            executor.prepare(plan, arena=name == ARENA)
        progress("first steps (exactness)")
        want = first_step(executor, dev, runnable["none"], inputs)
        noise = max_abs_diff(first_step(executor, dev, runnable["none"], inputs), want)
        diffs = {n: max_abs_diff(first_step(executor, dev, p, inputs, arena=n == ARENA), want)
                 for n, p in runnable.items() if n != "none"}
        del want
        for r in range(rounds):
            progress(f"timed round {r + 1} of {rounds}")
            for name, plan in runnable.items():
                wall, issue, peak, used = timed_steps(executor, dev, plan, inputs, steps, warmup, name == ARENA)
                walls[name].append(wall)
                issues[name].append(issue)
                peaks[name] = max(peaks[name], peak)
                memory[name] = (max(memory[name][0], used[0]), max(memory[name][1], used[1]))

    unplanned_wall = statistics.median(walls["none"])
    rows = []
    for name in ["none", *names]:
        plan = runnable.get(name)
        if plan is None:
            rows.append({"policy": name, "feasible": False, "why": plans[name]})
            continue
        timeline = simulate(plan, hardware)
        sim = timeline.figures
        sim_nominal = simulate(plan, nominal).figures
        wall = statistics.median(walls[name])
        rows.append({"policy": name, "feasible": True, "wall_s": wall, "wall_rounds_s": walls[name],
                     "issue_s": statistics.median(issues[name]),
                     "slowdown": wall / unplanned_wall, "sim_step_s": sim.step_s,
                     "sim_slowdown": sim.step_s / sim.compute_s, "sim_error": abs(sim.step_s - wall) / wall,
                     "sim_nominal_step_s": sim_nominal.step_s, "measured_peak_bytes": peaks[name],
                     "sim_peak_bytes": sim.peak_bytes, "h2d_bytes": sim.h2d_bytes, "d2h_bytes": sim.d2h_bytes,
                     "max_abs_diff": diffs.get(name, noise), "allocated_bytes": memory[name][0],
                     "reserved_bytes": memory[name][1],
                     # What the caching allocator model predicts it reserves for the plan (not for the arena row,
                     # which allocates one block), frees in instruction order and ordered by the simulated copies.
                     "model_reserved_bytes": None if name == ARENA else replay_caching_allocator(
                         plan, limit_bytes=nominal.memory_bytes).reserved_peak_bytes,
                     "model_stream_reserved_bytes": None if name == ARENA else replay_caching_allocator(
                         plan, limit_bytes=nominal.memory_bytes, timeline=timeline).reserved_peak_bytes,
                     "arena_bytes": plan.layout.arena_bytes if name == ARENA else 0,
                     "within_budget": name == "none" or peaks[name] <= budget_bytes})
    return {"workload": workload_name, "batch": captured.program.meta.get("batch"), "hardware": hardware.name,
            "nominal": nominal.name, "budget": budget,
            "budget_bytes": budget_bytes, "peak_bytes": simulate(runnable["none"], hardware).figures.peak_bytes,
            "plan_s": plan_s, "noise": noise, "rows": rows}


def print_table(result: dict) -> None:
    print(f"{result['workload']} at {result['budget']} ({result['budget_bytes'] / 2**30:.2f} GiB of a "
          f"{result['peak_bytes'] / 2**30:.2f} GiB peak), planned and simulated on {result['hardware']} "
          f"(nominal: {result['nominal']}); planning {result['plan_s']:.1f} s; unplanned noise {result['noise']:g}")
    print(f"  {'policy':18s} {'wall ms':>9s} {'slowdown':>9s} {'sim ms':>9s} {'sim slow':>9s} {'sim_err':>8s} "
          f"{'nominal ms':>10s} {'peak GiB':>9s} {'alloc GiB':>9s} {'resv GiB':>9s} {'model GiB':>9s} "
          f"{'stream GiB':>10s} {'moved GiB':>10s} {'max diff':>9s}")
    for row in result["rows"]:
        if not row["feasible"]:
            print(f"  {row['policy']:18s} infeasible: {row['why']}")
            continue
        moved = (row["h2d_bytes"] + row["d2h_bytes"]) / 2**30
        print(f"  {row['policy']:18s} {row['wall_s'] * 1e3:9.1f} {row['slowdown']:9.3f} {row['sim_step_s'] * 1e3:9.1f} "
              f"{row['sim_slowdown']:9.3f} {row['sim_error']:8.3f} {row['sim_nominal_step_s'] * 1e3:10.1f} "
              f"{row['measured_peak_bytes'] / 2**30:9.2f} {row['allocated_bytes'] / 2**30:9.2f} "
              f"{row['reserved_bytes'] / 2**30:9.2f} {_gib(row['model_reserved_bytes']):>9s} "
              f"{_gib(row['model_stream_reserved_bytes']):>10s} {moved:10.2f} "
              f"{row['max_abs_diff']:9.2g}")


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", help="profile to plan and simulate on (default: matched from the device name)")
    parser.add_argument("--budgets", default="50%,80%", help="comma-separated budgets (default 50%%,80%%)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each round's (default 1)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: the workload's)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the policies (default 2)")
    parser.add_argument("--link-bytes", type=int, default=1 << 30, help="bytes per link copy (default 1 GiB)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each link and matmul timing (default 5)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the same code on the CPU: tiny-llama, emulated link (checks the script)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    for option in ("steps", "rounds", "repeats", "link_bytes"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")

    def progress(message: str) -> None:
        print(f"gpu-compare: {message}", file=sys.stderr, flush=True)

    if args.dry_run:
        nominal = get_hardware(args.hardware or "h100-sxm")
        dev = DryRunDevice()
        link = {"h2d_bw": DRY_RUN_BW, "d2h_bw": DRY_RUN_BW, "duplex_share": nominal.duplex_share}
        result = {"device": dev.name(), "link": link, "matmul_flops": {}}
        hardware, workload = with_link(nominal, link), get_workload("tiny-llama")
    elif not torch.cuda.is_available():
        print("gpu-compare: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to measure")
        return 0
    else:
        name = torch.cuda.get_device_name()
        preset = args.hardware or matching_profile(name) or "h100-sxm"
        nominal = get_hardware(preset)
        progress(f"measuring the host link ({args.link_bytes / 2**30:.2f} GiB copies) and matmul rates on {name}")
        link = measure_link(args.link_bytes, args.repeats)
        result = {"device": name, "link": link, "matmul_flops": measure_matmul(8192, args.repeats)}
        torch.cuda.empty_cache()
        hardware, workload, dev = with_link(nominal, link), MEDIUM, CudaDevice()
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        link = result["link"]
        print(f"{result['device']}: host link H2D {link['h2d_bw'] / 1e9:.1f} GB/s, "
              f"D2H {link['d2h_bw'] / 1e9:.1f} GB/s, "
              f"duplex share {link['duplex_share']:.2f} (profile {nominal.name}: {nominal.h2d_bw / 1e9:.1f} / "
              f"{nominal.d2h_bw / 1e9:.1f} GB/s, {nominal.duplex_share:.2f})")
        for dtype, flops in result["matmul_flops"].items():
            profile = nominal.peak_flops.get(dtype, 0) / 1e12
            print(f"  8192^3 matmul {dtype}: {flops / 1e12:.0f} TFLOP/s (profile {profile:.0f})", flush=True)
    torch.manual_seed(0)
    progress(f"capturing {workload.name} on {dev.type}")
    with torch.device(dev.type):
        captured = capture_workload(workload, "train", batch=args.batch, fake=False)
    ok = True
    # Each budget's table as soon as it is measured, so a run stopped early keeps what it finished.
    for budget in args.budgets.split(","):
        figures = compare_policies(workload.name, captured, nominal, hardware, budget.strip(), dev, args.steps,
                                   args.warmup, args.rounds, progress)
        if args.json:
            print(json.dumps(figures), flush=True)
        else:
            print_table(figures)
        ok &= all(row["within_budget"] and row["max_abs_diff"] <= figures["noise"]
                  for row in figures["rows"] if row["feasible"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
