"""What one step of a plan returns (``PlanRun``), and how the step completes its transfers and builds it.

At the end of a step every lane op and transfer has finished, except offloads of donated state that the step
carries into the next (``carry=True``). In place (``donate=False``) the caller's storages the plan released get
their final bytes back; with ``donate=True`` the state is returned where the plan left it, for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperoffload.instructions import COPIES_OUT
from hyperoffload.runtime.views import _ViewMeta


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRun:
    """Result of running one step of a plan."""

    outputs: tuple[torch.Tensor, ...]
    """The step's outputs, in ``program.outputs`` order."""
    live_bytes: tuple[int, ...]
    """Device-tier bytes measured after each instruction (before its automatic frees)."""
    peak_bytes: int
    """Largest entry of ``live_bytes`` (the inputs' device bytes for a plan with no instructions)."""
    h2d_bytes: int
    """Bytes copied remote -> device by PREFETCH instructions and by h2d lane ops (the bytes each moved)."""
    d2h_bytes: int
    """Bytes copied device -> remote by OFFLOAD instructions and by d2h lane ops."""
    state: tuple[torch.Tensor, ...] = ()
    """With ``donate=True``: the step's inputs after the step, where the plan left them (pass them to the
    next step). Empty otherwise."""
    wall_s: float = 0.0
    """Seconds from the first instruction to the step's return."""
    copy_wait_s: float = 0.0
    """Seconds the caller's thread spent waiting for copies and lane ops (WAIT instructions, instructions that
    depend on a lane op, and the end of the step)."""
    memory_wait_s: float = 0.0
    """Seconds the caller's thread waited for a released storage's offload to finish so an allocation fits."""
    carried: int = 0
    """Offloads still in flight when the step returned (``carry=True``): the next step or the backend's
    ``synchronize`` completes them."""
    arena_bytes: int = 0
    """Bytes of the arena the step ran from (the buffer it allocated); 0 when not run from an arena."""
    slot_waits: int = 0
    """Allocations into the arena that first waited for the offload still reading their slot's previous
    occupant (on CUDA the compute stream waited, not the host)."""
    arena_reused: bool = False
    """Whether the step ran from the previous donated step's arena (``execute_plan``'s ``kept_arena``), moving the
    state into its start slots there rather than copying it into a new arena."""
    arena_copied_bytes: int = 0
    """Bytes of op results allocated outside the arena and copied into their slots (ops without a usable
    ``out=`` overload); 0 when not run from an arena."""


class _StepResults:
    """The end of the interpreter step: completing (or carrying) its transfers, then its outputs and state.

    A mixin of ``interpreter._Step``, whose state it uses: ``program``, ``transfers``, ``lanes``, ``in_flight``,
    ``started``, ``carry``, ``carried``, ``remote``, ``remote_home``, ``remembered``, ``replaced``, ``caller``,
    ``caller_meta``, ``caller_storages``, ``state_storages``, ``env``, ``aliases``, ``slots``, ``donate``,
    ``storage_of``, and the methods ``_await_lane``, ``_block``, ``_landed``, ``_finished`` and ``device_storage``.
    """

    __slots__ = ()

    def _finish(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Complete the step's transfers (or carry the last offloads of donated state), then build results."""
        program = self.program
        for lane in list(self.lanes.values()):  # every lane op has finished when the step returns
            self._await_lane(lane)
        self._await_collectives(list(self.collectives))  # and every collective
        returned = {self.storage_of[v] for v in program.outputs}
        for s, flight in sorted(self.in_flight.items()):
            if (self.carry and flight.kind in COPIES_OUT and flight.remote is self.remote_home.get(s)
                    and s not in returned):
                self.carried[flight.remote.data_ptr()] = flight.handle
                continue
            self._block(flight.handle)
            self._landed(flight)
        carried = {id(h) for h in self.carried.values()}
        for flight in self.started:  # superseded transfers too (an offload whose prefetch was waited)
            if id(flight.handle) in carried:
                continue
            if flight.held:
                self._block(flight.handle)
                self._finished(flight)
            elif flight.kind in COPIES_OUT and not self.transfers.is_done(flight.handle):
                # Waited for only by later compute (a WAIT, or its slot reused; on CUDA an event wait of the
                # compute stream): its remote buffer is host memory, which the results below and the caller may
                # read on the host. A prefetch needs no such wait: only compute reads what it wrote.
                self._block(flight.handle)
        self.in_flight.clear()
        self.started = []  # the step is over: what is carried belongs to the next step

        if self.donate:
            if self.slots is not None:
                self._constants_back()
            state = tuple(self._result(vid, in_place=False) for vid in program.inputs)
            outputs = tuple(self._result(vid, in_place=False) for vid in program.outputs)
            return outputs, state
        for s in self.replaced:
            final = self.device_storage(s, -1) if self.aliases.get(s) else self.remote[s]
            if final.data_ptr() != self.caller_storages[s].data_ptr():
                self.caller_storages[s].copy_(final)
        return tuple(self._result(vid, in_place=True) for vid in program.outputs), ()

    def _constants_back(self) -> None:
        """Running from an arena on donated state: graph constants the step mutated get their final bytes back
        (they are not part of the state handed to the next step, which reads them from the graph again)."""
        program = self.program
        mutated = {self.storage_of[v] for op in program.ops for v in op.mutates}
        for s in {self.storage_of[v] for v in program.constants} & mutated:
            home = self.caller_storages.get(s)
            if home is None:  # also a step input: handed on in the state
                continue
            final = self.device_storage(s, -1) if self.aliases.get(s) else self.remote[s]
            if final.data_ptr() != home.data_ptr():
                home.copy_(final)

    def _result(self, vid: int, *, in_place: bool) -> torch.Tensor:
        """The tensor of ``vid`` after the step: on the device, in remote memory, or (in place) in the caller's.

        A value left in a remote buffer of the backend's (not a caller's tensor) is returned as a copy: backends
        may reuse their buffers in the next step."""
        s = self.storage_of[vid]
        if in_place and s in self.replaced:
            meta = _ViewMeta.of(self.env[vid]) if vid in self.env else self.remembered[s][vid]
            return meta.view_into(self.caller_storages[s])
        if vid in self.env:
            if self.slots is not None and s not in self.state_storages:
                return self.env[vid].clone()  # out of the arena, which is freed when the step's state lets go
            return self.env[vid]
        meta = self.remembered[s].get(vid)
        if meta is None:  # an alias that was not read again: rebuild it from the caller's tensor's layout
            meta = self.caller_meta[vid] if vid in self.caller_meta else _ViewMeta.of(self.caller[vid])
        view = meta.view_into(self.remote[s])
        return view if self.remote[s] is self.remote_home.get(s) else view.clone()
