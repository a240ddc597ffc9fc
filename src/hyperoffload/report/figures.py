"""Simulated figures as a table for people (JSON output uses ``Figures.as_dict``)."""

from __future__ import annotations

from rich.table import Table

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


def figures_table(figures: Figures, *, title: str, hardware: Hardware) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("meaning")
    rows = [
        ("compute_s", format_seconds(figures.compute_s), "sum of op times: the step with unlimited memory"),
        ("step_s", format_seconds(figures.step_s), "simulated step time"),
        ("exposed_s", format_seconds(figures.exposed_s), "transfer time not hidden behind compute"),
        ("slowdown", f"{figures.slowdown:.3f}", "step_s / compute_s"),
        ("lower_bound_s", format_seconds(figures.lower_bound_s), "max(compute, this plan's traffic at full speed)"),
        ("peak_bytes", format_bytes(figures.peak_bytes),
         f"device memory at the peak ({format_bytes(hardware.memory_bytes)} on {hardware.name})"),
        ("h2d_bytes", format_bytes(figures.h2d_bytes), "moved remote -> device per step"),
        ("d2h_bytes", format_bytes(figures.d2h_bytes), "moved device -> remote per step"),
        ("stalls", str(figures.stalls), f"compute waited {format_seconds(figures.stall_copy_s)} on copies, "
                                         f"{format_seconds(figures.stall_memory_s)} on memory"),
    ]
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
