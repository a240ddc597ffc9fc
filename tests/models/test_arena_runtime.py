"""Running a plan from one static arena: every device tensor a view into one buffer of the layout's size,
results bit-identical to the unplanned step, live storages never sharing a byte (checked by the executor at
every allocation), and a slot reused only once the offload reading its previous occupant has finished."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_checks import assert_identical

from hyperoffload.budgets import parse_budget
from hyperoffload.hardware import get_hardware
from hyperoffload.hardware.cpu import CpuCalibration, cpu_emulated
from hyperoffload.layout import LayoutError, assign_offsets, check_layout
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import PlannerConfig, plan_hyperoffload
from hyperoffload.runtime import ArenaOverlap, AsyncExecutor, BudgetExceeded, EmulatedLink, run_async, run_plan
from hyperoffload.runtime import arena as arena_module
from hyperoffload.runtime import out_variants
from hyperoffload.runtime.out_variants import out_variant
from hyperoffload.runtime.placement import move_order
from hyperoffload.runtime.transfers import SyncTransfers
from hyperoffload.runtime.views import _ViewMeta
from hyperoffload.workloads import capture_workload, get_workload

pytestmark = pytest.mark.usefixtures("one_compute_thread")  # see tests/conftest.py

SLOW = {"h2d_bw": 200e6, "d2h_bw": 200e6, "h2d_latency_s": 20e-6, "d2h_latency_s": 20e-6}
"""A link slow enough that offloads of tiny-llama's tensors are still in flight when their slots come up again."""


@pytest.fixture(scope="module")
def planned(captured):
    """The planner's plan with a static layout at half the peak, on a profile with the SLOW link."""
    calibration = CpuCalibration(key="test", matmul_flops={"float32": 50e9}, memory_bw=10e9, op_overhead_s=10e-6,
                                 memory_bytes=2**34)
    hardware = cpu_emulated(calibration, h2d_bw=SLOW["h2d_bw"], d2h_bw=SLOW["d2h_bw"], latency_s=SLOW["h2d_latency_s"])
    budget = parse_budget("50%", captured.program, hardware)
    plan = plan_hyperoffload(captured.program, hardware, budget, config=PlannerConfig(static_layout=True))
    assert plan.layout is not None and plan.layout.arena_bytes <= budget
    assert any(i.kind.name == "PREFETCH" for i in plan.instructions)
    return plan


class DeferredOffloads:
    """Synchronous copies, except that an offload copies its bytes only when the executor waits for it: any
    slot overwritten before its occupant's offload was waited for would send wrong bytes to remote memory."""

    class Handle:
        def __init__(self, src, dst) -> None:
            self.src, self.dst, self.done = src, dst, False

        def complete(self) -> None:
            if not self.done:
                self.dst.copy_(self.src)
                self.done = True

    def __init__(self) -> None:
        self.inner = SyncTransfers()
        self.offloads = 0

    def device_storage(self, nbytes, like):
        return self.inner.device_storage(nbytes, like)

    def remote_arena(self, nbytes, like):
        return self.inner.remote_arena(nbytes, like)

    def offload(self, label, src, dst):
        self.offloads += 1
        return self.Handle(src, dst)

    def prefetch(self, label, src, dst, after):
        if after is not None:
            after.complete()
        dst.copy_(src)

    def wait(self, handle) -> None:
        if handle is not None:
            handle.complete()

    def is_done(self, handle) -> bool:
        return handle is None or handle.done

    synchronize = wait

    def abort(self, handles) -> None:
        pass


