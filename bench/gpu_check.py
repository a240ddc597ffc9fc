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
  promises about reserved memory). A failure there is reported as FAILED with its error,
  after the other figures;
* reads the caching allocator over the warm-up steps, from an empty cache: what it reserved beyond what was
  allocated at its fullest (``fragmentation_bytes``) next to what ``allocator_model`` predicts for the plan
  (``model_fragmentation_bytes``, frees ordered by the simulated copies);
* reads the caching allocator over one donated step: its ``max_memory_allocated`` less what this script holds
  on the GPU besides the step (``step_max_allocated_bytes``, against the budget), and the most it held beyond
  the executor's own count at an instruction (``untracked_bytes``).

Exit status 1 if a planned step (from the arena too) differs from the unplanned one by more than the noise
floor (or by anything, where the unplanned step is reproducible), the executor's measured peak passes the
budget, the arena is not the layout's size, or the arena run fails.
``--dry-run`` runs the same checks on the CPU with an emulated link, tiny-llama only and without allocator
statistics (the tests use it, so the script keeps working where no GPU is). Without CUDA (and without
``--dry-run``) it says so and exits 0. Usage: ``PYTHONPATH=src python3 bench/gpu_check.py [--steps N] [--json]``
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
from hyperoffload.runtime import AsyncExecutor, EmulatedLink
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


DRY_RUN_BW = 2e9
"""Each way, bytes/s: the emulated link of ``--dry-run``, slow enough for host-memory copies to emulate."""


class CudaDevice:
    """The GPU: CUDA side streams, pinned remote buffers, the caching allocator's statistics."""

    type = "cuda"
    memory_stats = True
    """Whether the allocator's statistics are real (the memory figures are None where they are not)."""

    def transfers(self, hardware):
        """The copy engines the steps run on; ``hardware`` is the profile they are simulated on."""
        from hyperoffload.runtime.cuda_streams import CudaStreams

        return CudaStreams()

    def name(self) -> str:
        return torch.cuda.get_device_name()

    synchronize = staticmethod(torch.cuda.synchronize)
    allocated = staticmethod(torch.cuda.memory_allocated)
    reserved = staticmethod(torch.cuda.memory_reserved)
    max_allocated = staticmethod(torch.cuda.max_memory_allocated)
    max_reserved = staticmethod(torch.cuda.max_memory_reserved)
    reset_peaks = staticmethod(torch.cuda.reset_peak_memory_stats)
    empty_cache = staticmethod(torch.cuda.empty_cache)


class DryRunDevice(CudaDevice):
    """The same checks on the CPU with an emulated link (``--dry-run``): no allocator statistics (every memory
    figure reads 0), so it checks the script, not memory."""

    type = "cpu"
    memory_stats = False

    def transfers(self, hardware):
        return EmulatedLink.for_hardware(hardware)  # the link the steps are simulated on

    def name(self) -> str:
        return "cpu (dry run)"

    synchronize = allocated = reserved = max_allocated = max_reserved = reset_peaks = empty_cache = staticmethod(
        lambda: 0)


