"""The asynchronous runtime on the emulated link: copies overlap compute on copy threads, results stay
bit-identical to the unplanned step, measured device bytes stay under the budget, and faults surface on
the caller's thread with the executor able to run the next step. No test asserts on wall-clock time: link
timing is checked on the engines' ideal clock, which is computed, not measured. The run command:
tests/cli/test_async_runtime_cli.py."""

from __future__ import annotations

import threading

import pytest
import torch
from runtime_checks import (END, SLOW, Interrupt, assert_identical, compute_uses, idle_ops, longest_idle_gap,
                            offload_trips, round_trip_plan, storage_named)
from runtime_checks import planned  # noqa: F401 - a fixture used here
from runtime_checks import slow_hardware

from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan, PlanError, check_plan, plan_without_offload
from hyperoffload.runtime import (AsyncExecutor, BudgetExceeded, EmulatedLink, NativeLink, TransferError, run_async,
                                  run_plan)

pytestmark = pytest.mark.usefixtures("one_compute_thread")  # see tests/conftest.py


@pytest.fixture(scope="module", params=[EmulatedLink, NativeLink], ids=["python-engines", "native-thread"])
def link(request):
    with request.param(**SLOW) as link:
        yield link


class Recording:
    """A transfer backend wrapping another and keeping every handle it returned."""

    def __init__(self, inner) -> None:
        self.inner, self.handles = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def offload(self, *args):
        self.handles.append(self.inner.offload(*args))
        return self.handles[-1]

    def prefetch(self, *args):
        self.handles.append(self.inner.prefetch(*args))
        return self.handles[-1]


# --- the link ---------------------------------------------------------------------------------------


def test_copy_engines_copy_the_bytes_in_order_and_never_faster_than_latency_plus_bytes_over_bandwidth():
    # A copy takes the link's time, or the memory system's if this (shared) machine is slower than the
    # link: the ideal is a lower bound, not a promise about wall time.
    with EmulatedLink(h2d_bw=1e9, d2h_bw=5e8, h2d_latency_s=1e-4, d2h_latency_s=2e-4) as link:
        sources = [torch.randn(4096 * (k + 1)).untyped_storage() for k in range(3)]
        remotes = [torch.UntypedStorage(s.nbytes()) for s in sources]
        offloads = [link.offload(f"x{k}", s, r) for k, (s, r) in enumerate(zip(sources, remotes))]
        device = torch.UntypedStorage(sources[2].nbytes())
        back = link.prefetch("x2", remotes[2], device, offloads[2])
        back.wait()
        for t in offloads:
            assert t.done() and t.error is None
            assert t.end_s - t.start_s >= 2e-4 + t.nbytes / 5e8 - 1e-9  # less float rounding of clock readings
        assert back.end_s - back.start_s >= 1e-4 + back.nbytes / 1e9 - 1e-9
        # One engine per direction: its copies never overlap; the prefetch starts after the offload it reads.
        for first, second in zip(offloads, offloads[1:]):
            assert second.start_s >= first.end_s
        assert back.start_s >= offloads[2].end_s
        assert all(bytes(r) == bytes(s) for r, s in zip(remotes, sources))
        assert bytes(device) == bytes(sources[2])


def test_link_rejects_bad_parameters_and_mismatched_buffers():
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        EmulatedLink(h2d_bw=0, d2h_bw=1e9)
    with EmulatedLink(h2d_bw=1e9, d2h_bw=1e9) as link:
        with pytest.raises(ValueError, match="source has 8 bytes, destination 4"):
            link.offload("x", torch.UntypedStorage(8), torch.UntypedStorage(4))


# --- steps ------------------------------------------------------------------------------------------


def test_round_trips_on_a_slow_link_give_the_unplanned_step_and_the_plans_accounting(captured, reference, link):
    program = captured.program
    plan = round_trip_plan(program, offload_trips(program))
    inputs = [t.clone() for t in captured.inputs]
    run = AsyncExecutor(link).run(plan, inputs)
    assert_identical(run.outputs, reference[0])
    assert_identical(inputs, reference[1])
    # Every transfer is waited for before its storage is released or read, so nothing is pinned by a copy and
    # the measured bytes are the plan's own accounting, instruction by instruction.
    assert run.live_bytes == check_plan(plan).live_bytes
    assert run.h2d_bytes > 0 and run.d2h_bytes > 0


def test_planned_step_stays_under_its_budget_at_every_instruction(captured, reference, link, planned):
    inputs = [t.clone() for t in captured.inputs]
    run = run_async(planned, inputs, link=link)
    assert_identical(run.outputs, reference[0])
    assert_identical(inputs, reference[1])
    assert max(run.live_bytes) == run.peak_bytes <= planned.budget_bytes
    assert run.h2d_bytes > 0 and run.d2h_bytes > 0