class StreamOrdered(DeferredOffloads):
    """Copies ordered as a GPU stream backend orders them, with what the host has seen kept apart: ``wait`` (later
    compute waits for the copy, an event wait of the compute stream on CUDA) and ``synchronize`` (the host blocks)
    are told apart, and a copy counts as done (``is_done``) only once the host has synchronized with it, as on a
    GPU that lags the host. Compute is the caller's thread here, so ``wait`` moves an offload's bytes at once; a
    prefetch moves its bytes at once, after the offload it depends on. The test sets ``step_over`` when the last
    instruction has run."""

    def __init__(self) -> None:
        super().__init__()
        self.offloaded: list[DeferredOffloads.Handle] = []
        self.stream_waited: set[int] = set()  # ids of the handles later compute waited for
        self.host_seen: set[int] = set()  # ids of the handles the host synchronized with
        self.host_blocks_mid_step = 0
        self.step_over = False

    def offload(self, label, src, dst):
        handle = super().offload(label, src, dst)
        self.offloaded.append(handle)
        return handle

    def prefetch(self, label, src, dst, after):
        if after is not None:
            after.complete()
        handle = self.Handle(src, dst)
        handle.complete()
        return handle

    def wait(self, handle) -> None:
        self.stream_waited.add(id(handle))
        handle.complete()

    def synchronize(self, handle) -> None:
        self.host_blocks_mid_step += not self.step_over
        handle.complete()
        self.host_seen.add(id(handle))

    def is_done(self, handle) -> bool:
        return id(handle) in self.host_seen


def _run_stream_ordered(captured, plan, *, arena):
    transfers = StreamOrdered()
    last = len(plan.instructions) - 1

    def note(i: int) -> None:
        transfers.step_over = i == last

    inputs = [t.clone() for t in captured.inputs]
    with AsyncExecutor(transfers) as executor:
        run = executor.run(plan, inputs, arena=arena, on_instruction=note)
    return transfers, run, inputs


def test_a_reused_slot_waits_on_the_compute_stream_not_on_the_host(captured, reference, planned):
    """Reusing a slot still read by an offload makes later compute wait for it (``Transfers.wait``: an event wait
    on CUDA), never blocks the host mid-step, and gives the same bytes. Without a budget, so that no allocation
    waits for memory on the host (``_make_room``, a separate rule)."""
    unbounded = dataclasses.replace(planned, budget_bytes=None)
    transfers, run, inputs = _run_stream_ordered(captured, unbounded, arena=True)
    assert run.slot_waits > 0
    assert transfers.host_blocks_mid_step == 0
    assert_identical([*run.outputs, *inputs], [*reference[0], *reference[1]])


def test_every_offload_has_finished_on_the_host_when_the_step_returns(captured, reference, planned):
    """Offloads that later compute only waited for on its stream (here: their slots reused) are still completed on
    the host before the step returns: their remote buffers are host memory that results may be read from."""
    unbounded = dataclasses.replace(planned, budget_bytes=None)
    transfers, run, inputs = _run_stream_ordered(captured, unbounded, arena=True)
    assert any(id(h) in transfers.stream_waited for h in transfers.offloaded)  # the case arises in this plan
    assert all(id(h) in transfers.host_seen for h in transfers.offloaded)
    assert_identical([*run.outputs, *inputs], [*reference[0], *reference[1]])


