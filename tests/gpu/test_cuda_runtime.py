"""The CUDA runtime (side streams, events, pinned remote buffers). Everything but the first test needs a CUDA
GPU and is skipped without one; ``make gpu-check`` runs the fuller check with step times and memory."""

from __future__ import annotations

import pytest
import torch

import hyperoffload
from hyperoffload.budgets import parse_budget
from hyperoffload.hardware import get_hardware
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import PlannerConfig, plan_hyperoffload
from hyperoffload.runtime import AsyncExecutor, run_async
from hyperoffload.runtime.measure import max_abs_diff
from hyperoffload.workloads import capture_workload, get_workload

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_backend_imports_anywhere_and_says_what_to_use_without_a_gpu():
    from hyperoffload.runtime import cuda_streams

    if torch.cuda.is_available():
        assert cuda_streams.CudaStreams().device.type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="emulated link"):
            cuda_streams.CudaStreams()
        with pytest.raises(RuntimeError, match="emulated link"):
            run_async(None, [], link="cuda")


@pytest.fixture(scope="module")
def on_gpu():
    """tiny-llama's training step captured on the GPU, its plan at half the peak on h100-sxm, and the
    unplanned step's results (outputs, then inputs after the step) on the CPU."""
    with torch.device("cuda"):
        captured = capture_workload(get_workload("tiny-llama"), "train", fake=False)
    plan = hyperoffload.plan(captured.program, "h100-sxm", "50%")
    inputs = [t.clone() for t in captured.inputs]
    ref = run_async(plan_without_offload(captured.program), inputs, link="cuda")
    return captured, plan, [t.cpu() for t in (*ref.outputs, *inputs)]


@needs_cuda
def test_planned_step_on_cuda_streams_matches_the_unplanned_step_under_the_budget(on_gpu):
    from hyperoffload.runtime.cuda_streams import place_inputs

    captured, plan, want = on_gpu
    inputs = place_inputs(plan, captured.inputs)
    assert any(t.is_pinned() for t in inputs) == bool(plan.initial_remote)
    run = run_async(plan, inputs, link="cuda")
    assert run.peak_bytes <= plan.budget_bytes
    assert run.h2d_bytes > 0 and run.d2h_bytes > 0
    assert max_abs_diff([t.cpu() for t in (*run.outputs, *inputs)], want) == 0.0


@needs_cuda
def test_donated_steps_overlap_on_cuda_and_end_where_the_unplanned_steps_end(on_gpu):
    from hyperoffload.runtime.cuda_streams import CudaStreams

    captured, plan, _ = on_gpu
    with AsyncExecutor(CudaStreams()) as executor:
        state = _three_donated_steps_match_the_unplanned_ones(executor, captured, plan)
        pinned = executor.transfers.pinned_bytes
        executor.step(plan, state)
        assert executor.transfers.pinned_bytes == pinned, "pinned remote buffers are allocated once and reused"


@pytest.fixture(scope="module")
def arena_plan(on_gpu):
    """tiny-llama's training step planned at half the peak on h100-sxm with a static layout, whose arena fits the
    budget (slot offsets are multiples of 256 bytes, so kernels see the alignment the allocator would give)."""
    captured = on_gpu[0]
    hardware = get_hardware("h100-sxm")
    budget = parse_budget("50%", captured.program, hardware)
    plan = plan_hyperoffload(captured.program, hardware, budget, config=PlannerConfig(static_layout=True))
    assert plan.layout is not None and plan.layout.arena_bytes <= budget
    return plan


@needs_cuda
def test_planned_step_runs_from_its_arena_on_cuda_bit_identically(on_gpu, arena_plan):
    """From one arena on the GPU with the CUDA backend: the same loss and updated state as the unplanned step, the
    arena the layout's size, and no two live storages on the same bytes (the executor raises ArenaOverlap)."""
    from hyperoffload.runtime.cuda_streams import CudaStreams, place_inputs

    captured, _, want = on_gpu
    inputs = place_inputs(arena_plan, captured.inputs)
    with AsyncExecutor(CudaStreams()) as executor:
        run = executor.run(arena_plan, inputs, arena=True)
    assert run.arena_bytes == arena_plan.layout.arena_bytes
    assert 0 < run.peak_bytes <= run.arena_bytes <= arena_plan.budget_bytes
    assert run.h2d_bytes > 0 and run.d2h_bytes > 0
    assert max_abs_diff([t.cpu() for t in (*run.outputs, *inputs)], want) == 0.0


@needs_cuda
def test_donated_steps_from_the_arena_on_cuda_end_where_the_unplanned_steps_end(on_gpu, arena_plan):
    """Step after step from one arena, the state placed in it first (``AsyncExecutor.place``), with the last
    offloads carried into the next step while the moves into the start slots may overwrite what they read."""
    from hyperoffload.runtime.cuda_streams import CudaStreams

    with AsyncExecutor(CudaStreams()) as executor:
        _three_donated_steps_match_the_unplanned_ones(executor, on_gpu[0], arena_plan, arena=True)


def _three_donated_steps_match_the_unplanned_ones(executor, captured, plan, arena: bool = False) -> list:
    """Three unplanned steps, then three planned steps on donated state (each within the budget and, from an
    arena, the layout's arena): the planned state equals the unplanned one exactly. Returns the planned state."""
    from hyperoffload.runtime.cuda_streams import place_inputs

    ref_state = [t.clone() for t in captured.inputs]
    unplanned = plan_without_offload(captured.program)
    for _ in range(3):
        executor.run(unplanned, ref_state)
    state = executor.place(plan, captured.inputs, arena=True) if arena else place_inputs(plan, captured.inputs)
    for _ in range(3):
        run = executor.step(plan, state, arena=arena)
        assert run.peak_bytes <= plan.budget_bytes
        if arena:
            assert run.arena_bytes == plan.layout.arena_bytes and run.arena_reused
        state = list(run.state)
    executor.synchronize()
    assert max_abs_diff([t.cpu() for t in state], [t.cpu() for t in ref_state]) == 0.0
    return state
