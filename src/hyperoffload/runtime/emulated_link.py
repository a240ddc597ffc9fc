"""An emulated link between two pools of host memory: one copy-engine thread per direction.

The device tier and the remote tier are both host memory on a CPU-only machine; what makes the
remote tier remote is that every copy between them goes through a ``CopyEngine``, a thread that
performs the copies of one direction in the order they were issued and takes as long as the
link would: ``latency + bytes / bandwidth`` per copy, the cost model's transfer time
(``hyperoffload.cost.transfer_time``). Compute runs meanwhile on the caller's thread; the copy
(``Tensor.copy_``) and the waits release the GIL, so the overlap is real.

Timing is kept on an ideal clock per engine: a copy starts at the latest of the moment it was
issued, the moment the previous copy of the engine ended on that clock, and the end of the copy it
depends on; it ends ``latency + bytes / bandwidth`` later (or as long after as the byte copy itself
took, if the memory system is slower than the link). The engine moves the bytes as soon as it
reaches the copy, and the copy *completes* at its ideal end: ``Transfer.done`` is false and
``Transfer.wait`` blocks until then (the waiting thread sleeps out the rest). Nothing can read a
destination before its copy completes (the executor reads a prefetched storage only after waiting,
and counts an offloaded storage as held until the offload completes), so what the step can observe is
a link of exactly that bandwidth and latency. Completing on the clock rather than by having the
engine sleep and wake keeps the engine from competing with compute for the GIL at arbitrary moments,
and late wake-ups of any thread never pile up into a slower link.

Lane ops (``EmulatedLink.lane_op``: a step's own data movement, such as an indexed fetch of KV blocks)
run on the engine of their direction like a copy, in FIFO order with its copies: the engine runs the op's
kernel when it reaches it, after the copies and lane ops it depends on have moved their bytes, and the op
completes ``latency + bytes / bandwidth`` after its ideal start (``bytes``: what the kernel reports it moved),
or as long after as the kernel's CPU time, whichever is later. The kernel runs Python on the engine's
thread, so it shares the GIL with compute: on this emulation a lane op's kernel time is taken from the
compute thread, which a copy engine's DMA would not do; its link time still overlaps compute.

Clients: a ``LinkClient`` (``EmulatedLink.client()``; each ``AsyncExecutor`` takes one) issues copies on the
link's engines into remote buffers of its own, so executors sharing one link, in several threads at once, never
write each other's buffers; used directly, the link is one more client, for one user at a time. A client records
every copy and lane op before it is queued and forgets it once the engine is through with it (``in_flight``).

Faults: an exception in a copy is caught on the engine's thread and stored in the copy's
``Transfer``; ``Transfer.wait`` raises it on the waiting thread as a ``TransferError`` naming
the copy. A copy that depends on a failed one fails too. ``cancel`` drops copies the engine has not
reached, and ``abort``, after cancelling and joining the handles it is given, waits for every other copy
the calling thread handed that client (``drain``): a step stopped after the link accepted a copy but before
the executor kept its handle (an asynchronous ``KeyboardInterrupt`` in between) still hands the link back
idle. Engines are daemon threads; ``close`` stops them.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from hyperoffload.runtime.host_link import HostLink, RemoteBuffers
from hyperoffload.runtime.transfers import TransferError

H2D, D2H = "h2d", "d2h"


class Transfer:
    """One copy on an engine: a handle the issuing thread can poll or wait on."""

    __slots__ = ("label", "direction", "nbytes", "what", "issued_s", "start_s", "end_s", "error", "cancelled",
                 "thread", "_accepted", "_copied")

    def __init__(self, label: str, direction: str, nbytes: int, what: str = "copy of") -> None:
        self.label, self.direction, self.nbytes = label, direction, nbytes
        self.what = what
        """``"copy of"`` for a copy, ``"lane op"`` for a lane op (how errors name it)."""
        self.issued_s = time.perf_counter()
        self.start_s = self.end_s = 0.0
        """Ideal start and end on the engine's clock (``time.perf_counter`` seconds), set once copied."""
        self.error: BaseException | None = None
        self.cancelled = False
        self.thread = threading.get_ident()
        """The thread that issued it."""
        self._accepted: set[Transfer] | None = None  # the client's record of its unsettled copies, left when settled
        # Held until the engine is through with the copy (bytes moved, or failed): a bare lock costs the engine
        # one C call to signal, where an Event would run Python code under the GIL.
        self._copied = threading.Lock()
        self._copied.acquire()

    def done(self) -> bool:
        """Whether the copy has completed (its ideal end has passed), failed or been cancelled; never blocks."""
        if self._copied.locked():
            return False
        return self.error is not None or time.perf_counter() >= self.end_s

    def settled(self) -> bool:
        """Whether the engine is through with the copy: it will not touch either buffer again (never blocks)."""
        return not self._copied.locked()

    def join(self) -> None:
        """Block until the engine is through with the copy, whatever its outcome (not until its ideal end)."""
        if self._copied.locked():
            self._copied.acquire()
            self._copied.release()

    def wait(self) -> None:
        """Block until the copy has completed; raise ``TransferError`` on this thread if it failed."""
        self.join()
        if self.error is not None:
            raise TransferError(f"{self.direction} {self.what} {self.label} ({self.nbytes} bytes) failed: "
                                f"{self.error}") from self.error
        remaining = self.end_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def cancel(self) -> None:
        """Ask the engine to drop this copy if it has not reached it yet."""
        self.cancelled = True

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done() else "in flight"
        return f"Transfer({self.direction} {self.label}, {self.nbytes} bytes, {state})"