class ArenaFrom(SyncTransfers):
    """Synchronous copies, with the arena allocated by the backend (``arena_storage``) on ``device``."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.arenas: list[int] = []

    def arena_storage(self, nbytes, like):
        self.arenas.append(nbytes)
        return torch.UntypedStorage(nbytes, device=self.device)


def test_the_arena_is_allocated_by_the_backend_on_the_inputs_device(captured, reference, planned):
    transfers = ArenaFrom("cpu")
    inputs = [t.clone() for t in captured.inputs]
    run = AsyncExecutor(transfers).run(planned, inputs, arena=True)
    assert transfers.arenas == [planned.layout.arena_bytes] == [run.arena_bytes]
    assert_identical([*run.outputs, *inputs], [*reference[0], *reference[1]])

    elsewhere = ArenaFrom("meta")
    originals = [t.clone() for t in inputs]
    with pytest.raises(ValueError, match="meta.*inputs are on cpu"):
        AsyncExecutor(elsewhere).run(planned, inputs, arena=True)
    assert_identical(inputs, originals)  # refused before anything ran


def test_slots_are_views_of_the_arena_bytes_with_each_tensors_own_layout():
    """What the executor builds a slot and a value in it from, on the arena's device: a byte range of the arena as
    a storage of its own, and a view with the value's dtype, size, stride and offset, writing the arena's bytes."""
    arena = torch.UntypedStorage(1024)
    arena_bytes = torch.empty(0, dtype=torch.uint8).set_(arena)
    arena_bytes.zero_()
    slot = arena[256:256 + 96]
    assert (slot.device, slot.nbytes(), slot.data_ptr()) == (arena.device, 96, arena.data_ptr() + 256)
    value = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, 1:5].t()  # a strided view with an offset
    meta = _ViewMeta.of(value)
    slot.copy_(value.untyped_storage())
    view = meta.view_into(slot)
    assert (view.dtype, view.shape, view.stride(), view.storage_offset(), view.device) == (
        value.dtype, value.shape, value.stride(), value.storage_offset(), arena.device)
    assert torch.equal(view, value)
    view.mul_(2)  # in place, into the arena: only the viewed elements change
    expected = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    expected[:, 1:5] *= 2
    assert torch.equal(arena_bytes[256:352].view(torch.float32), expected.flatten())
    assert not arena_bytes[:256].any() and not arena_bytes[352:].any()


def test_synchronous_arena_run_is_bit_identical_and_sized_by_the_layout(captured, reference, planned):
    inputs = [t.clone() for t in captured.inputs]
    run = run_plan(planned, inputs, arena=True)
    assert_identical([*run.outputs, *inputs], [*reference[0], *reference[1]])
    assert run.arena_bytes == planned.layout.arena_bytes <= planned.budget_bytes
    assert 0 < run.peak_bytes <= run.arena_bytes
    assert run.h2d_bytes > 0 and run.d2h_bytes > 0
    assert run_plan(planned, [t.clone() for t in captured.inputs]).arena_bytes == 0  # the default is unchanged


def test_arena_run_on_a_slow_emulated_link_is_bit_identical(captured, reference, planned):
    inputs = [t.clone() for t in captured.inputs]
    with EmulatedLink(**SLOW) as link:
        run = run_async(planned, inputs, link=link, arena=True)
    assert_identical([*run.outputs, *inputs], [*reference[0], *reference[1]])
    assert run.arena_bytes == planned.layout.arena_bytes


def test_a_slot_is_reused_only_after_the_offload_reading_it_finished(captured, reference, planned):
    """Offloads that finish only when waited for: every reuse of a released storage's slot must wait, and the
    bytes that reach remote memory (and come back by prefetch) are still the released storage's."""
    transfers = DeferredOffloads()
    inputs = [t.clone() for t in captured.inputs]
    with AsyncExecutor(transfers) as executor:
        run = executor.run(planned, inputs, arena=True)
    assert transfers.offloads > 0
    assert run.slot_waits > 0
    assert_identical([*run.outputs, *inputs], [*reference[0], *reference[1]])


def _disjoint_ranges(tensors) -> list[tuple[int, int]]:
    ranges = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                     for t in tensors if t.untyped_storage().nbytes()})
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end <= start, "two live storages share bytes of the arena"
    return ranges


def test_donated_steps_live_in_their_arena_and_repeat_bit_identically(captured, planned):
    """Step after step on donated state: the state the plan leaves on the device is views into one arena
    (storages pairwise disjoint, all within arena_bytes), the steps after the first run from that same arena
    (each state storage moved to its start slot in place, not copied into a second arena), and three steps
    match three unplanned steps."""
    assert _state_moves(planned) > 0, "every state storage ends where it starts: the moves go unexercised"
    want = [t.clone() for t in captured.inputs]
    unplanned = plan_without_offload(captured.program)
    for _ in range(3):
        want_out = run_plan(unplanned, want).outputs
    device_inputs = [k for k, v in enumerate(captured.program.inputs)
                     if captured.program.values[v].storage not in planned.initial_remote]
    with EmulatedLink(**SLOW) as link, AsyncExecutor(link) as executor:
        state = [t.clone() for t in captured.inputs]
        for k in range(3):
            run = executor.step(planned, state, arena=True)
            assert run.arena_reused == (k > 0)
            state = list(run.state)
            ranges = _disjoint_ranges(state[k] for k in device_inputs)
            assert ranges[-1][1] - ranges[0][0] <= run.arena_bytes == planned.layout.arena_bytes
        executor.synchronize()
    assert_identical([*run.outputs, *state], [*want_out, *want])


