"""Hardware profiles as tables, and as the objects ``hardware --json`` prints."""

from __future__ import annotations

from rich.table import Table

from hyperoffload.hardware import Hardware
from hyperoffload.hardware.profile import FILE_KEYS
from hyperoffload.units import format_bandwidth, format_bytes, format_seconds


def profile_dict(hardware: Hardware) -> dict:
    """Every field of ``hardware`` (bytes, bytes/s, seconds, FLOP/s), its mappings as plain dicts: the object
    ``hardware --json`` prints."""
    fields = {f: getattr(hardware, f) for f in hardware.__slots__}
    fields["peak_flops"] = dict(hardware.peak_flops)
    fields["measured_op_s"] = dict(hardware.measured_op_s)
    fields["sources"] = dict(hardware.sources)
    return fields


def hardware_list(profiles: list[Hardware]) -> Table:
    table = Table(title="Hardware profiles", title_justify="left")
    for column in ("name", "per node x nodes", "memory", "BF16 TFLOP/s", "HBM", "H2D", "D2H", "both ways", "intra-node",
                   "inter-node"):
        table.add_column(column, justify="left" if column == "name" else "right", no_wrap=column == "name")
    for h in profiles:
        devices = f"{h.devices_per_node}x{h.nodes}" if h.device_count > 1 else "1"
        table.add_row(h.name, devices, format_bytes(h.memory_bytes), f"{h.flops_for('bfloat16') / 1e12:.0f}",
                      format_bandwidth(h.hbm_bw), format_bandwidth(h.h2d_bw), format_bandwidth(h.d2h_bw),
                      f"x{h.duplex_share:g}", _link(h.intra_node_bw), _link(h.inter_node_bw))
    return table


def _link(bytes_per_s: float) -> str:
    """A network link's bandwidth, or "-" where the profile has none."""
    return format_bandwidth(bytes_per_s) if bytes_per_s else "-"


def _interconnect_rows(h: Hardware) -> list[tuple[str, str]]:
    """The interconnect fields that differ from one device with no network (a single-device profile shows none)."""
    rows = [
        ("devices_per_node", str(h.devices_per_node), h.devices_per_node != 1),
        ("nodes", str(h.nodes), h.nodes != 1),
        ("intra_node_bw", format_bandwidth(h.intra_node_bw), h.intra_node_bw != 0),
        ("intra_node_latency_s", format_seconds(h.intra_node_latency_s), h.intra_node_latency_s != 0),
        ("inter_node_bw", format_bandwidth(h.inter_node_bw), h.inter_node_bw != 0),
        ("inter_node_latency_s", format_seconds(h.inter_node_latency_s), h.inter_node_latency_s != 0),
        ("host_memory_bytes", format_bytes(h.host_memory_bytes), h.host_memory_bytes != 0),
        ("host_mem_bw", format_bandwidth(h.host_mem_bw), h.host_mem_bw != 0),
        ("host_link_shared_by", str(h.host_link_shared_by), h.host_link_shared_by != 1),
    ]
    return [(field, value) for field, value, shown in rows if shown or h.sources.get(field)]


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
    rows.extend(_interconnect_rows(h))  # optional too: shown where set or sourced
    for field, value in rows:
        table.add_row(FILE_KEYS.get(field, field), value, src(field))
    return table
