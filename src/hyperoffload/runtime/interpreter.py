"""The interpreter: run a Plan on real tensors, one loop over its instructions, one method per instruction kind.

``execute_plan`` runs one step of a plan with a transfer backend (``transfers.Transfers``) doing the copies;
``run_plan`` is the reference, with synchronous copies (``SyncTransfers``, which runs lane ops inline too);
``emulated_link`` and ``native_link`` run the copies on copy threads that take as long as the link would,
``cuda_streams`` on CUDA side streams. The step (``_Step``) dispatches each instruction to the method named after
its kind (``compute``, ``offload``, ``release``, ``prefetch``, ``wait``), as ``torch.fx.Interpreter`` dispatches
each node to the method named after its op.

There are two tiers. The *device* tier is an environment of live tensors, as in ``run_reference``; the *remote*
tier maps a storage id to a buffer holding a copy of that storage's bytes. Instructions act on them in plan order:

* ``COMPUTE op`` runs the op's fx node on the caller's thread (a lane op goes to its copy lane: ``lane_ops``).
  Storages are freed after their last device use exactly as ``check_plan(plan).frees_after`` says, by dropping
  every value aliasing them at once.
* ``OFFLOAD s`` starts a copy of the whole untyped storage of ``s`` into a remote buffer, so any view into it can
  be rebuilt.
* ``RELEASE s`` drops every value aliasing ``s`` from the device tier and remembers the view metadata (``views``)
  of those read again later or returned.
* ``PREFETCH s`` allocates a new device storage and starts a copy of the remote buffer into it.
* ``WAIT s`` waits for the latest transfer of ``s``; only then are the remembered views rebuilt on a prefetched
  storage, so no op can read a copy that has not landed.

*Remote* values (``Value.remote``: a step input living in remote memory for the whole step, such as a remote KV
cache) are in the environment so lane ops can read and write them, but their storages are never device bytes:
they are neither counted nor dropped, and only lane ops touch them. Inputs that start the step in remote memory
(``plan.initial_remote``) are their own remote copy: prefetches read the caller's storage, and an offload of
such a storage writes back into it.

Device bytes are measured after every instruction (``device_bytes``). With a budget, an allocation that would not
fit while a released storage is still being copied out waits for that copy (as the simulator's memory stall
does); if the measured bytes exceed the budget anyway the step fails with ``BudgetExceeded``. The caller's own
references to its input tensors are not part of the device tier: once the plan releases an input's storage, that
memory counts as remote.

What the step leaves behind depends on ``donate`` (``step_results``):

* ``donate=False`` (in place, like the unplanned step): caller tensors (step inputs and graph constants) whose
  storage the plan released are no longer the tensors the step updates, so the final bytes of every such storage
  are copied back into the caller's storage at the end, from the device tier or, if the plan leaves it in remote
  memory, from its remote copy; returned values aliasing such a storage are returned as views of the caller's
  storage. This copy-back emulates the caller's tensors living wherever the plan left them and is not counted as
  a transfer.
* ``donate=True`` (a training loop that hands its state to the executor): the executor takes the input tensors
  out of the list it is given (so it holds the only references and released memory is really given back) and
  returns the state where the plan left it, in ``PlanRun.state``, to be passed to the next step. Nothing is
  copied back. The plan must leave every input where it found it, so that it can run again on its own result.

With ``arena`` the step keeps every device storage in its slot of one buffer (``arena_step``).

The step's parts are mixins, one module per concern: ``transfers`` (the transfers it started), ``arena_step``
(running from an arena), ``lane_ops`` (ops on the copy lanes) and ``step_results`` (completing the step and
building its ``PlanRun``). Beside them: ``prepared_plan`` (what every step of a plan shares), ``views`` (a tensor
rebuilt as a view of another copy of its storage), ``out_variants`` (the ``out=`` overloads that write into
arena slots), ``arena`` (slots and the overlap check) and ``placement`` (where a donated step's state starts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx

from hyperoffload.instructions import COPIES_OUT
from hyperoffload.layout import Layout
from hyperoffload.plans import Kind, Plan, op_storages, op_writes
from hyperoffload.runtime.arena import ArenaOverlap, with_arena
from hyperoffload.runtime.arena_step import _ArenaStep
from hyperoffload.runtime.device_bytes import BudgetExceeded, _DeviceBytes
from hyperoffload.runtime.lane_ops import _LaneFlight, _LaneOps
from hyperoffload.runtime.prepared_plan import PreparedPlan, prepare_plan
from hyperoffload.runtime.reference import graph_object, run_op
from hyperoffload.runtime.step_results import PlanRun, _StepResults
from hyperoffload.runtime.transfers import SyncTransfers, Transfers, _InFlight, _TransferTracking
from hyperoffload.runtime.views import _ViewMeta
from hyperoffload.simulate import side_waits


def execute_plan(plan: Plan | PreparedPlan, inputs: MutableSequence[torch.Tensor] | Sequence[torch.Tensor],
                 transfers: Transfers, *, donate: bool = False, carry: bool = False,
                 carried: dict[int, Any] | None = None,
                 on_instruction: Callable[[int], None] | None = None, arena: bool | Layout = False,
                 kept_arena: list[torch.UntypedStorage] | None = None) -> PlanRun:
    """Run one step of ``plan`` on ``inputs`` with ``transfers`` doing the copies (see the module docstring).

    ``plan`` may be a ``PreparedPlan`` (``prepare_plan``), to check and analyse it once for many steps.
    ``donate``: take the tensors out of ``inputs`` (a list, emptied) and return the state in ``PlanRun.state``
    instead of updating the caller's tensors. ``carry``: leave offloads that write a donated input's final
    state into its remote copy in flight when the step returns, recorded in ``carried`` (remote storage
    address -> handle) so that the next step (given the same dict) orders its prefetches after them; the
    caller completes them with the backend before reading that state. ``on_instruction(i)`` is called after
    each instruction (progress, or stopping a step from outside by raising). ``arena``: run from one arena
    (``True``, or a ``Layout`` of the plan; see ``arena_step``). ``kept_arena``: where a donated step keeps
    its arena for the next (a list of at most one); a later donated step whose state lives in it reuses it.

    If anything raises (a failed copy, an op, ``on_instruction``), every transfer of the step is stopped or
    finished before the exception propagates, so no copy thread or stream touches a buffer afterwards.
    """
    prepared = plan if isinstance(plan, PreparedPlan) else prepare_plan(plan)
    if arena is not False and arena is not None:
        prepared = with_arena(prepared, arena)
    elif prepared.arena is not None:
        prepared = replace(prepared, arena=None)
    return _Step(prepared, inputs, transfers, donate=donate, carry=carry, carried=carried,
                 kept_arena=kept_arena).run(on_instruction)


def run_plan(plan: Plan, inputs: Sequence[torch.Tensor], *, arena: bool | Layout = False) -> PlanRun:
    """Execute ``plan`` (whose program must carry its fx graph) on ``inputs`` with synchronous copies.

    Raises ``PlanError`` (from ``check_plan``) if the plan is invalid, before anything runs. Inputs
    are used as given and updated in place, as in ``run_reference``: pass clones to keep the originals.
    ``arena``: run from one arena (``True``: ``plan.layout`` or ``assign_offsets(plan)``; or a ``Layout``
    of this plan), allocated on the device of the inputs the step starts with on the device tier; see
    ``hyperoffload.runtime.arena_step``.
    """
    return execute_plan(plan, inputs, SyncTransfers(), arena=arena)


class _Step(_TransferTracking, _ArenaStep, _LaneOps, _StepResults):
    """Mutable state of one step; ``run`` is the interpreter loop, and each instruction kind has its method."""

    def __init__(self, prepared: PreparedPlan, inputs, transfers: Transfers, *, donate: bool, carry: bool,
                 carried: dict[int, Any] | None, kept_arena: list[torch.UntypedStorage] | None = None) -> None:
        plan = prepared.plan
        program = plan.program
        if len(inputs) != len(program.inputs):
            raise ValueError(f"program {program.name} takes {len(program.inputs)} inputs, got {len(inputs)}")
        if carry and not donate:
            raise ValueError("carry=True needs donate=True: in place, the final state must be in the caller's "
                             "tensors when the step returns")
        if donate and prepared.repeatable is not None:
            raise ValueError(prepared.repeatable)
        self.plan, self.program, self.transfers = plan, program, transfers
        self.checked = prepared.checked
        self.storage_of, self.nodes = prepared.storage_of, prepared.nodes
        self.last_read, self.alloc = prepared.last_read, prepared.alloc
        self.remote_layout = prepared.remote
        self.remote_arena: torch.UntypedStorage | None = None  # the buffer the remote copies live in, once needed
        self.donate, self.carry = donate, carry
        self.carried = carried if carried is not None else {}
        values = program.values
        self.returned = set(program.outputs)

        self.caller: dict[int, torch.Tensor] = dict(zip(program.inputs, inputs))
        self.slots = prepared.arena.slots if prepared.arena is not None else None
        self.arena_reused = False
        self.writes_into_slot: dict[int, tuple[Any, str, _ViewMeta]] = {}
        if self.slots is not None:
            self._take_arena(prepared.arena, kept_arena if donate else None)
        if donate:
            del inputs[:]  # the executor holds the only references from here on
        for vid in program.constants:
            self.caller[vid] = getattr(program.graph, self.nodes[values[vid].name].target)
        self.caller_storages = {self.storage_of[v]: t.untyped_storage() for v, t in self.caller.items()}
        self.state_storages = frozenset(self.caller_storages)

        self.env: dict[int, torch.Tensor] = {}
        self.aliases: dict[int, set[int]] = {}  # storage id -> ids of the values in env that alias it
        self.remote: dict[int, torch.UntypedStorage] = {}
        # Inputs starting in remote memory: the caller's storage is their remote copy, and offloads write it.
        self.remote_home = {s: self.caller_storages[s] for s in plan.initial_remote}
        self.remembered: dict[int, dict[int, _ViewMeta]] = {}  # storage id -> released value id -> its view
        self.replaced: set[int] = set()  # caller storages the step no longer runs on
        self.bytes = _DeviceBytes()
        self.in_flight: dict[int, _InFlight] = {}  # storage id -> its latest transfer not yet waited for
        self.holding: list[_InFlight] = []  # offloads whose device storage still counts on their behalf
        self.started: list[_InFlight] = []
        self.h2d = self.d2h = 0
        self.copy_wait_s = self.memory_wait_s = 0.0
        self.slot_waits = 0
        self.arena_copied = 0
        self.caller_meta: dict[int, _ViewMeta] = {}  # caller tensors' views, when the step drops the tensors
        # Storages in remote memory for the whole step: in the environment for the lane ops, never device bytes.
        self.remote_tier = frozenset(s for s in set(self.storage_of) if values[s].remote)
        self.deps = program.dependencies()
        self.lanes: dict[int, _LaneFlight] = {}  # op id -> lane op not yet seen finished, in issue order
        # Collectives on a real process group run while the ops that do not read their results go on (not from an
        # arena, whose slots the ops write into in place): op id -> the c10d works still to wait for; an op waits
        # for those it reads from, directly or through views (``simulate.side_waits``).
        self.collectives: dict[int, list] = {}
        self.frees_after_collective: dict[int, list[int]] = {}  # op id -> storages to drop once it has finished
        self.defer_collectives = self.slots is None and any(op.collective is not None for op in program.ops)
        self.side_waits = side_waits(program) if self.defer_collectives else ()
        self.lane_op = getattr(transfers, "lane_op", None)

        self._enter_inputs()
        if donate:
            self._hold_donated_state()

    def _enter_inputs(self) -> None:
        """Bring the caller's tensors into the step: remote copies for those starting in remote memory, the
        others into the device tier (into their slots, from an arena), once no carried offload writes them."""
        for vid, tensor in self.caller.items():
            s = self.storage_of[vid]
            if s in self.plan.initial_remote:
                self.remote[s] = tensor.untyped_storage()
                self.remembered.setdefault(s, {})[vid] = _ViewMeta.of(tensor)
                self.replaced.add(s)
            else:
                self._wait_carried(tensor.untyped_storage())
                if self.slots is not None and (s, -1) in self.slots:
                    tensor = self._into_arena(vid, tensor)
                self.put(vid, tensor)

    def _hold_donated_state(self) -> None:
        """The executor holds the only references to donated state: keep the layouts of the caller's tensors, not
        the tensors, so that a storage the plan sends out is freed when the step lets go of it (and, from an arena,
        the state now lives in the step's arena). Graph constants stay: they are not state, so ``_constants_back``
        copies the bytes of mutated ones back into them."""
        inputs_on_device = [v for v in self.program.inputs if self.storage_of[v] not in self.plan.initial_remote]
        for vid in inputs_on_device:
            self.caller_meta[vid] = _ViewMeta.of(self.caller.pop(vid))
            self.caller_storages.pop(self.storage_of[vid], None)

    # --- the device tier --------------------------------------------------------------------------
    def put(self, vid: int, tensor: torch.Tensor) -> None:
        s = self.storage_of[vid]
        self.env[vid] = tensor
        self.aliases.setdefault(s, set()).add(vid)
        if s not in self.remote_tier:
            self.bytes.hold(tensor.untyped_storage())

    def drop_storage(self, s: int) -> dict[int, torch.Tensor]:
        if s in self.remote_tier:
            return {}  # not a device storage: nothing to give back, and the lane ops still need it
        dropped = {v: self.env.pop(v) for v in self.aliases.pop(s, ())}
        for t in dropped.values():
            self._let_go(t.untyped_storage())
        return dropped

    def _let_go(self, storage: torch.UntypedStorage) -> None:
        if self.bytes.let_go(storage) and self.slots is not None:
            self.ranges.remove(storage.data_ptr() - self.arena_base)

    def _where(self, index: int) -> str:
        if index < 0:
            return "before the first instruction"
        return f"instruction #{index} ({self.plan.instructions[index].describe(self.program)})"

    def device_storage(self, s: int, index: int) -> torch.UntypedStorage:
        """The device storage of ``s``, through any value aliasing it."""
        members = self.aliases.get(s)
        if not members:
            raise RuntimeError(f"instruction #{index}: storage {self.program.values[s].name} is not on the device")
        return self.env[next(iter(members))].untyped_storage()

    def lookup(self, node: torch.fx.Node) -> torch.Tensor:
        vid = self.program.node_values.get(node.name)
        return self.env[vid] if vid is not None else graph_object(self.program, node)

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, on_instruction: Callable[[int], None] | None) -> PlanRun:
        start = time.perf_counter()
        initial_bytes = self.bytes.total
        live: list[int] = []
        # Instruction kind -> the method that executes it (``compute``, ``offload``, ...), as fx dispatches on a
        # node's ``op``. Kept local: stored on the step, its bound methods would make a reference cycle, and the
        # step's tensors (its arena too) would then wait for the garbage collector to be freed.
        by_kind: dict[Kind, Callable[[int, int], None]] = {kind: getattr(self, kind.value) for kind in Kind}
        i = -1
        try:
            with torch.no_grad():
                for i, ins in enumerate(self.plan.instructions):
                    if self.alloc[i]:
                        if self.frees_after_collective:
                            self._room_from_collectives(self.alloc[i])
                        self._make_room(self.alloc[i])
                    by_kind[ins.kind](i, ins.target)
                    if self.lanes:
                        self._land_finished()
                    if self.collectives:
                        self._await_collectives([d for d, works in self.collectives.items()
                                                 if all(w.is_completed() for w in works)])
                    self._poll()
                    live.append(self.bytes.total)
                    if self.plan.budget_bytes is not None and self.bytes.total > self.plan.budget_bytes:
                        raise BudgetExceeded(
                            f"instruction #{i} ({ins.describe(self.program)}): measured {self.bytes.total} device "
                            f"bytes, over the budget of {self.plan.budget_bytes}")
                    for freed in self.checked.frees_after[i]:
                        if self.lanes:
                            self._await_producer(freed)
                        if self.collectives and self._dropped_later(freed):
                            continue
                        self.drop_storage(freed)
                    if on_instruction is not None:
                        on_instruction(i)
                i = len(self.plan.instructions)
                outputs, state = self._finish()
        except BaseException as error:
            self.transfers.abort([f.handle for f in self.started] + [f.handle for f in self.lanes.values()])
            if hasattr(error, "add_note"):  # Python 3.11+: say where, and that nothing is left running
                where = (f"instruction #{i} ({self.plan.instructions[i].describe(self.program)})"
                         if 0 <= i < len(self.plan.instructions) else "the end of the step")
                error.add_note(f"hyperoffload: the step of {self.program.name} stopped at {where}; every copy it "
                               f"had started was stopped or finished first")
            raise
        carried = len(self.carried)
        return PlanRun(outputs=outputs, live_bytes=tuple(live), peak_bytes=max(live, default=initial_bytes),
                       arena_reused=self.arena_reused,
                       h2d_bytes=self.h2d, d2h_bytes=self.d2h, state=state,
                       wall_s=time.perf_counter() - start, copy_wait_s=self.copy_wait_s,
                       memory_wait_s=self.memory_wait_s, carried=carried,
                       arena_bytes=self.arena.nbytes() if self.slots is not None else 0,
                       slot_waits=self.slot_waits, arena_copied_bytes=self.arena_copied)

    # --- one method per instruction kind (``Kind``), named after its value and dispatched by ``run`` -----
    def compute(self, i: int, op_id: int) -> None:
        """``COMPUTE op``: hand a lane op to its lane; run any other op's fx node once the lane ops it depends on
        have finished (from an arena, into its slot), and put its outputs into the device tier."""
        program = self.program
        op = program.ops[op_id]
        if op.lane is not None:
            self._issue_lane(i, op)
            return
        if self.lanes:
            self._await_lanes(self.deps[op_id])
        if self.collectives:
            self._await_collectives(self.side_waits[op_id])
        node = self.nodes[op.name]
        outputs = self._run_into_slot(i, op, node) if self.slots is not None else None
        if outputs is None:
            works = self.collectives.setdefault(op_id, []) if self.defer_collectives and op.collective else None
            outputs = run_op(program, op, node, self.lookup, works)
            if self.slots is not None:
                outputs = list(outputs)
                self._outputs_into_arena(i, op, outputs)
        for vid, tensor in zip(op.outputs, outputs):
            self.put(vid, tensor)
        for w in {self.storage_of[v] for v in op.mutates}:
            self.remote.pop(w, None)  # stale now; check_plan forbids prefetching it

    def _await_collectives(self, ops) -> None:
        """Wait for the collectives among ``ops`` still running (their results are then written), and drop what was
        freed while they still read it."""
        for d in ops:
            works = self.collectives.pop(d, None)
            if works is None:
                continue
            for work in works:
                work.wait()
            for s in self.frees_after_collective.pop(d, ()):
                self.drop_storage(s)

    def _room_from_collectives(self, nbytes: int) -> None:
        """Where ``nbytes`` more would not fit the budget, wait for the collectives holding freed storages, oldest
        first, until they do (a memory stall, as the simulator's)."""
        budget = self.plan.budget_bytes
        start = time.perf_counter()
        for d in list(self.frees_after_collective):
            if budget is None or self.bytes.total + nbytes <= budget:
                break
            self._await_collectives([d])
        self.memory_wait_s += time.perf_counter() - start

    def _dropped_later(self, s: int) -> bool:
        """Whether storage ``s``, freed now, is read by a collective still running: it is dropped (and its bytes
        given back) when that collective has finished, as the simulator gives back a side op's inputs."""
        reads = op_storages(self.program)[1]
        for d in self.collectives:
            if s in reads[d]:
                self.frees_after_collective.setdefault(d, []).append(s)
                return True
        return False

    def offload(self, i: int, s: int) -> None:
        """``OFFLOAD s``: start copying the whole storage of ``s`` into its remote copy."""
        if self.collectives:  # a collective still writing the storage: copy what it wrote
            writes = op_writes(self.program)
            self._await_collectives([d for d in list(self.collectives) if s in writes[d]])
        if self.lanes:  # a lane op still writing the storage: copy its result, not what was there before
            for flight in [f for f in self.lanes.values() if s in f.writes]:
                self._await_lane(flight)
        source = self.device_storage(s, i)
        target = self.remote_home.get(s)
        if target is None:
            target = self._remote_copy(i, source)
        handle = self.transfers.offload(self.program.values[s].name, source, target)
        self._track(_InFlight(Kind.OFFLOAD, s, handle, source, target))
        self.remote[s] = target
        self.d2h += source.nbytes()

    def _remote_copy(self, i: int, source: torch.UntypedStorage) -> torch.UntypedStorage:
        """Where the OFFLOAD at instruction ``i`` copies ``source``: its bytes of the step's remote buffer, which
        no other copy live at the same time shares (``remote_layout``)."""
        layout = self.remote_layout
        if self.remote_arena is None:
            self.remote_arena = self.transfers.remote_arena(layout.arena_bytes, source)
        offset = layout.offset_of[i]
        return self.remote_arena[offset:offset + source.nbytes()]

    def release(self, i: int, s: int) -> None:
        """``RELEASE s``: drop every value aliasing ``s`` from the device tier, remembering the views read again."""
        values = self.program.values
        storage = self.device_storage(s, i)
        dropped = self.drop_storage(s)
        # The owner is always kept so a prefetched storage stays referenced, hence measured, even
        # if no alias of it is read again.
        self.remembered[s] = {v: _ViewMeta.of(t) for v, t in dropped.items()
                              if v == s or self.last_read[v] > i or v in self.returned}
        if s in self.caller_storages:
            self.replaced.add(s)
        # The IR's aliasing must match the tensors', or the measured bytes would silently disagree.
        copies = sum(f.held and f.device.data_ptr() == storage.data_ptr() for f in self.holding)
        if self.bytes.references(storage) > copies:
            raise RuntimeError(f"instruction #{i}: {values[s].name} is still referenced after its release "
                               f"by a value the program does not record as aliasing it")
        del storage, dropped

    def prefetch(self, i: int, s: int) -> None:
        """``PREFETCH s``: allocate a device storage (from an arena, its slot) and start copying the remote copy
        of ``s`` into it, after the offload that fills that copy."""
        values = self.program.values
        source = self.remote[s]
        if self.slots is None:
            storage = self.transfers.device_storage(source.nbytes(), source)
        else:
            storage = self._slot(s, i)
            if storage.nbytes() != source.nbytes():
                raise ArenaOverlap(f"{self._where(i)}: the remote copy of {values[s].name} has "
                                   f"{source.nbytes()} bytes but its slot {storage.nbytes()}")
        previous = self.in_flight.get(s)
        if previous is not None and previous.kind in COPIES_OUT:
            dependency = previous.handle  # the lanes order the prefetch after the offload that fills `source`
        else:
            dependency = self.carried.pop(source.data_ptr(), None) if self.carried else None
        handle = self.transfers.prefetch(values[s].name, source, storage, dependency)
        self._track(_InFlight(Kind.PREFETCH, s, handle, storage, source))
        self.h2d += storage.nbytes()

    def wait(self, i: int, s: int) -> None:
        """``WAIT s``: wait for the latest transfer of ``s``; a prefetched storage's views become readable."""
        flight = self.in_flight.pop(s, None)
        if flight is None:
            raise RuntimeError(f"instruction #{i}: wait for {self.program.values[s].name}, whose transfer never "
                               f"happened")
        start = time.perf_counter()
        self.transfers.wait(flight.handle)
        self.copy_wait_s += time.perf_counter() - start
        self._landed(flight)
