"""Keep freed host memory in the process for reuse: ``keep_freed_host_memory``.

A training step on the CPU allocates and frees the same buffers every step. With glibc's default
malloc settings a freed block of more than 128 KiB is either unmapped or, at the top of the heap, trimmed
back to the operating system, and the next step's allocation of it faults in new pages, one minor page
fault per 4 KiB page. A step whose copies hold buffers a little longer (an asynchronous offload holds its
source until the copy lands) frees them in another order and hits this more often (measured in
``docs/runtime.md``, "Host memory").

``keep_freed_host_memory`` raises glibc's mmap and trim thresholds (``mallopt``), so that blocks up to
the mmap ceiling (32 MiB on 64-bit glibc) come from the heap and freed memory stays there to be handed out
again, as PyTorch's caching allocator keeps a GPU's memory. The process's resident memory then stays at its
high-water mark instead of shrinking between steps. It changes malloc for the whole process, so nothing in
this package calls it on its own: a program that runs steps on the CPU calls it once, before its loop (the
example and the benchmark do). Without glibc it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""Blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit systems)."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free bytes at the heap's top that glibc keeps before giving any back (the most ``mallopt`` takes)."""


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of returning it to the operating system (see the
    module docstring); whether the settings took (False where the C library is not glibc)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                               TRIM_THRESHOLD_BYTES))


__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_host_memory"]