class CountingArenas(EmulatedLink):
    """The emulated link, counting the arenas it allocates."""

    arenas = 0

    def arena_storage(self, nbytes, like):
        self.arenas += 1
        return self.device_storage(nbytes, like)


def test_state_placed_in_an_arena_is_run_from_it_without_a_second_arena(captured, planned):
    """``AsyncExecutor.place(..., arena=True)`` puts the device-resident state in its start slots of one arena,
    so the first donated step runs from that arena (nothing moved, no second arena while the state is copied);
    three steps match three unplanned steps, and the caller's tensors are left as they were."""
    program = captured.program
    before = [t.clone() for t in captured.inputs]
    want = [t.clone() for t in captured.inputs]
    unplanned = plan_without_offload(program)
    for _ in range(3):
        want_out = run_plan(unplanned, want).outputs
    slots = arena_module.arena_slots(planned, planned.layout).slots
    with CountingArenas(**SLOW) as link, AsyncExecutor(link) as executor:
        state = executor.place(planned, captured.inputs, arena=True)
        (arena,) = executor._arena
        assert link.arenas == 1 and arena.nbytes() == planned.layout.arena_bytes
        for vid, tensor in zip(program.inputs, state, strict=True):
            s = program.values[vid].storage
            if s in planned.initial_remote:
                assert not arena.data_ptr() <= tensor.data_ptr() < arena.data_ptr() + arena.nbytes()
            else:
                assert tensor.untyped_storage().data_ptr() - arena.data_ptr() == slots[(s, -1)][0]
        for _ in range(3):
            run = executor.step(planned, state, arena=True)
            assert run.arena_reused
            state = list(run.state)
        executor.synchronize()
        assert link.arenas == 1
    assert_identical([*run.outputs, *state], [*want_out, *want])
    assert_identical(captured.inputs, before)


def test_placed_state_without_an_arena_is_a_copy_the_steps_run_on(captured, planned):
    """Without an arena, ``place`` copies every input (same values and strides, new storages) and the plan's
    step on the copies matches the unplanned one."""
    program = captured.program
    with EmulatedLink(**SLOW) as link, AsyncExecutor(link) as executor:
        state = executor.place(planned, captured.inputs)
        assert executor._arena == []
        for given, placed in zip(captured.inputs, state, strict=True):
            assert placed.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()
            assert torch.equal(placed, given) and placed.stride() == given.stride()
        run = executor.step(planned, state)
        executor.synchronize()
    want = [t.clone() for t in captured.inputs]
    want_out = run_plan(plan_without_offload(program), want).outputs
    assert_identical([*run.outputs, *run.state], [*want_out, *want])


def test_placing_the_state_an_overlapped_step_returned_waits_for_its_offloads(captured, planned):
    """The state a step returns with ``overlap`` may still be written by that step's last offloads (its remote
    inputs): ``place`` copies it only once they have landed."""
    assert planned.initial_remote
    want = [t.clone() for t in captured.inputs]
    unplanned = plan_without_offload(captured.program)
    for _ in range(2):
        want_out = run_plan(unplanned, want).outputs
    with AsyncExecutor(DeferredOffloads()) as executor:
        run = executor.step(planned, executor.place(planned, captured.inputs), overlap=True)
        state = executor.place(planned, list(run.state), arena=True)
        run = executor.step(planned, state, arena=True)
        executor.synchronize()
    assert_identical([*run.outputs, *run.state], [*want_out, *want])


