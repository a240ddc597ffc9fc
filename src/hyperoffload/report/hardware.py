"""Hardware profiles as tables."""

from __future__ import annotations

from rich.table import Table

from hyperoffload.hardware import Hardware
from hyperoffload.hardware.profile import FILE_KEYS
from hyperoffload.units import format_bandwidth, format_bytes, format_seconds


def hardware_list(profiles: list[Hardware]) -> Table:
    table = Table(title="Hardware profiles", title_justify="left")
    for column in ("name", "memory", "BF16 TFLOP/s", "HBM", "H2D", "D2H", "both ways"):
        table.add_column(column, justify="left" if column == "name" else "right", no_wrap=column == "name")
    for h in profiles:
        table.add_row(h.name, format_bytes(h.memory_bytes), f"{h.flops_for('bfloat16') / 1e12:.0f}",
                      format_bandwidth(h.hbm_bw), format_bandwidth(h.h2d_bw), format_bandwidth(h.d2h_bw),
                      f"x{h.duplex_share:g}")
    return table


def hardware_detail(h: Hardware) -> Table:
    """Every figure of ``h`` under the key a profile file gives it, in the units a file may write, so a row
    can be copied into a file of one's own (``--json`` gives the dataclass fields in base units instead)."""
    table = Table(title=f"{h.name}: {h.description}", title_justify="left")
    table.add_column("key")
    table.add_column("value", justify="right")
    table.add_column("source")
    src = lambda f: h.sources.get(f, "")  # noqa: E731
    flops = ", ".join(f"{dtype} {rate / 1e12:.4g} TFLOP/s" for dtype, rate in h.peak_flops.items())
    rows = [
        ("memory_bytes", format_bytes(h.memory_bytes)),
        ("peak_flops", flops),
        ("hbm_bw", format_bandwidth(h.hbm_bw)),
        ("h2d_bw", format_bandwidth(h.h2d_bw)),
        ("d2h_bw", format_bandwidth(h.d2h_bw)),
        ("h2d_latency_s", format_seconds(h.h2d_latency_s)),
        ("d2h_latency_s", format_seconds(h.d2h_latency_s)),
        ("duplex_share", f"{h.duplex_share:g}"),
        ("launch_s", format_seconds(h.launch_s)),
        ("compute_efficiency", f"{h.compute_efficiency:g}"),
        ("memory_efficiency", f"{h.memory_efficiency:g}"),
    ]
    if h.issue_s:  # optional in a file; shown where it is set
        rows.append(("issue_s", format_seconds(h.issue_s)))
    for field, value in rows:
        table.add_row(FILE_KEYS.get(field, field), value, src(field))
    return table
