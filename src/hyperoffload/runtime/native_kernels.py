"""The cache operators' C++ kernels (``cache_kernels.cpp``) for steps whose copies run on a ``NativeLink``.

A compiled step calls a cache operator a few hundred times; with Python kernels each call costs the step's thread
several microseconds behind PyTorch's dispatcher (the Python call, the bookkeeping, the copy thread's foreign
call), which on a small model is a tenth of the step. ``load()`` builds the C++ kernels the first time (a few
seconds: they include PyTorch's headers, which the CPU wheel ships) and makes them the operators' CPU kernels.
An ``AsyncCopies`` over a ``NativeLink`` then keeps its bookkeeping in a ``NativeState`` on the C++ side, and the
kernels issue its copies straight to the copy thread; every other use of the operators (synchronous copies, an
``EmulatedLink``, copies that move nothing) still runs the Python kernels, which the C++ ones call.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from hyperoffload.runtime import native_link
from hyperoffload.runtime.native_build import NativeBuildFailed, NativeLibrary

SOURCE = Path(__file__).with_name("cache_kernels.cpp")


class NativeKernelsUnavailable(NativeBuildFailed):
    """The cache operators' C++ kernels could not be built or loaded."""


def _kernels(copy_thread: Path) -> NativeLibrary:
    """How the kernels are built: against PyTorch's headers and libraries (the wheel's own, as
    ``torch.utils.cpp_extension`` finds them) and its C++ ABI, linked to the copy thread's library ``copy_thread``
    they submit to (found again at load time through rpath)."""
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    flags = ("-O2", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *[f"-I{path}" for path in cpp_extension.include_paths()], str(copy_thread),
             *[f"-L{path}" for path in libs], "-lc10", "-ltorch_cpu",
             f"-Wl,-rpath,{copy_thread.parent}", *[f"-Wl,-rpath,{path}" for path in libs])
    return NativeLibrary(source=SOURCE, compiler_env="CXX", default_compiler="c++", flags=flags,
                         depends_on=torch.__version__, what="the cache operators' C++ kernels")


@functools.cache
def load() -> Path:
    """Build (the first time) and load the C++ kernels; return the library's path. Raises
    ``NativeKernelsUnavailable`` saying why when they cannot be (the Python kernels stay the operators' kernels)."""
    from hyperoffload import cache_ops

    try:
        path = _kernels(native_link.library_path()).build()
    except NativeBuildFailed as error:
        raise NativeKernelsUnavailable(str(error)) from None
    cache_ops.hand_cpu_kernels_over()
    torch.ops.load_library(str(path))
    return path


def built() -> bool:
    """Whether ``load()`` has nothing to compile: the kernels are loaded, or the copy thread and they are built for
    this source, compiler and PyTorch."""
    if load.cache_info().currsize:
        return True
    copy_thread = native_link.COPY_THREAD.target()
    return copy_thread.exists() and _kernels(copy_thread).target().exists()


def available() -> bool:
    """Whether the C++ kernels are loaded, or can be built and loaded here."""
    try:
        load()
    except NativeKernelsUnavailable:
        return False
    return True


def _ops():
    """The C++ library's own operators (``hyperoffload_native``: a state's open, activate, stats, drain, close)."""
    return torch.ops.hyperoffload_native


@dataclass(frozen=True, slots=True)
class NativeStats:
    """A ``NativeState``'s counters (``AsyncCopies``' fields of the same names) and table sizes."""

    waits: int
    overlapped_waits: int
    h2d_bytes: int
    d2h_bytes: int
    release_stalls: int
    release_wait_s: float
    wait_s: float
    pool_bytes: int
    """Bytes of the remote-buffer pool, taken or free."""
    pending: int
    reading: int
    moving: int
    """Copies whose bytes have not moved yet (their storages held until they have)."""


class NativeState:
    """An ``AsyncCopies``' bookkeeping on the C++ side, for copies on ``link`` (a ``NativeLink``); made active on
    the calling thread by ``activate()``. Freed when it is garbage (after its copies have moved)."""

    __slots__ = ("id", "link", "_finalizer", "__weakref__")

    def __init__(self, link: native_link.NativeLink, *, release_waits: bool, move_bytes: bool = True) -> None:
        """``release_waits``: as ``AsyncCopies``'; ``move_bytes`` False: every copy is issued, queued and timed as a
        copy of no bytes (the buffers keep their old contents: results are wrong), which is what a step pays for its
        cache operators without the copying."""
        load()
        self.link = link
        self.id = _ops().open.default(link.open_handle(), float(link.spin_s), bool(release_waits), bool(move_bytes))
        self._finalizer = weakref.finalize(self, _close, self.id, link)

    def activate(self) -> int:
        """Make this state the one the kernels use on this thread; return the id of the one before (0: none)."""
        self.link.open_handle()  # a closed link's copy thread is gone: nothing may wait on it
        return _ops().activate.default(self.id)

    def stats(self) -> NativeStats:
        values = _ops().stats.default(self.id)
        ints = [int(v) for v in values]
        return NativeStats(waits=ints[0], overlapped_waits=ints[1], h2d_bytes=ints[2], d2h_bytes=ints[3],
                           release_stalls=ints[4], release_wait_s=values[5], wait_s=values[6], pool_bytes=ints[7],
                           pending=ints[8], reading=ints[9], moving=ints[10])

    def drain(self) -> None:
        """Block until every copy issued through this state has moved its bytes, then forget them and the remote
        buffers only its pool holds (``AsyncCopies.drain``)."""
        if self.link._handle is not None:
            _ops().drain.default(self.id)


def deactivate() -> int:
    """Make no state active on this thread (the C++ kernels call the Python ones); return the id of the one before."""
    return _ops().activate.default(0)


def reactivate(previous: int) -> None:
    """Make state ``previous`` (0: none) the active one on this thread again."""
    _ops().activate.default(previous)


def _close(state_id: int, link: native_link.NativeLink) -> None:
    _ops().close.default(state_id, link._handle is not None)


__all__ = ["NativeKernelsUnavailable", "NativeState", "NativeStats", "available", "built", "deactivate", "load",
           "reactivate"]
