"""How a step runs from its arena: opening or reusing it, and putting each storage into its slot.

Run from one arena (``execute_plan(..., arena=True)``, ``run_plan(plan, inputs, arena=True)``), every device
storage lives in its slot ``[offset, offset + nbytes)`` of one byte buffer of ``layout.arena_bytes``, allocated once
at the start of the step on the device tier, where ``layout`` is ``plan.layout`` (from
``PlannerConfig(static_layout=True)``), a ``Layout`` passed in, or ``assign_offsets(plan)``.

* Step inputs on the device are copied into their slots first (in place, the caller's tensors still get the final
  state back); a prefetch copies from remote memory straight into its slot.
* An op that makes one new storage and has an ``out=`` overload with the same arguments (``out_variants``: ``mm.out``
  for ``mm``, ``mul.out`` for ``mul.Tensor``) writes straight into its slot, as a view with the size and strides the
  capture recorded. Other ops allocate through PyTorch, and each output that owns a storage is copied into its slot
  right after the op, every value aliasing it rebound as a view of the slot with its own size, stride and offset,
  so in-place ops write into the arena. That costs such an output one copy and a transient allocation outside the
  arena (``PlanRun.arena_copied_bytes`` counts them); routing every allocation into the arena would take a pluggable
  allocator (``MemPool``).
* A slot is reused only once the offload reading its previous occupant has finished: before the slot is written
  again, later compute is made to wait for that offload (``Transfers.wait``), and a prefetch into the slot starts
  only after the compute issued before it (the backend's ``prefetch`` contract), so the ops reading the previous
  occupant have finished too.
* At every allocation the step checks, from the slot tensors' addresses, that the live storages' byte ranges are
  inside the arena and pairwise disjoint, and raises ``ArenaOverlap`` naming both storages and the instruction
  otherwise.
* Outputs that do not alias an input are returned as copies, so the arena is freed when the step returns. With
  ``donate=True`` the state lives in the arena; given ``kept_arena`` (as ``AsyncExecutor.step`` does), the next
  donated step of the plan runs from that same arena, moving each state storage from where the step left it to its
  start slot (``placement.move_order``), so a training loop holds one arena rather than two while the state is
  copied from one into the next.

The arena is the same code on every device: the buffer is allocated where the backend puts device storages
(``Transfers.arena_storage``, else ``Transfers.device_storage``) and must be on the device of the step's device-tier
inputs; slots are byte ranges of it (``UntypedStorage`` slices, which share its memory) and values are views of them
with their own dtype, size, stride and offset (``views``). On CPU the waits above block the caller's thread (ops run
on it). On CUDA (``cuda_streams.CudaStreams``) every copy into a slot (``_fill``) runs on the compute stream after the
op that produced it; a reused slot's wait is an event wait of the compute stream, so the host does not block; a
prefetch's side stream waits for the compute stream first; and the arena is marked as used by both side streams, so
a copy of a slot still queued when the arena is freed (a carried offload) keeps its block from being reused
(``tests/gpu/test_cuda_runtime.py`` and ``make gpu-check`` run this where there is a GPU).
"""

from __future__ import annotations

import time

import torch
import torch.fx

from hyperoffload.layout import Layout
from hyperoffload.runtime.arena import ArenaOverlap, ArenaSlots, _ArenaRanges, _check_arena_budget
from hyperoffload.runtime.placement import _starts_on_device, move_order
from hyperoffload.runtime.reference import op_arguments, run_op
from hyperoffload.runtime.views import _ViewMeta


