"""Idle spans: the unit a planner decides on.

A storage is *used on the device* by every op that reads or writes it. Between two consecutive
uses it idles; if the span is long enough it can go to remote memory after the first use and come
back before the second. Step inputs (parameters, optimizer state, KV cache) persist from step to
step, so each also has a cyclic span from its last use to its first use in the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperoffload.analysis.uses import Uses, storage_uses
from hyperoffload.ir import Program

MIN_SPAN_PARTS = 10_000
"""Default of ``PlannerConfig.min_span_parts`` and ``XlaHiddenConfig.min_span_parts`` (a count), which document it:
both policies choose among the same spans."""

@dataclass(frozen=True, slots=True)
class Span:
    """Storage ``storage`` is not used on the device strictly between positions ``first`` and ``last``.

    A *cyclic* span (``first >= last``) runs from a step input's last use in one step to its first use
    in the next (the same position for an input used once): the storage lives in remote memory between
    steps (it starts the step there, comes in before ``last`` and goes out after ``first``), as training
    state does in ZeRO-Offload.
    """

    storage: int
    first: int
    """Position of the use before the span."""
    last: int
    """Position of the use after the span."""
    nbytes: int

    @property
    def cyclic(self) -> bool:
        return self.first >= self.last


def idle_spans(program: Program, uses: Uses, *, min_bytes: int, scalars: bool = False) -> list[Span]:
    """Every span of at least one position between two uses of a storage of ``min_bytes`` or more; with ``scalars``,
    of each 0-dim storage too, however small."""
    values = program.values
    # Only step inputs can start the step in remote memory (``Plan.initial_remote``): the caller hands them
    # over each step. Graph constants (tensor attributes of a model that are neither parameters nor buffers)
    # are the graph's own, so they have spans between their uses but no cyclic one.
    persistent = frozenset(values[v].storage for v in program.inputs)
    spans = []
    for s, positions in uses.positions.items():
        size = values[s].alloc_bytes
        if size == 0:  # an empty storage frees nothing by leaving
            continue
        if size < min_bytes and not (scalars and values[s].shape == ()):
            continue
        # A step input's idle time before its first use is covered by its cyclic span (it arrives from
        # remote memory), which also frees it after its last use: no separate span from the start.
        for previous, p in zip(positions, positions[1:]):
            if p - previous >= 2:
                spans.append(Span(s, previous, p, size))
        if s in persistent:
            spans.append(Span(s, positions[-1], positions[0], size))
    return spans


def positions_arrays(spans: list[Span]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, last, nbytes) of ``spans`` as int64 arrays."""
    return (np.fromiter((s.first for s in spans), np.int64, len(spans)),
            np.fromiter((s.last for s in spans), np.int64, len(spans)),
            np.fromiter((s.nbytes for s in spans), np.int64, len(spans)))


__all__ = ["Span", "Uses", "idle_spans", "positions_arrays", "storage_uses"]
