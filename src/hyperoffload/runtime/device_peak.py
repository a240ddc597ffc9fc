"""Measure the device-tier bytes a call holds: on a CPU-only machine, where both tiers are host memory, from the
profiler (``device_peak``); on a GPU, from the caching allocator's counters (``cuda_peak``).

Inductor's compiled code allocates its buffers in C++ (no Python and no dispatcher mode sees them),
so the bytes are read from PyTorch's profiler, which records every allocation and free of the CPU
allocator with its address and the operator it happened in (``profile_memory=True``). An allocation
made inside a cache operator that creates a remote buffer (``hyperoffload::offload``) is remote
memory, as is its free; every other allocation is device memory. A copy engine's thread may free the
device buffer of a copy it has just finished (when the graph let go of it first); the profiler does not
see other threads, so those frees come from the link's own log (``EmulatedLink.device_frees``). ``device_peak`` replays the
events in time order and returns the most device bytes allocated at once during the call, above
what was allocated when it began (the caller adds what its inputs held).

The profiler writes two lines to the process's standard error each time it starts and stops
(kineto's ``profiler_start`` / ``profiler_stop``); they are kept out of the user's terminal by
pointing file descriptor 2 elsewhere for exactly those two moments.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")

REMOTE_ALLOCATING_OPS = frozenset({"hyperoffload::offload"})
"""Operators whose allocations are remote buffers."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DevicePeak:
    """Device-tier allocations of one call (bytes)."""

    peak_bytes: int
    """The most device bytes allocated at once during the call, above those allocated when it began."""
    allocated_bytes: int
    """Device bytes allocated during the call, in all."""
    remote_allocated_bytes: int
    """Remote bytes allocated during the call (the buffers offloads copied into)."""


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 goes to the null device inside the block (Python's ``sys.stderr`` object included)."""
    try:
        saved = os.dup(2)
    except OSError:  # no standard error to speak of
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def device_peak(fn: Callable[[], T], remote_ops: frozenset[str] = REMOTE_ALLOCATING_OPS,
                extra_frees: Sequence[tuple[int, int, int]] = ()) -> tuple[T, DevicePeak]:
    """Call ``fn()`` under the profiler and return its result with its ``DevicePeak``. ``extra_frees``: device
    buffers freed on threads the profiler does not see, as ``(time.time_ns(), address, bytes)``, filled in by the
    time ``fn`` returns (``EmulatedLink.device_frees``)."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.__enter__()
    try:
        result = fn()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    return result, _replay(prof, remote_ops, extra_frees)


def _replay(prof: profile, remote_ops: frozenset[str], extra_frees: Sequence[tuple[int, int, int]]) -> DevicePeak:
    # The profiler's timestamps are nanoseconds of the same wall clock as ``time.time_ns``.
    events = [(at, ptr, -nbytes, False) for at, ptr, nbytes in extra_frees]
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size, _inside(event, remote_ops)))
    events.sort(key=lambda e: e[0])
    remote: set[int] = set()
    held = peak = allocated = remote_allocated = 0
    for _, ptr, size, in_remote_op in events:
        if size > 0 and in_remote_op:
            remote.add(ptr)
            remote_allocated += size
            continue
        if size < 0 and ptr in remote:
            remote.discard(ptr)
            continue
        if size > 0:
            remote.discard(ptr)  # a remote buffer freed where the profiler did not see it; the address is reused
        held += size
        allocated += max(size, 0)
        peak = max(peak, held)
    return DevicePeak(peak_bytes=peak, allocated_bytes=allocated, remote_allocated_bytes=remote_allocated)


def _inside(event, names: frozenset[str]) -> bool:
    parent = event.parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.parent
    return False


def cuda_peak(fn: Callable[[], T], device: torch.device) -> tuple[T, int]:
    """Call ``fn()`` and return its result with the most bytes the CUDA caching allocator had allocated on
    ``device`` at once while it ran (``torch.cuda.max_memory_allocated``), above what was allocated when it began.
    The device is synchronized before and after, so the figure covers every kernel and copy the call queued."""
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - start


__all__ = ["DevicePeak", "REMOTE_ALLOCATING_OPS", "cuda_peak", "device_peak"]
