"""A copy lane's reservations, in the time of the compute stream's no-stall schedule.

Copies are issued at op boundaries (when the compute stream reaches them), so reservations start
at an op's start time. Keeping each lane's reservations disjoint and issuing copies in the order of
their reservations makes the FIFO lanes of the simulator run them when the planner expected.
"""

from __future__ import annotations

import bisect


class Lane:
    """Disjoint busy intervals [start, end) in seconds.

    Reservations closer than ``min_gap`` seconds are merged: no copy shorter than that will be
    booked, so such a gap could never be used, and merging keeps searches short on a busy lane.

    Reservations are only ever added, so a position found busy for a copy stays busy for it. Each search
    remembers how far it got (``_searched``), and the same search asked again, as the planner does for a
    candidate span at every selection step, resumes there instead of walking the busy positions again:
    on a busy lane most searches fail after a long walk. The answers are those of a search from scratch.
    The ``op_start`` lists searched must not change between calls.
    """

    def __init__(self, min_gap: float = 0.0) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.min_gap = min_gap
        self._searched: dict[tuple, int] = {}
        """(search, its fixed arguments) -> earliest: every position from ``lowest`` below this one is busy;
        latest: every position from the first candidate down to above this one is busy."""
        self._start_lists: dict[int, list[float]] = {}
        """The ``op_start`` lists the searches were keyed by (``id``), held so that no other list takes the id of
        one while this lane lives: a reused id would hand a search another list's result."""

    def earliest(self, op_start: list[float], lowest: int, duration: float, limit: int) -> int:
        """The first position q in [lowest, limit) whose start (``op_start``, ascending, seconds) leaves
        ``duration`` free, or -1."""
        starts, ends = self.starts, self.ends  # hot loop: local names
        bisect_left = bisect.bisect_left
        self._start_lists.setdefault(id(op_start), op_start)
        key = (False, id(op_start), lowest, duration)
        q = self._searched.get(key, lowest)
        while q < limit:
            begin = op_start[q]
            end = begin + duration
            j = _blocker(starts, ends, begin, end)
            if j < 0:
                break
            while j + 1 < len(starts) and starts[j + 1] - ends[j] < duration:
                j += 1  # a gap shorter than the copy: whatever starts in it runs into the next reservation
            q = max(q + 1, bisect_left(op_start, ends[j]))
        self._searched[key] = q
        return q if q < limit else -1

    def latest(self, op_start: list[float], highest: int, duration: float, deadline: float, lowest: int) -> int:
        """The last position q in [lowest, highest] with start + duration <= deadline and free, or -1."""
        starts, ends = self.starts, self.ends
        bisect_right = bisect.bisect_right
        self._start_lists.setdefault(id(op_start), op_start)
        key = (True, id(op_start), highest, duration, deadline)
        q = self._searched.get(key)
        if q is None:
            q = min(highest, bisect_right(op_start, deadline - duration) - 1)
        while q >= lowest:
            begin = op_start[q]
            end = begin + duration
            j = _blocker(starts, ends, begin, end)
            if j < 0:
                break
            while j > 0 and starts[j] - ends[j - 1] < duration:
                j -= 1  # a gap shorter than the copy: whatever ends in it started in the previous reservation
            q = min(q - 1, bisect_right(op_start, starts[j] - duration) - 1)
        self._searched[key] = q
        return q if q >= lowest else -1

    def reserve(self, begin: float, end: float) -> None:
        k = bisect.bisect_left(self.starts, begin)
        if k > 0 and self.ends[k - 1] + self.min_gap > begin:  # join the reservation before
            k -= 1
            begin = self.starts[k]
            end = max(end, self.ends[k])
            del self.starts[k], self.ends[k]
        while k < len(self.starts) and end + self.min_gap > self.starts[k]:  # and those after
            end = max(end, self.ends[k])
            del self.starts[k], self.ends[k]
        self.starts.insert(k, begin)
        self.ends.insert(k, end)


def _blocker(starts: list[float], ends: list[float], begin: float, end: float) -> int:
    """Index of a reservation overlapping [begin, end) among sorted, disjoint ones, or -1: only the one at
    or before ``begin`` and the one after it can."""
    k = bisect.bisect_right(starts, begin) - 1
    if k >= 0 and ends[k] > begin and starts[k] < end:
        return k
    if k + 1 < len(starts) and starts[k + 1] < end:
        return k + 1
    return -1
