"""The asynchronous runtime stays correct where a link is shared or a step is stopped at an awkward moment: two
executors on one emulated link never share a remote buffer, and a copy the link accepted is never left running
after the step that issued it has raised, even if the step stopped before it could record the copy's handle."""

from __future__ import annotations

import threading

import pytest
import torch
from runtime_checks import SLOW, Interrupt, assert_identical, planned  # noqa: F401 - planned is a fixture used here

from hyperoffload.ir import ValueKind
from hyperoffload.plans import Kind, plan_without_offload
from hyperoffload.runtime import AsyncExecutor, EmulatedLink, run_plan

pytestmark = pytest.mark.usefixtures("one_compute_thread")  # see tests/conftest.py

STEPS = 3


def _another_model(program, inputs):
    """The step's inputs with every parameter nudged: another copy of the model, same shapes (the optimizer's
    state is left as it is: nudged, a second moment could go negative)."""
    generator = torch.Generator().manual_seed(1)
    return [t + 1e-2 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
            if program.values[v].kind is ValueKind.PARAMETER else t.clone() for v, t in zip(program.inputs, inputs)]


def _unplanned_steps(program, inputs):
    """``STEPS`` unplanned steps on clones of ``inputs``: (each step's outputs, the state after the last)."""
    unplanned = plan_without_offload(program)
    state = [t.clone() for t in inputs]
    return [run_plan(unplanned, state).outputs for _ in range(STEPS)], state


# --- one link, two executors ----------------------------------------------------------------------


