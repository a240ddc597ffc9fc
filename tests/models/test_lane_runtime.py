"""Lane ops on the real runtime: a decode step of tiny-deepseek with its KV cache in remote memory, run with the
block fetches and row stores on the copy lanes. Results stay bit-identical to the captured step (and to the
step with the cache on the device), the remote cache never counts as device bytes, the fetch overlaps
independent compute on a slow link, and a failing lane op surfaces as ``TransferError`` on the caller's thread.
No test asserts on wall time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_flatten

from hyperoffload.hardware.cpu import CpuCalibration, cpu_emulated
from hyperoffload.ir import ValueKind, kind_bytes
from hyperoffload.plans import check_plan, plan_without_offload
from hyperoffload.policies import POLICIES
from hyperoffload.policies.reorder import fetch_on_demand, overlap_lane_ops
from hyperoffload.runtime import AsyncExecutor, EmulatedLink, TransferError, run_async, run_plan
from hyperoffload.workloads import get_workload
from hyperoffload.workloads.build import capture_workload

pytestmark = pytest.mark.usefixtures("one_compute_thread")  # see tests/conftest.py

BATCH, CONTEXT = 2, 200
SLOW = {"h2d_bw": 200e6, "d2h_bw": 200e6, "h2d_latency_s": 20e-6, "d2h_latency_s": 20e-6}
"""A slow link: a layer's block fetch (20 KiB) takes about as long as its kernel."""
CRAWL = {"h2d_bw": 20e6, "d2h_bw": 20e6, "h2d_latency_s": 50e-6, "d2h_latency_s": 50e-6}
"""A link slow enough that a layer's block fetch (about 1 ms) outlasts its kernel many times over: lane ops are
still running when a step is stopped."""
ORDERS = {"overlap": overlap_lane_ops, "on-demand": fetch_on_demand}


def _capture(pool_blocks: int | None, remote_kv: bool = True):
    return capture_workload(get_workload("tiny-deepseek"), "decode", batch=BATCH, context=CONTEXT, fake=False,
                            remote_kv=remote_kv, pool_blocks=pool_blocks)


@pytest.fixture(scope="module")
def remote_steps():
    return {pool: _capture(pool) for pool in (None, 4)}


@pytest.fixture(scope="module")
def device_step():
    """The same decode step (same seed: same weights and token) with the KV cache on the device."""
    return _capture(None, remote_kv=False)


def _clones(captured) -> list[torch.Tensor]:
    return [t.clone() for t in captured.inputs]


def _eager(captured) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """The captured step on clones of its inputs: (outputs, inputs after the step)."""
    inputs = _clones(captured)
    outputs = tuple(x for x in tree_flatten(captured.step(*inputs))[0] if isinstance(x, torch.Tensor))
    return outputs, inputs


def _assert_identical(got, want) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), f"tensor {k} differs"


def _remote_bytes(program) -> int:
    return sum(program.values[v].nbytes for v in program.inputs if program.values[v].remote)


@pytest.mark.parametrize("pool_blocks", [None, 4])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_lane_ops_on_the_copy_lanes_give_the_captured_step_bit_for_bit(remote_steps, device_step, pool_blocks, order):
    captured = remote_steps[pool_blocks]
    program = captured.program
    plan = plan_without_offload(program, order=ORDERS[order](program))
    want_outputs, want_inputs = _eager(captured)
    device_logits = _eager(device_step)[0][0]
    lane_ops = [op for op in program.ops if op.lane]
    assert {op.lane for op in lane_ops} == {"h2d", "d2h"}

    inputs = _clones(captured)
    sync = run_plan(plan, inputs)
    _assert_identical(sync.outputs, want_outputs)
    _assert_identical(inputs, want_inputs)  # the remote cache got the new rows, the pool its blocks
    with EmulatedLink(**SLOW) as link:
        for _ in range(2):  # the second step reuses the link's engines
            inputs = _clones(captured)
            run = run_async(plan, inputs, link=link)
            _assert_identical(run.outputs, want_outputs)
            _assert_identical(inputs, want_inputs)
    # Both caches hold the same (zero) rows, so the remote form reads the same values as the on-device one.
    assert torch.equal(run.outputs[0], device_logits)
    # Every lane op's traffic is counted: the stores' rows, and the blocks fetched (all of them, from an empty pool).
    assert run.d2h_bytes == sync.d2h_bytes == sum(op.transfer_bytes for op in lane_ops if op.lane == "d2h")
    fetched = sum(o.nbytes for op in lane_ops if op.lane == "h2d" for o in (program.values[v] for v in op.outputs))
    assert run.h2d_bytes == sync.h2d_bytes == fetched > 0


