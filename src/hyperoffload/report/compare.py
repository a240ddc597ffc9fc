"""Comparisons for people: a table with a row per policy, a sweep table, and their plots (PNG)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.table import Table

from hyperoffload.compare import VARIES, PolicyResult, SweepPoint
from hyperoffload.units import format_bytes, format_seconds

_FIGSIZE_IN = (9.0, 5.0)
_COLOURS = ("#4c72b0", "#7f7f7f", "#c44e52", "#dd8452", "#8172b3", "#55a868", "#937860", "#da8bc3", "#ccb974")
_DPI = 120


def compare_table(results: Sequence[PolicyResult], *, title: str) -> Table:
    """A row per policy: whether it meets the budget, its simulated step and what it moved."""
    table = Table(title=title, title_justify="left")
    for column, justify in (("policy", "left"), ("meets budget", "left"), ("step_s", "right"),
                            ("slowdown", "right"), ("step / bound", "right"), ("step / window", "right"),
                            ("peak_bytes", "right"),
                            ("h2d_bytes", "right"), ("d2h_bytes", "right"), ("stalls", "right"),
                            ("plan_s", "right")):
        table.add_column(column, justify=justify)
    for r in results:
        f = r.timeline.figures
        table.add_row(r.policy, "yes" if r.feasible else f"[yellow]no[/yellow]: {r.misses}",
                      format_seconds(f.step_s), f"{f.slowdown:.3f}", f"{f.step_s / f.bound_s:.3f}",
                      f"{f.step_s / r.window_bound_s:.3f}" if r.window_bound_s else "-",
                      format_bytes(f.peak_bytes), format_bytes(f.h2d_bytes), format_bytes(f.d2h_bytes),
                      str(f.stalls), f"{r.plan_s:.2f} s")
    return table


def verdict(results: Sequence[PolicyResult], policy: str = "hyperoffload") -> str:
    """One line: how ``policy`` compares with the fastest other policy that meets the budget."""
    ours = next((r for r in results if r.policy == policy), None)
    others = [r for r in results if r.policy != policy and r.feasible and r.plan.policy != "none"]
    if ours is None:
        return ""
    if not ours.feasible:
        return f"{policy} does not meet this budget ({ours.misses})."
    if not others:
        return f"{policy} is the only policy that offloads and meets this budget."
    best = min(others, key=lambda r: r.step_s)
    ratio = best.step_s / ours.step_s
    relation = "faster than" if ratio > 1 else "as fast as" if ratio == 1 else "slower than"
    return (f"{policy}: {format_seconds(ours.step_s)}; the fastest other policy that meets the budget, "
            f"{best.policy}: {format_seconds(best.step_s)} ({policy} is {relation} it, ratio {ratio:.3f}).")


def sweep_table(points: Sequence[SweepPoint], *, vary: str, title: str) -> Table:
    """A row per value, a column per policy: simulated step_s, or what it needs when it misses the budget."""
    table = Table(title=title, title_justify="left")
    # The value as typed (90%, 16GB/s); varying the budget, the next column is the bytes that comes to.
    table.add_column(vary)
    table.add_column("budget_bytes", justify="right")
    table.add_column("compute_s", justify="right")
    names = [r.policy for r in points[0].results] if points else []
    for name in names:
        table.add_column(name, justify="right")
    for point in points:
        first = point.results[0]
        cells = []
        for r in point.results:
            cells.append(format_seconds(r.step_s) if r.feasible else f"[yellow]{r.misses}[/yellow]")
        table.add_row(point.value, format_bytes(first.budget_bytes),
                      format_seconds(first.timeline.figures.compute_s), *cells)
    return table


def plot_compare(results: Sequence[PolicyResult], path: str | Path, *, title: str) -> None:
    """Bars of simulated step time per policy (seconds); policies over the budget hatched and labelled."""
    fig = Figure(figsize=_FIGSIZE_IN, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = [r.policy for r in results]
    steps = [r.step_s for r in results]
    bars = ax.bar(names, steps, color=["#4c72b0" if r.feasible else "#cccccc" for r in results],
                  hatch=None, edgecolor="black", linewidth=0.5)
    for bar, r in zip(bars, results):
        label = f"{r.step_s:.3g} s" if r.feasible else f"misses the budget\n{r.misses}"
        if not r.feasible:
            bar.set_hatch("//")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    if results:
        compute_s = results[0].timeline.figures.compute_s
        ax.axhline(compute_s, color="black", linestyle="--", linewidth=1.0,
                   label=f"compute_s {format_seconds(compute_s)} (unlimited memory)")
        ax.legend(loc="upper left", fontsize=9)
    ax.set_ylabel("simulated step time (s)")
    ax.set_title(textwrap.fill(title, 90), fontsize=11)
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_ylim(0, max(steps, default=1.0) * 1.25)
    fig.savefig(path, format="png")


def plot_sweep(points: Sequence[SweepPoint], path: str | Path, *, vary: str, title: str) -> None:
    """Simulated step time (seconds) against the varied quantity, a line per policy; points where a
    policy misses the budget are drawn hollow."""
    fig = Figure(figsize=_FIGSIZE_IN, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if vary == "budget":
        scale, unit = (2**30, "GiB") if max((p.x for p in points), default=0) >= 2**30 else (2**20, "MiB")
    else:
        scale, unit = 1e9, "GB/s"
    xs = [p.x / scale for p in points]
    names = [r.policy for r in points[0].results] if points else []
    for k, name in enumerate(names):
        rows = [p.results[k] for p in points]
        colour = _COLOURS[k % len(_COLOURS)]
        ours = name == "hyperoffload"  # drawn on top, thicker: other lines often lie on it
        ax.plot(xs, [r.step_s for r in rows], marker="o", linewidth=2.4 if ours else 1.2, color=colour, label=name,
                zorder=3 if ours else 2)
        hollow = [(x, r.step_s) for x, r in zip(xs, rows) if not r.feasible]
        if hollow:
            ax.plot(*zip(*hollow), marker="o", linestyle="none", markerfacecolor="white", markeredgecolor=colour,
                    zorder=4)
    if points:
        ax.plot(xs, [p.results[0].timeline.figures.compute_s for p in points], color="black", linestyle="--",
                linewidth=1.0, label="compute_s (unlimited memory)")
    _, meaning = VARIES[vary]
    ax.set_xlabel(meaning.replace("(bytes/s)", f"({unit})").replace("(bytes)", f"({unit})"))
    ax.set_ylabel("simulated step time (s)")
    ax.set_title(textwrap.fill(title, 90) + "\n(hollow: the policy does not meet the budget there)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.savefig(path, format="png")
