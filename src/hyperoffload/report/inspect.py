"""What a captured step holds: sizes by kind, the no-offload peak and what makes it up."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table

from hyperoffload.analysis import memory_profile
from hyperoffload.capture import Captured
from hyperoffload.ir import Program, ValueKind, kind_bytes
from hyperoffload.units import format_bytes, format_count

if TYPE_CHECKING:
    from hyperoffload.runtime.reference import EagerComparison


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInspection:
    """Figures of a captured step (bytes, FLOPs, seconds): what ``hyperoffload inspect`` shows."""

    meta: Mapping[str, Any]
    """What the capture recorded about the step (``Program.meta``: batch, seq, dtype...)."""
    workload: str
    mode: str
    num_ops: int
    num_values: int
    flops: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    kv_bytes: int
    input_bytes: int
    peak_bytes: int
    """The no-offload peak of device memory."""
    peak_op: dict[str, Any] | None
    """Where the peak is reached: the op's position in the order, name, target and phase; None for a step of no ops."""
    peak_by_kind: dict[str, int]
    """Bytes live at the peak by value kind, largest first."""
    peak_values: list[dict[str, Any]]
    """The largest values live at the peak (name, kind, shape, dtype, bytes), largest first."""
    capture_s: float
    world: int
    """Ranks the step is sharded over (1: one device)."""
    collectives: dict[str, dict[str, int]]
    """``collectives(program)``."""
    verify: dict[str, Any] | None = None
    """The step executed with real weights against eager and the analysis (``inspect --verify``;
    ``verify_figures``); None unless run."""

    def verified(self, check: Mapping[str, Any]) -> StepInspection:
        """These figures with the executed step's ``check`` (``verify_figures``)."""
        return replace(self, verify=dict(check))

    @property
    def verify_failure(self) -> str | None:
        """Why the executed step disagrees with eager or with the analysis, in words; None when it agrees or was
        not executed."""
        check = self.verify
        if check is None or (check["identical_to_eager"] and check["live_bytes_agree"]):
            return None
        why = [] if check["live_bytes_agree"] else ["the measured live bytes differ from the analysis"]
        if not check["identical_to_eager"]:
            # A difference at float rounding means the traced graph ran other kernels than eager for some ops (a
            # Hugging Face decode with a batch above one: a batched matmul where eager folds the batch into one).
            why.append(f"the results differ from eager by up to {check['max_abs_diff']:.3g}"
                       + (" (the size of float rounding: the graph may run other kernels than eager for some ops)"
                          if check["max_abs_diff"] < 1e-5 else ""))
        return "; ".join(why)

    def as_dict(self) -> dict[str, Any]:
        """The object ``inspect --json`` prints: the capture's meta, then the figures (``verify`` when run)."""
        figures = {**self.meta,
                   **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("meta", "verify")}}
        if self.verify is not None:
            figures["verify"] = self.verify
        return figures


def verify_figures(comparison: EagerComparison) -> dict[str, Any]:
    """A step executed with real weights against eager and the analysis (``runtime.compare_with_eager``), as
    ``inspect --json`` prints it under ``verify``."""
    return {"identical_to_eager": comparison.identical, "max_abs_diff": comparison.max_abs_diff,
            "measured_peak_bytes": comparison.measured_peak_bytes,
            "analysed_peak_bytes": comparison.analysed_peak_bytes, "live_bytes_agree": comparison.live_bytes_agree}


def inspect_step(captured: Captured, *, top: int = 10) -> StepInspection:
    """Figures of a captured step; ``top``: how many of the largest values live at the peak to list."""
    program = captured.program
    profile = memory_profile(program)
    peak_by_kind: Counter[str] = Counter()
    for s in profile.peak_storages:
        peak_by_kind[program.values[s].kind.value] += program.values[s].alloc_bytes
    peak_op = program.ops[profile.order[profile.peak_position]] if profile.peak_position >= 0 else None
    return StepInspection(
        meta=dict(program.meta),
        workload=program.meta.get("workload", program.name),
        mode=program.mode,
        num_ops=len(program.ops),
        num_values=len(program.values),
        flops=sum(op.flops for op in program.ops),
        params_bytes=kind_bytes(program, [ValueKind.PARAMETER]),
        grads_bytes=kind_bytes(program, [ValueKind.GRADIENT]),
        optimizer_bytes=kind_bytes(program, [ValueKind.OPTIMIZER_STATE]),
        activation_bytes=kind_bytes(program, [ValueKind.ACTIVATION]),
        kv_bytes=kind_bytes(program, [ValueKind.KV_CACHE]),
        input_bytes=kind_bytes(program, [ValueKind.INPUT]),
        peak_bytes=profile.peak_bytes,
        peak_op=None if peak_op is None else {"position": profile.peak_position, "name": peak_op.name,
                                              "target": peak_op.target, "phase": peak_op.phase.value},
        peak_by_kind=dict(peak_by_kind.most_common()),
        peak_values=[_describe(program, s) for s in profile.peak_storages[:top]],
        capture_s=round(captured.capture_s, 3),
        world=program.meta.get("world", 1),
        collectives=collectives(program),
    )


