"""A simulated step as a PNG: device memory over time above, what each stream is doing below.

Drawn with matplotlib's Agg canvas directly (no pyplot), so plotting neither needs a display nor
changes the backend of a program that imports this module.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from hyperoffload.simulate import COMPUTE, D2H, H2D, HOST, NET, Timeline
from hyperoffload.units import format_bytes

_ROWS = ((COMPUTE, "compute"), (H2D, "H2D\nprefetch"), (D2H, "D2H\noffload"))
_NET_ROW = (NET, "network\ncollectives")
"""Shown below the copy lanes for a timeline with collectives (a sharded step)."""
_HOST_ROW = (HOST, "host\nCPU ops")
"""Shown last for a timeline with host ops (an optimizer step on the host)."""
_COLOURS = {COMPUTE: "#4c72b0", H2D: "#55a868", D2H: "#dd8452", NET: "#8172b2", HOST: "#937860"}
_STALL_COLOURS = {"copy": "#d62728", "network": "#e377c2", "host": "#bcbd22", "memory": "#8b0000"}
_MEMORY_COLOUR = "#6a3d9a"
_FIGSIZE_IN = (11.0, 6.0)
_DPI = 120
# Roughly the plot area's width in pixels: bars narrower than one pixel are widened to one, and
# gaps narrower than one are closed, so a step of tens of thousands of ops draws a few thousand bars.
_PLOT_WIDTH_PX = 1100
# Characters per title line that fit the figure's width: about 0.6 em a character, so 11 in (792 pt) holds
# about 100 bold 13 pt characters, and the memory panel (narrowed by the activity legend) about 140 at 9 pt.
_TITLE_CHARS = 90
_SUBTITLE_CHARS = 130
# A reference line more than this many times the memory curve's peak is left off the memory panel (and
# named in its legend): an axis reaching up to it would squash the curve into a flat line at zero.
_OFF_SCALE_RATIO = 4.0


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str, budget_bytes: int | None = None,
                  budget_label: str = "budget") -> None:
    """Write a PNG of ``timeline`` to ``path``: memory (bytes shown in GiB or MiB) and stream activity over time."""
    timeline_figure(timeline, title=title, budget_bytes=budget_bytes, budget_label=budget_label).savefig(
        path, format="png")


def timeline_figure(timeline: Timeline, *, title: str, budget_bytes: int | None = None,
                    budget_label: str = "budget") -> Figure:
    """The figure ``plot_timeline`` saves, drawn on an Agg canvas: its axes are the memory panel, then the
    activity panel."""
    end_s = _end(timeline)
    scale, unit = (1.0, "s") if end_s >= 1.0 else (1e3, "ms")
    span = end_s * scale if end_s > 0 else 1.0
    fig = Figure(figsize=_FIGSIZE_IN, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    mem_ax, act_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2.6, 1.0))
    # A plan's title names the step, hardware, policy and budget, and can be longer than the figure is wide:
    # suptitle neither wraps nor shrinks, so the ends would be cut off.
    fig.suptitle(textwrap.fill(title, _TITLE_CHARS), fontsize=13, fontweight="bold")

    _draw_memory(mem_ax, timeline, budget_bytes, scale, span, budget_label)
    _draw_activity(act_ax, timeline, scale, span)
    act_ax.set_xlim(0.0, span)
    act_ax.set_xlabel(f"time from step start ({unit})")
    f = timeline.figures
    mem_ax.set_title(textwrap.fill(
        f"step {f.step_s * scale:.3g} {unit}, compute {f.compute_s * scale:.3g} {unit} "
        f"(slowdown {f.slowdown:.3f}x); peak {format_bytes(f.peak_bytes)}; "
        f"copied {format_bytes(f.h2d_bytes)} in, {format_bytes(f.d2h_bytes)} out; "
        f"{f.stalls} stalls", _SUBTITLE_CHARS), fontsize=9, loc="left")
    return fig


def _end(timeline: Timeline) -> float:
    return max((*(iv.end for iv in timeline.intervals), *(s.end for s in timeline.stalls),
                *(t for t, _ in timeline.memory)), default=0.0)


def _draw_memory(ax, timeline: Timeline, budget_bytes: int | None, scale: float, span: float,
                 budget_label: str) -> None:
    memory = timeline.memory
    top = max((b for _, b in memory), default=0)
    line = budget_bytes if budget_bytes is not None and _line_on_scale(timeline, budget_bytes, top) else None
    # GiB as asked for big steps; a step that never reaches 1 GiB would read as a flat line of zeros.
    div, unit = (2**30, "GiB") if max(top, line or 0) >= 2**30 else (2**20, "MiB")
    ax.set_ylabel(f"device memory ({unit})")
    ax.grid(True, axis="y", alpha=0.3)
    if memory:
        times = [t * scale for t, _ in memory] + [span]
        sizes = [b / div for _, b in memory] + [memory[-1][1] / div]
        ax.step(times, sizes, where="post", color=_MEMORY_COLOUR, linewidth=1.2, label="device memory")
        ax.fill_between(times, sizes, step="post", color=_MEMORY_COLOUR, alpha=0.12, linewidth=0)
        peak_t, peak_b = next((t, b) for t, b in memory if b == top)
        ax.plot([peak_t * scale], [peak_b / div], marker="v", color="black", markersize=7, linestyle="none",
                label=f"peak {format_bytes(peak_b)}")
        ax.annotate(f"peak {format_bytes(peak_b)}", (peak_t * scale, peak_b / div), xytext=(0, 8),
                    textcoords="offset points", ha="left" if peak_t * scale < 0.8 * span else "right",
                    fontsize=9)
    if line is not None:
        ax.axhline(line / div, color="black", linestyle="--", linewidth=1.0,
                   label=f"{budget_label} {format_bytes(line)}")
        ax.annotate(f"{budget_label} {format_bytes(line)}", (span, line / div), xytext=(-4, 3),
                    textcoords="offset points", ha="right", va="bottom", fontsize=9)
    elif budget_bytes is not None:
        # Named, not drawn: an arrow pointing up, in the legend only, says the limit lies above the axis.
        ax.plot([], [], marker="^", color="black", linestyle="none",
                label=f"{budget_label} {format_bytes(budget_bytes)}, above this axis "
                      f"({budget_bytes / top:,.0f}x the peak)")
    ceiling = max(top, line or 0) / div
    ax.set_ylim(0.0, ceiling * 1.15 if ceiling > 0 else 1.0)
    if memory or budget_bytes is not None:
        ax.legend(loc="lower right", fontsize=9, framealpha=0.9)


def _line_on_scale(timeline: Timeline, line_bytes: int, top: int) -> bool:
    """Whether the memory panel draws the reference line at ``line_bytes`` (curve peak ``top``). The plan's
    own budget always: the curve against it is what a plan's plot is for. Another limit (the device's memory
    under a step simulated without a budget) only when it is within ``_OFF_SCALE_RATIO`` of the peak."""
    if top <= 0 or line_bytes == timeline.figures.budget_bytes:
        return True
    return line_bytes <= _OFF_SCALE_RATIO * top


def _draw_activity(ax, timeline: Timeline, scale: float, span: float) -> None:
    pixel = span / _PLOT_WIDTH_PX
    height = 0.7
    ticks, labels, handles = [], [], []
    used = {iv.stream for iv in timeline.intervals}
    rows = (*_ROWS, *(row for row in (_NET_ROW, _HOST_ROW) if row[0] in used))
    for row, (stream, label) in enumerate(rows):
        y = len(rows) - 1 - row  # compute on top
        spans = [(iv.start * scale, iv.end * scale) for iv in timeline.intervals if iv.stream == stream]
        busy = sum(e - s for s, e in spans)
        ax.broken_barh(_bars(spans, pixel), (y - height / 2, height), facecolors=_COLOURS[stream], linewidth=0)
        ticks.append(y)
        labels.append(f"{label}\n{busy / span:.0%} busy" if span > 0 and spans else label)
        handles.append(Patch(color=_COLOURS[stream], label=_legend_label(stream)))
    causes = sorted({s.cause for s in timeline.stalls})
    for cause in causes:
        spans = [(s.start * scale, s.end * scale) for s in timeline.stalls if s.cause == cause]
        ax.broken_barh(_bars(spans, pixel), (len(rows) - 1 - height / 2, height),
                       facecolors=_STALL_COLOURS.get(cause, "#d62728"), linewidth=0)
        handles.append(Patch(color=_STALL_COLOURS.get(cause, "#d62728"), label=f"compute stalled on {cause}"))
    ax.set_yticks(ticks, labels, fontsize=9)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def _legend_label(stream: str) -> str:
    return {COMPUTE: "op running", H2D: "prefetch (host to device)", D2H: "offload (device to host)",
            NET: "collective (between ranks)", HOST: "host op (on the CPU)"}[stream]


def _bars(spans: Iterable[tuple[float, float]], pixel: float) -> list[tuple[float, float]]:
    """(start, width) bars: spans merged where they overlap or are less than ``pixel`` apart, then at
    least ``pixel`` wide so a short copy between long ops still shows."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1] + pixel:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, max(e - s, pixel)) for s, e in merged]