def test_consecutive_steps_on_donated_state_with_overlapping_offloads_match_the_unplanned_steps(
        captured, link, planned):
    assert planned.initial_remote, "the plan should keep some state in remote memory between steps"
    unplanned = plan_without_offload(captured.program)
    ref_state = [t.clone() for t in captured.inputs]
    ref_losses = [run_plan(unplanned, ref_state).outputs for _ in range(3)]

    state = [t.clone() for t in captured.inputs]
    given = state
    with AsyncExecutor(link) as executor:
        for step in range(3):
            run = executor.step(planned, state)
            assert given == [], "the executor takes the donated tensors"
            assert run.peak_bytes <= planned.budget_bytes
            assert_identical(run.outputs, ref_losses[step])
            state = given = list(run.state)
        executor.synchronize()
    assert_identical(state, ref_state)


def test_steps_keep_their_remote_copies_in_the_buffer_the_plan_lays_out(captured):
    """A step's remote copies live in one host buffer, those never live at once on the same bytes, step after step:
    the host memory the steps keep is what the plan says it keeps (``remote_layout``), less than its copies
    together."""
    import hyperoffload
    from hyperoffload.remote_layout import remote_layout

    # A budget whose copies share bytes: which ones do depends on the planner's choices, so the first of a few.
    for budget in ("5%", "10%", "15%", "20%"):
        planned = hyperoffload.plan(captured.program, slow_hardware(), budget)
        layout = remote_layout(planned)
        if layout.arena_bytes < sum(c.nbytes for c in layout.copies):
            break
    else:
        pytest.fail("no plan of these budgets has copies that share bytes")
    unplanned = plan_without_offload(captured.program)
    ref_state = [t.clone() for t in captured.inputs]
    ref_losses = [run_plan(unplanned, ref_state).outputs for _ in range(2)]
    state = [t.clone() for t in captured.inputs]
    with NativeLink(**SLOW) as link, AsyncExecutor(link) as executor:
        for step in range(2):
            run = executor.step(planned, state)
            assert_identical(run.outputs, ref_losses[step])
            state = list(run.state)
            assert executor.transfers.remote_nbytes == layout.arena_bytes
        executor.synchronize()
    assert_identical(state, ref_state)


def test_prefetch_left_unwaited_at_the_end_is_completed_before_the_step_returns(captured, reference):
    program = captured.program
    param = storage_named(program, "output.weight")
    last = compute_uses(program, param)[-1]
    # Offloaded after its last use, then brought back at the very end with no wait: the step must still hand
    # back the landed bytes, however slow the link.
    instrs = list(round_trip_plan(program, [(param, last, END)]).instructions) + [Instr(Kind.PREFETCH, param)]
    plan = Plan(program=program, instructions=tuple(instrs))
    inputs = [t.clone() for t in captured.inputs]
    with EmulatedLink(h2d_bw=20e6, d2h_bw=1e12, h2d_latency_s=0.02) as slow:
        recording = Recording(slow)
        run = run_async(plan, inputs, link=recording)
    assert all(h.done() for h in recording.handles)
    assert_identical(run.outputs, reference[0])
    assert_identical(inputs, reference[1])


def test_offload_released_before_it_lands_holds_its_bytes_until_it_has(captured, reference):
    program = captured.program
    param = storage_named(program, "embed.weight")
    a, b = longest_idle_gap(program, param)
    # Release right after the offload is issued; wait for the offload only after the next op.
    instrs = list(round_trip_plan(program, [(param, a, b)]).instructions)
    offload = instrs.index(Instr(Kind.OFFLOAD, param))
    wait = instrs.index(Instr(Kind.WAIT, param), offload)
    instrs.insert(wait + 2, instrs.pop(wait))
    plan = Plan(program=program, instructions=tuple(instrs))
    check = check_plan(plan)
    release = instrs.index(Instr(Kind.RELEASE, param))
    assert release < instrs.index(Instr(Kind.WAIT, param), offload)
    # The offload cannot land before the step has passed the release: the engine holds it until then.
    gate = threading.Event()

    def hold_offload(transfer):
        if transfer.direction == "d2h":
            assert gate.wait(10), "the step never reached the release"

    def after(i):
        if i == release:
            gate.set()

    nbytes = program.values[param].alloc_bytes
    inputs = [t.clone() for t in captured.inputs]
    with EmulatedLink(h2d_bw=1e12, d2h_bw=1e12, fault=hold_offload) as gated:
        run = run_async(plan, inputs, link=gated, on_instruction=after)
    assert check.live_bytes[release] == check.live_bytes[release - 1] - nbytes
    assert run.live_bytes[release] == check.live_bytes[release] + nbytes  # still held by the copy
    assert run.live_bytes[:release] == check.live_bytes[:release]
    assert_identical(run.outputs, reference[0])
    assert_identical(inputs, reference[1])