class _Fence:
    """A marker in an engine's queue: released when the engine reaches it, so every job queued before it has
    settled by then. It takes no link time."""

    __slots__ = ("reached",)

    def __init__(self) -> None:
        self.reached = threading.Lock()
        self.reached.acquire()


class _Job:
    __slots__ = ("transfer", "src", "dst", "after", "work")

    def __init__(self, transfer: Transfer, src: torch.UntypedStorage | None, dst: torch.UntypedStorage | None,
                 after: Sequence[Transfer], work: Callable[[], int | None] | None = None) -> None:
        self.transfer, self.src, self.dst, self.after, self.work = transfer, src, dst, after, work


def _copy_bytes(dst: torch.UntypedStorage, src: torch.UntypedStorage) -> None:
    """Copy ``src`` into ``dst`` with one ``memmove``: single-threaded, and ctypes releases the GIL for it.

    ``Tensor.copy_`` would split a large copy over ATen's OpenMP pool, whose threads then compete with
    the compute thread's own pool for the same cores and spin at its barriers.
    """
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes())


class CopyEngine:
    """A thread that runs one direction's copies in issue order, throttled to a bandwidth and latency."""

    def __init__(self, direction: str, bandwidth: float, latency_s: float,
                 fault: Callable[[Transfer], None] | None = None) -> None:
        if not bandwidth > 0:
            raise ValueError(f"{direction} bandwidth must be positive bytes/s, got {bandwidth}")
        if latency_s < 0:
            raise ValueError(f"{direction} latency must be >= 0 seconds, got {latency_s}")
        self.direction, self.bandwidth, self.latency_s = direction, bandwidth, latency_s
        self._fault = fault
        self._queue: queue.SimpleQueue[_Job | _Fence | None] = queue.SimpleQueue()
        self._clock = 0.0  # ideal end of the previous copy
        self.busy_s = 0.0
        """Ideal seconds this engine spent copying (latency included), over its life."""
        self._thread = threading.Thread(target=self._loop, name=f"hyperoffload-{direction}", daemon=True)
        self._thread.start()

    def submit(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage,
               after: Transfer | None = None, *, accepted: set[Transfer] | None = None) -> Transfer:
        """Queue a copy of ``src`` into ``dst`` (same size) that starts after ``after`` has finished. ``accepted``:
        a set the copy joins before it is queued and leaves once the engine is through with it."""
        if src.nbytes() != dst.nbytes():
            raise ValueError(f"copy of {label}: source has {src.nbytes()} bytes, destination {dst.nbytes()}")
        return self._enqueue(_Job(Transfer(label, self.direction, src.nbytes()), src, dst,
                                  () if after is None else (after,)), accepted)

    def submit_work(self, label: str, nbytes: int, work: Callable[[], int | None],
                    after: Sequence[Transfer] = (), *, accepted: set[Transfer] | None = None) -> Transfer:
        """Queue a lane op: ``work()`` runs on this engine once every transfer in ``after`` has moved its bytes,
        and returns the bytes it moved (None: ``nbytes``); the op completes when a copy of that many bytes
        would (see the module docstring). ``accepted``: as for ``submit``."""
        return self._enqueue(_Job(Transfer(label, self.direction, nbytes, "lane op"), None, None, tuple(after), work),
                             accepted)

    def _enqueue(self, job: _Job, accepted: set[Transfer] | None) -> Transfer:
        if not self._thread.is_alive():
            raise TransferError(f"the {self.direction} copy engine is closed; create a new link")
        transfer = job.transfer
        if accepted is not None:
            # Recorded before it is queued: whatever stops the issuing thread from here on (an asynchronous
            # KeyboardInterrupt included) cannot leave a queued copy that its client does not know of.
            transfer._accepted = accepted
            accepted.add(transfer)
        self._queue.put(job)
        return transfer

    def fence(self) -> _Fence | None:
        """A marker queued behind every job queued so far; ``fence.reached`` is released once all of them have
        settled (None if the engine is closed, which it is only after running everything queued before)."""
        if not self._thread.is_alive():
            return None
        fence = _Fence()
        self._queue.put(fence)
        return fence

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    free_log: list[tuple[int, int, int]] | None = None
    """While a list: each device buffer this engine's thread frees, as ``(time.time_ns(), address, bytes)``
    (``EmulatedLink.device_frees``)."""

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Fence):
                job.reached.release()
                continue
            transfer = job.transfer
            try:
                self._copy(job)
            except BaseException as error:  # noqa: BLE001 - every failure goes to the waiting thread
                transfer.error = error
            finally:
                log = self.free_log
                if log is not None:
                    # The device side of the copy, if this engine holds its last reference: dropping it frees it.
                    device = job.dst if self.direction == H2D else job.src
                    if (device is not None and sys.getrefcount(device) <= 3
                            and torch._C._storage_Use_Count(device._cdata) == 1):
                        log.append((time.time_ns(), device.data_ptr(), device.nbytes()))
                    device = None
                job.src = job.dst = job.after = job.work = None  # let go of the buffers before anyone is told
                if transfer._accepted is not None:
                    transfer._accepted.discard(transfer)
                transfer._copied.release()

    def _copy(self, job: _Job) -> None:
        transfer = job.transfer
        for after in job.after:
            after.join()
            if after.error is not None:
                raise TransferError(f"it needed {after.direction} {after.what} {after.label}, which "
                                    f"failed") from after.error
        if transfer.cancelled:
            raise TransferError("cancelled before it started")
        start = max(self._clock, transfer.issued_s, *(after.end_s for after in job.after))
        if self._fault is not None:
            self._fault(transfer)
        if job.work is not None:
            # The kernel's own CPU time: run from Python on this thread, its wall time would also count the
            # waits for the GIL that the compute thread holds, which a real copy engine never has.
            working = time.thread_time()
            moved = job.work()
            copied_s = time.thread_time() - working
            if moved is not None:
                transfer.nbytes = moved
        else:
            copying = time.perf_counter()
            if transfer.nbytes:
                _copy_bytes(job.dst, job.src)
            copied_s = time.perf_counter() - copying
        # The link's time, or the memory system's if it is slower; a late start of this thread is not the
        # link's (``done`` also waits for the bytes to be copied, whenever that is).
        end = start + max(self.latency_s + transfer.nbytes / self.bandwidth, copied_s)
        transfer.start_s, transfer.end_s = start, end
        self.busy_s += end - start
        self._clock = end