def check(workload: Workload, hardware, budget: str, steps: int, warmup: int, dev: CudaDevice) -> dict:
    torch.manual_seed(0)
    with torch.device(dev.type):
        captured = capture_workload(workload, "train", fake=False)
    program = captured.program
    plan = hyperoffload.plan(program, hardware, budget)
    sim = simulate(plan, hardware).figures
    unplanned = plan_without_offload(program)

    with AsyncExecutor(dev.transfers(hardware)) as executor:
        # Reference and noise floor: the unplanned step twice, in place, on the GPU.
        ref_inputs = [t.clone() for t in captured.inputs]
        ref = executor.run(unplanned, ref_inputs)
        again_inputs = [t.clone() for t in captured.inputs]
        again = executor.run(unplanned, again_inputs)
        noise = max_abs_diff([*again.outputs, *again_inputs], [*ref.outputs, *ref_inputs])
        want = [t.cpu() for t in (*ref.outputs, *ref_inputs)]
        del ref, again, ref_inputs, again_inputs

        # The planned step in place, inputs where the plan expects them.
        inputs = executor.place(plan, captured.inputs)
        run = executor.run(plan, inputs)
        diff = max_abs_diff([t.cpu() for t in (*run.outputs, *inputs)], want)
        del run, inputs

        arena = arena_check(executor, program, captured.inputs, hardware, budget, want, noise, dev)
        del want

        # Timed steps on donated state; nothing else of ours stays on the GPU meanwhile.
        state = executor.place(plan, captured.inputs)
        del captured
        executor.synchronize()
        dev.synchronize()
        # What this script holds on the GPU besides the step's state.
        outside = dev.allocated() - device_bytes(state, dev.type)
        # The caching allocator from an empty cache over the warm-up steps: what it reserves beyond what is
        # allocated at its fullest is fragmentation, which the allocator model predicts for the plan.
        dev.empty_cache()
        dev.reset_peaks()
        for _ in range(warmup):
            state = list(executor.step(plan, state).state)
        executor.synchronize()
        dev.synchronize()
        fragmentation = dev.max_reserved() - dev.max_allocated()
        # The device, not the budget, limits it; frees ordered by the simulated copies.
        model = replay_caching_allocator(plan, limit_bytes=hardware.memory_bytes, timeline=simulate(plan, hardware))
        untracked, step_allocated, state = allocator_beside_count(executor, plan, state, outside, dev)
        executor.synchronize()
        dev.synchronize()
        dev.reset_peaks()
        start = time.perf_counter()
        peak = 0
        for _ in range(steps):
            run = executor.step(plan, state)
            peak = max(peak, run.peak_bytes)
            state = list(run.state)
            del run
        executor.synchronize()
        dev.synchronize()
        wall = (time.perf_counter() - start) / steps
        allocated = dev.max_allocated()
        pinned = getattr(executor.transfers, "pinned_bytes", 0)
        del state
    dev.empty_cache()
    result = {"workload": workload.name, "hardware": hardware.name, "device": dev.name(),
              "budget_bytes": plan.budget_bytes, "sim_peak_bytes": sim.peak_bytes, "measured_peak_bytes": peak,
              "max_memory_allocated": allocated, "pinned_remote_bytes": pinned, "outside_bytes": outside,
              "step_max_allocated_bytes": step_allocated, "untracked_bytes": untracked,
              "fragmentation_bytes": fragmentation,
              "model_fragmentation_bytes": model.reserved_peak_bytes - model.live_peak_bytes,
              "wall_s": wall, "sim_step_s": sim.step_s, "sim_compute_s": sim.compute_s,
              "sim_error": abs(sim.step_s - wall) / wall, "max_abs_diff": diff, "unplanned_noise": noise,
              "h2d_bytes": sim.h2d_bytes, "d2h_bytes": sim.d2h_bytes, "arena": arena,
              "ok": diff <= noise and peak <= plan.budget_bytes and arena["ok"]}
    return result if dev.memory_stats else _without_memory(result)


MEMORY_FIGURES = ("max_memory_allocated", "outside_bytes", "step_max_allocated_bytes", "untracked_bytes",
                  "fragmentation_bytes")


def _without_memory(result: dict) -> dict:
    """``result`` with the allocator's figures None (a device without allocator statistics)."""
    arena = {**result["arena"], "step_max_allocated_bytes": None} if "error" not in result["arena"] else result["arena"]
    return {**result, **dict.fromkeys(MEMORY_FIGURES), "arena": arena}


