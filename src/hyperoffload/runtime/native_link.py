"""An emulated link whose copies move on one native thread: ``NativeLink``.

The same link as ``EmulatedLink`` (both tiers host memory; each direction a FIFO of copies on an ideal clock
of ``latency + bytes / bandwidth`` per copy, a copy completing at its ideal end), with the copies moved by a
thread written in C (``copy_thread.c``, compiled with the machine's C compiler on first use and cached) instead
of two Python threads. That thread never takes the GIL, so a compiled step's kernels, which hold the GIL while
they run, never wait for it and it never waits for them; where a core is free of compute threads it spins
briefly between copies rather than sleeping, because waking a thread whose processor has halted costs a virtual
machine tens of microseconds per copy. One thread moves both directions' copies, each direction keeping its own
clock and its own order, taking next the copy an ideal duplex link would start first: the two directions overlap
on the ideal clocks as on a duplex link, while a 2-core machine keeps a core for compute.

What it leaves out, against ``EmulatedLink``: lane ops (an executor runs them inline on its own thread), fault
injection, and cancelling a queued copy (``abort`` lets queued copies finish: each is one ``memmove``).

A handle (``NativeTransfer``) holds both storages of its copy until the bytes have moved, and the link holds
every handle until then, so no buffer a queued copy reads or writes is freed under it. Device buffers are let go
of on the caller's thread (``device_frees`` logs nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from hyperoffload.hardware import Hardware
from hyperoffload.runtime.emulated_link import D2H, H2D, EmulatedLink
from hyperoffload.runtime.host_link import HostLink, RemoteBuffers
from hyperoffload.runtime.native_build import NativeBuildFailed, NativeLibrary

SOURCE = Path(__file__).with_name("copy_thread.c")
_DIRECTION = {H2D: 0, D2H: 1}


class NativeLinkUnavailable(NativeBuildFailed):
    """The native copy thread could not be built (no C compiler, or it failed)."""


COPY_THREAD = NativeLibrary(source=SOURCE, compiler_env="CC", default_compiler="cc",
                            flags=("-O2", "-shared", "-fPIC", "-pthread", "-std=gnu11"), what="NativeLink's copy thread")
"""How the copy thread is built."""


def library_path() -> Path:
    """The compiled copy thread, built from ``copy_thread.c`` with ``$CC`` (default ``cc``) the first time."""
    try:
        return COPY_THREAD.build()
    except NativeBuildFailed as error:
        raise NativeLinkUnavailable(f"{error}\nor use EmulatedLink, whose copy threads are Python") from None


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled copy thread (``library_path``), loaded."""
    target = library_path()
    lib = ctypes.CDLL(str(target))
    lib.ho_create.restype = ctypes.c_void_p
    lib.ho_create.argtypes = [ctypes.c_double] * 5
    lib.ho_submit.restype = ctypes.c_int64
    lib.ho_submit.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_int, ctypes.c_int64]
    lib.ho_poll.restype = ctypes.c_double
    lib.ho_poll.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    lib.ho_start.restype = ctypes.c_double
    lib.ho_start.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    lib.ho_wait.restype = ctypes.c_double
    lib.ho_wait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_double]
    lib.ho_busy.restype = ctypes.c_double
    lib.ho_busy.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ho_moving.restype = ctypes.c_double
    lib.ho_moving.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ho_destroy.argtypes = [ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether the native copy thread can be built and loaded here."""
    try:
        library()
    except (NativeLinkUnavailable, OSError):
        return False
    return True


SPIN_S = 2e-3
"""How long the copy thread spins after its last copy, when a core is free for it (seconds): longer than the gaps
between a step's copies, so that it stays awake through a step, and short enough to leave the core soon after."""


def default_spin_s() -> float:
    """``SPIN_S`` when PyTorch's compute threads leave a core of this process free, else 0: a spinning copy thread
    on a core that one of them needs stalls every parallel region until the scheduler moves it, which made steps
    several times slower."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return SPIN_S if torch.get_num_threads() < cores else 0.0


class NativeTransfer:
    """One copy on a ``NativeLink``: a handle the issuing thread can poll or wait on."""

    __slots__ = ("label", "direction", "nbytes", "what", "error", "end_s", "_start_s", "_link", "_dir", "_seq",
                 "_buffers", "_done")

    def __init__(self, link: NativeLink, label: str, direction: str, nbytes: int, seq: int,
                 buffers: tuple[torch.UntypedStorage, torch.UntypedStorage]) -> None:
        self.label, self.direction, self.nbytes, self.what = label, direction, nbytes, "copy of"
        self.error: BaseException | None = None
        """Always None: a copy on this link cannot fail (the attribute is the ``Transfer`` protocol's)."""
        self._start_s: float | None = None
        self.end_s: float | None = None
        """Ideal end (``time.perf_counter`` seconds), once the bytes have moved."""
        self._link, self._dir, self._seq = link, _DIRECTION[direction], seq
        self._buffers: tuple | None = buffers
        self._done = False

    def settled(self) -> bool:
        """Whether the bytes have moved: the thread will not touch either buffer again (never blocks)."""
        if self._buffers is None:
            return True
        if self._link._handle is None:  # closed: every copy moved before the thread stopped
            self._closed()
            return True
        end_s = self._link._lib.ho_poll(self._link._handle, self._dir, self._seq)
        if end_s < 0:
            return False
        self._moved(end_s)
        return True

    def _moved(self, end_s: float) -> None:
        self.end_s, self._buffers = end_s, None

    def _closed(self) -> None:
        self._buffers, self._done = None, True
        if self.end_s is None:
            self._start_s = self.end_s = 0.0

    @property
    def start_s(self) -> float | None:
        """Ideal start (``time.perf_counter`` seconds) once the bytes have moved, else None; read from the copy
        thread when first asked (0.0 once 65536 later copies of its direction have been issued)."""
        if self._start_s is None and self.settled():
            handle = self._link._handle
            self._start_s = 0.0 if handle is None else self._link._lib.ho_start(handle, self._dir, self._seq)
        return self._start_s

    def done(self) -> bool:
        """Whether the copy has completed (its ideal end has passed); never blocks."""
        if not self._done:
            # ``time.perf_counter`` reads the copy thread's clock (CLOCK_MONOTONIC), without a foreign call.
            self._done = self.settled() and time.perf_counter() >= self.end_s
        return self._done

    def join(self) -> None:
        """Block until the bytes have moved (not until the ideal end)."""
        if self._buffers is not None:
            self._block(complete=False)

    def wait(self) -> None:
        """Block until the copy has completed."""
        if not self._done:
            if self._buffers is not None or time.perf_counter() < self.end_s:
                self._block(complete=True)
            self._done = True

    def _block(self, *, complete: bool) -> None:
        """Wait on the copy thread until the bytes have moved and, with ``complete``, the ideal end has passed."""
        link = self._link
        if link._handle is None:  # closed: every copy moved before the thread stopped
            self._closed()
        else:
            self._moved(link._lib.ho_wait(link._handle, self._dir, self._seq, int(complete), link.spin_s))

    def cancel(self) -> None:
        """Nothing: a copy on this link is one ``memmove``, let finish (``abort`` waits for it)."""

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"NativeTransfer({self.direction} {self.label}, {self.nbytes} bytes, {state})"


class NativeClient(RemoteBuffers):
    """One user's side of a ``NativeLink``: copies into remote buffers of its own, recorded until their bytes
    have moved (``in_flight``)."""

    def __init__(self, link: NativeLink) -> None:
        super().__init__()
        self.link = link
        self._unsettled: deque[NativeTransfer] = deque()

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "link":
            raise AttributeError(name)
        return getattr(self.link, name)

    def _issue(self, direction: str, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage,
               after: NativeTransfer | None) -> NativeTransfer:
        if src.nbytes() != dst.nbytes():
            raise ValueError(f"copy of {label}: source has {src.nbytes()} bytes, destination {dst.nbytes()}")
        link = self.link
        handle = link.open_handle()
        after_dir, after_seq = (-1, 0) if after is None else (after._dir, after._seq)
        seq = link._lib.ho_submit(handle, _DIRECTION[direction], dst.data_ptr(), src.data_ptr(), src.nbytes(),
                                  after_dir, after_seq)
        transfer = NativeTransfer(link, label, direction, src.nbytes(), seq, (src, dst))
        unsettled = self._unsettled
        if len(unsettled) >= 32:  # now and then: a handle whose waiter already saw it settle is let go of sooner
            while unsettled and unsettled[0].settled():
                unsettled.popleft()
        unsettled.append(transfer)
        return transfer

    def in_flight(self) -> int:
        """How many of this client's copies have not moved their bytes yet."""
        self._unsettled = deque(t for t in self._unsettled if not t.settled())
        return len(self._unsettled)

    def drain(self) -> None:
        """Block until every copy this client issued has moved its bytes. Never raises."""
        for t in self._unsettled:
            t.join()
        self._unsettled.clear()

    def close(self) -> None:
        """Let every copy of this client finish and let go of its remote buffers (the link stays open)."""
        self.drain()
        self._remote.clear()

    # --- the Transfers protocol: issuing copies ----------------------------------------------------
    def offload(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage) -> NativeTransfer:
        return self._issue(D2H, label, src, dst, None)

    def prefetch(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage,
                 after: NativeTransfer | None) -> NativeTransfer:
        return self._issue(H2D, label, src, dst, after)

    def abort(self, handles: Sequence[NativeTransfer]) -> None:
        # No copy can be dropped once issued; each is a memmove, so letting them all finish is quick.
        self.drain()


class NativeLink(HostLink):
    """Two directions of an emulated link, remote -> device (H2D) and device -> remote (D2H), moved by one native
    thread (see the module docstring). A ``Transfers`` backend without lane ops; used directly, the link is one
    ``NativeClient`` of itself, for one user at a time, and ``client()`` gives each further user its own."""

    def __init__(self, *, h2d_bw: float, d2h_bw: float, h2d_latency_s: float = 0.0, d2h_latency_s: float = 0.0,
                 spin_s: float | None = None) -> None:
        """Bandwidths in bytes/s, latencies in seconds per copy; ``spin_s``: how long the copy thread, and a
        caller waiting for a copy, spin before they sleep (seconds); None: ``default_spin_s()``."""
        for name, bw in (("h2d", h2d_bw), ("d2h", d2h_bw)):
            if not bw > 0:
                raise ValueError(f"{name} bandwidth must be positive bytes/s, got {bw}")
        for name, latency in (("h2d", h2d_latency_s), ("d2h", d2h_latency_s)):
            if latency < 0:
                raise ValueError(f"{name} latency must be >= 0 seconds, got {latency}")
        spin_s = default_spin_s() if spin_s is None else spin_s
        if spin_s < 0:
            raise ValueError(f"spin_s must be >= 0 seconds, got {spin_s}")
        self._lib = library()
        self.h2d_bw, self.d2h_bw = h2d_bw, d2h_bw
        self.h2d_latency_s, self.d2h_latency_s, self.spin_s = h2d_latency_s, d2h_latency_s, spin_s
        self._handle: int | None = self._lib.ho_create(h2d_bw, d2h_bw, h2d_latency_s, d2h_latency_s, spin_s)
        if not self._handle:
            raise NativeLinkUnavailable("the native copy thread could not be started")
        self._close_lock = threading.Lock()
        self._forked = False
        self._own = NativeClient(self)
        _LIVE.add(self)

    def __repr__(self) -> str:
        return (f"NativeLink(h2d {self.h2d_bw:.3g} B/s + {self.h2d_latency_s:.3g} s, "
                f"d2h {self.d2h_bw:.3g} B/s + {self.d2h_latency_s:.3g} s)")

    def open_handle(self) -> int:
        """The copy thread's handle; a ``RuntimeError`` saying what to do once the link is closed (or was made
        before this process forked): nothing may issue copies to, or wait on, a copy thread that is gone."""
        if self._handle is None:
            raise RuntimeError("the NativeLink is closed; create a new link" if not self._forked else
                               "this NativeLink was made before the process forked, and its copy thread is not in "
                               "this process: create a new NativeLink here")
        return self._handle

    def client(self) -> NativeClient:
        """A new client of this link, with remote buffers and a record of its copies of its own."""
        return NativeClient(self)

    def busy_s(self, direction: str) -> float:
        """Ideal seconds ``direction`` (``"h2d"`` or ``"d2h"``) spent copying, latency included, over its life."""
        return self._lib.ho_busy(self._handle, _DIRECTION[direction])

    def moving_s(self, direction: str) -> float:
        """Wall seconds the copy thread spent moving ``direction``'s bytes (its ``memmove`` calls), over its life:
        against ``busy_s``, how close the memory system came to being slower than the link."""
        return self._lib.ho_moving(self._handle, _DIRECTION[direction])

    @contextlib.contextmanager
    def device_frees(self) -> Iterator[list[tuple[int, int, int]]]:
        """An empty log: this link frees every buffer on the caller's thread, where the profiler sees it."""
        yield []

    def close(self) -> None:
        """Move every copy issued so far, then stop the copy thread."""
        with self._close_lock:
            if self._handle is not None:
                self._lib.ho_destroy(self._handle)
                self._handle = None
        self._own._unsettled.clear()
        self._own._remote.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def in_flight(self) -> int:
        """How many copies issued through the link itself have not moved their bytes yet."""
        return self._own.in_flight()


_LIVE: weakref.WeakSet[NativeLink] = weakref.WeakSet()
"""Every open NativeLink of this process, so that a forked child (a DataLoader worker, say) can disown them: the
child has the parent's memory but not its copy threads, and must never wait for or join one."""


def _disown_after_fork() -> None:
    for link in list(_LIVE):
        link._handle, link._forked = None, True
    _LIVE.clear()


os.register_at_fork(after_in_child=_disown_after_fork)


HOST_LINKS = (EmulatedLink, NativeLink)
"""The emulated links between two pools of host memory (``isinstance`` checks of a ``link=`` argument)."""


def host_link(hardware: Hardware) -> NativeLink | EmulatedLink:
    """The link a step on the CPU copies over by default: a ``NativeLink`` of ``hardware``'s bandwidths and
    latencies, or, where it cannot be built, an ``EmulatedLink`` (same timing, copies slower to issue), with a
    warning saying why."""
    try:
        return NativeLink.for_hardware(hardware)
    except (NativeLinkUnavailable, OSError) as error:
        warnings.warn(f"{error}\nfalling back to EmulatedLink: the same link timing, with each copy costing the "
                      f"step's thread more to issue", stacklevel=3)
        return EmulatedLink.for_hardware(hardware)


__all__ = ["COPY_THREAD", "HOST_LINKS", "NativeClient", "NativeLink", "NativeLinkUnavailable", "NativeTransfer", "available",
           "host_link", "library", "library_path"]