class LinkClient(RemoteBuffers):
    """One user's side of an ``EmulatedLink`` (a ``Transfers`` backend): copies on the link's two engines, into
    remote buffers of its own, recorded as they are accepted.

    Each ``AsyncExecutor`` on a link takes a client of its own (``EmulatedLink.client``), so executors sharing
    a link, in one thread or several, never write each other's remote buffers; the link's own ``Transfers``
    methods are those of one more client, for a single user at a time. A client is for one step at a time. It
    issues copies itself; the rest (``device_storage``, ``wait``, ``arena_storage`` of a link that has one, ...)
    is the link's.

    Every copy and lane op the client hands an engine joins its record before it is queued and leaves it once
    the engine is through with it, so ``abort`` (the executor's cleanup when a step fails) also settles copies
    the step never recorded: one accepted just before the step was stopped (an asynchronous
    ``KeyboardInterrupt`` between ``offload`` returning and the executor keeping the handle, say).
    """

    def __init__(self, link: EmulatedLink) -> None:
        super().__init__()
        self.link = link
        self._accepted: set[Transfer] = set()  # added to by the issuing thread, left by the engines' threads
        link._clients.add(self)

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "link":
            raise AttributeError(name)
        return getattr(self.link, name)

    def in_flight(self) -> int:
        """How many of this client's copies and lane ops the engines are not through with (that may still touch
        a buffer); 0 once a step has returned without carrying offloads, or has failed."""
        return len(self._accepted)

    def drain(self) -> None:
        """Block until the engines are through with every copy and lane op this thread handed this client,
        recorded by the step or not (it cancels none: ``abort`` cancels those it is given). Never raises."""
        me = threading.get_ident()
        mine = [t for t in tuple(self._accepted) if t.thread == me]
        if not mine:
            return
        # Everything this thread queued is ahead of a fence queued now (an engine runs its queue in order).
        link = self.link
        fences = [engine.fence() for engine in (link.h2d, link.d2h) if any(t.direction == engine.direction
                                                                             for t in mine)]
        for fence in fences:
            if fence is not None:
                fence.reached.acquire()
        for t in mine:
            if not t.settled():  # stopped between joining the record and being queued: it never will run
                t.error = TransferError("stopped before it was queued")
                self._accepted.discard(t)
                t._copied.release()

    def close(self) -> None:
        """Let the engines finish this client's copies and let go of its remote buffers (the link stays open)."""
        self.drain()
        self._remote.clear()

    # --- the Transfers protocol: issuing copies ----------------------------------------------------
    def offload(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage) -> Transfer:
        # Ops run synchronously on the caller's thread, so whatever last wrote ``src`` has finished.
        return self.link.d2h.submit(label, src, dst, accepted=self._accepted)

    def prefetch(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage,
                 after: Transfer | None) -> Transfer:
        return self.link.h2d.submit(label, src, dst, after, accepted=self._accepted)

    def lane_op(self, label: str, lane: str, nbytes: int, work: Callable[[], int | None],
                after: Sequence[Transfer]) -> Transfer:
        """Run a lane op's ``work`` on the engine of ``lane`` (``"h2d"`` or ``"d2h"``), after ``after``; see
        ``hyperoffload.runtime.transfers.Transfers.lane_op``."""
        engine = self.link.h2d if lane == H2D else self.link.d2h if lane == D2H else None
        if engine is None:
            raise ValueError(f"lane op {label}: lane must be {H2D!r} or {D2H!r}, got {lane!r}")
        return engine.submit_work(label, nbytes, work, after, accepted=self._accepted)

    def abort(self, handles: Sequence[Transfer]) -> None:
        # Copies the engines have not reached are dropped; the bytes of the others are already moved, so once
        # the engines are through with them nothing touches a buffer again (their ideal end need not pass). Then
        # the copies this thread handed the client that ``handles`` misses (its caller stopped before keeping
        # them) are waited for too.
        for t in handles:
            t.cancel()
        for t in handles:
            t.join()
        self.drain()


