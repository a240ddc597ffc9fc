"""GPU check: planned LLaMA training steps with the CUDA runtime against the unplanned step and the simulator.

Where CUDA exists, for ``tiny-llama`` and a small LLaMA (8 layers, hidden 1024), both float32:

* captures the training step on the GPU, plans it at ``--budget`` of its peak on the matching hardware
  profile (by device name, or ``--hardware``);
* runs the unplanned step twice (the second run is the noise floor: some CUDA kernels are not
  bit-reproducible) and the planned step once in place with the CUDA runtime (side streams, events,
  pinned remote buffers), and compares outputs and every updated input (parameters, gradients folded
  into the AdamW update, moments): ``max_abs_diff``;
* runs planned steps on donated state (inputs that start in remote memory in pinned host memory, the rest
  on the GPU) and measures ``wall_s`` (mean step period after warm-up, one synchronize at the end) and
  ``torch.cuda.max_memory_allocated`` over those steps, next to the executor's own measured peak, the
  budget, and the simulator's ``step_s`` and ``peak_bytes`` on the profile;
* runs the step from one static arena (``arena=True``): planned at the same budget with a static layout,
  once in place with the CUDA runtime, and reports the arena's bytes (against the layout's), the executor's
  measured peak, ``max_abs_diff`` against the unplanned step, the slot waits (reuses of a slot an offload
  was still reading, waited for on the compute stream), and the step's ``max_memory_allocated`` beyond what
  was allocated before it (the arena, op results made outside it, kernels' workspaces: what the budget
  promises about reserved memory, not yet measured on a GPU). A failure there is reported as FAILED with its error,
  after the other figures;
* reads the caching allocator over the warm-up steps, from an empty cache: what it reserved beyond what was
  allocated at its fullest (``fragmentation_bytes``) next to what ``allocator_model`` predicts for the plan
  (``model_fragmentation_bytes``; not yet run on a GPU);
* reads the caching allocator over one donated step: its ``max_memory_allocated`` less what this script holds
  on the GPU besides the step (``step_max_allocated_bytes``, against the budget), and the most it held beyond
  the executor's own count at an instruction (``untracked_bytes``).

Exit status 1 if a planned step (from the arena too) differs from the unplanned one by more than the noise
floor (or by anything, where the unplanned step is reproducible), the executor's measured peak passes the
budget, the arena is not the layout's size, or the arena run fails.
Without CUDA it says so and exits 0. Usage: ``PYTHONPATH=src python3 bench/gpu_check.py [--steps N] [--json]``
with a Python that has a CUDA build of PyTorch (``make gpu-check``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import hyperoffload
from hyperoffload.allocator_model import replay_caching_allocator
from hyperoffload.budgets import parse_budget
from hyperoffload.hardware import get_hardware
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import PlannerConfig, plan_hyperoffload
from hyperoffload.runtime import AsyncExecutor
from hyperoffload.runtime.measure import max_abs_diff
from hyperoffload.simulate import simulate
from hyperoffload.workloads import LlamaConfig, Workload, capture_workload, get_workload

SMALL = Workload(name="small-llama", description="8-layer LLaMA-style decoder, hidden 1024 (GPU check)",
                 config=LlamaConfig(vocab_size=32000, hidden=1024, ffn=2816, layers=8, heads=16, kv_heads=4),
                 dtype=torch.float32, batch=4, seq=512, context=512, source="project-defined for the GPU check")

PROFILES = (("GH200", "gh200"), ("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80g"), ("MI300", "mi300x"))
"""Substring of the CUDA device name -> hardware preset (first match wins; GH200 before H200)."""


def matching_profile(name: str) -> str | None:
    return next((preset for key, preset in PROFILES if key in name), None)


def check(workload: Workload, hardware, budget: str, steps: int, warmup: int) -> dict:
    from hyperoffload.runtime.cuda_streams import CudaStreams, place_inputs

    torch.manual_seed(0)
    with torch.device("cuda"):
        captured = capture_workload(workload, "train", fake=False)
    program = captured.program
    plan = hyperoffload.plan(program, hardware, budget)
    sim = simulate(plan, hardware).figures
    unplanned = plan_without_offload(program)

    with AsyncExecutor(CudaStreams()) as executor:
        # Reference and noise floor: the unplanned step twice, in place, on the GPU.
        ref_inputs = [t.clone() for t in captured.inputs]
        ref = executor.run(unplanned, ref_inputs)
        again_inputs = [t.clone() for t in captured.inputs]
        again = executor.run(unplanned, again_inputs)
        noise = max_abs_diff([*again.outputs, *again_inputs], [*ref.outputs, *ref_inputs])
        want = [t.cpu() for t in (*ref.outputs, *ref_inputs)]
        del ref, again, ref_inputs, again_inputs

        # The planned step in place, inputs where the plan expects them.
        inputs = place_inputs(plan, captured.inputs)
        run = executor.run(plan, inputs)
        diff = max_abs_diff([t.cpu() for t in (*run.outputs, *inputs)], want)
        del run, inputs

        arena = arena_check(executor, program, captured.inputs, hardware, budget, want, noise)
        del want

        # Timed steps on donated state; nothing else of ours stays on the GPU meanwhile.
        state = place_inputs(plan, captured.inputs)
        del captured
        executor.synchronize()
        torch.cuda.synchronize()
        # What this script holds on the GPU besides the step's state.
        outside = torch.cuda.memory_allocated() - device_bytes(state)
        # The caching allocator from an empty cache over the warm-up steps: what it reserves beyond what is
        # allocated at its fullest is fragmentation, which the allocator model predicts for the plan.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            state = list(executor.step(plan, state).state)
        executor.synchronize()
        torch.cuda.synchronize()
        fragmentation = torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()
        model = replay_caching_allocator(plan, limit_bytes=hardware.memory_bytes)  # the device, not the budget
        untracked, step_allocated, state = allocator_beside_count(executor, plan, state, outside)
        executor.synchronize()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        peak = 0
        for _ in range(steps):
            run = executor.step(plan, state)
            peak = max(peak, run.peak_bytes)
            state = list(run.state)
            del run
        executor.synchronize()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
        allocated = torch.cuda.max_memory_allocated()
        pinned = executor.transfers.pinned_bytes
        del state
    torch.cuda.empty_cache()
    return {"workload": workload.name, "hardware": hardware.name, "device": torch.cuda.get_device_name(),
            "budget_bytes": plan.budget_bytes, "sim_peak_bytes": sim.peak_bytes, "measured_peak_bytes": peak,
            "max_memory_allocated": allocated, "pinned_remote_bytes": pinned, "outside_bytes": outside,
            "step_max_allocated_bytes": step_allocated, "untracked_bytes": untracked,
            "fragmentation_bytes": fragmentation,
            "model_fragmentation_bytes": model.reserved_peak_bytes - model.live_peak_bytes,
            "wall_s": wall, "sim_step_s": sim.step_s, "sim_compute_s": sim.compute_s,
            "sim_error": abs(sim.step_s - wall) / wall, "max_abs_diff": diff, "unplanned_noise": noise,
            "h2d_bytes": sim.h2d_bytes, "d2h_bytes": sim.d2h_bytes, "arena": arena,
            "ok": diff <= noise and peak <= plan.budget_bytes and arena["ok"]}


def device_bytes(tensors) -> int:
    """Bytes of the distinct CUDA storages under ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum(storages.values())


