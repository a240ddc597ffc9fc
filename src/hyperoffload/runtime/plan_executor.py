"""Run a Plan on real tensors: one interpreter loop, with the copies done by a swappable transfer backend.

There are two tiers. The *device* tier is an environment of live tensors, as in
``run_reference``; the *remote* tier maps a storage id to a buffer holding a copy of that
storage's bytes. Instructions act on them in plan order:

* ``COMPUTE op`` runs the op's fx node on the caller's thread. Storages are freed after their last
  device use exactly as ``check_plan(plan).frees_after`` says, by dropping every value aliasing
  them at once.
* ``OFFLOAD s`` starts a copy of the whole untyped storage of ``s`` into a remote buffer, so any
  view into it can be rebuilt.
* ``RELEASE s`` drops every value aliasing ``s`` from the device tier and remembers the view
  metadata of those read again later or returned.
* ``PREFETCH s`` allocates a new device storage and starts a copy of the remote buffer into it.
* ``WAIT s`` waits for the latest transfer of ``s``; only then are the remembered views rebuilt on
  a prefetched storage, so no op can read a copy that has not landed.
* ``COMPUTE op`` of a *lane op* (``Op.lane``: an indexed fetch of KV blocks, a write of rows to a remote
  cache) hands the op's kernel, with the input tensors it reads, to the transfer backend's lane of that
  direction (``Transfers.lane_op``), as the simulator runs it: after the lane ops it depends on
  (``Program.dependencies()``) have finished, in FIFO order with that lane's copies. The interpreter goes
  on; the first instruction that depends on the lane op (reads its outputs, or touches a storage it writes
  or writes one it reads), or an ``OFFLOAD`` of a storage it writes, waits for it first (counted in
  ``copy_wait_s``), and every lane op has finished when the step returns. Its outputs join the device tier
  once the step sees it finished; the device storages it reads stay counted until then, even if the plan
  frees them meanwhile. A lane op that fails raises ``TransferError``.

*Remote* values (``Value.remote``: a step input living in remote memory for the whole step, such as a
remote KV cache) are in the environment so lane ops can read and write them, but their storages are never
device bytes: they are neither counted nor dropped, and only lane ops touch them.

How copies run is the transfer backend's business (``Transfers``): ``SyncTransfers`` copies at
once on the caller's thread (``run_plan``, the reference, which runs lane ops inline too);
``hyperoffload.runtime.emulated_link`` runs them, lane ops included, on throttled copy threads and
``hyperoffload.runtime.cuda_streams`` on CUDA side streams.

Device bytes are measured from the tensors themselves: the distinct storages (by address) that the
device tier references, plus device storages an unfinished transfer still holds (a prefetch not yet
waited for, or an offload still reading a storage the plan has already released or freed). The
count is kept incrementally, so measuring after every instruction costs nothing. With a budget,
an allocation that would not fit while a released storage is still being copied out waits for that
copy (as the simulator's memory stall does); if the measured bytes exceed the budget anyway the
step fails with ``BudgetExceeded``. The caller's own references to its input tensors are not part
of the device tier: once the plan releases an input's storage, that memory counts as remote.

**Running from one arena** (``arena=True``, ``run_plan(plan, inputs, arena=True)``): every device
storage lives in its slot ``[offset, offset + nbytes)`` of one byte buffer of ``layout.arena_bytes``,
allocated once at the start of the step on the device tier, where ``layout`` is ``plan.layout`` (from
``PlannerConfig(static_layout=True)``), a ``Layout`` passed in, or ``assign_offsets(plan)``. Step inputs
on the device are copied into their slots first (in place, the caller's tensors still get the final
state back); a prefetch copies from remote memory straight into its slot; each op's outputs that own a
storage are copied into their slot right after the op, and every value aliasing such a storage is
rebound as a view of the slot with its own size, stride and offset, so in-place ops write into the
arena. That costs each such output one extra copy and a transient allocation outside the arena: ops
allocate their outputs through PyTorch (routing them into the arena directly would take a pluggable
allocator / ``MemPool`` or ``out=`` variants). A slot is reused only once the offload reading its previous
occupant has finished: before the slot is written again, later compute is made to wait for that offload
(``Transfers.wait``), and a prefetch into the slot starts only after the compute issued before it (the
backend's ``prefetch`` contract), so the ops reading the previous occupant have finished too. At every
allocation the executor checks, from the slot tensors' addresses, that the live storages' byte ranges are
inside the arena and pairwise disjoint, and raises ``ArenaOverlap`` naming both storages and the instruction
otherwise. Outputs that do not alias an input are returned as copies, so the arena is freed when the
step returns. With ``donate=True`` the state lives in the arena; given ``kept_arena`` (as ``AsyncExecutor.step``
does), the next donated step of the plan runs from that same arena, moving each state storage from where the
step left it to its start slot (``move_order``), so a training loop holds one arena rather than two while
the state is copied from one into the next.

The arena is the same code on every device: the buffer is allocated where the backend puts device storages
(``Transfers.arena_storage``, else ``Transfers.device_storage``) and must be on the device of the step's
device-tier inputs; slots are byte ranges of it (``UntypedStorage`` slices, which share its memory) and
values are views of them with their own dtype, size, stride and offset. On CPU the waits above block the
caller's thread (ops run on it). On CUDA (``cuda_streams.CudaStreams``) every copy into a slot (``_fill``)
runs on the compute stream after the op that produced it; a reused slot's wait is an event wait of the
compute stream, so the host does not block; a prefetch's side stream waits for the compute stream first; and
the arena is marked as used by both side streams, so a copy of a slot still queued when the arena is freed
(a carried offload) keeps its block from being reused. This CUDA path ran on an H200 bit-identically
(``tests/gpu/test_cuda_runtime.py`` and ``make gpu-check`` run it where there is a GPU).

An op that makes one new storage and has an ``out=`` overload with the same arguments (``mm.out`` for
``mm``, ``mul.out`` for ``mul.Tensor``) writes straight into its slot, as a view with the size and strides
the capture recorded; other ops allocate through PyTorch and their result is copied into the slot (a
transient allocation outside the arena, and one copy). ``PlanRun.arena_copied_bytes`` counts those copies.

Inputs that start the step in remote memory (``plan.initial_remote``) are their own remote copy:
prefetches read the caller's storage, and an offload of such a storage writes back into it.

What the step leaves behind depends on ``donate``:

* ``donate=False`` (in place, like the unplanned step): caller tensors (step inputs and graph
  constants) whose storage the plan released are no longer the tensors the step updates, so the
  final bytes of every such storage are copied back into the caller's storage at the end, from the
  device tier or, if the plan leaves it in remote memory, from its remote copy; returned values
  aliasing such a storage are returned as views of the caller's storage. This copy-back emulates
  the caller's tensors living wherever the plan left them and is not counted as a transfer.
* ``donate=True`` (a training loop that hands its state to the executor): the executor takes the
  input tensors out of the list it is given (so it holds the only references and released memory
  is really given back) and returns the state where the plan left it, in ``PlanRun.state``, to be
  passed to the next step. Nothing is copied back. The plan must leave every input where it found
  it, so that it can run again on its own result.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.fx

from hyperoffload.layout import Layout, assign_offsets, residencies
from hyperoffload.plans import Kind, Plan, PlanCheck, check_plan
from hyperoffload.runtime.reference import op_arguments, run_op


class BudgetExceeded(RuntimeError):
    """The executor measured more device bytes than the plan's budget: the budget promise is broken."""