def test_placing_an_arena_over_the_budget_is_refused(captured, planned):
    tight = dataclasses.replace(planned, budget_bytes=planned.layout.arena_bytes - 1)
    with AsyncExecutor(EmulatedLink(**SLOW)) as executor, pytest.raises(BudgetExceeded, match="over its budget"):
        executor.place(tight, captured.inputs, arena=True)
    assert executor._arena == []


def test_release_arena_frees_the_arena_once_the_state_is_dropped(captured, planned):
    from torch.multiprocessing.reductions import StorageWeakRef

    with EmulatedLink(h2d_bw=1e12, d2h_bw=1e12) as link, AsyncExecutor(link) as executor:
        run = executor.step(planned, [t.clone() for t in captured.inputs], arena=True)
        executor.synchronize()
        (kept,) = executor._arena  # the executor's own reference, for this test to follow
        arena = StorageWeakRef(kept)
        del run, kept
        assert not arena.expired(), "kept for the next step"
        executor.release_arena()
        assert arena.expired()
        run = executor.step(planned, [t.clone() for t in captured.inputs], arena=True)
        assert not run.arena_reused


def _state_moves(plan) -> int:
    """How many device-resident state storages the layout leaves somewhere other than their start slot."""
    program, layout = plan.program, plan.layout
    state = {program.values[v].storage for v in program.inputs} - set(plan.initial_remote)
    first: dict[int, int] = {}
    last: dict[int, tuple[int, int]] = {}
    for r, offset in zip(layout.residencies, layout.offsets, strict=True):
        if r.storage in state:
            if r.start < 0:
                first[r.storage] = offset
            if r.storage not in last or r.start > last[r.storage][0]:
                last[r.storage] = (r.start, offset)
    return sum(last[s][1] != first[s] for s in first if s in last)


def _corrupted(layout):
    """``layout`` with one residency moved onto the bytes of another that is live at the same time."""
    found = layout.residencies
    for a, b in itertools.combinations(range(len(found)), 2):
        ra, rb = found[a], found[b]
        if ra.storage != rb.storage and min(ra.start, rb.start) >= 0 and ra.start < rb.end and rb.start < ra.end:
            small, big = (a, b) if ra.nbytes <= rb.nbytes else (b, a)
            offsets = list(layout.offsets)
            offsets[small] = offsets[big]
            return dataclasses.replace(layout, offsets=tuple(offsets)), found[small], found[big]
    raise AssertionError("no two residencies overlap in time")


def test_a_layout_putting_two_live_storages_on_the_same_bytes_is_caught(captured, planned):
    layout, moved, onto = _corrupted(planned.layout)
    with pytest.raises(LayoutError):
        check_layout(layout)
    names = [captured.program.values[r.storage].name for r in (moved, onto)]
    with pytest.raises(ArenaOverlap) as caught:
        run_plan(planned, [t.clone() for t in captured.inputs], arena=layout)
    message = str(caught.value)
    assert f"instruction #{max(moved.start, onto.start)} " in message
    assert all(name in message for name in names), message
    assert "still live" in message


def test_an_arena_over_the_budget_or_of_another_plan_is_refused(captured, planned):
    tight = dataclasses.replace(planned, budget_bytes=planned.layout.arena_bytes - 1)
    inputs = [t.clone() for t in captured.inputs]
    originals = [t.clone() for t in inputs]
    with pytest.raises(BudgetExceeded, match="static_layout"):
        run_plan(tight, inputs, arena=True)
    assert_identical(inputs, originals)  # refused before anything ran
    other = assign_offsets(plan_without_offload(captured.program))
    with pytest.raises(ValueError, match="assign_offsets"):
        run_plan(planned, inputs, arena=other)


def test_a_plan_without_a_layout_runs_from_the_one_computed_for_it(captured, reference):
    plan = plan_without_offload(captured.program)
    inputs = [t.clone() for t in captured.inputs]
    run = run_plan(plan, inputs, arena=True)
    assert_identical([*run.outputs, *inputs], [*reference[0], *reference[1]])
    assert run.arena_bytes == assign_offsets(plan).arena_bytes


