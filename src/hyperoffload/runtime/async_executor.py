"""Run plans with real asynchronous transfers: an emulated link on CPU, or CUDA side streams.

``run_async(plan, inputs, link=...)`` runs one step, in place, like ``run_plan`` but with the
copies overlapping compute. ``AsyncExecutor`` runs step after step on one link (its copy threads
or streams are made once) and can leave a step's last offloads in flight while the next step
starts, as a training loop would::

    from hyperoffload.runtime import AsyncExecutor, EmulatedLink

    with AsyncExecutor(EmulatedLink(h2d_bw=2e9, d2h_bw=2e9, h2d_latency_s=50e-6, d2h_latency_s=50e-6)) as ex:
        state = list(inputs)
        for _ in range(steps):
            run = ex.step(plan, state)       # donated: state moves to where the plan leaves it
            state = list(run.state)
        ex.synchronize()                     # before reading the state

The instruction handling is ``hyperoffload.runtime.interpreter.execute_plan``, shared with the
synchronous reference; only the transfer backend differs. The step's own lane ops (``Op.lane``: the block fetches and
row stores of a remote KV cache) run on the link's copy lanes too, overlapping compute as the simulator
models them; on CUDA they run inline on the compute stream (see ``cuda_streams``). Every step measures device-tier bytes
after every instruction and fails with ``BudgetExceeded`` if they pass the plan's budget; a copy
that fails, or a step stopped by an exception (``KeyboardInterrupt`` included), raises on the
caller's thread only after every copy of that step has stopped (on the emulated link and on CUDA streams,
also one the backend accepted just before the step was stopped, whose handle the step never kept), and the
executor can run the next step. Executors may share one emulated link, in several threads at once: each issues its copies
through a client of its own (``EmulatedLink.client``), with its own remote buffers. A ``CudaStreams`` has no
clients: it serves one open executor at a time (its pinned remote buffers are per storage id and size, so two
executors' steps on one would share them), and a second is refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, MutableSequence, Sequence
from typing import Any, Self

import torch

from hyperoffload.hardware import Hardware
from hyperoffload.layout import Layout
from hyperoffload.plans import Plan
from hyperoffload.runtime.arena import with_arena
from hyperoffload.runtime.emulated_link import EmulatedLink
from hyperoffload.runtime.interpreter import execute_plan
from hyperoffload.runtime.placement import place_state
from hyperoffload.runtime.prepared_plan import PreparedPlan, prepare_plan
from hyperoffload.runtime.step_results import PlanRun
from hyperoffload.runtime.transfers import Transfers

CUDA = "cuda"


def make_transfers(link: Transfers | Hardware | str) -> tuple[Transfers, bool]:
    """The transfer backend ``link`` names, and whether it was made here (so is ours to close).

    ``link`` is a backend (an ``EmulatedLink``, a ``CudaStreams``, or anything with the ``Transfers``
    methods), a ``Hardware`` profile (an emulated link with its bandwidths and latencies), or ``"cuda"``
    (CUDA side streams on the current device).
    """
    if isinstance(link, Hardware):
        return EmulatedLink.for_hardware(link), True
    if isinstance(link, str):
        if link != CUDA:
            raise ValueError(f"unknown link {link!r}: pass 'cuda', a Hardware profile, or an EmulatedLink")
        from hyperoffload.runtime.cuda_streams import CudaStreams

        return CudaStreams(), True
    missing = [m for m in ("offload", "prefetch", "wait", "synchronize", "abort") if not hasattr(link, m)]
    if missing:
        raise TypeError(f"{type(link).__name__} is not a transfer backend (no {', '.join(missing)}); pass an "
                        f"EmulatedLink, a CudaStreams, a Hardware profile or 'cuda'")
    return link, False


class AsyncExecutor:
    """Runs steps of plans over one transfer backend, carrying a step's last offloads into the next."""

    def __init__(self, link: Transfers | Hardware | str) -> None:
        """``link``: see ``make_transfers``. A backend with clients (``EmulatedLink.client``) gives this executor
        one of its own: executors sharing a link, even in several threads, then never share a remote buffer, and a
        failed step settles every copy this executor's client accepted."""
        self._backend, self._owned = make_transfers(link)
        # A method of the backend's class: a wrapper that forwards attributes to a link keeps getting the calls.
        has_clients = callable(getattr(type(self._backend), "client", None))
        self.transfers = self._backend.client() if has_clients else self._backend
        if not has_clients:
            _hold(self._backend, self)
        self._carried: dict[int, Any] = {}
        self._arena: list[torch.UntypedStorage] = []  # the last donated step's arena (at most one), for the next
        self._prepared: dict[int, PreparedPlan] = {}

    def prepare(self, plan: Plan, arena: bool | Layout = False) -> PreparedPlan:
        """``plan`` checked and analysed once (``PlanError`` if invalid); later steps of it reuse this. With
        ``arena``, its arena slots too (see ``execute_plan``)."""
        prepared = self._prepared.get(id(plan))
        if prepared is None or prepared.plan is not plan:
            prepared = self._prepared[id(plan)] = prepare_plan(plan)
        if arena is not False and arena is not None:
            prepared = self._prepared[id(plan)] = with_arena(prepared, arena)
        return prepared

    def place(self, plan: Plan, inputs: Sequence[torch.Tensor], *, arena: bool | Layout = False) -> list[torch.Tensor]:
        """Copies of ``inputs`` where ``plan`` starts them on this executor's backend, as the state to donate to
        ``step`` (``place_state``: remote inputs in its remote buffers, pinned on CUDA). With ``arena``, the
        device-resident ones in their start slots of a new arena, which the first ``step(plan, state,
        arena=...)`` then runs from: without this, that step copies the state into a new arena while the
        caller's copies are still alive, holding the state twice. Any arena kept from an earlier step is let
        go of first. The offloads carried over from the last step are completed first (``synchronize``): they
        may still be writing the remote state that ``inputs`` hold when those are the state it returned."""
        self.synchronize()
        if arena is not False and arena is not None:
            self._arena.clear()
        state, buffer = place_state(self.prepare(plan, arena), inputs, self.transfers, arena=arena)
        if buffer is not None:
            self._arena.append(buffer)
        return state

    def run(self, plan: Plan, inputs: Sequence[torch.Tensor], *,
            on_instruction: Callable[[int], None] | None = None, arena: bool | Layout = False) -> PlanRun:
        """One step in place, like ``run_plan``: inputs are updated in the caller's tensors, and every copy
        has finished when it returns. ``arena``: run from one arena, as ``run_plan``."""
        self.synchronize()
        return execute_plan(self.prepare(plan, arena), inputs, self.transfers, on_instruction=on_instruction,
                            arena=arena)

    def step(self, plan: Plan, state: MutableSequence[torch.Tensor], *, overlap: bool = True,
             on_instruction: Callable[[int], None] | None = None, arena: bool | Layout = False) -> PlanRun:
        """One step on donated ``state`` (a list, emptied): the result's ``state`` is the inputs after the
        step, where the plan left them, for the next step. If the step fails, the donated state is lost with it
        (restart from your own copy); the executor itself can run the next step. With ``overlap``, offloads that send state back
        to remote memory at the end may still be in flight when this returns; the next step orders its
        prefetches after them, and ``synchronize`` completes them. ``arena``: run from one arena, in which the
        returned state lives. The first such step allocates it and copies the state in; a later step of the same
        plan on the state it returned runs from the same arena, moving each state storage to its start slot, so
        a training loop holds one arena, not two while the state is copied. Donated tensors are overwritten by
        later steps: clone what you keep."""
        if not isinstance(state, list):
            raise TypeError("step() takes the state as a list, which it empties (the executor holds the tensors "
                            "from then on); pass list(tensors)")
        try:
            return execute_plan(self.prepare(plan, arena), state, self.transfers, donate=True, carry=overlap,
                                carried=self._carried, on_instruction=on_instruction, arena=arena,
                                kept_arena=self._arena if arena is not False and arena is not None else None)
        except BaseException:
            self._arena.clear()  # it held only the state the failed step lost
            self._finish_carried()
            raise

    def release_arena(self) -> None:
        """Let go of the arena kept for the next donated step (``step(..., arena=True)``): once the caller drops
        the state that lives in it, its memory is free. The next such step allocates a new one."""
        self._arena.clear()

    def synchronize(self) -> None:
        """Wait for the offloads carried over from the last step; raise ``TransferError`` if one failed."""
        carried, self._carried = self._carried, {}
        try:
            for handle in carried.values():
                self.transfers.synchronize(handle)
        except BaseException:
            self.transfers.abort(list(carried.values()))
            raise

    def _finish_carried(self) -> None:
        """After a failed step: let the previous step's last offloads land (they hold finished state); their
        own errors, if any, are secondary to the one being raised."""
        carried, self._carried = self._carried, {}
        for handle in carried.values():
            try:
                self.transfers.synchronize(handle)
            except Exception:  # noqa: BLE001, S110 - secondary to the error being raised
                pass

    def close(self) -> None:
        """Complete carried copies, let go of this executor's client of the backend, and stop a backend this
        executor made."""
        self._arena.clear()
        try:
            self.synchronize()
        finally:
            if self.transfers is not self._backend:
                self.transfers.close()
            elif _holder(self._backend) is self:
                self._backend._hyperoffload_executor = None
            if self._owned and hasattr(self._backend, "close"):
                self._backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _holder(backend: Any) -> AsyncExecutor | None:
    """The open executor using ``backend``, a backend without clients, if any."""
    held = getattr(backend, "_hyperoffload_executor", None)
    return held() if held is not None else None


