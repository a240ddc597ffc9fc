"""Trace JSON and timeline PNG of a captured tiny-llama step with no offload, and how its memory panel shows a
device's memory far above the curve and near it."""

from __future__ import annotations

import pytest
from output_checks import check_png, check_trace, drawn_levels, memory_axes

from hyperoffload.hardware import get_hardware
from hyperoffload.plans import plan_without_offload
from hyperoffload.report.plot import plot_timeline
from hyperoffload.report.trace import timeline_to_trace
from hyperoffload.simulate import Timeline, simulate
from hyperoffload.workloads import capture_workload, get_workload

MIB = 2**20


@pytest.fixture(scope="module")
def h100():
    return get_hardware("h100-sxm")


def _legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


@pytest.fixture(scope="module")
def llama_timeline(h100) -> Timeline:
    captured = capture_workload(get_workload("tiny-llama"), "train")
    return simulate(plan_without_offload(captured.program), h100)


def test_llama_trace(llama_timeline):
    assert llama_timeline.intervals
    check_trace(llama_timeline, timeline_to_trace(llama_timeline, name="tiny-llama train"), None)


def test_adjacent_slices_share_boundaries(llama_timeline):
    """Back-to-back ops must not overlap once rounded, or trace viewers nest them."""
    trace = timeline_to_trace(llama_timeline, name="tiny-llama train")
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "compute"]
    ends = [round((e["ts"] + e["dur"]) * 1000) for e in compute]
    starts = [round(e["ts"] * 1000) for e in compute]
    assert all(end <= nxt for end, nxt in zip(ends, starts[1:]))


def test_plot_llama(llama_timeline, tmp_path):
    path = tmp_path / "llama.png"
    plot_timeline(llama_timeline, path, title="tiny-llama train, no offload, h100-sxm")
    check_png(path)


def test_device_memory_far_above_the_curve_is_named_not_drawn(llama_timeline, h100):
    """simulate's plot: a 16 MiB step under an 80 GiB device must not be squashed flat by the device line."""
    peak = llama_timeline.figures.peak_bytes
    assert h100.memory_bytes > 4 * peak and llama_timeline.figures.budget_bytes is None
    ax = memory_axes(llama_timeline, budget_bytes=h100.memory_bytes, budget_label="h100-sxm memory")
    assert ax.get_ylabel() == "device memory (MiB)"
    bottom, top = ax.get_ylim()
    assert bottom == 0 and peak / MIB < top < 1.5 * peak / MIB
    assert not drawn_levels(ax)
    assert any(t.startswith("h100-sxm memory 80.00 GiB") and "above this axis" in t for t in _legend_texts(ax))


def test_device_memory_near_the_curve_is_drawn(llama_timeline):
    limit = 2 * llama_timeline.figures.peak_bytes
    ax = memory_axes(llama_timeline, budget_bytes=limit, budget_label="device memory")
    assert drawn_levels(ax) == {limit / MIB}
    assert ax.get_ylim()[1] > limit / MIB
