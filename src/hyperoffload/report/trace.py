"""A simulated step as a Chrome / Perfetto trace (JSON), to browse in ui.perfetto.dev or chrome://tracing.

One process named after the plan; one track per stream (compute, h2d, d2h; net and host where the step has
collectives or host ops) plus a "stalls" track
for the compute stream's waits; device memory (and the budget, if given) as counters. Times in the
trace are microseconds from the start of the step, as the format requires.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hyperoffload.simulate import COMPUTE, D2H, H2D, HOST, NET, Timeline

_PID = 1
STALLS = "stalls"
# Track ids and the order tracks are shown in: the stalls track sits under compute because every
# stall is the compute stream waiting.
_TRACKS = ((COMPUTE, 1, 0), (STALLS, 4, 1), (H2D, 2, 2), (D2H, 3, 3), (NET, 5, 4), (HOST, 6, 5))
_TID = {stream: tid for stream, tid, _ in _TRACKS}
_TRACK_NAMES = {COMPUTE: "compute", STALLS: "stalls (compute waiting)", H2D: "h2d (prefetch)",
                D2H: "d2h (offload)", NET: "net (collectives)", HOST: "host (CPU ops)"}
MEMORY_COUNTER = "device memory"
BUDGET_COUNTER = "memory budget"


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _us(ns: int) -> float:
    """Microseconds with nanosecond resolution.

    Whole nanoseconds keep the file short, and since readers round ``ts * 1000`` back to
    nanoseconds, an event that ends where the next one starts shares its boundary exactly
    instead of overlapping it by a rounding error (which would nest the slices).
    """
    return ns / 1000


def timeline_to_trace(timeline: Timeline, *, name: str, budget_bytes: int | None = None) -> dict[str, Any]:
    """The trace of ``timeline`` as a JSON-ready dict (``ts``/``dur`` in microseconds, memory in bytes).

    Each interval becomes a complete event named by its label, with ``args.instruction`` its index
    in the plan; each stall a complete event named by its cause on the stalls track; every memory
    change a ``"device memory"`` counter sample. With ``budget_bytes``, a flat ``"memory budget"``
    counter spans the step.
    """
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": _PID, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": _PID, "tid": 0, "args": {"sort_index": 0}},
    ]
    # A sharded step's collectives, a host-optimizer step's host ops: their tracks only where they ran.
    used = {iv.stream for iv in timeline.intervals}
    for stream, tid, order in _TRACKS:
        if stream in (NET, HOST) and stream not in used:
            continue
        events.append({"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid,
                       "args": {"name": _TRACK_NAMES[stream]}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": _PID, "tid": tid,
                       "args": {"sort_index": order}})

    for iv in timeline.intervals:
        start, end = _ns(iv.start), _ns(iv.end)
        events.append({"ph": "X", "name": iv.label, "cat": iv.stream, "pid": _PID, "tid": _TID[iv.stream],
                       "ts": _us(start), "dur": _us(end - start), "args": {"instruction": iv.instruction}})
    stall_tid = _TID[STALLS]
    for st in timeline.stalls:
        start, end = _ns(st.start), _ns(st.end)
        events.append({"ph": "X", "name": st.cause, "cat": STALLS, "pid": _PID, "tid": stall_tid,
                       "ts": _us(start), "dur": _us(end - start), "args": {"instruction": st.instruction}})

    for when, nbytes in timeline.memory:
        events.append({"ph": "C", "name": MEMORY_COUNTER, "pid": _PID, "tid": 0, "ts": _us(_ns(when)),
                       "args": {"bytes": nbytes}})
    if budget_bytes is not None:
        # Two samples, at the start and the end of the step, so the flat line spans it.
        end = _ns(_step_end(timeline))
        for when in sorted({0, end}):
            events.append({"ph": "C", "name": BUDGET_COUNTER, "pid": _PID, "tid": 0, "ts": _us(when),
                           "args": {"bytes": budget_bytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timeline: Timeline, path: str | Path, *, name: str, budget_bytes: int | None = None) -> Path:
    """Write ``timeline_to_trace`` to ``path`` as compact JSON (traces of large plans run to tens of MB)."""
    path = Path(path)
    trace = timeline_to_trace(timeline, name=name, budget_bytes=budget_bytes)
    # json.dumps runs the C encoder; json.dump to a file goes through the pure-Python chunked one (3x slower).
    path.write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")
    return path


def _step_end(timeline: Timeline) -> float:
    """Seconds until the last thing the timeline records (busy stream, stall or memory change)."""
    return max((*(iv.end for iv in timeline.intervals), *(s.end for s in timeline.stalls),
                *(t for t, _ in timeline.memory)), default=0.0)
