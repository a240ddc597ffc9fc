"""Trace JSON and timeline PNG of simulated steps: a captured tiny-llama step and a hand-made plan with copies."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from programs import op, program, value

from hyperoffload.compare import sweep
from hyperoffload.hardware import get_hardware
from hyperoffload.ir import Op, ValueKind
from hyperoffload.plans import Instr, Kind, Plan, plan_without_offload
from hyperoffload.report.compare import sweep_table
from hyperoffload.report.plot import plot_timeline, timeline_figure
from hyperoffload.report.trace import BUDGET_COUNTER, MEMORY_COUNTER, timeline_to_trace, write_trace
from hyperoffload.simulate import Timeline, simulate
from hyperoffload.workloads import capture_workload, get_workload

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIB = 2**20
TEST_FOLDERS = (Path(__file__).parent, Path(__file__).parent.parent)
"""This file's folder and tests/ (where ``programs`` is): a subprocess importing this file needs both."""


@pytest.fixture(scope="module")
def h100():
    return get_hardware("h100-sxm")


@pytest.fixture(scope="module")
def llama_timeline(h100) -> Timeline:
    captured = capture_workload(get_workload("tiny-llama"), "train")
    return simulate(plan_without_offload(captured.program), h100)


def offload_chain_plan(budget_bytes: int | None = None) -> Plan:
    """v0 -> op0 -> v1 -> op1 -> v2 -> op2 -> v3; op3 reads v1 and v3. v1 goes to host memory after op1
    and comes back while op2 runs; op2 is long enough to hide part of the prefetch, not all of it."""
    values = [value(0, 64 * MIB, ValueKind.INPUT), value(1, 64 * MIB), value(2, 64 * MIB), value(3, 64 * MIB),
              value(4, 64 * MIB)]
    ops = [op(0, [0], [1]), op(1, [1], [2]), op(2, [2], [3], flops=5 * 10**10), op(3, [1, 3], [4])]
    prog = program(values, ops, inputs=[0], outputs=[4])
    instrs = (Instr(Kind.COMPUTE, 0), Instr(Kind.OFFLOAD, 1), Instr(Kind.COMPUTE, 1), Instr(Kind.RELEASE, 1),
              Instr(Kind.WAIT, 1), Instr(Kind.PREFETCH, 1), Instr(Kind.COMPUTE, 2), Instr(Kind.WAIT, 1),
              Instr(Kind.COMPUTE, 3))
    return Plan(program=prog, instructions=instrs, policy="test", budget_bytes=budget_bytes)


@pytest.fixture(scope="module")
def chain_timeline(h100) -> Timeline:
    return simulate(offload_chain_plan(budget_bytes=4 * 64 * MIB), h100)


def test_chain_plan_uses_both_copy_lanes_and_stalls(chain_timeline):
    streams = Counter(iv.stream for iv in chain_timeline.intervals)
    assert streams == {"compute": 4, "h2d": 1, "d2h": 1}
    assert chain_timeline.stalls and {s.cause for s in chain_timeline.stalls} == {"copy"}


def _check_trace(timeline: Timeline, trace: dict, budget_bytes: int | None) -> None:
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


def test_llama_trace(llama_timeline):
    assert llama_timeline.intervals
    _check_trace(llama_timeline, timeline_to_trace(llama_timeline, name="tiny-llama train"), None)


def test_chain_trace_with_budget(chain_timeline):
    budget = chain_timeline.figures.budget_bytes
    _check_trace(chain_timeline, timeline_to_trace(chain_timeline, name="chain", budget_bytes=budget), budget)


def test_adjacent_slices_share_boundaries(llama_timeline):
    """Back-to-back ops must not overlap once rounded, or trace viewers nest them."""
    trace = timeline_to_trace(llama_timeline, name="tiny-llama train")
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "compute"]
    ends = [round((e["ts"] + e["dur"]) * 1000) for e in compute]
    starts = [round(e["ts"] * 1000) for e in compute]
    assert all(end <= nxt for end, nxt in zip(ends, starts[1:]))


def test_write_trace_is_compact_json(chain_timeline, tmp_path):
    path = write_trace(chain_timeline, tmp_path / "chain.json", name="chain")
    text = path.read_text()
    assert "\n" not in text and ", " not in text
    assert json.loads(text) == json.loads(json.dumps(timeline_to_trace(chain_timeline, name="chain")))


def _check_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000


def test_plot_llama(llama_timeline, tmp_path):
    path = tmp_path / "llama.png"
    plot_timeline(llama_timeline, path, title="tiny-llama train, no offload, h100-sxm")
    _check_png(path)


def test_plot_chain_with_budget(chain_timeline, tmp_path):
    path = tmp_path / "chain.png"
    plot_timeline(chain_timeline, path, title="offload chain", budget_bytes=chain_timeline.figures.budget_bytes)
    _check_png(path)