def allocator_beside_count(executor, plan, state: list, outside: int) -> tuple[int, int, list]:
    """One donated step with the caching allocator's bytes read after every instruction, less ``outside`` (what
    the caller holds on the GPU besides the step). Returns the most those bytes exceeded the executor's own count
    at any instruction (``untracked``: the count is taken after the instruction, before its frees; the read after
    them, so this is a floor), the step's ``max_memory_allocated`` less ``outside`` (temporaries inside ops
    included), and the state after the step."""
    samples: list[int] = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run = executor.step(plan, state, on_instruction=lambda i: samples.append(torch.cuda.memory_allocated()))
    untracked = max(a - outside - live for a, live in zip(samples, run.live_bytes, strict=True))
    executor.synchronize()
    torch.cuda.synchronize()
    return untracked, torch.cuda.max_memory_allocated() - outside, list(run.state)


def arena_check(executor, program, inputs, hardware, budget: str, want, noise: float) -> dict:
    """One step in place from one static arena on the GPU: planned at ``budget`` with a static layout, run with
    ``executor``'s CUDA backend, compared with ``want`` (the unplanned step's outputs and inputs after it, on the
    CPU). A failure of the run is returned as the figures' ``error``, so the other checks still report."""
    from hyperoffload.runtime.cuda_streams import place_inputs

    budget_bytes = parse_budget(budget, program, hardware)
    plan = plan_hyperoffload(program, hardware, budget_bytes, config=PlannerConfig(static_layout=True))
    layout_bytes = plan.layout.arena_bytes
    try:
        placed = place_inputs(plan, inputs)
        executor.synchronize()
        torch.cuda.synchronize()
        outside = torch.cuda.memory_allocated()  # the caller's tensors (updated in place) and everything else
        torch.cuda.reset_peak_memory_stats()
        run = executor.run(plan, placed, arena=True)
        executor.synchronize()
        torch.cuda.synchronize()
        step_allocated = torch.cuda.max_memory_allocated() - outside  # the arena, and what ops made outside it
        diff = max_abs_diff([t.cpu() for t in (*run.outputs, *placed)], want)
    except Exception as error:  # noqa: BLE001 - reported with the figures; the exit status says it failed
        return {"layout_arena_bytes": layout_bytes, "budget_bytes": budget_bytes, "error": f"{type(error).__name__}: "
                f"{error}", "ok": False}
    return {"layout_arena_bytes": layout_bytes, "arena_bytes": run.arena_bytes, "budget_bytes": budget_bytes,
            "measured_peak_bytes": run.peak_bytes, "slot_waits": run.slot_waits, "max_abs_diff": diff,
            "h2d_bytes": run.h2d_bytes, "d2h_bytes": run.d2h_bytes, "step_max_allocated_bytes": step_allocated,
            "arena_copied_bytes": run.arena_copied_bytes,
            "ok": diff <= noise and run.arena_bytes == layout_bytes and run.peak_bytes <= budget_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", help="profile to simulate on (default: matched from the device name)")
    parser.add_argument("--budget", default="50%", help="budget for both workloads (default 50%%)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per workload")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to check")
        return 0
    name = torch.cuda.get_device_name()
    preset = args.hardware or matching_profile(name)
    if preset is None:
        preset = "h100-sxm"
        print(f"gpu-check: no profile matches {name!r}; simulating on {preset} (pass --hardware to choose)")
    hardware = get_hardware(preset)
    results = []
    for workload in (get_workload("tiny-llama"), SMALL):
        r = check(workload, hardware, args.budget, args.steps, args.warmup)
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        print(f"{r['workload']:12s} on {r['device']} (simulated as {r['hardware']}), budget {r['budget_bytes']:,} B")
        print(f"  step: wall {r['wall_s'] * 1e3:.2f} ms, simulated {r['sim_step_s'] * 1e3:.2f} ms "
              f"(compute {r['sim_compute_s'] * 1e3:.2f} ms), sim_error {r['sim_error']:.3f}")
        print(f"  memory: executor peak {r['measured_peak_bytes']:,} B, max_memory_allocated "
              f"{r['max_memory_allocated']:,} B ({r['max_memory_allocated'] / r['budget_bytes']:.3f} x budget), "
              f"simulated peak {r['sim_peak_bytes']:,} B; pinned remote buffers {r['pinned_remote_bytes']:,} B")
        print(f"  allocator: one step's max_memory_allocated less the script's other GPU memory "
              f"{r['step_max_allocated_bytes']:,} B ({r['step_max_allocated_bytes'] / r['budget_bytes']:.3f} x "
              f"budget); at most {r['untracked_bytes']:,} B beyond the executor's count at an instruction")
        print(f"  fragmentation: reserved beyond allocated at the fullest {r['fragmentation_bytes']:,} B over "
              f"{args.warmup} step(s) from an empty cache; the allocator model predicts "
              f"{r['model_fragmentation_bytes']:,} B for the plan")
        print(f"  exactness: max_abs_diff {r['max_abs_diff']:g} (unplanned vs unplanned: {r['unplanned_noise']:g})")
        a = r["arena"]
        if "error" in a:
            print(f"  arena: FAILED ({a['error']}); layout arena {a['layout_arena_bytes']:,} B")
        else:
            print(f"  arena: {a['arena_bytes']:,} B (layout {a['layout_arena_bytes']:,} B, budget "
                  f"{a['budget_bytes']:,} B), executor peak {a['measured_peak_bytes']:,} B, slot waits "
                  f"{a['slot_waits']}, max_abs_diff {a['max_abs_diff']:g}")
            print(f"         the step's max_memory_allocated beyond what was allocated before it "
                  f"{a['step_max_allocated_bytes']:,} B ({a['step_max_allocated_bytes'] / a['budget_bytes']:.3f} x "
                  f"budget); op results copied into the arena {a['arena_copied_bytes']:,} B")
        print(f"  -> {'ok' if r['ok'] else 'FAILED'}", flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