class Oversized:
    """A backend that allocates more device memory per prefetch than the plan accounts for."""

    def __init__(self, inner, extra: int) -> None:
        self.inner, self.extra = inner, extra

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def device_storage(self, nbytes, like):
        return torch.UntypedStorage(nbytes + self.extra)

    def prefetch(self, label, src, dst, after):
        return self.inner.prefetch(label, src, torch.UntypedStorage(src.nbytes()), after)


def test_measured_bytes_over_the_budget_fail_loudly(captured, link, planned):
    with pytest.raises(BudgetExceeded, match="over the budget"):
        run_async(planned, [t.clone() for t in captured.inputs], link=Oversized(link, 2**20))


# --- faults -----------------------------------------------------------------------------------------


def test_failed_copy_raises_on_the_callers_thread_and_the_next_step_runs(captured, reference, planned):
    failures = []

    def fault(transfer):
        if transfer.direction == "h2d" and not failures:
            failures.append(transfer.label)
            raise OSError("link reset")

    with EmulatedLink(**SLOW, fault=fault) as faulty:
        recording = Recording(faulty)
        executor = AsyncExecutor(recording)
        with pytest.raises(TransferError, match="h2d copy of .* failed: link reset") as raised:
            executor.run(planned, [t.clone() for t in captured.inputs])
        assert failures[0] in str(raised.value)
        if hasattr(raised.value, "__notes__"):
            assert "stopped at instruction #" in raised.value.__notes__[0]
        assert all(h.settled() for h in recording.handles), "a copy was still running after the step failed"
        inputs = [t.clone() for t in captured.inputs]
        run = executor.run(planned, inputs)
    assert_identical(run.outputs, reference[0])
    assert_identical(inputs, reference[1])


