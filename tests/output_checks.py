"""Shared checks of what the reports put out, for the unit, model and command-line tests: the figures every
row of a comparison has, and the trace JSON, the PNG and the memory panel of a simulated step's timeline."""

from __future__ import annotations

import json

import pytest

from hyperoffload.report.plot import timeline_figure
from hyperoffload.report.trace import BUDGET_COUNTER, MEMORY_COUNTER
from hyperoffload.simulate import Timeline

FIGURES = ("compute_s", "step_s", "exposed_s", "lower_bound_s", "excess_bytes", "bound_s", "slowdown", "peak_bytes",
           "h2d_bytes", "d2h_bytes", "stalls", "plan_s", "policy", "feasible", "budget_bytes")
"""The keys every row of ``compare`` and ``sweep`` has, as objects and as JSON."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_trace(timeline: Timeline, trace: dict, budget_bytes: int | None) -> None:
    """``trace``, made of ``timeline``, survives JSON and shows it whole: one process, a named and ordered thread per
    stream and one for stalls, a slice per interval and per stall at its times, the memory counter, and a budget
    counter exactly when ``budget_bytes`` is given."""
    trace = json.loads(json.dumps(trace))
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    process = [e["args"]["name"] for e in meta if e["name"] == "process_name"]
    assert len(process) == 1
    threads = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert len(threads) == 4
    for stream in ("compute", "h2d", "d2h", "stalls"):
        assert sum(name.startswith(stream) for name in threads.values()) == 1
    sort_index = {e["tid"]: e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    assert set(sort_index) == set(threads) and len(set(sort_index.values())) == 4
    tid_of = {name.split()[0]: tid for tid, name in threads.items()}

    slices = [e for e in events if e["ph"] == "X" and e["tid"] != tid_of["stalls"]]
    assert len(slices) == len(timeline.intervals)
    for ev, iv in zip(slices, timeline.intervals):
        assert ev["name"] == iv.label
        assert ev["tid"] == tid_of[iv.stream]
        assert ev["args"]["instruction"] == iv.instruction
        assert ev["ts"] == pytest.approx(iv.start * 1e6, abs=1e-3)
        assert ev["dur"] == pytest.approx((iv.end - iv.start) * 1e6, abs=1e-3)
        assert ev["dur"] >= 0

    stalls = [e for e in events if e["ph"] == "X" and e["tid"] == tid_of["stalls"]]
    assert [(e["name"], e["args"]["instruction"]) for e in stalls] == \
        [(s.cause, s.instruction) for s in timeline.stalls]
    for ev, st in zip(stalls, timeline.stalls):
        assert ev["ts"] == pytest.approx(st.start * 1e6, abs=1e-3)
        assert ev["dur"] == pytest.approx((st.end - st.start) * 1e6, abs=1e-3)

    memory = [e for e in events if e["ph"] == "C" and e["name"] == MEMORY_COUNTER]
    assert len(memory) == len(timeline.memory)
    if not memory:
        return
    assert [e["ts"] for e in memory] == sorted(e["ts"] for e in memory)
    assert memory[-1]["args"]["bytes"] == timeline.memory[-1][1]
    assert max(e["args"]["bytes"] for e in memory) == timeline.figures.peak_bytes
    budget = [e for e in events if e["ph"] == "C" and e["name"] == BUDGET_COUNTER]
    if budget_bytes is None:
        assert not budget
    else:
        assert budget and {e["args"]["bytes"] for e in budget} == {budget_bytes}


def check_png(path) -> None:
    """``path`` holds a PNG with a figure drawn in it (more than 10 kB)."""
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000


def memory_axes(timeline: Timeline, **kwargs):
    """The device-memory panel of ``timeline``'s figure (its first axes)."""
    return timeline_figure(timeline, title="t", **kwargs).axes[0]


def drawn_levels(ax) -> set[float]:
    """The heights of the dashed horizontal lines drawn across the panel (axhline gives x in axes units)."""
    return {line.get_ydata()[0] for line in ax.get_lines()
            if line.get_linestyle() == "--" and list(line.get_xdata()) == [0, 1]}