class EmulatedLink(HostLink):
    """Two copy engines, remote -> device (H2D) and device -> remote (D2H), each with its own bandwidth.

    A transfer backend for ``hyperoffload.runtime.interpreter.execute_plan``: both tiers are host
    memory, so storages are plain CPU storages and only the copies cost link time. Used directly, the link
    issues copies as one ``LinkClient`` of its engines, for one user at a time; ``client()`` gives each further
    user (each ``AsyncExecutor``) its own.
    """

    def __init__(self, *, h2d_bw: float, d2h_bw: float, h2d_latency_s: float = 0.0, d2h_latency_s: float = 0.0,
                 fault: Callable[[Transfer], None] | None = None) -> None:
        """Bandwidths in bytes/s, latencies in seconds per copy. ``fault(transfer)``, if given, is called on the
        engine's thread before each copy; what it raises fails that copy (for testing fault handling)."""
        self.h2d = CopyEngine(H2D, h2d_bw, h2d_latency_s, fault)
        self.d2h = CopyEngine(D2H, d2h_bw, d2h_latency_s, fault)
        self._clients: weakref.WeakSet[LinkClient] = weakref.WeakSet()
        self._own = LinkClient(self)

    def __repr__(self) -> str:
        return (f"EmulatedLink(h2d {self.h2d.bandwidth:.3g} B/s + {self.h2d.latency_s:.3g} s, "
                f"d2h {self.d2h.bandwidth:.3g} B/s + {self.d2h.latency_s:.3g} s)")

    def client(self) -> LinkClient:
        """A new client of this link's engines, with remote buffers and a record of its copies of its own."""
        return LinkClient(self)

    @contextlib.contextmanager
    def device_frees(self) -> Iterator[list[tuple[int, int, int]]]:
        """Inside the block, the device buffers the engines' threads free (a copy's engine held the last reference
        when it finished) are logged, as ``(time.time_ns(), address, bytes)``: PyTorch's profiler records only the
        thread it runs on (``hyperoffload.runtime.device_peak``)."""
        log: list[tuple[int, int, int]] = []
        self.h2d.free_log = self.d2h.free_log = log
        try:
            yield log
        finally:
            self.h2d.free_log = self.d2h.free_log = None

    def in_flight(self) -> int:
        """How many copies and lane ops of this link's clients (its own use included) the engines are not
        through with."""
        return sum(c.in_flight() for c in list(self._clients))

    def close(self) -> None:
        """Stop both engines (after the copies already queued) and let go of every client's remote buffers."""
        self.h2d.close()
        self.d2h.close()
        for c in list(self._clients):
            c._remote.clear()

    def lane_op(self, label: str, lane: str, nbytes: int, work: Callable[[], int | None],
                after: Sequence[Transfer]) -> Transfer:
        """Run a lane op's ``work`` on the engine of ``lane``; see ``LinkClient.lane_op``."""
        return self._own.lane_op(label, lane, nbytes, work, after)


__all__ = ["D2H", "H2D", "CopyEngine", "EmulatedLink", "LinkClient", "Transfer"]