def test_out_overloads_match_the_captured_ops_arguments():
    aten = torch.ops.aten
    assert out_variant(aten.mm.default) == (aten.mm.out, "out")
    assert out_variant(aten.mul.Tensor) == (aten.mul.out, "out")
    # mul.Scalar_out has only a composite kernel (it allocates and copies): mul.Scalar writes through mul.out, with
    # the scalar wrapped as mul.Scalar wraps it; _to_copy and clone (clone.out: composite too) through copy_.
    assert out_variant(aten.mul.Scalar) == (aten.mul.out, "out")
    assert out_variant(aten.div.Scalar) == (aten.div.out, "out")
    assert out_variant(aten.clone.default) == (out_variants._copy_into, "out")
    assert out_variant(aten._to_copy.default) == (out_variants._copy_into, "out")
    assert out_variant(aten.add.Scalar) is None
    assert out_variant(aten.silu_backward.default) == (aten.silu_backward.grad_input, "grad_input")
    assert out_variant(aten.sum.dim_IntList) == (aten.sum.IntList_out, "out")
    assert out_variant(aten.view.default) is None  # a view: no out= form
    assert out_variant(aten._scaled_dot_product_flash_attention_for_cpu.default) is None  # two outputs
    assert out_variant(torch.add) is None  # not an overload


def test_copies_write_into_their_slot_only_as_strided_copies_on_the_same_device():
    x = torch.arange(6.0).reshape(2, 3).t()
    out = torch.empty(3, 2, dtype=torch.bfloat16)
    assert out_variants._copy_into(x, out=out, dtype=torch.bfloat16) is out
    assert torch.equal(out, torch.ops.aten._to_copy.default(x, dtype=torch.bfloat16))
    for refused in ({"device": "meta"}, {"layout": torch.sparse_coo}, {"pin_memory": True}):
        with pytest.raises(RuntimeError, match="strided copy"):
            out_variants._copy_into(x, out=out, **refused)


def test_dtype_casts_and_scalar_ops_write_into_their_slots_bit_identically():
    """A bf16 step (casts to float32 around the norms and the loss, scalar multiplies and divides) from its
    arena: the casts, clones and scalar ops write into their slots instead of being allocated outside the
    arena and copied in, and the step is bit-identical to the unplanned one."""
    workload = dataclasses.replace(get_workload("tiny-llama"), dtype=torch.bfloat16)
    captured = capture_workload(workload, "train", fake=False)
    program = captured.program
    written = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default, torch.ops.aten.mul.Scalar,
               torch.ops.aten.div.Scalar}
    nodes = {n.name: n for n in program.graph.graph.nodes}
    cast_bytes = sum(program.values[o].alloc_bytes for op in program.ops if nodes[op.name].target in written
                     for o in op.outputs if program.values[o].owns_storage)
    assert cast_bytes > 0
    plan = plan_hyperoffload(program, get_hardware("h200"), parse_budget("60%", program, get_hardware("h200")),
                             config=PlannerConfig(static_layout=True))
    want = [t.clone() for t in captured.inputs]
    want_out = run_plan(plan_without_offload(program), want).outputs
    inputs = [t.clone() for t in captured.inputs]
    run = run_plan(plan, inputs, arena=True)
    assert_identical([*run.outputs, *inputs], [*want_out, *want])
    original = dict(out_variants._WRITTEN_INTO_OUT)
    try:
        out_variants._WRITTEN_INTO_OUT.clear()
        out_variants.out_variant.cache_clear()
        copied_before = run_plan(plan, [t.clone() for t in captured.inputs], arena=True).arena_copied_bytes
    finally:
        out_variants._WRITTEN_INTO_OUT.update(original)
        out_variants.out_variant.cache_clear()
    assert copied_before - run.arena_copied_bytes == cast_bytes


