"""Where each storage is used, in an execution order: the positions of the ops that touch it, and of
those that write it. Spans (``policies.spans``) and the window bound (``analysis.window_bound``) read it."""

from __future__ import annotations

from dataclasses import dataclass

from hyperoffload.ir import Program
from hyperoffload.plans import op_storages, op_writes


@dataclass(frozen=True, slots=True, kw_only=True)
class Uses:
    """Where each storage is used on the device, in an execution order."""

    positions: dict[int, list[int]]
    """Storage -> positions (in the order) of the ops that read or write it, ascending."""
    writes: dict[int, list[int]]
    """Storage -> positions of the ops that produce or overwrite it, ascending."""


def storage_uses(program: Program, order: list[int]) -> Uses:
    touched, written = op_storages(program)[0], op_writes(program)
    positions: dict[int, list[int]] = {}
    writes: dict[int, list[int]] = {}
    for p, op_id in enumerate(order):
        for s in touched[op_id]:
            positions.setdefault(s, []).append(p)
        for s in written[op_id]:
            writes.setdefault(s, []).append(p)
    return Uses(positions=positions, writes=writes)


__all__ = ["Uses", "storage_uses"]