def device_bytes(tensors, device_type: str = "cuda") -> int:
    """Bytes of the distinct storages on ``device_type`` under ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t.device.type == device_type}
    return sum(storages.values())


def allocator_beside_count(executor, plan, state: list, outside: int, dev: CudaDevice) -> tuple[int, int, list]:
    """One donated step with the caching allocator's bytes read after every instruction, less ``outside`` (what
    the caller holds on the GPU besides the step). Returns the most those bytes exceeded the executor's own count
    at any instruction (``untracked``: the count is taken after the instruction, before its frees; the read after
    them, so this is a floor), the step's ``max_memory_allocated`` less ``outside`` (temporaries inside ops
    included), and the state after the step."""
    samples: list[int] = []
    dev.synchronize()
    dev.reset_peaks()
    run = executor.step(plan, state, on_instruction=lambda i: samples.append(dev.allocated()))
    untracked = max(a - outside - live for a, live in zip(samples, run.live_bytes, strict=True))
    executor.synchronize()
    dev.synchronize()
    return untracked, dev.max_allocated() - outside, list(run.state)


def arena_check(executor, program, inputs, hardware, budget: str, want, noise: float, dev: CudaDevice) -> dict:
    """One step in place from one static arena on the GPU: planned at ``budget`` with a static layout, run with
    ``executor``'s CUDA backend, compared with ``want`` (the unplanned step's outputs and inputs after it, on the
    CPU). A failure of the run is returned as the figures' ``error``, so the other checks still report."""
    budget_bytes = parse_budget(budget, program, hardware)
    plan = plan_hyperoffload(program, hardware, budget_bytes, config=PlannerConfig(static_layout=True))
    layout_bytes = plan.layout.arena_bytes
    try:
        placed = executor.place(plan, inputs)
        executor.synchronize()
        dev.synchronize()
        outside = dev.allocated()  # the caller's tensors (updated in place) and everything else
        dev.reset_peaks()
        run = executor.run(plan, placed, arena=True)
        executor.synchronize()
        dev.synchronize()
        step_allocated = dev.max_allocated() - outside  # the arena, and what ops made outside it
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
    parser.add_argument("--dry-run", action="store_true",
                        help="the same checks on the CPU with an emulated link, tiny-llama only (checks the script)")
    args = parser.parse_args(argv)
    link = {}
    if args.dry_run:
        dev, workloads = DryRunDevice(), (get_workload("tiny-llama"),)
        preset = args.hardware or "h200"
        link = {"h2d_bw": DRY_RUN_BW, "d2h_bw": DRY_RUN_BW}  # the emulated link, which is what the steps run on
    elif not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to check")
        return 0
    else:
        dev, workloads = CudaDevice(), (get_workload("tiny-llama"), SMALL)
        name = dev.name()
        preset = args.hardware or matching_profile(name)
        if preset is None:
            preset = "h100-sxm"
            print(f"gpu-check: no profile matches {name!r}; simulating on {preset} (pass --hardware to choose)")
    hardware = get_hardware(preset).replace(**link)
    results = []
    for workload in workloads:
        r = check(workload, hardware, args.budget, args.steps, args.warmup, dev)
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        print(f"{r['workload']:12s} on {r['device']} (simulated as {r['hardware']}), budget {r['budget_bytes']:,} B")
        print(f"  step: wall {r['wall_s'] * 1e3:.2f} ms, simulated {r['sim_step_s'] * 1e3:.2f} ms "
              f"(compute {r['sim_compute_s'] * 1e3:.2f} ms), sim_error {r['sim_error']:.3f}")
        print(f"  memory: executor peak {r['measured_peak_bytes']:,} B, simulated peak {r['sim_peak_bytes']:,} B; "
              f"pinned remote buffers {r['pinned_remote_bytes']:,} B")
        if r["max_memory_allocated"] is None:
            print("  allocator: no statistics on this device")
        else:
            print_allocator(r, args.warmup)
        print(f"  exactness: max_abs_diff {r['max_abs_diff']:g} (unplanned vs unplanned: {r['unplanned_noise']:g})")
        print_arena(r["arena"])
        print(f"  -> {'ok' if r['ok'] else 'FAILED'}", flush=True)
    return 0 if all(r["ok"] for r in results) else 1


def print_allocator(r: dict, warmup: int) -> None:
    print(f"  allocator: one step's max_memory_allocated less the script's other GPU memory "
          f"{r['step_max_allocated_bytes']:,} B ({r['step_max_allocated_bytes'] / r['budget_bytes']:.3f} x "
          f"budget); at most {r['untracked_bytes']:,} B beyond the executor's count at an instruction")
    print(f"  fragmentation: reserved beyond allocated at the fullest {r['fragmentation_bytes']:,} B over "
          f"{warmup} step(s) from an empty cache; the allocator model predicts "
          f"{r['model_fragmentation_bytes']:,} B for the plan")


def print_arena(a: dict) -> None:
    if "error" in a:
        print(f"  arena: FAILED ({a['error']}); layout arena {a['layout_arena_bytes']:,} B")
        return
    print(f"  arena: {a['arena_bytes']:,} B (layout {a['layout_arena_bytes']:,} B, budget "
          f"{a['budget_bytes']:,} B), executor peak {a['measured_peak_bytes']:,} B, slot waits "
          f"{a['slot_waits']}, max_abs_diff {a['max_abs_diff']:g}; op results copied into the arena "
          f"{a['arena_copied_bytes']:,} B")
    if a["step_max_allocated_bytes"] is not None:
        print(f"         the step's max_memory_allocated beyond what was allocated before it "
              f"{a['step_max_allocated_bytes']:,} B ({a['step_max_allocated_bytes'] / a['budget_bytes']:.3f} x "
              f"budget)")


if __name__ == "__main__":
    sys.exit(main())