def _hold(backend: Any, executor: AsyncExecutor) -> None:
    """Mark ``backend`` (one without clients) as used by ``executor``, refusing a second open executor: the
    backend keys remote buffers by the plan's storages, so two executors' steps would write each other's."""
    if _holder(backend) is not None:
        raise ValueError(f"this {type(backend).__name__} already serves an open AsyncExecutor, and it keeps one set of "
                         f"remote buffers: two executors' steps would overwrite each other's. Close the first "
                         f"executor (or use it as a context manager), or give each executor its own backend")
    backend._hyperoffload_executor = weakref.ref(executor)


def run_async(plan: Plan, inputs: Sequence[torch.Tensor], *, link: Transfers | Hardware | str,
              on_instruction: Callable[[int], None] | None = None, arena: bool | Layout = False) -> PlanRun:
    """Run one step of ``plan`` on ``inputs`` (updated in place) with copies on ``link``; see ``make_transfers``.

    A lowered plan is run through its ``Plan``: ``lower_plan(plan)`` and this function execute the same
    instructions. Raises ``PlanError`` before anything runs if the plan is invalid, ``TransferError`` if a
    copy fails, ``BudgetExceeded`` if the measured device bytes pass the budget. ``arena``: run from one
    arena (``True``: ``plan.layout`` or ``assign_offsets(plan)``; or a ``Layout``), as ``run_plan``, on the
    link's device: CPU for an emulated link, the GPU for ``"cuda"`` (run on an H200: docs/results.md).
    """
    with AsyncExecutor(link) as executor:
        return executor.run(plan, inputs, on_instruction=on_instruction, arena=arena)


__all__ = ["CUDA", "AsyncExecutor", "make_transfers", "run_async"]
