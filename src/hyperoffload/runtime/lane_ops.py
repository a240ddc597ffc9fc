"""Lane ops: ops that run on a copy lane (``Op.lane``) rather than on the caller's thread.

A lane op (an indexed fetch of KV blocks, a write of rows to a remote cache) is handed, with the input tensors
it reads, to the transfer backend's lane of its direction (``Transfers.lane_op``), as the simulator runs it:
after the lane ops it depends on (``Program.dependencies()``) have finished, in FIFO order with that lane's
copies. The interpreter goes on; the first instruction that depends on the lane op (reads its outputs, or
touches a storage it writes or writes one it reads), or an ``OFFLOAD`` of a storage it writes, waits for it
first (counted in ``copy_wait_s``), and every lane op has finished when the step returns. Its outputs join the
device tier once the step sees it finished; the device storages it reads stay counted until then, even if the
plan frees them meanwhile. A lane op that fails raises ``TransferError``. The remote values it reads and writes
(``Value.remote``) are in the step's environment but are never device bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from hyperoffload.block_ops import LANE_OP_RULES
from hyperoffload.plans import Kind
from hyperoffload.runtime.reference import run_op
from hyperoffload.runtime.transfers import TransferError, _InFlight, run_lane_inline


@dataclass(slots=True, eq=False)
class _LaneFlight:
    """A lane op handed to its lane that the step has not yet seen finish."""

    op: Any
    """The ``ir.Op``."""
    index: int
    """The instruction that issued it."""
    writes: frozenset[int]
    """Storage ids it writes (its ``mutates``)."""
    handle: Any = None
    produced: list[torch.Tensor] | None = None
    """Its output tensors, in ``op.outputs`` order, once its kernel has run (set on the lane's thread)."""
    moved: int = 0
    """Bytes it moved over the link (set on the lane's thread)."""
    holds: list[_InFlight] | None = None
    """The device storages it reads or writes, counted on its behalf until the step sees it finish."""




def _run_lane_kernel(program, op, node: torch.fx.Node, bound: dict) -> tuple[list[torch.Tensor], int]:
    """Run a lane op's kernel on the tensors in ``bound`` (fx node -> tensor); return its outputs and the bytes
    it moved between the tiers: those it really copied for the cache operators whose traffic follows from
    their arguments, else the op's stated ``transfer_bytes``."""
    args = torch.fx.node.map_arg(node.args, bound.__getitem__)
    rule = LANE_OP_RULES.get(op.target)  # how the operator's bytes are counted (``block_ops``)
    before = rule.before(args, node.kwargs) if rule is not None and rule.before is not None else None
    with torch.no_grad():  # grad mode is per thread, and this may run on a lane's thread
        outputs = run_op(program, op, node, bound.__getitem__)
    moved = rule.moved(args, outputs, before) if rule is not None and rule.moved is not None else None
    return outputs, op.transfer_bytes if moved is None else moved


class _LaneOps:
    """The interpreter step's handling of lane ops: issuing them to their lane, waiting for them, landing them.

    A mixin of ``interpreter._Step``, whose state it uses: ``lanes`` (op id -> ``_LaneFlight``), ``lane_op`` (the
    backend's, or None), ``deps``, ``nodes``, ``env``, ``storage_of``, ``remote``, ``remote_tier``, ``bytes``,
    ``holding``, ``started``, ``slots``, the byte and wait counters, ``lookup``, ``put``, ``_finished`` and
    ``_outputs_into_arena``.
    """

    __slots__ = ()

    def _issue_lane(self, i: int, op) -> None:
        """Hand lane op ``op`` (instruction ``i``) to its lane, after the pending lane ops it depends on."""
        node = self.nodes[op.name]
        after = []
        if self.lanes:
            reads = set(op.inputs)
            for d in self.deps[op.id]:
                flight = self.lanes.get(d)
                if flight is None:
                    continue
                if reads.intersection(flight.op.outputs):
                    self._await_lane(flight)  # its outputs must exist as tensors before this op can be given them
                else:
                    after.append(flight.handle)  # a storage hazard: the lanes order the two
        bound = {n: self.lookup(n) for n in node.all_input_nodes}
        for w in {self.storage_of[v] for v in op.mutates}:
            self.remote.pop(w, None)  # stale now, as after a compute op's write
        flight = _LaneFlight(op=op, index=i, writes=frozenset(self.storage_of[v] for v in op.mutates))
        program = self.program

        def work() -> int:
            flight.produced, flight.moved = _run_lane_kernel(program, op, node, bound)
            return flight.moved

        label = f"{op.name} ({op.target})"
        if self.lane_op is None:
            run_lane_inline(label, work)
        else:
            flight.handle = self.lane_op(label, op.lane, op.transfer_bytes, work, after)
        if flight.produced is not None and flight.handle is None:  # run inline: nothing is in flight
            self._land_lane(flight)
            return
        # The storages it reads or writes stay device bytes on its behalf until it has finished, even if the
        # plan frees or releases them meanwhile (and, in an arena, their bytes are not reused before then).
        flight.holds = []
        seen: set[int] = set()
        for v in op.inputs:
            sid = self.storage_of[v]
            if sid in self.remote_tier or sid in seen:
                continue
            seen.add(sid)
            hold = _InFlight(Kind.COMPUTE, sid, flight.handle, self.env[v].untyped_storage(), None)
            self.bytes.hold(hold.device)
            self.holding.append(hold)
            self.started.append(hold)
            flight.holds.append(hold)
        self.lanes[op.id] = flight

    def _await_lane(self, flight: _LaneFlight) -> None:
        """Wait for lane op ``flight`` (counted as copy wait) and bring its outputs into the device tier."""
        start = time.perf_counter()
        self.transfers.wait(flight.handle)
        self.copy_wait_s += time.perf_counter() - start
        self._land_lane(flight)

    def _await_lanes(self, ops: Sequence[int]) -> None:
        for d in ops:
            flight = self.lanes.get(d)
            if flight is not None:
                self._await_lane(flight)

    def _await_producer(self, s: int) -> None:
        """The plan frees ``s``: if a pending lane op produces it, let it land first so that it is dropped."""
        for flight in [f for f in self.lanes.values() if any(self.storage_of[o] == s for o in f.op.outputs)]:
            self._await_lane(flight)

    def _land_finished(self) -> None:
        """Bring in the outputs of the lane ops that have finished (their bytes count from then on)."""
        for flight in [f for f in self.lanes.values() if self.transfers.is_done(f.handle)]:
            self._await_lane(flight)  # returns at once, or raises if it failed

    def _land_lane(self, flight: _LaneFlight) -> None:
        op = flight.op
        self.lanes.pop(op.id, None)
        outputs = flight.produced
        if outputs is None:
            raise TransferError(f"lane op {op.name} ({op.target}) finished without producing its outputs")
        if self.slots is not None:
            outputs = list(outputs)
            self._outputs_into_arena(flight.index, op, outputs)
        for vid, tensor in zip(op.outputs, outputs):
            self.put(vid, tensor)
        flight.produced = None
        if op.lane == "h2d":
            self.h2d += flight.moved
        else:
            self.d2h += flight.moved
        if flight.holds:
            for hold in flight.holds:
                self._finished(hold)
            self.holding = [f for f in self.holding if f.held]