def test_pooled_fetch_counts_only_the_blocks_it_moves(remote_steps):
    captured = remote_steps[4]
    plan = plan_without_offload(captured.program, order=overlap_lane_ops(captured.program))
    with AsyncExecutor(EmulatedLink(**SLOW)) as executor:
        state = _clones(captured)
        first = executor.step(plan, state)
        state = list(first.state)
        second = executor.step(plan, state)  # the same blocks again: all resident, only the own rows refreshed
    assert first.h2d_bytes > 0
    cfg = get_workload("tiny-deepseek").config
    row = cfg.kv_dim * 4
    assert second.h2d_bytes <= cfg.layers * BATCH * row < first.h2d_bytes


@pytest.mark.parametrize("pool_blocks", [None, 4])
def test_the_remote_cache_never_counts_as_device_bytes(remote_steps, pool_blocks):
    captured = remote_steps[pool_blocks]
    program = captured.program
    remote = _remote_bytes(program)
    weights = kind_bytes(program, [ValueKind.PARAMETER])
    assert remote > 0
    plan = plan_without_offload(program, order=overlap_lane_ops(program))
    budget = check_plan(plan).peak_bytes  # the plan's own accounting, which leaves remote storages out
    plan = dataclasses.replace(plan, budget_bytes=budget)
    device_inputs = sum(t.untyped_storage().nbytes() for v, t in zip(program.inputs, captured.inputs)
                        if not program.values[v].remote)
    with EmulatedLink(**SLOW) as link:
        runs = [run_plan(plan, _clones(captured)), run_async(plan, _clones(captured), link=link)]
    for run in runs:  # within the budget: counting the remote cache would raise BudgetExceeded
        assert run.peak_bytes <= budget
        assert run.peak_bytes < remote + weights
        assert min(run.live_bytes) >= device_inputs  # measured from the tensors: not undercounted either
    assert runs[0].peak_bytes == budget  # run inline, the measured bytes are the plan's accounting exactly


def _fetches_and_readers(plan) -> dict[str, tuple[int, int]]:
    """For each block fetch (an h2d lane op) of ``plan``, by its lane label: (its instruction, the instruction of
    the first compute op that needs it)."""
    program = plan.program
    deps = program.dependencies()
    found = {}
    for k, ins in enumerate(plan.instructions):
        op = program.ops[ins.target]
        if op.lane == "h2d":
            reader = next(r for r in range(k + 1, len(plan.instructions))
                          if op.id in deps[plan.instructions[r].target])
            found[f"{op.name} ({op.target})"] = (k, reader)
    return found


def test_the_fetch_overlaps_independent_compute(remote_steps):
    """Issued early (``overlap_lane_ops``), each layer's block fetch has compute between it and its first reader;
    on demand it has none. At run time the executor leaves the fetch in flight through all of that compute: each
    fetch is held on its lane until every instruction before its reader has finished, which would never happen
    if the executor waited for the fetch any earlier. Counted in instructions, not seconds."""
    import threading

    captured = remote_steps[None]
    program = captured.program
    plans = {name: plan_without_offload(program, order=order(program)) for name, order in ORDERS.items()}
    on_demand = _fetches_and_readers(plans["on-demand"])
    assert on_demand and all(reader == k + 1 for k, reader in on_demand.values())
    overlap = _fetches_and_readers(plans["overlap"])
    assert overlap.keys() == on_demand.keys()
    assert all(reader > k + 1 for k, reader in overlap.values())

    finished = threading.Condition()
    last = [-1]  # the last instruction the step has finished

    def after(i: int) -> None:
        with finished:
            last[0] = i
            finished.notify_all()

    held_fetches: list[str] = []

    def hold_until_before_reader(transfer) -> None:
        if transfer.label in overlap:
            held_fetches.append(transfer.label)
            with finished:
                assert finished.wait_for(lambda: last[0] >= overlap[transfer.label][1] - 1, timeout=20), \
                    f"the step waited for {transfer.label} before the compute ahead of its reader"

    with EmulatedLink(**SLOW, fault=hold_until_before_reader) as held:
        run = run_async(plans["overlap"], _clones(captured), link=held, on_instruction=after)
    assert sorted(held_fetches) == sorted(overlap)  # every fetch was held: the check above ran for each
    outputs, _ = _eager(captured)
    assert all(torch.equal(a, b) for a, b in zip(run.outputs, outputs, strict=True))


