"""Trace JSON and timeline PNG of simulated steps: a hand-made plan with copies. Those of a captured tiny-llama
step are in tests/models/test_report_outputs_models.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from output_checks import check_png, check_trace, drawn_levels, memory_axes
from programs import op, program, value

from hyperoffload.compare import sweep
from hyperoffload.hardware import get_hardware
from hyperoffload.ir import Op, ValueKind
from hyperoffload.plans import Instr, Kind, Plan, plan_without_offload
from hyperoffload.report.compare import sweep_table
from hyperoffload.report.plot import plot_timeline, timeline_figure
from hyperoffload.report.trace import timeline_to_trace, write_trace
from hyperoffload.simulate import Timeline, simulate

MIB = 2**20
TEST_FOLDERS = (Path(__file__).parent, Path(__file__).parent.parent)
"""This file's folder and tests/ (where ``programs`` and ``output_checks`` are): a subprocess importing this file
needs both."""


@pytest.fixture(scope="module")
def h100():
    return get_hardware("h100-sxm")


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


def test_chain_trace_with_budget(chain_timeline):
    budget = chain_timeline.figures.budget_bytes
    check_trace(chain_timeline, timeline_to_trace(chain_timeline, name="chain", budget_bytes=budget), budget)


def test_write_trace_is_compact_json(chain_timeline, tmp_path):
    path = write_trace(chain_timeline, tmp_path / "chain.json", name="chain")
    text = path.read_text()
    assert "\n" not in text and ", " not in text
    assert json.loads(text) == json.loads(json.dumps(timeline_to_trace(chain_timeline, name="chain")))


def test_plot_chain_with_budget(chain_timeline, tmp_path):
    path = tmp_path / "chain.png"
    plot_timeline(chain_timeline, path, title="offload chain", budget_bytes=chain_timeline.figures.budget_bytes)
    check_png(path)


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
    check_png(tmp_path / "t.png")


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
        check_trace(views, timeline_to_trace(views, name="views", budget_bytes=budget), budget)
        for i, timeline in enumerate((views, bare)):
            path = tmp_path / f"empty{i}-{budget}.png"
            plot_timeline(timeline, path, title="nothing runs", budget_bytes=budget)
            check_png(path)
    bare_trace = json.loads(json.dumps(timeline_to_trace(bare, name="bare")))
    assert {e["ph"] for e in bare_trace["traceEvents"]} == {"M"}


def test_a_plans_budget_is_drawn_however_far_above_the_curve(h100):
    budget = 100 * 4 * 64 * MIB
    timeline = simulate(offload_chain_plan(budget_bytes=budget), h100)
    assert budget > 4 * timeline.figures.peak_bytes
    ax = memory_axes(timeline, budget_bytes=budget)
    assert ax.get_ylabel() == "device memory (GiB)"
    assert drawn_levels(ax) == {budget / 2**30}
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