@pytest.mark.parametrize("donate", [False, True])
def test_interrupted_step_stops_its_copies_and_the_next_step_runs(captured, reference, planned, donate):
    prefetches = [i for i, ins in enumerate(planned.instructions) if ins.kind is Kind.PREFETCH]
    stop_at = prefetches[len(prefetches) // 2]  # with copies in flight on the slow link

    def interrupt(i):
        if i == stop_at:
            raise Interrupt

    with EmulatedLink(**SLOW) as slow:
        recording = Recording(slow)
        executor = AsyncExecutor(recording)
        with pytest.raises(Interrupt):
            if donate:
                executor.step(planned, [t.clone() for t in captured.inputs], on_instruction=interrupt)
            else:
                executor.run(planned, [t.clone() for t in captured.inputs], on_instruction=interrupt)
        assert recording.handles and all(h.settled() for h in recording.handles)
        inputs = [t.clone() for t in captured.inputs]
        run = executor.run(planned, inputs)
    assert_identical(run.outputs, reference[0])
    assert_identical(inputs, reference[1])


def test_invalid_plans_and_inputs_fail_before_anything_runs(captured, link):
    program = captured.program
    param = storage_named(program, "embed.weight")
    a, b = longest_idle_gap(program, param)
    instrs = tuple(i for i in round_trip_plan(program, [(param, a, b)]).instructions
                   if not (i.kind is Kind.WAIT and i.target == param))
    inputs = [t.clone() for t in captured.inputs]
    with pytest.raises(PlanError):
        run_async(Plan(program=program, instructions=instrs), inputs, link=link)
    assert_identical(inputs, captured.inputs)
    with pytest.raises(ValueError, match="takes .* inputs"):
        run_async(plan_without_offload(program), inputs[:-1], link=link)
    with pytest.raises(ValueError, match="unknown link"):
        run_async(plan_without_offload(program), inputs, link="infiniband")
    # A plan that leaves a parameter in remote memory cannot run step after step on its own state.
    leaves = round_trip_plan(program, [(param, compute_uses(program, param)[-1], END)])
    with pytest.raises(ValueError, match="different tier"):
        AsyncExecutor(link).step(leaves, [t.clone() for t in captured.inputs])


# --- the memory really held -----------------------------------------------------------------------


def test_a_released_storage_is_freed_once_its_offload_has_landed(captured):
    """The executor's count and the memory really held agree: once an offloaded activation is released and its
    copy has landed, nothing of the step still references its device storage (the transfer's record of it
    included), so the allocator can reuse its bytes before the step ends. Seen on a GPU, where a step's
    ``torch.cuda.max_memory_allocated`` was twice its budget while the executor counted the budget."""
    from torch.multiprocessing.reductions import StorageWeakRef

    program = captured.program
    activations = [v.id for v in program.values
                   if v.kind is ValueKind.ACTIVATION and v.owns_storage and v.id not in program.inputs]
    storage = max(activations, key=lambda s: idle_ops(program, s))
    plan = round_trip_plan(program, [(storage, *longest_idle_gap(program, storage))])
    instrs = plan.instructions
    release = instrs.index(Instr(Kind.RELEASE, storage))
    prefetch = instrs.index(Instr(Kind.PREFETCH, storage))
    assert prefetch - release > 2

    class Watching(Recording):
        def offload(self, label, src, dst):
            self.source = StorageWeakRef(src)
            return super().offload(label, src, dst)

    expired: dict[int, bool] = {}
    with EmulatedLink(h2d_bw=1e12, d2h_bw=1e12) as fast:
        watching = Watching(fast)
        run = run_async(plan, [t.clone() for t in captured.inputs], link=watching,
                        on_instruction=lambda i: expired.setdefault(i, watching.source.expired())
                        if release <= i < prefetch else None)
    assert run.h2d_bytes > 0 and run.d2h_bytes > 0
    assert expired[prefetch - 1], "the released storage was still referenced just before its prefetch"


def test_donated_state_sent_out_mid_step_is_freed_before_it_comes_back(captured):
    """On donated state the executor holds the only references: a parameter the plan sends out between its
    forward and backward uses is freed once its copy has landed and the step has released it, not kept alive by
    the step's record of its inputs until the step ends (which kept a GPU's allocated memory above the budget)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    program = captured.program
    param = storage_named(program, "layers.0.attn.wq.weight")
    plan = round_trip_plan(program, [(param, *longest_idle_gap(program, param))])
    release = plan.instructions.index(Instr(Kind.RELEASE, param))
    prefetch = plan.instructions.index(Instr(Kind.PREFETCH, param))
    state = [t.clone() for t in captured.inputs]
    weight = StorageWeakRef(state[program.inputs.index(param)].untyped_storage())
    expired: dict[int, bool] = {}
    with EmulatedLink(h2d_bw=1e12, d2h_bw=1e12) as fast, AsyncExecutor(fast) as executor:
        run = executor.step(plan, state, on_instruction=lambda i: expired.setdefault(i, weight.expired())
                            if release <= i < prefetch else None)
        executor.synchronize()
        unplanned = executor.run(plan_without_offload(program), inputs := [t.clone() for t in captured.inputs])
    assert state == [], "the donated list is emptied"
    assert expired[prefetch - 1], "the parameter's device storage was still alive just before its prefetch"
    assert_identical(run.outputs, unplanned.outputs)
    assert_identical(run.state, inputs)


def test_device_memory_really_held_never_exceeds_the_executors_count(captured, planned):
    """At every instruction of a donated planned step on the slow link, the device-tier storages still alive
    (donated inputs, every op's outputs, every prefetch's destination: followed by weak references, so the
    check holds none) add up to no more than the executor's count, which the budget bounds. The count is read
    before the instruction's frees, the storages after them."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    followed: dict[int, tuple[StorageWeakRef, int]] = {}  # data_ptr -> (weak reference, bytes)
    remote: set[int] = set()

    def follow(storage: torch.UntypedStorage) -> None:
        if storage.data_ptr() not in remote and storage.nbytes():
            followed[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    follow(t.untyped_storage())
            return out

    class Following(Recording):
        def offload(self, label, src, dst):
            remote.add(dst.data_ptr())
            return super().offload(label, src, dst)

        def prefetch(self, label, src, dst, after):
            remote.add(src.data_ptr())
            follow(dst)
            return super().prefetch(label, src, dst, after)

    held: list[int] = []

    def sample(i: int) -> None:
        for ptr in [p for p, (ref, _) in followed.items() if ref.expired() or p in remote]:
            del followed[ptr]
        held.append(sum(n for _, n in followed.values()))

    program = planned.program
    state = [t.clone() for t in captured.inputs]
    for vid, tensor in zip(program.inputs, state):
        if program.values[vid].storage in planned.initial_remote:
            remote.add(tensor.untyped_storage().data_ptr())
        else:
            follow(tensor.untyped_storage())
    del tensor
    with EmulatedLink(**SLOW) as slow, AsyncExecutor(Following(slow)) as executor:
        with Outputs():
            run = executor.step(planned, state, on_instruction=sample)
        executor.synchronize()
    assert len(held) == len(run.live_bytes) == len(planned.instructions)
    over = [(i, h - n) for i, (h, n) in enumerate(zip(held, run.live_bytes)) if h > n]
    assert not over, f"storages alive beyond the count at {len(over)} instructions, first {over[0]}"
    assert max(held) > 0.5 * planned.budget_bytes  # the check followed the step's real storages