def test_two_executors_on_one_link_in_two_threads_each_get_their_own_steps(captured, planned):
    """Each executor runs donated planned steps of its own model copy, at the same time as the other on the same
    slow link (so both have copies in flight at once); each gets what its own unplanned steps give, bit for bit."""
    program = captured.program
    models = [list(captured.inputs), _another_model(program, captured.inputs)]
    expected = [_unplanned_steps(program, model) for model in models]
    assert not torch.equal(expected[0][0][0][0], expected[1][0][0][0]), "the two models should differ"

    got: list = [None, None]
    errors: list[BaseException] = []
    start = threading.Barrier(2)
    with EmulatedLink(**SLOW) as link:
        executors = [AsyncExecutor(link), AsyncExecutor(link)]

        def train(k: int) -> None:
            try:
                state = [t.clone() for t in models[k]]
                outputs = []
                start.wait(30)
                for _ in range(STEPS):
                    run = executors[k].step(planned, state)
                    outputs.append(tuple(t.clone() for t in run.outputs))
                    state = list(run.state)
                executors[k].synchronize()
                got[k] = outputs, state
            except BaseException as error:  # noqa: BLE001 - raised again on the test's thread
                errors.append(error)

        threads = [threading.Thread(target=train, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for executor in executors:
            executor.close()
    if errors:
        raise errors[0]
    for (outputs, state), (want_outputs, want_state) in zip(got, expected):
        for step in range(STEPS):
            assert_identical(outputs[step], want_outputs[step])
        assert_identical(state, want_state)


def test_each_executor_on_a_link_has_its_own_remote_buffers(captured):
    """An executor reuses its remote buffer from step to step; another executor on the same link gets a buffer of
    its own of the same size."""
    like = captured.inputs[0].untyped_storage()
    with EmulatedLink(**SLOW) as link, AsyncExecutor(link) as first, AsyncExecutor(link) as second:
        mine = first.transfers.remote_arena(like.nbytes(), like).data_ptr()
        assert first.transfers.remote_arena(like.nbytes(), like).data_ptr() == mine
        assert second.transfers.remote_arena(like.nbytes(), like).data_ptr() != mine


class Forwarding:
    """A transfer backend without clients (as ``CudaStreams`` is): every call goes to the link's own methods."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_backend_without_clients_serves_one_open_executor_at_a_time(captured, planned):  # noqa: F811
    """Its remote buffers are keyed by the plan's storages: a second open executor is refused, one made after the
    first is closed runs bit-identical."""
    with EmulatedLink(**SLOW) as link:
        shared = Forwarding(link)
        with AsyncExecutor(shared):
            with pytest.raises(ValueError, match="already serves an open AsyncExecutor"):
                AsyncExecutor(shared)
        with AsyncExecutor(shared) as executor:
            inputs = [t.clone() for t in captured.inputs]
            outputs = executor.step(planned, inputs).outputs
        reference = [t.clone() for t in captured.inputs]
        assert_identical(outputs, run_plan(plan_without_offload(captured.program), reference).outputs)


# --- a step stopped right after the link accepted a copy --------------------------------------------


DIRECTION = {"offload": "d2h", "prefetch": "h2d"}


class StopsAfterAccepting:
    """A backend wrapping another whose ``kind`` call (``"offload"`` or ``"prefetch"``) number ``at`` hands the copy
    to the inner backend, then raises before returning the handle: an interrupt that lands after the backend has
    accepted a copy and before the executor has kept its handle."""

    def __init__(self, inner, kind: str, at: int) -> None:
        self.inner, self.kind, self.at = inner, kind, at
        self.calls = 0
        self.stopping: str | None = None
        """The label of the copy being stopped after, while it is handed to the inner backend."""
        self.accepted = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def offload(self, label, src, dst):
        return self._issue("offload", label, src, dst)

    def prefetch(self, label, src, dst, after):
        return self._issue("prefetch", label, src, dst, after)

    def _issue(self, kind, label, *args):
        self.calls += kind == self.kind
        stop = kind == self.kind and self.calls == self.at
        if stop:
            self.stopping = label
        handle = getattr(self.inner, kind)(label, *args)
        if stop:
            self.accepted = handle
            raise Interrupt
        return handle


@pytest.mark.parametrize("kind", ["offload", "prefetch"])
@pytest.mark.parametrize("through", ["link", "client"])
def test_copy_accepted_just_before_the_step_stopped_is_not_left_running(captured, reference, planned, kind, through):
    """The copy the step never kept a handle of is held on its engine for up to a second (so that it is surely
    still running when the step stops): the step raises only once the engine is through with it, the link has
    nothing in flight, and the executor's next step is the unplanned step, bit for bit."""
    issued = [i for i, ins in enumerate(planned.instructions) if ins.kind.name.lower() == kind]
    assert len(issued) > 2
    wrapper: list[StopsAfterAccepting] = []
    release = threading.Event()

    def hold(transfer):
        if wrapper and transfer.label == wrapper[0].stopping and transfer.direction == DIRECTION[kind]:
            release.wait(1.0)

    with EmulatedLink(**SLOW, fault=hold) as link:
        wrapper.append(StopsAfterAccepting(link if through == "link" else link.client(), kind, len(issued) // 2))
        executor = AsyncExecutor(wrapper[0])
        with pytest.raises(Interrupt):
            executor.step(planned, [t.clone() for t in captured.inputs])
        stopped = wrapper[0].accepted
        assert stopped is not None
        running = not stopped.settled()
        release.set()
        assert not running, f"the {kind} of {wrapper[0].stopping} was still running after the step had raised"
        assert link.in_flight() == 0
        inputs = [t.clone() for t in captured.inputs]
        run = executor.run(planned, inputs)
        assert link.in_flight() == 0
    assert_identical(run.outputs, reference[0])
    assert_identical(inputs, reference[1])


class _StopsOnce:
    """Stands in for an engine's queue whose next ``put`` is stopped by an interrupt before it queues anything."""

    def __init__(self, queue) -> None:
        self.queue, self.stopped = queue, False

    def get(self):
        return self.queue.get()

    def put(self, job) -> None:
        if not self.stopped:
            self.stopped = True
            raise Interrupt
        self.queue.put(job)


def test_copy_stopped_between_being_recorded_and_queued_is_settled_by_abort():
    """A client records a copy before it queues it, so that no queued copy escapes its record; if the issuing
    thread is stopped in between, the copy never runs, and ``abort`` settles its record."""
    with EmulatedLink(h2d_bw=1e9, d2h_bw=1e9) as link:
        client = link.client()
        source = torch.randn(1024).untyped_storage()
        remote = client.remote_arena(source.nbytes(), source)
        queue, link.d2h._queue = link.d2h._queue, _StopsOnce(link.d2h._queue)
        try:
            with pytest.raises(Interrupt):
                client.offload("x", source, remote)
        finally:
            link.d2h._queue = queue
        assert client.in_flight() == 1
        client.abort([])
        assert client.in_flight() == link.in_flight() == 0
        client.offload("x", source, remote).wait()
        assert bytes(remote) == bytes(source)