def test_op_results_are_written_into_their_slots_not_copied_there(captured, reference, planned):
    """From the arena, ops with an ``out=`` overload write straight into their slots; only the rest (attention's
    several outputs, a few backward kernels) are allocated outside the arena and copied in. Results are
    bit-identical either way, also when every ``out=`` call is refused and the executor falls back to copying."""
    program = captured.program
    made = sum(program.values[o].alloc_bytes for op in program.ops for o in op.outputs
               if program.values[o].owns_storage)
    inputs = [t.clone() for t in captured.inputs]
    run = run_plan(planned, inputs, arena=True)
    assert_identical([*run.outputs, *inputs], [*reference[0], *reference[1]])
    assert 0 < run.arena_copied_bytes < 0.15 * made  # attention's outputs and ops with composite out= kernels

    def refusing(*args, **kwargs):
        raise RuntimeError("out= refused")

    original = arena_module.out_variant  # where the arena looks up the out= overloads
    try:
        arena_module.out_variant = lambda target, device_type: (
            (refusing, "out") if original(target, device_type) else None)
        inputs = [t.clone() for t in captured.inputs]
        fallback = run_plan(planned, inputs, arena=True)
    finally:
        arena_module.out_variant = original
    assert_identical([*fallback.outputs, *inputs], [*reference[0], *reference[1]])
    assert fallback.arena_copied_bytes == made  # every op result copied in, the step's inputs not counted
    assert run_plan(planned, [t.clone() for t in captured.inputs]).arena_copied_bytes == 0  # no arena


@st.composite
def _moves(draw):
    """Up to five moves within a 64-byte buffer: sources pairwise disjoint, destinations pairwise disjoint."""
    k = draw(st.integers(1, 5))

    def disjoint() -> list[tuple[int, int]]:
        cuts = sorted(draw(st.lists(st.integers(0, 64), min_size=2 * k, max_size=2 * k, unique=True)))
        return [(cuts[2 * i], cuts[2 * i + 1] - cuts[2 * i]) for i in range(k)]

    sources, destinations = disjoint(), disjoint()
    return {i: (sources[i][0], destinations[i][0], min(sources[i][1], destinations[i][1])) for i in range(k)}


@pytest.mark.parametrize(("moves", "spills"), [
    ({"a": (0, 10, 2), "b": (10, 20, 4), "c": (20, 12, 4)}, 1),  # a waits on the cycle b <-> c: spill b or c
    ({"a": (0, 2, 4)}, 1),  # shifted onto itself
    ({"a": (0, 4, 4), "b": (4, 0, 4)}, 1),  # a swap
    ({"a": (0, 4, 4), "b": (4, 8, 4), "c": (8, 0, 4), "d": (12, 16, 4)}, 1),  # a three-cycle and a free move
    ({"a": (0, 8, 4), "b": (8, 0, 4), "c": (16, 24, 4), "d": (24, 16, 4)}, 2),  # two swaps
])
def test_move_order_of_known_overlaps(moves, spills):
    """Each cycle of moves costs one spill (a copy outside the arena), and a move only waiting on a cycle none."""
    steps = move_order(moves)
    assert [kind for kind, _ in steps].count("spill") == spills
    assert sum(kind == "copy" for kind, _ in steps) == len(moves)
    _check_moves(moves, steps, seed=0)


@settings(max_examples=300, deadline=None)
@given(moves=_moves(), seed=st.integers(0, 2**16))
def test_move_order_never_overwrites_a_range_before_it_is_read(moves, seed):
    """Replayed on a buffer of random bytes, the steps of ``move_order`` land every move's original bytes at its
    destination, whatever the overlaps (cycles of moves, a range shifted onto itself)."""
    _check_moves(moves, move_order(moves), seed)


def _check_moves(moves, steps, seed: int) -> None:
    buffer = bytearray(torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(seed)).tolist())
    want = {key: bytes(buffer[src:src + n]) for key, (src, _, n) in moves.items()}
    spilled: dict[int, bytes] = {}
    for kind, key in steps:
        src, dst, n = moves[key]
        if kind == "spill":
            spilled[key] = bytes(buffer[src:src + n])
        else:
            buffer[dst:dst + n] = spilled.get(key, bytes(buffer[src:src + n]))
    for key, (_, dst, n) in moves.items():
        assert bytes(buffer[dst:dst + n]) == want[key]
