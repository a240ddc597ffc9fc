"""The cache operators: offload, prefetch, wait and release, as ``torch.library`` operators.

A lowered plan (``hyperoffload.lower``) is an ordinary ``torch.fx`` graph in which data movement
is spelled as calls of these four operators, so the graph can be printed, traced and run like any
other. They mirror the cache operators MindSpore inserts for HyperOffload:

======================================  ==========================  ===================================
operator                                MindSpore                   plan instruction (``plan.Kind``)
======================================  ==========================  ===================================
``hyperoffload::offload(x)``            ``UpdateToRemote``          ``OFFLOAD``: device -> remote copy
``hyperoffload::prefetch(remote)``      ``UpdateToDevice``          ``PREFETCH``: remote -> device copy
``hyperoffload::wait(x)``               stream/event sync           ``WAIT``: a transfer has finished
``hyperoffload::release(x)``            ``Free``                    ``RELEASE``: drop the device copy
``hyperoffload::offload.into(x, r)``    ``UpdateToRemote``          none: state sent home (``lower_plan``)
======================================  ==========================  ===================================

Which operator each instruction kind lowers to is stated by the kind's rule (``instructions.RULES``, its
``operator``); ``KIND_OPERATORS`` resolves those names to the operators defined here. The NSA block operators
(``prefetch_blocks`` and the other lane ops a decode step calls itself) share the namespace but live in
``hyperoffload.block_ops``, with their byte-count rules; import them from there.

``release.live(x, live)`` is ``release(x)`` that also names ``live``, the values computed from ``x``
before the release and read after it, so that a compiler computing values where they are read
(Inductor) computes those before the release; the backend's Inductor route writes it
(``hyperoffload.compile.inductor.realize_before_releases``), lowered plans never do.

The first four are the smallest set that lets a plan say everything it needs: a copy in each direction, a
point where the compute stream depends on a copy (so copies can be issued early and overlap
compute), and a point where device memory is given back (separate from the copy, so a tensor
can be offloaded early and still be read until its last use).

The unit of transfer is a whole *storage*, not a tensor: ``offload`` and ``prefetch`` return a
flat, one-dimensional buffer holding every element of the storage, so that every view sharing
that storage (a transpose, a reshape, the result of an in-place op) can be rebuilt on the copy
with ``aten.as_strided`` using its original size, stride and storage offset. The buffer has the
dtype of the tensor passed in and ``storage bytes // element size`` elements; a lowered plan
always passes the storage owner's tensor, or a flat buffer of it, so buffers have the owner's dtype.

Kernels exist for CPU tensors, where "remote memory" is simply another host allocation. Those below are the
Python kernels; on a machine with a C++ compiler a step on a ``NativeLink`` loads C++ ones
(``hyperoffload.runtime.native_kernels``), which become the CPU kernels, keep an ``AsyncCopies``' bookkeeping on
the C++ side and call these (as the ``_python_*`` operators) for every other use. They copy
synchronously unless the caller runs the graph inside ``copies_on(copies)``: then ``offload`` and
``prefetch`` start their copy on ``copies.client`` (a client of a ``NativeLink`` or an ``EmulatedLink``) and
return the destination buffer at once, ``wait`` blocks until the copy that made
its argument has completed, and ``release`` drops nothing itself: the engine holds both buffers of a
copy until it is through with them, so the device copy goes when the graph's last reference and the
copy are both gone. The ``torch.compile`` backend installs its ``AsyncCopies`` around each call of
a compiled graph (``hyperoffload.backend(..., link=...)``); nothing else finds it. A CUDA kernel must
put the remote buffer in pinned host memory. Every operator has a fake (meta) implementation, so
graphs using them trace under ``make_fx`` and ``FakeTensorMode`` without touching data, and all four
are marked side-effectful so dead-code elimination (fx's, and Inductor's, which keeps them as
fallback kernels) keeps them.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from hyperoffload.runtime.host_buffers import HostBuffers

from hyperoffload.block_ops import NAMESPACE
from hyperoffload.instructions import RULES, Kind


@dataclass(eq=False, slots=True, kw_only=True)
class AsyncCopies:
    """Where the cache operators' copies run while a graph is called inside ``copies_on(self)``.

    ``client`` issues the copies (the ``Transfers`` protocol of ``hyperoffload.runtime``: ``offload(label,
    src, dst)`` and ``prefetch(label, src, dst, after)`` return a handle with ``wait()`` and ``done()``;
    an ``EmulatedLink.client()`` for a step on the CPU, a ``CudaCopyStreams`` for one on a GPU). A handle that
    also has ``free_after()`` (a GPU copy) is one whose source may be read by the copy after the host has moved
    on: a release of that source calls it, whatever ``release_waits`` says, so that its memory is handed out
    again only after the copy. A copy started in one call may be waited for in a later one (a saved
    activation offloaded in the forward and waited for in the backward), so one ``AsyncCopies`` serves
    every call of a compiled step, one call at a time.
    """

    client: Any
    pending: dict[int, tuple[Any, torch.UntypedStorage]] = field(default_factory=dict)
    """The copy in flight into each destination buffer not yet waited for, by the buffer's storage address
    (the storage is held with it, so no other buffer can take that address meanwhile)."""
    waits: int = 0
    """How many ``wait`` calls found a copy of theirs to wait for."""
    overlapped_waits: int = 0
    """How many of those found another copy started by these operators (the latest one not yet waited for) not
    completed when they began: copies in flight together, overlapping the graph's compute (never, when copies are
    synchronous)."""
    h2d_bytes: int = 0
    """Bytes the prefetches started here copied (or are copying) to the device, in all."""
    d2h_bytes: int = 0
    """Bytes the offloads started here copied (or are copying) to remote memory, in all."""
    release_waits: bool = False
    """Whether a ``release`` blocks until the offload still reading its storage has completed, so that the device
    copy is gone when the release returns, as a plan counts it; otherwise the copy holds the storage until it is
    through, and the graph runs on meanwhile (holding more device memory than the plan counted)."""
    reading: dict[int, tuple[Any, torch.UntypedStorage]] = field(default_factory=dict)
    """The offload reading each device storage, by the storage's address, in the order they were issued; the storage
    is held with it until the offload has completed (a GPU copy's handle does not hold its source)."""
    release_stalls: int = 0
    """How many releases found the offload of their storage still running (and, with ``release_waits``, waited)."""
    release_wait_s: float = 0.0
    """Seconds the graph's thread spent blocked in releases, waiting for offloads to complete (``release_waits``)."""
    wait_s: float = 0.0
    """Seconds the graph's thread spent blocked in ``wait``, for copies not completed yet."""

    remote_buffers: HostBuffers = field(default_factory=HostBuffers)
    """Where the offloads of a step on the CPU get their remote buffers: reused across steps, so that a copy does
    not fault in new pages each time (a GPU's page-locked buffers come from PyTorch's caching host allocator)."""

    native_kernels: bool = True
    """Whether copies on a ``NativeLink`` go through the operators' C++ kernels (``hyperoffload.runtime.native_kernels``),
    which keep this bookkeeping on the C++ side (``native``) and cost a step about a microsecond per operator; where
    they cannot be built, a warning says why and the Python kernels run. ``release_waits`` is read when the object is
    made."""
    move_bytes: bool = True
    """False: copies are issued and timed but move no bytes, so results are wrong; what a step pays for its cache
    operators without the copying (benchmarks). Only with the C++ kernels (``native``)."""
    native: Any = field(default=None, init=False)
    """The ``NativeState`` the C++ kernels keep this object's copies in, or None (the Python kernels keep them in
    ``pending``, ``reading`` and ``remote_buffers``). Its counters are copied into this object's fields each time a
    ``copies_on`` block ends."""

    _prune_at: int = 64
    """Entries of ``pending`` and ``reading`` together past which ``started`` forgets completed copies (then twice
    what is left): amortized, so that a call does not scan every copy in flight."""

    def __post_init__(self) -> None:
        from hyperoffload.runtime import native_kernels
        from hyperoffload.runtime.native_link import NativeClient

        if self.native_kernels and isinstance(self.client, NativeClient):
            try:
                self.native = native_kernels.NativeState(self.client.link, release_waits=self.release_waits,
                                                         move_bytes=self.move_bytes)
            except native_kernels.NativeKernelsUnavailable as error:
                _warn_python_kernels(error)
        if not self.move_bytes and self.native is None:
            raise ValueError("AsyncCopies(move_bytes=False) needs the C++ kernels: a NativeLink's client, and "
                             "native_kernels=True where they can be built")

    def drain(self) -> None:
        """Block until every copy started here has moved its bytes (the client's ``drain``, and the C++ kernels'), and
        forget them and the remote buffers kept for reuse: what a step that stopped half-way, or a trial run, calls,
        so that the next step finds no record of a copy it never waited for (a failed one would fail the next step's
        prefetch of the same buffer), and host memory keeps no buffers of a plan that will not run again."""
        if self.native is not None:
            self.native.drain()
        self.client.drain()
        self.pending.clear()
        self.reading.clear()
        self.remote_buffers.clear()

    def _pull_native(self) -> None:
        """Copy the C++ kernels' counters into this object's fields."""
        stats = self.native.stats()
        for name in ("waits", "overlapped_waits", "h2d_bytes", "d2h_bytes", "release_stalls", "release_wait_s",
                     "wait_s"):
            setattr(self, name, getattr(stats, name))

    def offload(self, x: torch.Tensor) -> torch.Tensor:
        """Start copying ``x``'s whole storage into a new remote buffer; return the buffer (``hyperoffload::offload``).
        Called once per transfer inside compiled graphs."""
        storage = x.untyped_storage()
        nbytes, itemsize = storage.nbytes(), x.element_size()
        if nbytes % itemsize:
            return _copy_now(x, REMOTE_DEVICE)
        if x.device.type == "cpu":
            dst = self.remote_buffers.tensor(nbytes // itemsize, x.dtype)
        else:  # page-locked, from PyTorch's caching host allocator, so that the copy is asynchronous DMA
            dst = torch.empty((nbytes // itemsize,), dtype=x.dtype, device=REMOTE_DEVICE, pin_memory=True)
        self.offload_into(storage, dst.untyped_storage())
        return dst

    def offload_into(self, storage: torch.UntypedStorage, into: torch.UntypedStorage) -> None:
        """Start copying the device storage ``storage`` into ``into``, a remote storage of the same size
        (``hyperoffload::offload.into``, and ``offload`` once it has its buffer)."""
        handle = self.client.offload(_LABEL, storage, into)
        self.d2h_bytes += storage.nbytes()
        self._started(handle, into)
        self.reading[storage.data_ptr()] = (handle, storage)

    def _reap(self) -> None:
        """Let go of the device storages of completed offloads, oldest first (an engine completes one direction's
        copies in order): a storage whose offload is its last use has no release, and this is where the graph's
        other references being gone lets it be freed, within a cache operator of its copy completing, as the plan
        counts it (the simulator frees it when the copy lands)."""
        reading = self.reading
        while reading:
            key = next(iter(reading))
            if not _completed(reading[key][0]):
                return
            del reading[key]

    def prefetch(self, remote: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Start copying the remote buffer ``remote`` into a new buffer on ``device``; return it
        (``hyperoffload::prefetch``). A remote buffer whose own offload is still in flight is read once that copy
        has landed."""
        storage = remote.untyped_storage()
        nbytes, itemsize = storage.nbytes(), remote.element_size()
        if nbytes % itemsize:
            return _copy_now(remote, device)
        dst = torch.empty((nbytes // itemsize,), dtype=remote.dtype, device=device)
        into = dst.untyped_storage()
        entry = self.pending.get(storage.data_ptr())
        handle = self.client.prefetch(_LABEL, storage, into, None if entry is None else entry[0])
        self.h2d_bytes += nbytes
        self._started(handle, into)
        return dst

    def _started(self, handle: Any, into: torch.UntypedStorage) -> None:
        """Record ``handle``, the copy into ``into``; let go of completed offloads' storages (``_reap``); now and
        then, forget copies that completed and were never waited for."""
        self._reap()
        if len(self.pending) + len(self.reading) > self._prune_at:
            # A failed copy stays, so that its wait raises the failure.
            for table in (self.pending, self.reading):
                for key in [k for k, (h, _) in table.items() if _completed(h)]:
                    del table[key]
            self._prune_at = max(64, 2 * (len(self.pending) + len(self.reading)))
        self.pending[into.data_ptr()] = (handle, into)

    def released(self, x: torch.Tensor) -> None:
        """``x``'s storage is released: with ``release_waits``, block until the offload reading it has completed
        (raising its ``TransferError`` if it failed: the remote copy the plan counts on is missing)."""
        entry = self.reading.pop(x.untyped_storage().data_ptr(), None)
        if entry is None or _completed(entry[0]):
            return
        self.release_stalls += 1
        free_after = getattr(entry[0], "free_after", None)
        if free_after is not None:  # a GPU copy: its source's memory is handed out again only after it
            free_after()
        elif self.release_waits:
            start = time.perf_counter()
            entry[0].wait()
            self.release_wait_s += time.perf_counter() - start

    def wait_for(self, x: torch.Tensor) -> None:
        """Block until the copy into ``x``'s storage has completed (nothing to do if none is pending)."""
        entry = self.pending.pop(x.untyped_storage().data_ptr(), None)
        if entry is None:
            return
        self.waits += 1
        if self.pending:  # the latest copy only: a wait must not cost the step a scan of every pending copy
            self.overlapped_waits += not next(reversed(self.pending.values()))[0].done()
        start = time.perf_counter()
        entry[0].wait()
        self.wait_s += time.perf_counter() - start
        self._reap()


def _completed(handle: Any) -> bool:
    """Whether a copy has completed without failing (a failed copy's record stays, so that its wait raises)."""
    return handle.done() and getattr(handle, "error", None) is None


_LABEL = "a compiled step's storage"
"""How a copy a cache operator started names what it copies (a failure reads "d2h copy of a compiled step's storage
(4096 bytes) failed: ...", the direction and size saying which)."""

_ACTIVE: contextvars.ContextVar[AsyncCopies | None] = contextvars.ContextVar("hyperoffload_async_copies",
                                                                            default=None)


@contextlib.contextmanager
def copies_on(copies: AsyncCopies | None) -> Iterator[None]:
    """Run the cache operators called inside this block on ``copies`` (synchronously when None)."""
    native = None if copies is None else copies.native
    previous = None
    if native is not None:
        previous = native.activate()
    elif _KERNELS.native:  # the C++ kernels run Python's for this block
        from hyperoffload.runtime import native_kernels
        previous = native_kernels.deactivate()
    token = _ACTIVE.set(copies)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        if previous is not None:
            from hyperoffload.runtime import native_kernels
            native_kernels.reactivate(previous)
        if native is not None:
            copies._pull_native()


@dataclass(slots=True)
class _Kernels:
    """Which kernels the operators have on the CPU."""

    native: bool = False
    """Whether the C++ kernels have been loaded (``hand_cpu_kernels_over``): then they are the CPU kernels, and call
    the Python ones (the ``_python_*`` operators) unless a ``NativeState`` is active."""
    python_cpu: torch.library.Library = field(default_factory=lambda: torch.library.Library(NAMESPACE, "IMPL"))
    """The registrations of the Python kernels of ``offload``, ``offload.into`` and ``prefetch`` for the CPU (``wait``
    and ``release`` have theirs for every device, which a CPU kernel of their own takes over from)."""


_KERNELS = _Kernels()


def hand_cpu_kernels_over() -> None:
    """Withdraw the Python CPU kernels that the C++ kernels (``hyperoffload.runtime.native_kernels.load``) replace;
    called just before that library is loaded."""
    if not _KERNELS.native:
        _KERNELS.python_cpu._destroy()
        _KERNELS.native = True


_WARNED: list[str] = []


def _warn_python_kernels(error: Exception) -> None:
    """Say once per process why a step on a ``NativeLink`` runs the cache operators' Python kernels."""
    if not _WARNED:
        _WARNED.append(str(error))
        warnings.warn(f"{error}\nthe cache operators run their Python kernels: each costs a compiled step several "
                      f"microseconds more", stacklevel=4)


def _copy_now(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new flat buffer on ``device`` holding ``src``'s whole storage, copied now on the caller's thread."""
    flat = _flat_storage(src)
    return flat.clone() if flat.device == device else flat.to(device)


REMOTE_DEVICE = torch.device("cpu")
"""Where remote buffers live: host memory (page-locked when the device is a GPU)."""


def _storage_elements(x: torch.Tensor) -> int:
    """Elements of ``x``'s dtype that fit in its whole storage."""
    return x.untyped_storage().nbytes() // x.element_size()


def _flat_storage(x: torch.Tensor) -> torch.Tensor:
    """A one-dimensional view of ``x``'s whole storage, from storage offset 0, in ``x``'s dtype."""
    return x.as_strided((_storage_elements(x),), (1,), 0)


# ``offload`` and ``prefetch`` are defined from a schema with a CPU kernel rather than with ``custom_op``: they are
# called once per transfer inside compiled graphs, and ``custom_op``'s Python layers (its autograd wrapper and the
# redispatch behind it) cost several times what the kernel itself does per call. They are never differentiated.
torch.library.define(f"{NAMESPACE}::offload", "(Tensor x) -> Tensor")


def offload(x: torch.Tensor) -> torch.Tensor:
    """Copy the whole storage of ``x`` to remote memory; return the remote buffer.

    The result is a new one-dimensional tensor of ``x``'s dtype with ``storage bytes // element
    size`` elements and a storage of its own, holding the storage contents from offset 0 (not just
    the elements ``x`` views). ``x`` is neither changed nor freed: dropping the device copy is
    ``release``'s job. The result lives in host memory (``REMOTE_DEVICE``), page-locked when ``x`` is on a
    GPU. Call ``wait`` on the result before reading it.
    """
    copies = _ACTIVE.get()
    return _copy_now(x, REMOTE_DEVICE) if copies is None else copies.offload(x)


_KERNELS.python_cpu.impl("offload", offload, "CPU")
torch.library.impl(f"{NAMESPACE}::offload", "CUDA")(offload)


@torch.library.register_fake(f"{NAMESPACE}::offload")
def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty((_storage_elements(x),), dtype=x.dtype, device=REMOTE_DEVICE)


# ``offload.into``: the same copy into a remote buffer the caller already has (a step's state, whose caller's tensor
# is its home in remote memory): what would otherwise be an offload into a new buffer and a copy from it.
torch.library.define(f"{NAMESPACE}::offload.into", "(Tensor x, Tensor(a!) remote) -> ()")


def offload_into(x: torch.Tensor, remote: torch.Tensor) -> None:
    """Copy the whole storage of ``x`` into the whole storage of ``remote``, a tensor in remote memory whose storage
    has the same size (it is written, whatever part of it ``remote`` views). Call ``wait(remote)`` before reading
    ``remote``, or handing it back to its owner."""
    storage, into = x.untyped_storage(), remote.untyped_storage()
    if storage.nbytes() != into.nbytes():
        raise ValueError(f"offload.into: the device storage has {storage.nbytes()} bytes, the remote buffer "
                         f"{into.nbytes()}")
    copies = _ACTIVE.get()
    if copies is None:
        into.copy_(storage)
    else:
        copies.offload_into(storage, into)


_KERNELS.python_cpu.impl("offload.into", offload_into, "CPU")
torch.library.impl(f"{NAMESPACE}::offload.into", "CUDA")(offload_into)


@torch.library.register_fake(f"{NAMESPACE}::offload.into")
def _offload_into_fake(x: torch.Tensor, remote: torch.Tensor) -> None:
    return None


torch.library.define(f"{NAMESPACE}::prefetch", "(Tensor remote, Device? device=None) -> Tensor")


def prefetch(remote: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Copy the whole storage of the remote buffer ``remote`` to ``device``; return the device copy.

    ``device``: the device the storage is computed on (None: ``remote``'s own device, as in a step on the CPU,
    where both tiers are host memory). The result is a new one-dimensional tensor, laid out exactly like
    ``offload``'s result, with a storage of its own: views of the offloaded storage are rebuilt on it with
    ``aten.as_strided``. Call ``wait`` on the result before reading it.
    """
    device = remote.device if device is None else torch.device(device)
    copies = _ACTIVE.get()
    return _copy_now(remote, device) if copies is None else copies.prefetch(remote, device)


_KERNELS.python_cpu.impl("prefetch", prefetch, "CPU")
torch.library.impl(f"{NAMESPACE}::prefetch", "CUDA")(prefetch)


@torch.library.register_fake(f"{NAMESPACE}::prefetch")
def _prefetch_fake(remote: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    return torch.empty((_storage_elements(remote),), dtype=remote.dtype,
                       device=remote.device if device is None else device)


# ``wait`` returns its argument's storage, which ``custom_op`` does not allow (its results must be
# fresh tensors), so it is defined from a schema whose alias annotation says so: the result is an
# alias of ``x``, and tracing and functionalization treat it like a view.
torch.library.define(f"{NAMESPACE}::wait", "(Tensor(a) x) -> Tensor(a)")


def wait(x: torch.Tensor) -> torch.Tensor:
    """Complete the transfer that produced ``x`` (an ``offload`` or ``prefetch`` result).

    Inside ``copies_on(copies)`` this blocks until that copy has completed (raising its
    ``TransferError`` if it failed); a synchronous copy has nothing left to wait for. The result is an alias of
    ``x`` (``aten.alias``: the same storage, size, stride and offset); it is a new tensor object
    rather than ``x`` itself because a kernel whose schema says ``Tensor(a) -> Tensor(a)`` must
    return a view, as ``aten.alias`` does. Readers of the transferred data read the result, which
    is what orders them after the wait.
    """
    copies = _ACTIVE.get()
    if copies is not None:
        copies.wait_for(x)
    return torch.ops.aten.alias.default(x)


torch.library.define(f"{NAMESPACE}::release", "(Tensor x) -> ()")


def release(x: torch.Tensor) -> None:
    """Mark the point where the device copy of ``x``'s storage is dropped.

    The kernel does nothing: in a lowered graph no node after the release reads ``x`` or any
    alias of its storage, so the graph's own reference is its last and the memory is returned
    when the executor lets go of it (``torch.fx`` code drops a value after its last use; Inductor
    code compiled by the backend reuses no buffer). A copy still reading the storage (an
    asynchronous ``offload``) holds it until the copy is through, so the device copy is dropped
    once that copy has completed, or, when the active ``AsyncCopies`` has ``release_waits``, before the release
    returns (it waits for that copy).
    """
    _released(x)


torch.library.impl(f"{NAMESPACE}::wait", "CompositeExplicitAutograd")(wait)
torch.library.impl(f"{NAMESPACE}::release", "CompositeExplicitAutograd")(release)


def _released(x: torch.Tensor) -> None:
    copies = _ACTIVE.get()
    if copies is not None:
        copies.released(x)


# ``release.live``: the same release, naming the values computed from ``x`` before the release that are
# read after it. A compiler that computes a value where it is read rather than where it is defined
# (Inductor inlines pointwise ops into their readers) would read ``x`` after its release; as arguments
# of the release they are computed by then (``hyperoffload.compile.inductor``).
torch.library.define(f"{NAMESPACE}::release.live", "(Tensor x, Tensor[] live) -> ()")


def release_live(x: torch.Tensor, live: list[torch.Tensor]) -> None:
    """``release(x)``, after every tensor of ``live`` (values computed before the release) has been computed."""
    _released(x)


torch.library.impl(f"{NAMESPACE}::release.live", "CompositeExplicitAutograd")(release_live)

for _op in (torch.ops.hyperoffload.offload.default, torch.ops.hyperoffload.offload.into,
            torch.ops.hyperoffload.prefetch.default,
            torch.ops.hyperoffload.wait.default, torch.ops.hyperoffload.release.default,
            torch.ops.hyperoffload.release.live):
    # Transfers and frees are the point of the schedule even when nothing reads their result.
    torch.fx.node.has_side_effect(_op)
del _op

OFFLOAD = torch.ops.hyperoffload.offload.default
OFFLOAD_INTO = torch.ops.hyperoffload.offload.into
PREFETCH = torch.ops.hyperoffload.prefetch.default
WAIT = torch.ops.hyperoffload.wait.default
RELEASE = torch.ops.hyperoffload.release.default
RELEASE_LIVE = torch.ops.hyperoffload.release.live

# The Python kernels under names of their own, with their operators' schemas, for the C++ kernels to call when no
# ``NativeState`` is active (``release.live`` calls ``_python_release``: its ``live`` only orders the graph).
for _name, _op, _kernel in (("_python_offload", OFFLOAD, offload), ("_python_offload_into", OFFLOAD_INTO, offload_into),
                            ("_python_prefetch", PREFETCH, prefetch), ("_python_wait", WAIT, wait),
                            ("_python_release", RELEASE, release)):
    _schema = str(_op._schema)
    torch.library.define(f"{NAMESPACE}::{_name}", _schema[_schema.index("("):])
    torch.library.impl(f"{NAMESPACE}::{_name}", "CPU")(_kernel)
del _name, _op, _kernel, _schema


def _resolve(qualified: str) -> torch._ops.OpOverload:
    """The operator named ``namespace::name[.overload]`` (``default`` when no overload is named)."""
    namespace, _, name = qualified.partition("::")
    name, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


KIND_OPERATORS: dict[Kind, torch._ops.OpOverload] = {
    kind: _resolve(rule.operator) for kind, rule in RULES.items() if rule.operator is not None}
"""The cache operator each instruction kind lowers to, for the kinds whose rule names one (``instructions.RULES``'
``operator``; a compute runs its op's own fx node)."""

__all__ = ["AsyncCopies", "KIND_OPERATORS", "NAMESPACE", "OFFLOAD", "OFFLOAD_INTO", "PREFETCH", "RELEASE",
           "RELEASE_LIVE", "WAIT", "copies_on", "offload", "offload_into", "prefetch", "release", "wait"]