def test_plot_leaves_pyplot_alone(tmp_path):
    """Plotting needs no display and must not switch the backend of the program that calls it."""
    script = (
        "import sys\n"
        "from hyperoffload.hardware import get_hardware\n"
        "from hyperoffload.simulate import simulate\n"
        "from hyperoffload.report.plot import plot_timeline\n"
        "sys.path[:0] = sys.argv[2:]\n"
        "from test_report_outputs import offload_chain_plan\n"
        "plot_timeline(simulate(offload_chain_plan(), get_hardware('h100-sxm')), sys.argv[1], title='t')\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    env = {**os.environ, "DISPLAY": "", "MPLBACKEND": ""}
    env.pop("MPLBACKEND")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "t.png"), *map(str, TEST_FOLDERS)],
                   check=True, env=env)
    _check_png(tmp_path / "t.png")


def view_only_timeline(h100) -> Timeline:
    """A step whose only op makes an alias: it costs nothing, so nothing is busy."""
    values = [value(0, 4 * MIB, ValueKind.INPUT), value(1, 4 * MIB, storage=0)]
    view = Op(id=0, name="view", target="aten.view.default", inputs=(0,), outputs=(1,))
    return simulate(plan_without_offload(program(values, [view], inputs=[0], outputs=[1])), h100)


def test_empty_timelines(h100, chain_timeline, tmp_path):
    views = view_only_timeline(h100)
    assert not views.intervals and not views.stalls
    bare = dataclasses.replace(chain_timeline, intervals=(), stalls=(), memory=())
    for budget in (None, 8 * MIB):
        _check_trace(views, timeline_to_trace(views, name="views", budget_bytes=budget), budget)
        for i, timeline in enumerate((views, bare)):
            path = tmp_path / f"empty{i}-{budget}.png"
            plot_timeline(timeline, path, title="nothing runs", budget_bytes=budget)
            _check_png(path)
    bare_trace = json.loads(json.dumps(timeline_to_trace(bare, name="bare")))
    assert {e["ph"] for e in bare_trace["traceEvents"]} == {"M"}


def _memory_axes(timeline: Timeline, **kwargs):
    return timeline_figure(timeline, title="t", **kwargs).axes[0]


def _legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def _drawn_levels(ax) -> set[float]:
    """The heights of the dashed horizontal lines drawn across the panel (axhline gives x in axes units)."""
    return {line.get_ydata()[0] for line in ax.get_lines()
            if line.get_linestyle() == "--" and list(line.get_xdata()) == [0, 1]}


def test_device_memory_far_above_the_curve_is_named_not_drawn(llama_timeline, h100):
    """simulate's plot: a 16 MiB step under an 80 GiB device must not be squashed flat by the device line."""
    peak = llama_timeline.figures.peak_bytes
    assert h100.memory_bytes > 4 * peak and llama_timeline.figures.budget_bytes is None
    ax = _memory_axes(llama_timeline, budget_bytes=h100.memory_bytes, budget_label="h100-sxm memory")
    assert ax.get_ylabel() == "device memory (MiB)"
    bottom, top = ax.get_ylim()
    assert bottom == 0 and peak / MIB < top < 1.5 * peak / MIB
    assert not _drawn_levels(ax)
    assert any(t.startswith("h100-sxm memory 80.00 GiB") and "above this axis" in t for t in _legend_texts(ax))


def test_device_memory_near_the_curve_is_drawn(llama_timeline):
    limit = 2 * llama_timeline.figures.peak_bytes
    ax = _memory_axes(llama_timeline, budget_bytes=limit, budget_label="device memory")
    assert _drawn_levels(ax) == {limit / MIB}
    assert ax.get_ylim()[1] > limit / MIB


def test_a_plans_budget_is_drawn_however_far_above_the_curve(h100):
    budget = 100 * 4 * 64 * MIB
    timeline = simulate(offload_chain_plan(budget_bytes=budget), h100)
    assert budget > 4 * timeline.figures.peak_bytes
    ax = _memory_axes(timeline, budget_bytes=budget)
    assert ax.get_ylabel() == "device memory (GiB)"
    assert _drawn_levels(ax) == {budget / 2**30}
    assert ax.get_ylim()[1] > budget / 2**30


def test_long_title_is_wrapped_inside_the_figure(chain_timeline):
    title = ("tiny-llama train on h100-sxm, hyperoffload, budget 8.08 MiB (two consecutive steps: state stays in "
             "remote memory between them)")
    fig = timeline_figure(chain_timeline, title=title)
    fig.canvas.draw()
    suptitle = fig.get_suptitle()
    assert "\n" in suptitle and suptitle.replace("\n", " ") == title
    box = fig._suptitle.get_window_extent()
    assert box.x0 >= fig.bbox.x0 and box.x1 <= fig.bbox.x1


def test_sweep_table_budget_columns_have_distinct_headers(h100):
    points = sweep(offload_chain_plan().program, h100, vary="budget", values=["90%", "50%"], budget=None,
                   policies=["none"])
    headers = [str(column.header) for column in sweep_table(points, vary="budget", title="t").columns]
    assert headers[:3] == ["budget", "budget_bytes", "compute_s"]
    assert len(set(headers)) == len(headers)