class _ArenaStep:
    """The interpreter step's arena: its buffer, the live byte ranges in it, and the copies into its slots.

    A mixin of ``interpreter._Step``, whose state it uses: ``slots``, ``writes_into_slot``, ``plan``, ``program``,
    ``transfers``, ``caller``, ``carried``, ``storage_of``, ``env``, ``aliases``, ``holding``, ``replaced``, the
    counters (``slot_waits``, ``memory_wait_s``, ``arena_copied``), ``lookup``, ``_where`` and ``_finished``. It
    sets ``arena``, ``arena_base`` (the address of its first byte), ``ranges`` and ``arena_reused``.
    """

    __slots__ = ()

    def _take_arena(self, arena: ArenaSlots, kept_arena: list[torch.UntypedStorage] | None) -> None:
        """Run from the arena in ``kept_arena`` (a donated step's, given for donated steps only) if the state lives
        in it, else from a new one; keep the one the state will live in there for the next donated step.

        Before taking donated inputs: a refusal loses nothing. The kept arena is let go of first, so that it is not
        held while a new one is allocated if it cannot be reused."""
        previous = kept_arena.pop() if kept_arena else None
        if previous is None or not self._reuse_arena(arena.layout, previous):
            del previous
            self._open_arena(arena.layout)
        if kept_arena is not None:
            kept_arena.append(self.arena)  # one arena at a time: the one the state will live in
        self.writes_into_slot = arena.writes_into_slot.get(self.arena.device.type, {})

    def _reuse_arena(self, layout: Layout, arena: torch.UntypedStorage) -> bool:
        """Run from ``arena``, the previous donated step's, if the donated state lives in it: move each state
        storage from where that step left it to its slot at this step's start (``move_order``; a storage in a
        cycle of moves goes through a temporary copy outside the arena). Whether it did; if not, nothing moved.

        Reusing keeps one arena per training loop: a new one per step would hold two while the state is copied
        from the old into the new."""
        _check_arena_budget(self.plan, layout)
        base, end = arena.data_ptr(), arena.data_ptr() + arena.nbytes()
        resident = {self.storage_of[v]: t.untyped_storage() for v, t in self.caller.items()
                    if _starts_on_device(self.plan, self.storage_of[v])}
        if arena.nbytes() != layout.arena_bytes or not resident or any(
                not base <= st.data_ptr() < end or (s, -1) not in self.slots
                or st.nbytes() != self.slots[(s, -1)][1] for s, st in resident.items()):
            return False
        # The previous step's last offloads may still read slots that the moves and this step write.
        for handle in self.carried.values():
            self.transfers.wait(handle)
        moves = {s: (st.data_ptr() - base, self.slots[(s, -1)][0], st.nbytes()) for s, st in resident.items()}
        spilled: dict[int, torch.UntypedStorage] = {}
        for kind, s in move_order(moves):
            src, dst, nbytes = moves[s]
            if kind == "spill":
                spilled[s] = arena[src:src + nbytes].clone()
            else:
                source = spilled.pop(s) if s in spilled else arena[src:src + nbytes]
                arena[dst:dst + nbytes].copy_(source)
        self.arena, self.arena_base, self.ranges = arena, base, _ArenaRanges()
        for v, tensor in self.caller.items():
            s = self.storage_of[v]
            if s in moves:
                offset, nbytes = self.slots[(s, -1)]
                self.caller[v] = _ViewMeta.of(tensor).view_into(arena[offset:offset + nbytes])
        self.arena_reused = True
        return True

    def _open_arena(self, layout: Layout) -> None:
        """Allocate the step's arena on the device tier, after checking it fits the plan's budget."""
        _check_arena_budget(self.plan, layout)
        resident = [t for v, t in self.caller.items() if _starts_on_device(self.plan, self.storage_of[v])]
        # The backend decides where device storages live (as for a prefetch without an arena); ``like`` tells
        # backends that follow their inputs (``SyncTransfers``) which device that is.
        like = (resident or list(self.caller.values()) or [torch.empty(0)])[0].untyped_storage()
        allocate = getattr(self.transfers, "arena_storage", None) or self.transfers.device_storage
        self.arena = allocate(layout.arena_bytes, like)
        if resident and self.arena.device != resident[0].device:
            raise ValueError(f"the arena of plan {self.program.name} was allocated on {self.arena.device} by "
                             f"{type(self.transfers).__name__}, but the step's device-tier inputs are on "
                             f"{resident[0].device}; place the inputs on the backend's device")
        self.arena_base = self.arena.data_ptr()
        self.ranges = _ArenaRanges()

    def _slot(self, s: int, index: int) -> torch.UntypedStorage:
        """The arena slot of the residency of ``s`` that instruction ``index`` (-1: the step's start) allocates,
        once the bytes are free: offloads still reading them are waited for; a live storage there is an error."""
        key = (s, index)
        if key not in self.slots:
            raise ArenaOverlap(f"{self._where(index)}: the layout has no slot for {self.program.values[s].name} "
                               f"allocated here; it is not this plan's layout (use assign_offsets(plan))")
        offset, nbytes = self.slots[key]
        arena_bytes = self.arena.nbytes()
        if offset < 0 or offset + nbytes > arena_bytes:
            raise ArenaOverlap(f"{self._where(index)}: {self.program.values[s].name} is placed at arena bytes "
                               f"[{offset}, {offset + nbytes}), outside the {arena_bytes}-byte arena")
        slot = self.arena[offset:offset + nbytes]
        lo = slot.data_ptr() - self.arena_base  # from the slot's own address, not the layout's offset
        hi = lo + slot.nbytes()
        self._free_slot(lo, hi)
        clash = self.ranges.overlapping(lo, hi)
        if clash is not None:
            other_lo, other_hi, other = clash
            raise ArenaOverlap(f"{self._where(index)}: {self.program.values[s].name} is placed at arena bytes "
                               f"[{lo}, {hi}), overlapping {self.program.values[other].name} at [{other_lo}, "
                               f"{other_hi}), which is still live; the layout puts two live storages on the same "
                               f"bytes (hyperoffload.layout.check_layout finds such layouts)")
        self.ranges.add(lo, hi, s)
        return slot

    def _free_slot(self, lo: int, hi: int) -> None:
        """Order every later write of ``[lo, hi)`` after the offloads still reading those bytes for a storage the
        step has let go of.

        ``Transfers.wait`` is enough: the slot is then written by compute, which it orders, or by a prefetch,
        which starts after the compute issued before it. On CUDA that is an event wait of the compute stream
        rather than a host block; on CPU backends the caller's thread is the compute, so it blocks. ``_finish``
        still completes these offloads on the host before the step returns."""
        lo, hi = lo + self.arena_base, hi + self.arena_base
        reading = [f for f in self.holding if f.held and f.start < hi and lo < f.end]
        if not reading:
            return
        start = time.perf_counter()
        waited = False
        for flight in reading:
            if not self.transfers.is_done(flight.handle):
                self.transfers.wait(flight.handle)
                waited = True
            self._finished(flight)
        self.holding = [f for f in self.holding if f.held]
        self.slot_waits += waited
        self.memory_wait_s += time.perf_counter() - start

    def _into_arena(self, vid: int, tensor: torch.Tensor) -> torch.Tensor:
        """A step input's storage copied into its slot; ``tensor`` as a view of the slot."""
        s = self.storage_of[vid]
        placed = next((self.env[v] for v in self.aliases.get(s, ())), None)
        if placed is None:
            slot = self._slot(s, -1)
            if tensor.untyped_storage().data_ptr() != slot.data_ptr():  # not already there (a reused arena)
                self._fill(slot, tensor.untyped_storage(), s, -1)
            self.replaced.add(s)  # in place, the caller's storage gets the final bytes back
        else:  # another input aliasing the same storage was placed already
            slot = placed.untyped_storage()
        return _ViewMeta.of(tensor).view_into(slot)

    def _fill(self, slot: torch.UntypedStorage, source: torch.UntypedStorage, s: int, index: int) -> None:
        if source.nbytes() != slot.nbytes():
            raise ArenaOverlap(f"{self._where(index)}: {self.program.values[s].name} has {source.nbytes()} bytes "
                               f"but its slot in the layout {slot.nbytes()}; the program's sizes do not match "
                               f"the tensors (capture the step again)")
        slot.copy_(source)

    def _run_into_slot(self, i: int, op, node: torch.fx.Node) -> list[torch.Tensor] | None:
        """Run ``op`` (instruction ``i``) with its ``out=`` overload writing straight into its slot, if it makes
        one new storage and has such an overload; None otherwise (the caller runs it and copies the result)."""
        found = self.writes_into_slot.get(op.id)
        if found is None or (op.outputs[0], i) not in self.slots:
            return None
        overload, out_name, meta = found
        o = op.outputs[0]
        slot = self._slot(o, i)
        out = meta.view_into(slot)
        args, kwargs = op_arguments(node, self.lookup)
        try:
            overload(*args, **kwargs, **{out_name: out})
        except RuntimeError:
            out = None  # the out= kernel refused this view (it would resize it, say): run the op as captured
        if out is None or out.untyped_storage().data_ptr() != slot.data_ptr() or tuple(out.size()) != meta.size:
            produced = run_op(self.program, op, node, self.lookup)
            self._fill(slot, produced[0].untyped_storage(), o, i)
            self.arena_copied += slot.nbytes()
            return [_ViewMeta.of(produced[0]).view_into(slot)]
        return [out]

    def _outputs_into_arena(self, i: int, op, tensors: list[torch.Tensor]) -> None:
        """Move the storages op ``op`` (instruction ``i``) allocated into their slots, rebinding every output
        aliasing them as a view of the slot with its own size, stride and offset."""
        values = self.program.values
        for o in op.outputs:
            if not values[o].owns_storage or (o, i) not in self.slots:
                continue  # a view of a storage already placed, or an empty storage (nothing to place)
            slot = self._slot(o, i)
            self._fill(slot, tensors[op.outputs.index(o)].untyped_storage(), o, i)
            self.arena_copied += slot.nbytes()
            for k, v in enumerate(op.outputs):
                if self.storage_of[v] == o:
                    tensors[k] = _ViewMeta.of(tensors[k]).view_into(slot)
