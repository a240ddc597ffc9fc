"""Pausing Python's cyclic garbage collector around work that makes many objects and no cycles.

Planning an 8B training step makes millions of short-lived objects (instructions, lane searches,
simulator events) on top of a captured program of some 450k. Each full collection walks all of them,
and the collector ran several per plan, a large share of the planning time (docs/results.md, "Planning
results (simulated)", has the figure). Planning leaves no cyclic garbage behind (a collection after
planning with the collector off finds none), so reference counting frees everything it makes and the
collector has nothing to find.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; re-enable it after, if it was enabled before (nested
    blocks, and a caller that disabled it itself, are left as they were)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