class TransferError(RuntimeError):
    """A copy failed (or was cancelled because the step stopped); raised on the thread that runs the step."""


class ArenaOverlap(RuntimeError):
    """Running from an arena, a storage was placed on bytes a live storage still holds, or outside the arena."""


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


class Transfers(Protocol):
    """How copies between the tiers run. A *handle* is whatever ``offload``/``prefetch``/``lane_op`` return."""

    def device_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        """A new device storage of ``nbytes`` (for a prefetch), allocated where ``like``'s tier lives."""

    def remote_storage(self, key: int, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        """A remote buffer of ``nbytes`` for storage id ``key`` (the destination of an offload)."""

    def offload(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage) -> Any:
        """Start copying device ``src`` into remote ``dst`` once the work issued so far has written ``src``."""

    def prefetch(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage, after: Any | None) -> Any:
        """Start copying remote ``src`` into device ``dst``, after the transfer ``after`` (which fills ``src``) and
        after the compute issued so far (and what it was made to ``wait`` for): ``dst`` may be an arena slot whose
        previous occupant that compute still reads."""

    def wait(self, handle: Any) -> None:
        """Make later compute wait for the transfer; raise ``TransferError`` if it failed."""

    def input_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        """Optional: a remote buffer of ``nbytes`` for a step input that starts in remote memory, filled by
        ``place_state`` and owned by the caller (default: a new storage where ``like`` lives)."""

    def arena_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        """Optional: the step's arena, a device storage of ``nbytes`` allocated where ``like``'s tier lives, that
        may be freed while copies into or out of byte ranges of it are still queued (without it, the executor
        takes ``device_storage``, enough where copies are done with a buffer once their handle says so)."""

    def is_done(self, handle: Any) -> bool:
        """Whether the transfer has finished (without blocking)."""

    def synchronize(self, handle: Any) -> None:
        """Block the caller's thread until the transfer has finished; raise ``TransferError`` if it failed."""

    def abort(self, handles: Sequence[Any]) -> None:
        """Stop or finish every transfer in ``handles`` so none touches any buffer afterwards; never raises."""

    def lane_op(self, label: str, lane: str, nbytes: int, work: Callable[[], int | None],
                after: Sequence[Any]) -> Any:
        """Run a lane op on copy lane ``lane`` (``"h2d"`` or ``"d2h"``), after the transfers and lane ops in
        ``after`` (which write what it reads, or read what it writes) have finished; return its handle.

        ``work()`` runs the op's kernel and returns the bytes it moved (None: ``nbytes``, the op's stated
        ``transfer_bytes``); the lane takes at least as long as it would for a copy of that many bytes. An
        exception from ``work`` fails the handle: ``wait``/``synchronize`` raise it as ``TransferError``.
        ``work`` must have returned on the host by the time ``wait`` returns (the executor then reads the
        outputs it produced). A backend that has run it inline, in order with what follows, returns None
        (nothing is in flight). Optional: without it the executor runs lane ops inline on the caller's thread.
        """


def run_lane_inline(label: str, work: Callable[[], int | None]) -> None:
    """Run a lane op's ``work`` at once on the caller's thread; a failure is raised as ``TransferError``."""
    try:
        work()
    except Exception as error:  # a failed lane op is a failed transfer, whatever the kernel raised
        raise TransferError(f"lane op {label} failed: {error}") from error


class SyncTransfers:
    """The reference backend: every copy happens at once, on the caller's thread."""

    def device_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        return torch.UntypedStorage(nbytes, device=like.device)

    def remote_storage(self, key: int, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        return torch.UntypedStorage(nbytes, device=like.device)

    def offload(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage) -> None:
        dst.copy_(src)

    def prefetch(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage, after: Any | None) -> None:
        dst.copy_(src)

    def wait(self, handle: Any) -> None:
        pass

    def is_done(self, handle: Any) -> bool:
        return True

    def synchronize(self, handle: Any) -> None:
        pass

    def abort(self, handles: Sequence[Any]) -> None:
        pass

    def lane_op(self, label: str, lane: str, nbytes: int, work: Callable[[], int | None],
                after: Sequence[Any]) -> None:
        run_lane_inline(label, work)


@dataclass(frozen=True, slots=True)
class _ViewMeta:
    """What it takes to rebuild a tensor as a view into a new copy of its storage."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    """In elements of ``dtype``."""

    @staticmethod
    def of(tensor: torch.Tensor) -> _ViewMeta:
        return _ViewMeta(tensor.dtype, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

    def view_into(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.storage_offset, self.size, self.stride)


class _DeviceBytes:
    """Bytes of the distinct storages the device tier holds, counted by address as references come and go.

    Every holder (a value in the environment, an unfinished transfer) takes a reference on the storage it
    holds; a storage's bytes count while any reference is left. This is what ``live_storage_bytes`` would
    measure over the holders' tensors, kept up to date in O(1) per change.
    """

    __slots__ = ("_refs", "total")

    def __init__(self) -> None:
        self._refs: dict[int, list[int]] = {}  # data_ptr -> [nbytes, references]
        self.total = 0

    def hold(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if not nbytes:
            return
        entry = self._refs.get(storage.data_ptr())
        if entry is None:
            self._refs[storage.data_ptr()] = [nbytes, 1]
            self.total += nbytes
        else:
            entry[1] += 1

    def let_go(self, storage: torch.UntypedStorage) -> bool:
        """Drop one reference; return whether that was the storage's last (its bytes stop counting)."""
        if not storage.nbytes():
            return False
        entry = self._refs[storage.data_ptr()]
        entry[1] -= 1
        if entry[1] == 0:
            del self._refs[storage.data_ptr()]
            self.total -= entry[0]
            return True
        return False

    def references(self, storage: torch.UntypedStorage) -> int:
        """How many holders reference ``storage`` (0 for an empty one)."""
        entry = self._refs.get(storage.data_ptr()) if storage.nbytes() else None
        return entry[1] if entry else 0


@dataclass(slots=True, eq=False)
class _InFlight:
    """A transfer the step started."""

    kind: Kind
    storage: int
    handle: Any
    device: torch.UntypedStorage | None
    """The device-side storage the copy reads (offload) or writes (prefetch); counted while ``held``, and let go
    of (None) once the step has seen the copy finish, so that the flight, kept until the step ends, does not keep
    the storage's memory alive after the count has dropped it."""
    remote: torch.UntypedStorage
    held: bool = True
    """Whether the device bytes still count on the transfer's behalf (until the step sees it finish)."""
    start: int = 0
    """Address of ``device``'s first byte (kept, so that finding the copies reading a slot reads no storages)."""
    end: int = 0
    """Address one past ``device``'s last byte."""

    def __post_init__(self) -> None:
        self.start = self.device.data_ptr()
        self.end = self.start + self.device.nbytes()


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


_PREFETCH_BLOCKS = "hyperoffload.prefetch_blocks.default"
_FETCH_BLOCKS_POOLED = "hyperoffload.fetch_blocks_pooled.default"
_STORE_ROWS = "hyperoffload.store_rows.default"


def _run_lane_kernel(program, op, node: torch.fx.Node, bound: dict) -> tuple[list[torch.Tensor], int]:
    """Run a lane op's kernel on the tensors in ``bound`` (fx node -> tensor); return its outputs and the bytes
    it moved between the tiers: those it really copied for the cache operators whose traffic follows from
    their arguments, else the op's stated ``transfer_bytes``."""
    args = torch.fx.node.map_arg(node.args, bound.__getitem__)
    pooled = op.target == _FETCH_BLOCKS_POOLED and len(args) >= 6 and not node.kwargs
    if pooled:
        remote, _, slots, _, positions, block_size = args[:6]
        held = slots[..., 0].clone()  # the block table before the fetch: what was resident
    with torch.no_grad():  # grad mode is per thread, and this may run on a lane's thread
        outputs = run_op(program, op, node, bound.__getitem__)
    if op.target == _PREFETCH_BLOCKS:
        moved = sum(t.nbytes for t in outputs)
    elif op.target == _STORE_ROWS and len(args) >= 2:
        moved = args[1].nbytes
    elif pooled:
        row = remote.shape[-1] * remote.element_size()
        fetched = int((slots[..., 0] != held).sum())  # every block brought in takes a slot holding another block
        refreshed = int((held == int(positions[0]) // block_size).any(-1).sum())  # its own row, if resident
        moved = fetched * block_size * row + refreshed * row
    else:
        moved = op.transfer_bytes
    return outputs, moved


def move_order(moves: dict[Any, tuple[int, int, int]]) -> list[tuple[str, Any]]:
    """An order for moving byte ranges within one buffer so that no range is overwritten before it is read.

    ``moves`` maps a key to ``(source, destination, nbytes)`` (offsets; sources are pairwise disjoint, and so
    are destinations). Returns steps ``("copy", key)`` (copy that move's bytes from its current source to its
    destination) and ``("spill", key)`` (first copy its source out of the buffer, to a temporary, which is its
    source from then on): a cycle of moves, each writing where another still has to read, needs one spill, and
    so does a move whose destination overlaps its own source."""
    pending = {key: (src, dst, n) for key, (src, dst, n) in moves.items() if src != dst}
    spilled: set[Any] = set()
    steps: list[tuple[str, Any]] = []

    def reads(key) -> tuple[int, int] | None:
        src, _, n = pending[key]
        return None if key in spilled else (src, src + n)

    def blocked_by(key):
        """A pending move that still reads from the buffer where ``key`` writes (spilled sources are read from
        elsewhere), or None; one exists for every move whenever no move is ready."""
        _, dst, n = pending[key]
        return next((other for other in pending if other != key and (span := reads(other)) is not None
                     and span[0] < dst + n and dst < span[1]), None)

    while pending:
        ready = [key for key in pending if blocked_by(key) is None]
        if not ready:  # every pending move writes where another reads: take one source out of the buffer,
            # one on a cycle of such waits (a move outside every cycle would still wait after the spill). Following
            # each move to one it waits for must come back to a move seen before: that one is on a cycle.
            seen: list[Any] = []
            key = next(iter(pending))
            while key not in seen:
                seen.append(key)
                key = blocked_by(key)
            steps.append(("spill", key))
            spilled.add(key)
            continue
        for key in ready:
            src, dst, n = pending.pop(key)
            if key not in spilled and src < dst + n and dst < src + n:  # shifted onto itself
                steps.append(("spill", key))
            steps.append(("copy", key))
    return steps


class _ArenaRanges:
    """Byte ranges ``[lo, hi)`` (from the arena's base) of the storages live in the arena, which never overlap."""

    __slots__ = ("_ends", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted
        self._ends: dict[int, tuple[int, int]] = {}  # lo -> (hi, storage id)

    def overlapping(self, lo: int, hi: int) -> tuple[int, int, int] | None:
        """A live range sharing a byte with ``[lo, hi)``, as ``(lo, hi, storage id)``, or None."""
        j = bisect.bisect_left(self._starts, lo)
        for k in (j - 1, j):  # disjoint ranges: only the neighbours can overlap a new one
            if 0 <= k < len(self._starts):
                start = self._starts[k]
                end, sid = self._ends[start]
                if start < hi and lo < end:
                    return start, end, sid
        return None

    def add(self, lo: int, hi: int, sid: int) -> None:
        bisect.insort(self._starts, lo)
        self._ends[lo] = (hi, sid)

    def remove(self, lo: int) -> None:
        if self._ends.pop(lo, None) is not None:
            del self._starts[bisect.bisect_left(self._starts, lo)]


@dataclass(frozen=True, slots=True, eq=False)
class ArenaSlots:
    """Where a plan's residencies live in its arena: a checked ``Layout`` of that plan, indexed for the executor."""

    layout: Layout
    slots: dict[tuple[int, int], tuple[int, int]]
    """(storage id, instruction that allocates it, -1 before the step) -> (offset, bytes) in the arena."""
    writes_into_slot: dict[str, dict[int, tuple[Any, str, _ViewMeta]]]
    """Device type -> op id -> the ``out=`` overload, its out argument's name and the captured layout of its
    result, for each op that writes its one new storage straight into its slot on that device (``out_variant``)."""


def arena_slots(plan: Plan, layout: Layout | None = None) -> ArenaSlots:
    """Index ``layout`` (default: ``plan.layout``, else ``assign_offsets(plan)``) for running ``plan`` from
    its arena; ``ValueError`` if the layout's residencies are not the plan's. Offsets are not checked here:
    the executor checks every placement against the storages live at that moment."""
    layout = layout if layout is not None else plan.layout if plan.layout is not None else assign_offsets(plan)
    if not isinstance(layout, Layout):
        raise TypeError(f"arena takes True or a hyperoffload.layout.Layout, got {type(layout).__name__}")
    if len(layout.offsets) != len(layout.residencies):
        raise ValueError(f"layout has {len(layout.offsets)} offsets for {len(layout.residencies)} residencies")
    expected = residencies(plan)
    if sorted(map(_residency_key, layout.residencies)) != sorted(map(_residency_key, expected)):
        raise ValueError(f"the layout's {len(layout.residencies)} residencies are not the {len(expected)} of plan "
                         f"{plan.program.name} (a layout of another plan?); compute it with "
                         f"hyperoffload.layout.assign_offsets(plan)")
    return ArenaSlots(layout=layout, slots={(r.storage, r.start): (off, r.nbytes)
                                            for r, off in zip(layout.residencies, layout.offsets)},
                      writes_into_slot={device: _writes_into_slot(plan.program, device) for device in _DISPATCH_KEYS})


def _writes_into_slot(program, device_type: str) -> dict[int, tuple[Any, str, _ViewMeta]]:
    """The ops of ``program`` that can write their one new storage into its slot on ``device_type`` (see
    ``ArenaSlots``)."""
    nodes = {n.name: n for n in program.graph.graph.nodes}
    found = {}
    for op in program.ops:
        node = nodes.get(op.name)
        meta = node.meta.get("val") if node is not None else None
        if len(op.outputs) != 1 or not program.values[op.outputs[0]].owns_storage or not isinstance(meta, torch.Tensor):
            continue
        variant = out_variant(node.target, device_type)
        if variant is not None:
            found[op.id] = (*variant, _ViewMeta(meta.dtype, tuple(meta.size()), tuple(meta.stride()),
                                                meta.storage_offset()))
    return found


def _residency_key(r) -> tuple[int, int, int, int]:
    return (r.storage, r.start, r.end, r.nbytes)


def run_plan(plan: Plan, inputs: Sequence[torch.Tensor], *, arena: bool | Layout = False) -> PlanRun:
    """Execute ``plan`` (whose program must carry its fx graph) on ``inputs`` with synchronous copies.

    Raises ``PlanError`` (from ``check_plan``) if the plan is invalid, before anything runs. Inputs
    are used as given and updated in place, as in ``run_reference``: pass clones to keep the originals.
    ``arena``: run from one arena (``True``: ``plan.layout`` or ``assign_offsets(plan)``; or a ``Layout``
    of this plan), allocated on the device of the inputs the step starts with on the device tier; see the
    module docstring.
    """
    return execute_plan(plan, inputs, SyncTransfers(), arena=arena)


_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
"""Device type -> the dispatch key an ``out=`` kernel must be registered under to write into its ``out``."""


def _copy_into(self: torch.Tensor, *, out: torch.Tensor, dtype=None, layout=None, device=None, pin_memory=None,
               non_blocking: bool = False, memory_format=None) -> torch.Tensor:
    """``_to_copy`` or ``clone`` of ``self`` written into ``out`` (laid out as the captured result). Only a
    strided copy on ``self``'s own device: anything else raises, and the executor runs the op as captured."""
    target = None if device is None else torch.device(device)
    if layout not in (None, torch.strided) or pin_memory or (target is not None and (
            target.type != self.device.type or target.index not in (None, self.device.index))):
        raise RuntimeError("not a strided copy on the source's device")
    return out.copy_(self)


_WRITTEN_INTO_OUT: dict[Any, tuple[Any, str]] = {
    torch.ops.aten._to_copy.default: (_copy_into, "out"),
    torch.ops.aten.clone.default: (_copy_into, "out"),
    torch.ops.aten.mul.Scalar: (torch.ops.aten.mul.out, "out"),
    torch.ops.aten.div.Scalar: (torch.ops.aten.div.out, "out"),
}
"""Ops whose result the arena writes into its slot some other way than through their own ``out=`` overload."""


@functools.cache
def out_variant(target, device_type: str = "cpu") -> tuple[Any, str] | None:
    """The ``out=`` overload of aten overload ``target`` that takes the same arguments (names and types) and has a
    kernel of its own on ``device_type``, and the name of its one out argument; None if it has none (``mm.default``
    -> ``mm.out``, ``mul.Tensor`` -> ``mul.out``, ``silu_backward.default`` -> ``silu_backward.grad_input``).

    An ``out=`` overload with only a composite kernel (``mul.Scalar_out``, ``clone.out``) runs the op as usual and
    copies its result into ``out``: it would allocate outside the arena all the same, so it does not count.
    Instead, ``_to_copy`` and ``clone`` write with ``copy_`` (what both do once they have allocated), and
    ``mul.Scalar`` and ``div.Scalar`` with the tensor overload's ``out=`` kernel, which they call with the scalar
    wrapped (``_WRITTEN_INTO_OUT``): the same bytes without the allocation. The largest of these in a LLaMA step,
    the logits' upcast to float32, was the 1.95 GiB a bf16 step held outside its arena on an H200."""
    written = _WRITTEN_INTO_OUT.get(target)
    if written is not None:
        overload, out_name = written
        key = _DISPATCH_KEYS.get(device_type)
        has_kernel = overload is _copy_into or (
            key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key))
        return (overload, out_name) if has_kernel else None
    packet = getattr(target, "overloadpacket", None)
    schema = getattr(target, "_schema", None)
    key = _DISPATCH_KEYS.get(device_type)
    if packet is None or schema is None or key is None:
        return None
    name = target._overloadname
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    for candidate in dict.fromkeys(("out" if name == "default" else f"{name}_out", "out", *packet.overloads())):
        if candidate not in packet.overloads():
            continue
        overload = getattr(packet, candidate)
        outs = [a for a in overload._schema.arguments if a.is_out]
        ins = [(a.name, str(a.type)) for a in overload._schema.arguments if not a.is_out]
        if len(outs) == 1 and ins == wanted and torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key):
            return overload, outs[0].name
    return None


@dataclass(frozen=True, slots=True, eq=False)
class PreparedPlan:
    """What every step of a plan needs that does not depend on the tensors (``prepare_plan``)."""

    plan: Plan
    checked: PlanCheck
    storage_of: tuple[int, ...]
    """Storage id of every value."""
    nodes: dict[str, torch.fx.Node]
    last_read: tuple[int, ...]
    """Index of the last instruction reading each value (-1 if none)."""
    alloc: tuple[int, ...]
    """Bytes each instruction allocates in the plan's accounting (what must fit under the budget)."""
    repeatable: str | None
    """Why the plan cannot run step after step on its own state, or None if it can."""
    arena: ArenaSlots | None = None
    """The arena layout to run from, when asked for (``with_arena``)."""


def with_arena(prepared: PreparedPlan, arena: bool | Layout = True) -> PreparedPlan:
    """``prepared`` with the arena slots ``arena`` asks for (``True``: the plan's layout, or one computed for
    it; a ``Layout``: that one), reusing those it already has."""
    if arena is True and prepared.arena is not None:
        return prepared
    if isinstance(arena, Layout) and prepared.arena is not None and prepared.arena.layout is arena:
        return prepared
    layout = None if arena is True else arena
    return replace(prepared, arena=arena_slots(prepared.plan, layout))


def prepare_plan(plan: Plan) -> PreparedPlan:
    """Check ``plan`` (``PlanError`` if invalid) and precompute what running it needs; reuse it across steps."""
    program = plan.program
    if program.graph is None:
        raise ValueError(f"program {program.name} has no fx graph to execute; build it with a capture function")
    checked = check_plan(plan)
    values = program.values
    last_read = [-1] * len(values)
    alloc = [0] * len(plan.instructions)
    for i, ins in enumerate(plan.instructions):
        if ins.kind is Kind.COMPUTE:
            op = program.ops[ins.target]
            for v in op.inputs:
                last_read[v] = i
            alloc[i] = sum(values[o].alloc_bytes for o in op.outputs if values[o].owns_storage)
        elif ins.kind is Kind.PREFETCH:
            alloc[i] = values[ins.target].alloc_bytes
    return PreparedPlan(plan=plan, checked=checked, storage_of=tuple(v.storage for v in values),
                        nodes={n.name: n for n in program.graph.graph.nodes}, last_read=tuple(last_read),
                        alloc=tuple(alloc), repeatable=_why_not_repeatable(plan))


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
    (``True``, or a ``Layout`` of the plan; see the module docstring). ``kept_arena``: where a donated step keeps
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


def _check_arena_budget(plan: Plan, layout: Layout) -> None:
    budget = plan.budget_bytes
    if budget is not None and layout.arena_bytes > budget:
        raise BudgetExceeded(
            f"the arena of plan {plan.program.name} takes {layout.arena_bytes} bytes, over its budget of "
            f"{budget}: plan with PlannerConfig(static_layout=True) (plan/run --static-layout), which re-plans "
            f"until the arena fits, or run without the arena")


def place_state(plan: Plan | PreparedPlan, inputs: Sequence[torch.Tensor], transfers: Transfers, *,
                arena: bool | Layout = False) -> tuple[list[torch.Tensor], torch.UntypedStorage | None]:
    """Copies of a step's ``inputs`` where ``plan`` starts them, to donate to its first step: inputs that start
    in remote memory (``plan.initial_remote``) and those that live there for the whole step (a remote KV cache,
    which only lane ops touch) in the backend's remote buffers (``Transfers.input_storage``: pinned host memory
    on CUDA), the others in device storages of the backend, or, with ``arena`` (as ``execute_plan``'s), each in
    its start slot of one new arena (an empty input, which has none, in a device storage of its own). Returns
    the copies and the arena (None without one). Inputs that share a storage share its copy; the caller's
    tensors are left as they are.

    Why the arena: a donated step that finds its state outside an arena copies it into a new one, so the
    device holds the state twice while it does (the arena and the caller's copies). Placed here, the state
    is already in its slots, and a step given this arena (``kept_arena``) moves nothing."""
    prepared = plan if isinstance(plan, PreparedPlan) else prepare_plan(plan)
    plan, program = prepared.plan, prepared.plan.program
    if len(inputs) != len(program.inputs):
        raise ValueError(f"program {program.name} takes {len(program.inputs)} inputs, got {len(inputs)}")
    slots = None
    buffer = None
    if arena is not False and arena is not None:
        prepared = with_arena(prepared, arena)
        _check_arena_budget(plan, prepared.arena.layout)
        slots = prepared.arena.slots
        resident = [t for v, t in zip(program.inputs, inputs) if _starts_on_device(plan, prepared.storage_of[v])]
        like = (resident or list(inputs) or [torch.empty(0)])[0].untyped_storage()
        allocate = getattr(transfers, "arena_storage", None) or transfers.device_storage
        buffer = allocate(prepared.arena.layout.arena_bytes, like)
    copies: dict[int, torch.UntypedStorage] = {}
    placed = []
    for vid, tensor in zip(program.inputs, inputs):
        s = prepared.storage_of[vid]
        copy = copies.get(s)
        if copy is None:
            source = tensor.detach().untyped_storage()
            if not _starts_on_device(plan, s):
                allocate = getattr(transfers, "input_storage", None) or _input_storage
                copy = allocate(source.nbytes(), source)
            elif buffer is not None and (s, -1) in slots:
                offset, nbytes = slots[(s, -1)]
                if nbytes != source.nbytes():
                    raise ArenaOverlap(f"input {program.values[vid].name} has {source.nbytes()} bytes but its slot "
                                       f"in the layout {nbytes}; the program's sizes do not match the tensors "
                                       f"(capture the step again)")
                copy = buffer[offset:offset + nbytes]
            else:
                copy = transfers.device_storage(source.nbytes(), source)
            copy.copy_(source)
            copies[s] = copy
        placed.append(_ViewMeta.of(tensor).view_into(copy))
    return placed, buffer


def _starts_on_device(plan: Plan, s: int) -> bool:
    """Whether storage ``s`` is on the device tier when a step of ``plan`` starts: not an input that starts in
    remote memory (``initial_remote``) nor one that stays there for the whole step (a remote KV cache)."""
    return s not in plan.initial_remote and not plan.program.values[s].remote


def _input_storage(nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
    """A remote buffer for an input that starts a step in remote memory, where the backend has no
    ``input_storage`` of its own: a new storage on ``like``'s device (the reference backends keep both tiers
    there)."""
    return torch.UntypedStorage(nbytes, device=like.device)


class _Step:
    """Mutable state of one step; ``run`` is the interpreter loop."""

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
        self.donate, self.carry = donate, carry
        self.carried = carried if carried is not None else {}
        values = program.values
        self.returned = set(program.outputs)

        self.caller: dict[int, torch.Tensor] = dict(zip(program.inputs, inputs))
        self.slots = prepared.arena.slots if prepared.arena is not None else None
        self.arena_reused = False
        self.writes_into_slot: dict[int, tuple[Any, str, _ViewMeta]] = {}
        if self.slots is not None:
            # Before taking donated inputs: a refusal loses nothing. The kept arena is let go of first, so that it
            # is not held while a new one is allocated if it cannot be reused.
            previous = kept_arena.pop() if kept_arena and donate else None
            if previous is None or not self._reuse_arena(prepared.arena.layout, previous):
                del previous
                self._open_arena(prepared.arena.layout)
            if kept_arena is not None and donate:
                kept_arena.append(self.arena)  # one arena at a time: the one the state will live in
            self.writes_into_slot = prepared.arena.writes_into_slot.get(self.arena.device.type, {})
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
        self.lane_op = getattr(transfers, "lane_op", None)

        for vid, tensor in self.caller.items():
            s = self.storage_of[vid]
            if s in plan.initial_remote:
                self.remote[s] = tensor.untyped_storage()
                self.remembered.setdefault(s, {})[vid] = _ViewMeta.of(tensor)
                self.replaced.add(s)
            else:
                self._wait_carried(tensor.untyped_storage())
                if self.slots is not None and (s, -1) in self.slots:
                    tensor = self._into_arena(vid, tensor)
                self.put(vid, tensor)
        if donate:
            # The executor holds the only references to donated state: keep the layouts of the caller's tensors,
            # not the tensors, so that a storage the plan sends out is freed when the step lets go of it (and,
            # from an arena, the state now lives in the step's arena). Graph constants stay: they are not state,
            # so ``_constants_back`` copies the bytes of mutated ones back into them.
            inputs_on_device = [v for v in program.inputs if self.storage_of[v] not in plan.initial_remote]
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

    # --- the arena --------------------------------------------------------------------------------
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
        return self.env[self.program.node_values[node.name]]

    # --- transfers --------------------------------------------------------------------------------
    def _wait_carried(self, storage: torch.UntypedStorage) -> None:
        """A previous step may still be writing this caller storage (a carried offload): finish that first."""
        handle = self.carried.pop(storage.data_ptr(), None) if self.carried else None
        if handle is not None:
            self._block(handle)

    def _block(self, handle: Any) -> None:
        start = time.perf_counter()
        self.transfers.synchronize(handle)
        self.copy_wait_s += time.perf_counter() - start

    def _finished(self, flight: _InFlight) -> None:
        """The step has seen ``flight`` finish: its device storage no longer counts on its behalf."""
        if flight.held:
            flight.held = False
            self._let_go(flight.device)
            flight.device = None

    def _poll(self) -> None:
        """Let go of the device storages held by offloads that have finished."""
        if self.holding:
            for flight in self.holding:
                if self.transfers.is_done(flight.handle):
                    self._finished(flight)
            self.holding = [f for f in self.holding if f.held]

    def _make_room(self, nbytes: int) -> None:
        """Wait for offloads of storages the device tier has let go of, oldest first, until ``nbytes`` more
        fit under the budget (the simulator's memory stall)."""
        budget = self.plan.budget_bytes
        if budget is None or self.bytes.total + nbytes <= budget:
            return
        self._poll()
        start = time.perf_counter()
        for flight in list(self.holding):
            if self.bytes.total + nbytes <= budget:
                break
            if not self._referenced_elsewhere(flight.device):
                self.transfers.synchronize(flight.handle)
                self._finished(flight)
        self.holding = [f for f in self.holding if f.held]
        self.memory_wait_s += time.perf_counter() - start

    def _referenced_elsewhere(self, storage: torch.UntypedStorage) -> bool:
        """Whether something besides one transfer (the device tier, another transfer) references ``storage``."""
        return self.bytes.references(storage) > 1

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, on_instruction: Callable[[int], None] | None) -> PlanRun:
        start = time.perf_counter()
        initial_bytes = self.bytes.total
        live: list[int] = []
        i = -1
        try:
            with torch.no_grad():
                for i, ins in enumerate(self.plan.instructions):
                    if self.alloc[i]:
                        self._make_room(self.alloc[i])
                    self._execute(i, ins)
                    if self.lanes:
                        self._land_finished()
                    self._poll()
                    live.append(self.bytes.total)
                    if self.plan.budget_bytes is not None and self.bytes.total > self.plan.budget_bytes:
                        raise BudgetExceeded(
                            f"instruction #{i} ({ins.describe(self.program)}): measured {self.bytes.total} device "
                            f"bytes, over the budget of {self.plan.budget_bytes}")
                    for freed in self.checked.frees_after[i]:
                        if self.lanes:
                            self._await_producer(freed)
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

    def _execute(self, i: int, ins) -> None:
        s = ins.target
        program, values = self.program, self.program.values
        if ins.kind is Kind.COMPUTE:
            op = program.ops[s]
            if op.lane is not None:
                self._issue_lane(i, op)
                return
            if self.lanes:
                self._await_lanes(self.deps[s])
            node = self.nodes[op.name]
            outputs = self._run_into_slot(i, op, node) if self.slots is not None else None
            if outputs is None:
                outputs = run_op(program, op, node, self.lookup)
                if self.slots is not None:
                    outputs = list(outputs)
                    self._outputs_into_arena(i, op, outputs)
            for vid, tensor in zip(op.outputs, outputs):
                self.put(vid, tensor)
            for w in {self.storage_of[v] for v in op.mutates}:
                self.remote.pop(w, None)  # stale now; check_plan forbids prefetching it
        elif ins.kind is Kind.OFFLOAD:
            if self.lanes:  # a lane op still writing the storage: copy its result, not what was there before
                for flight in [f for f in self.lanes.values() if s in f.writes]:
                    self._await_lane(flight)
            source = self.device_storage(s, i)
            target = self.remote_home.get(s)
            if target is None:
                target = self.transfers.remote_storage(s, source.nbytes(), source)
            handle = self.transfers.offload(values[s].name, source, target)
            self._track(_InFlight(Kind.OFFLOAD, s, handle, source, target))
            self.remote[s] = target
            self.d2h += source.nbytes()
        elif ins.kind is Kind.RELEASE:
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
        elif ins.kind is Kind.PREFETCH:
            source = self.remote[s]
            if self.slots is None:
                storage = self.transfers.device_storage(source.nbytes(), source)
            else:
                storage = self._slot(s, i)
                if storage.nbytes() != source.nbytes():
                    raise ArenaOverlap(f"{self._where(i)}: the remote copy of {values[s].name} has "
                                       f"{source.nbytes()} bytes but its slot {storage.nbytes()}")
            previous = self.in_flight.get(s)
            if previous is not None and previous.kind is Kind.OFFLOAD:
                dependency = previous.handle  # the lanes order the prefetch after the offload that fills `source`
            else:
                dependency = self.carried.pop(source.data_ptr(), None) if self.carried else None
            handle = self.transfers.prefetch(values[s].name, source, storage, dependency)
            self._track(_InFlight(Kind.PREFETCH, s, handle, storage, source))
            self.h2d += storage.nbytes()
        elif ins.kind is Kind.WAIT:
            flight = self.in_flight.pop(s, None)
            if flight is None:
                raise RuntimeError(f"instruction #{i}: wait for {values[s].name}, whose transfer never happened")
            start = time.perf_counter()
            self.transfers.wait(flight.handle)
            self.copy_wait_s += time.perf_counter() - start
            self._landed(flight)

    # --- lane ops ---------------------------------------------------------------------------------
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

    def _track(self, flight: _InFlight) -> None:
        self.bytes.hold(flight.device)
        self.started.append(flight)
        if flight.kind is Kind.OFFLOAD:
            self.holding.append(flight)
        self.in_flight[flight.storage] = flight  # a prefetch after an offload replaces it: the lanes order them

    def _landed(self, flight: _InFlight) -> None:
        """A waited transfer: a prefetched storage's views become readable; the transfer's hold ends."""
        if flight.kind is Kind.PREFETCH:
            for vid, meta in self.remembered.pop(flight.storage, {}).items():
                self.put(vid, meta.view_into(flight.device))
        self._finished(flight)

    def _finish(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Complete the step's transfers (or carry the last offloads of donated state), then build results."""
        program = self.program
        for lane in list(self.lanes.values()):  # every lane op has finished when the step returns
            self._await_lane(lane)
        returned = {self.storage_of[v] for v in program.outputs}
        for s, flight in sorted(self.in_flight.items()):
            if (self.carry and flight.kind is Kind.OFFLOAD and flight.remote is self.remote_home.get(s)
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
            elif flight.kind is Kind.OFFLOAD and not self.transfers.is_done(flight.handle):
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


def _why_not_repeatable(plan: Plan) -> str | None:
    """Why ``plan`` cannot run on its own results (it leaves an input in another tier than it starts in)."""
    program = plan.program
    on_device = {program.values[v].storage: program.values[v].storage not in plan.initial_remote
                 for v in program.inputs}
    for ins in plan.instructions:
        if ins.target in on_device and ins.kind in (Kind.PREFETCH, Kind.RELEASE):
            on_device[ins.target] = ins.kind is Kind.PREFETCH
    moved = [program.values[s].name for s, here in on_device.items() if here != (s not in plan.initial_remote)]
    if not moved:
        return None
    return (f"the plan leaves {moved[0]} (and {len(moved) - 1} more) in a different tier than it starts in, so "
            f"it cannot run step after step on its own state; run it in place (donate=False) or add the missing "
            f"prefetch or offload")


__all__ = ["ArenaOverlap", "ArenaSlots", "BudgetExceeded", "PlanRun", "PreparedPlan", "SyncTransfers", "TransferError",
           "Transfers", "arena_slots", "execute_plan", "prepare_plan", "run_lane_inline", "run_plan", "with_arena"]
