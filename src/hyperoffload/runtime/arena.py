"""The arena a step can run from: where each residency of a plan lives in one byte buffer, and the checks on it.

Every device storage lives in its slot ``[offset, offset + nbytes)`` of one buffer of ``layout.arena_bytes``
(``ArenaSlots``, from a checked ``Layout`` of the plan); ``_ArenaRanges`` keeps the byte ranges of the storages
live in it, so that each placement is checked against them (``ArenaOverlap`` otherwise). How a step fills and
reuses the slots is ``arena_step``'s business.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from hyperoffload.layout import Layout, assign_offsets, residencies
from hyperoffload.plans import Plan
from hyperoffload.runtime.device_bytes import BudgetExceeded
from hyperoffload.runtime.out_variants import _DISPATCH_KEYS, out_variant
from hyperoffload.runtime.views import _ViewMeta

if TYPE_CHECKING:
    from hyperoffload.runtime.prepared_plan import PreparedPlan


class ArenaOverlap(RuntimeError):
    """Running from an arena, a storage was placed on bytes a live storage still holds, or outside the arena."""


class _ArenaRanges:
    """Byte ranges ``[lo, hi)`` (from the arena's base) of the storages live in the arena, which never overlap."""

    __slots__ = ("_ends", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted
        self._ends: dict[int, tuple[int, int]] = {}  # lo -> (hi, storage id)

    def overlapping(self, lo: int, hi: int) -> tuple[int, int, int] | None:
        """A live range sharing a byte with ``[lo, hi)``, as ``(lo, hi, storage id)``, or None."""
        j = bisect.bisect_left(self._starts, lo)
        for k in (j - 1, j):  # disjoint ranges: only the neighbours can overlap a new one
            if 0 <= k < len(self._starts):
                start = self._starts[k]
                end, sid = self._ends[start]
                if start < hi and lo < end:
                    return start, end, sid
        return None

    def add(self, lo: int, hi: int, sid: int) -> None:
        bisect.insort(self._starts, lo)
        self._ends[lo] = (hi, sid)

    def remove(self, lo: int) -> None:
        if self._ends.pop(lo, None) is not None:
            del self._starts[bisect.bisect_left(self._starts, lo)]


@dataclass(frozen=True, slots=True, eq=False)
class ArenaSlots:
    """Where a plan's residencies live in its arena: a checked ``Layout`` of that plan, indexed for the executor."""

    layout: Layout
    slots: dict[tuple[int, int], tuple[int, int]]
    """(storage id, instruction that allocates it, -1 before the step) -> (offset, bytes) in the arena."""
    writes_into_slot: dict[str, dict[int, tuple[Any, str, _ViewMeta]]]
    """Device type -> op id -> the ``out=`` overload, its out argument's name and the captured layout of its
    result, for each op that writes its one new storage straight into its slot on that device (``out_variant``)."""


def arena_slots(plan: Plan, layout: Layout | None = None) -> ArenaSlots:
    """Index ``layout`` (default: ``plan.layout``, else ``assign_offsets(plan)``) for running ``plan`` from
    its arena; ``ValueError`` if the layout's residencies are not the plan's. Offsets are not checked here:
    the executor checks every placement against the storages live at that moment."""
    layout = layout if layout is not None else plan.layout if plan.layout is not None else assign_offsets(plan)
    if not isinstance(layout, Layout):
        raise TypeError(f"arena takes True or a hyperoffload.layout.Layout, got {type(layout).__name__}")
    if len(layout.offsets) != len(layout.residencies):
        raise ValueError(f"layout has {len(layout.offsets)} offsets for {len(layout.residencies)} residencies")
    expected = residencies(plan)
    if sorted(map(_residency_key, layout.residencies)) != sorted(map(_residency_key, expected)):
        raise ValueError(f"the layout's {len(layout.residencies)} residencies are not the {len(expected)} of plan "
                         f"{plan.program.name} (a layout of another plan?); compute it with "
                         f"hyperoffload.layout.assign_offsets(plan)")
    return ArenaSlots(layout=layout, slots={(r.storage, r.start): (off, r.nbytes)
                                            for r, off in zip(layout.residencies, layout.offsets)},
                      writes_into_slot={device: _writes_into_slot(plan.program, device) for device in _DISPATCH_KEYS})


def _writes_into_slot(program, device_type: str) -> dict[int, tuple[Any, str, _ViewMeta]]:
    """The ops of ``program`` that can write their one new storage into its slot on ``device_type`` (see
    ``ArenaSlots``)."""
    nodes = {n.name: n for n in program.graph.graph.nodes}
    found = {}
    for op in program.ops:
        node = nodes.get(op.name)
        meta = node.meta.get("val") if node is not None else None
        if len(op.outputs) != 1 or not program.values[op.outputs[0]].owns_storage or not isinstance(meta, torch.Tensor):
            continue
        variant = out_variant(node.target, device_type)
        if variant is not None:
            found[op.id] = (*variant, _ViewMeta(meta.dtype, tuple(meta.size()), tuple(meta.stride()),
                                                meta.storage_offset()))
    return found


def _residency_key(r) -> tuple[int, int, int, int]:
    return (r.storage, r.start, r.end, r.nbytes)


def _check_arena_budget(plan: Plan, layout: Layout) -> None:
    budget = plan.budget_bytes
    if budget is not None and layout.arena_bytes > budget:
        raise BudgetExceeded(
            f"the arena of plan {plan.program.name} takes {layout.arena_bytes} bytes, over its budget of "
            f"{budget}: plan with PlannerConfig(static_layout=True) (plan/run --static-layout), which re-plans "
            f"until the arena fits, or run without the arena")


def with_arena(prepared: PreparedPlan, arena: bool | Layout = True) -> PreparedPlan:
    """``prepared`` with the arena slots ``arena`` asks for (``True``: the plan's layout, or one computed for
    it; a ``Layout``: that one), reusing those it already has."""
    if arena is True and prepared.arena is not None:
        return prepared
    if isinstance(arena, Layout) and prepared.arena is not None and prepared.arena.layout is arena:
        return prepared
    layout = None if arena is True else arena
    return replace(prepared, arena=arena_slots(prepared.plan, layout))
