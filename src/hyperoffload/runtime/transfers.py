"""How copies between the tiers run (the ``Transfers`` backend protocol), and how a step keeps track of them.

``SyncTransfers`` copies at once on the caller's thread (the reference, which runs lane ops inline too);
``hyperoffload.runtime.emulated_link`` runs copies, lane ops included, on throttled copy threads and
``hyperoffload.runtime.cuda_streams`` on CUDA side streams. A step records every transfer it starts
(``_InFlight``): the device storage it reads or writes keeps counting as device bytes until the step has seen
it finish, and an allocation that would not fit the budget waits for offloads of storages already let go of.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hyperoffload.instructions import COPIES_IN, COPIES_OUT, Kind


class TransferError(RuntimeError):
    """A copy failed (or was cancelled because the step stopped); raised on the thread that runs the step."""


class Transfers(Protocol):
    """How copies between the tiers run. A *handle* is whatever ``offload``/``prefetch``/``lane_op`` return."""

    def device_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        """A new device storage of ``nbytes`` (for a prefetch), allocated where ``like``'s tier lives."""

    def remote_arena(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        """A remote buffer of ``nbytes`` that a step's offloads copy into, each at its offset (``remote_layout``):
        the same buffer for every step asking for that many bytes, so a copy still landing when a step returns
        stays where the next step looks for it. ``like``: a device storage, for a backend whose remote tier is
        on the device's side."""

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

    def remote_arena(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
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


class _TransferTracking:
    """The interpreter step's side of its transfers: holding their device storages, seeing them finish, waiting.

    A mixin of ``interpreter._Step``, whose state it uses: ``transfers``, ``bytes`` (``_DeviceBytes``),
    ``holding``, ``started``, ``in_flight``, ``carried``, ``remembered``, ``plan``, the wait counters
    (``copy_wait_s``, ``memory_wait_s``), and the device tier's ``put`` and ``_let_go``.
    """

    __slots__ = ()

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

    def _track(self, flight: _InFlight) -> None:
        self.bytes.hold(flight.device)
        self.started.append(flight)
        if flight.kind in COPIES_OUT:  # it reads the device storage, which counts until the copy has finished
            self.holding.append(flight)
        self.in_flight[flight.storage] = flight  # a prefetch after an offload replaces it: the lanes order them

    def _landed(self, flight: _InFlight) -> None:
        """A waited transfer: a prefetched storage's views (a copy in, ``COPIES_IN``) become readable; the transfer's
        hold ends."""
        if flight.kind in COPIES_IN:
            for vid, meta in self.remembered.pop(flight.storage, {}).items():
                self.put(vid, meta.view_into(flight.device))
        self._finished(flight)