def test_a_failing_lane_op_raises_transfer_error_and_the_next_step_runs(remote_steps, monkeypatch):
    captured = remote_steps[None]
    program = captured.program
    plan = plan_without_offload(program, order=overlap_lane_ops(program))
    fetch = next(op for op in program.ops if op.lane == "h2d")
    node = next(n for n in program.graph.graph.nodes if n.name == fetch.name)
    kernel = node.target

    def broken(*args, **kwargs):
        raise OSError("remote memory unreachable")

    want_outputs, _ = _eager(captured)
    monkeypatch.setattr(node, "target", broken)
    with pytest.raises(TransferError, match=f"lane op {fetch.name} .* failed: remote memory unreachable"):
        run_plan(plan, _clones(captured))
    with EmulatedLink(**SLOW) as link:
        executor = AsyncExecutor(link)
        with pytest.raises(TransferError, match=f"h2d lane op {fetch.name} .*failed: remote memory unreachable") as raised:
            executor.run(plan, _clones(captured))
        if hasattr(raised.value, "__notes__"):
            assert "stopped at" in raised.value.__notes__[0]
        monkeypatch.setattr(node, "target", kernel)
        run = executor.run(plan, _clones(captured))
    _assert_identical(run.outputs, want_outputs)


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (which pytest would treat as the user stopping the run)."""


def test_a_step_interrupted_with_lane_ops_in_flight_stops_cleanly(remote_steps):
    captured = remote_steps[None]
    program = captured.program
    plan = plan_without_offload(program, order=overlap_lane_ops(program))
    stop_at = next(i for i, ins in enumerate(plan.instructions) if program.ops[ins.target].lane == "h2d")
    handles = []

    class Recording:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def lane_op(self, *args):
            handles.append(self.inner.lane_op(*args))
            return handles[-1]

    def interrupt(i):
        if i == stop_at:
            raise Interrupt

    want_outputs, want_inputs = _eager(captured)
    with EmulatedLink(**CRAWL) as link:
        executor = AsyncExecutor(Recording(link))
        with pytest.raises(Interrupt):
            executor.run(plan, _clones(captured), on_instruction=interrupt)
        assert handles and all(h.settled() for h in handles), "a lane op was still running after the step stopped"
        inputs = _clones(captured)
        run = executor.run(plan, inputs)
    _assert_identical(run.outputs, want_outputs)
    _assert_identical(inputs, want_inputs)


def test_planned_copies_share_the_lanes_with_lane_ops_within_the_budget(remote_steps):
    """A plan that also offloads and prefetches (the pool and block table a pooled fetch writes among them) runs
    its copies on the same lanes as the lane ops: an offload of a storage a lane op writes waits for it."""
    captured = remote_steps[4]
    program = captured.program
    calibration = CpuCalibration(key="test", matmul_flops={"float32": 50e9}, memory_bw=10e9, op_overhead_s=10e-6,
                                 memory_bytes=2**34)
    hardware = cpu_emulated(calibration, h2d_bw=SLOW["h2d_bw"], d2h_bw=SLOW["d2h_bw"], latency_s=SLOW["h2d_latency_s"])
    peak = check_plan(plan_without_offload(program)).peak_bytes
    plan = POLICIES["hyperoffload"](program, hardware, int(0.6 * peak))
    assert plan.budget_bytes is not None and any(ins.kind.value == "offload" for ins in plan.instructions)
    want_outputs, want_inputs = _eager(captured)
    with EmulatedLink(**SLOW) as link:
        inputs = _clones(captured)
        run = run_async(plan, inputs, link=link)
    _assert_identical(run.outputs, want_outputs)
    _assert_identical(inputs, want_inputs)
    assert run.peak_bytes <= plan.budget_bytes
    # From one arena too (a compute-only plan, whose arena fits any budget that fits the step).
    inputs = _clones(captured)
    arena_run = run_plan(plan_without_offload(program, order=overlap_lane_ops(program)), inputs, arena=True)
    _assert_identical(arena_run.outputs, want_outputs)
    _assert_identical(inputs, want_inputs)


def test_a_remote_cache_is_placed_in_remote_memory_beside_an_arena(remote_steps):
    """``AsyncExecutor.place(..., arena=True)`` of a step whose KV cache lives in remote memory for the whole step:
    the cache has no slot, so it goes to a remote buffer, the rest into the arena, and the step runs from that
    arena, bit-identical to the captured step."""
    captured = remote_steps[None]
    program = captured.program
    plan = plan_without_offload(program, order=overlap_lane_ops(program))
    want_outputs, want_inputs = _eager(captured)
    with AsyncExecutor(EmulatedLink(**SLOW)) as executor:
        state = executor.place(plan, captured.inputs, arena=True)
        (arena,) = executor._arena
        for vid, tensor in zip(program.inputs, state, strict=True):
            inside = arena.data_ptr() <= tensor.untyped_storage().data_ptr() < arena.data_ptr() + arena.nbytes()
            assert inside != program.values[vid].remote
        run = executor.step(plan, state, arena=True)
        executor.synchronize()
    assert run.arena_reused
    _assert_identical([*run.outputs, *run.state], [*want_outputs, *want_inputs])
