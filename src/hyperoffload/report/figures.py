"""Simulated figures as a table for people (JSON output uses ``Figures.as_dict``), and the step as captured,
simulated without offloading: what ``hyperoffload simulate`` prints."""

from __future__ import annotations

from rich.console import Group
from rich.highlighter import ReprHighlighter
from rich.table import Table
from rich.text import Text

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.simulate import Figures
from hyperoffload.units import format_bytes, format_seconds


def step_fields(program: Program) -> dict:
    """What every report says of the step it is about: ``workload``, ``mode`` and ``world`` (the ranks the step
    is sharded over; 1 for a step of one device)."""
    return {"workload": program.meta.get("workload", program.name), "mode": program.mode,
            "world": program.meta.get("world", 1)}


def step_title(program: Program) -> str:
    """``"<name> <mode>"``, with the rank it is where the step is sharded over ranks."""
    world = program.meta.get("world", 1)
    return f"{program.name} {program.mode}" + (f" (rank 0 of {world}, FSDP2)" if world > 1 else "")


def console_text(markup: str, *, highlight: bool = True) -> Text:
    """``markup`` as ``Console.print`` shows a string: rich markup read and, with ``highlight``, numbers and the
    like coloured. Reports return such lines (in a ``Group``, after their tables) rather than print them."""
    text = Text.from_markup(markup)
    if not highlight:
        return text
    highlighted = ReprHighlighter()(str(text))
    highlighted.copy_styles(text)
    return highlighted


def figures_table(figures: Figures, *, title: str, hardware: Hardware) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("meaning")
    rows = [
        ("compute_s", format_seconds(figures.compute_s), "sum of op times on the compute stream: the step with unlimited memory"),
        ("step_s", format_seconds(figures.step_s), "simulated step time"),
        ("exposed_s", format_seconds(figures.exposed_s), "transfer time not hidden behind compute"),
        ("slowdown", f"{figures.slowdown:.3f}", "step_s / compute_s"),
        ("lower_bound_s", format_seconds(figures.lower_bound_s), "max(compute, collectives, host ops, this plan's traffic at full speed)"),
        ("peak_bytes", format_bytes(figures.peak_bytes),
         f"device memory at the peak ({format_bytes(hardware.memory_bytes)} on {hardware.name})"),
        ("h2d_bytes", format_bytes(figures.h2d_bytes), "moved remote -> device per step"),
        ("d2h_bytes", format_bytes(figures.d2h_bytes), "moved device -> remote per step"),
        ("stalls", str(figures.stalls), f"compute waited {format_seconds(figures.stall_copy_s)} on copies, "
                                         f"{format_seconds(figures.stall_memory_s)} on memory"
                                         + (f", {format_seconds(figures.stall_network_s)} on collectives"
                                            if figures.network_s else "")
                                         + (f", {format_seconds(figures.stall_host_s)} on host ops"
                                            if figures.host_s else "")),
    ]
    if figures.network_s:
        rows.append(("network_s", format_seconds(figures.network_s),
                     "the step's collectives one after another on the network, beside compute"))
    if figures.host_s:
        rows.append(("host_s", format_seconds(figures.host_s),
                     "the step's host ops (its optimizer step on the CPU) one after another, beside compute"))
    if figures.budget_bytes is not None:
        rows += [
            ("budget_bytes", format_bytes(figures.budget_bytes), "the plan's device-memory budget"),
            ("excess_bytes", format_bytes(figures.excess_bytes), "no-offload peak minus budget: what must leave"),
            ("bound_s", format_seconds(figures.bound_s), "step time if the excess crossed once each way, hidden"),
            ("duplex_bound_s", format_seconds(figures.duplex_bound_s),
             "bound_s when both directions share the link at once"),
        ]
    for row in rows:
        table.add_row(*row)
    return table


def no_offload_dict(program: Program, hardware: Hardware, figures: Figures) -> dict:
    """The object ``simulate --json`` prints: the step, the profile, ``figures`` of the step without offloading
    and whether its peak ``fits`` the device."""
    return {**step_fields(program), "hardware": hardware.name, "policy": "none", **figures.as_dict(),
            "device_memory_bytes": hardware.memory_bytes, "fits": figures.peak_bytes <= hardware.memory_bytes}


def no_offload_summary(program: Program, hardware: Hardware, figures: Figures) -> Group:
    """``figures`` of the step without offloading as ``simulate`` prints them: the table, and a warning when the
    step does not fit the device."""
    parts = [figures_table(figures, title=f"{step_title(program)} on {hardware.name}, as captured (no offload)",
                           hardware=hardware)]
    if figures.peak_bytes > hardware.memory_bytes:
        parts.append(console_text(f"[yellow]The step needs {format_bytes(figures.peak_bytes)} of device memory; "
                                  f"{hardware.name} has {format_bytes(hardware.memory_bytes)}. It does not fit without "
                                  f"offloading.[/yellow]"))
    return Group(*parts)