def collectives(program: Program) -> dict[str, dict[str, int]]:
    """Per collective kind in ``program`` (``"all_gather"``...): how many ops, and the bytes of the whole tensors
    they gather or reduce (``Collective.full_bytes``), summed; empty for a step of one device."""
    found: dict[str, dict[str, int]] = {}
    for op in program.ops:
        if op.collective is not None:
            entry = found.setdefault(op.collective.kind.value, {"count": 0, "full_bytes": 0})
            entry["count"] += 1
            entry["full_bytes"] += op.collective.full_bytes
    return found


def _describe(program: Program, vid: int) -> dict[str, Any]:
    v = program.values[vid]
    return {"name": v.name, "kind": v.kind.value, "shape": list(v.shape), "dtype": v.dtype, "bytes": v.alloc_bytes}


def inspect_tables(inspection: StepInspection) -> Group:
    """The figures of ``inspect_step`` as tables for a terminal."""
    figures = inspection.as_dict()
    title = f"{figures['workload']} {figures['mode']}"
    if figures.get("world", 1) > 1:
        title += f", rank 0 of {figures['world']} (FSDP2)"
    shape = ", ".join(f"{k} {figures[k]}" for k in ("batch", "seq", "context") if k in figures)
    sizes = Table(title=f"{title} ({shape}; {figures.get('dtype', '?')})", title_justify="left")
    sizes.add_column("quantity")
    sizes.add_column("value", justify="right")
    for label, key in (("parameters", "params_bytes"), ("gradients", "grads_bytes"),
                       ("optimizer state", "optimizer_bytes"), ("saved activations", "activation_bytes"),
                       ("KV cache", "kv_bytes"), ("step inputs", "input_bytes")):
        sizes.add_row(label, format_bytes(figures[key]))
    peak_op = figures["peak_op"]
    where = f" (at op {peak_op['position']}, {peak_op['phase']})" if peak_op else ""
    sizes.add_row("[bold]peak device memory, no offload[/bold]", f"[bold]{format_bytes(figures['peak_bytes'])}[/bold]")
    sizes.add_row("peak reached at", where.strip(" ()") or "-")
    sizes.add_row("ops", f"{figures['num_ops']:,}")
    sizes.add_row("FLOPs", format_count(figures["flops"]))
    sizes.add_row("capture time", f"{figures['capture_s']:.1f} s")

    by_kind = Table(title="What the peak is made of", title_justify="left")
    by_kind.add_column("kind")
    by_kind.add_column("bytes", justify="right")
    by_kind.add_column("share", justify="right")
    for kind, size in figures["peak_by_kind"].items():
        by_kind.add_row(kind, format_bytes(size), f"{100 * size / max(figures['peak_bytes'], 1):.1f}%")

    largest = Table(title="Largest values live at the peak", title_justify="left")
    for column in ("value", "kind", "shape", "dtype"):
        largest.add_column(column)
    largest.add_column("bytes", justify="right")
    for v in figures["peak_values"]:
        largest.add_row(v["name"], v["kind"], "x".join(map(str, v["shape"])) or "scalar", v["dtype"],
                        format_bytes(v["bytes"]))
    parts = [sizes, by_kind, largest]
    if figures.get("collectives"):
        network = Table(title="Collectives of this rank (whole tensors' bytes)", title_justify="left")
        for column in ("collective", "ops", "bytes"):
            network.add_column(column, justify="left" if column == "collective" else "right")
        for kind, entry in figures["collectives"].items():
            network.add_row(kind.replace("_", "-"), f"{entry['count']:,}", format_bytes(entry["full_bytes"]))
        parts.append(network)
    if "verify" in figures:
        parts.append(_verify_table(figures["verify"]))
    return Group(*parts)


def _verify_table(check: dict[str, Any]) -> Table:
    table = Table(title="Executed on CPU with real weights (reference executor)", title_justify="left")
    table.add_column("check")
    table.add_column("result", justify="right")
    ok = lambda good: "[green]yes[/green]" if good else "[red]NO[/red]"  # noqa: E731
    table.add_row("measured peak (from the tensors' storages)", format_bytes(check["measured_peak_bytes"]))
    table.add_row("analysed peak", format_bytes(check["analysed_peak_bytes"]))
    table.add_row("equal at every op", ok(check["live_bytes_agree"]))
    table.add_row("results bit-identical to eager", ok(check["identical_to_eager"]))
    return table
