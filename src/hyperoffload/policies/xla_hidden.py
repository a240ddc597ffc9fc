"""``xla-hidden``: offload a value only if its transfers fit entirely in the compute between its uses.

Models XLA's automatic, budgeted host offloading (rematerialization with host offload, scheduled by
the latency-hiding scheduler; ``docs/references.md``): where the program's memory is over the limit,
a buffer may go to host memory between two uses only if ``bytes / d2h_bw + bytes / h2d_bw`` (plus each
copy's latency) fits inside the estimated compute time between its last use and its next use.

How faithful: candidates are the idle spans between two consecutive uses of a storage (no state is
kept in host memory across steps: XLA's pass works inside one program). At the position furthest
over the budget the largest hideable candidate covering it is taken, until the budget is met or no
hideable candidate is left. Each copy's time is estimated as if it had the link to itself, as XLA's
cost analysis does: copy-start right after the use before the span, the device buffer freed where the
offload is estimated to have landed, copy-start of the reload as late as still lands in time, and
copy-done (a wait) right before the next use. Copies that overlap share the link in the simulation,
so some are not hidden after all. A storage whose host copy is still current is not copied again.

Budget: when no hideable candidate is left and the budget is not met, XLA reports the memory it
could not save; here the plan is returned without a budget, and its peak is what the policy needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperoffload.cost import op_times
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Kind, Plan, check_plan, plan_without_offload
from hyperoffload.policies.common import Placed, emit_plan, written_between
from hyperoffload.policies.spans import MIN_SPAN_PARTS, Span, Uses, idle_spans, positions_arrays, storage_uses

POLICY = "xla-hidden"


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaHiddenConfig:
    """Knobs of the budgeted host offload."""

    min_bytes: int | None = None
    """Storages smaller than this (bytes) are not candidates; None: the no-offload peak divided by
    ``min_span_parts``."""
    min_span_parts: int = MIN_SPAN_PARTS
    """Without ``min_bytes``, the candidates are the storages from the no-offload peak divided by this many parts up
    (a count): the HyperOffload planner's default (``PlannerConfig.min_span_parts``), so both choose among the same
    spans."""


def plan_xla_hidden(program: Program, hardware: Hardware, budget_bytes: int,
                    config: XlaHiddenConfig = XlaHiddenConfig()) -> Plan:
    """Offload only spans whose copies hide in the compute between their uses, until the budget is met."""
    live = np.asarray(check_plan(plan_without_offload(program)).live_bytes, dtype=np.int64)
    if len(program.ops) == 0 or live.max() <= budget_bytes:
        return emit_plan(program, (), policy=POLICY, budget_bytes=budget_bytes)
    uses = storage_uses(program, list(range(len(program.ops))))
    windows = _hidden_windows(program, hardware, uses, live, config)
    taken = _taken(windows, live - budget_bytes)
    return emit_plan(program, _placements(windows, taken, uses), policy=POLICY, budget_bytes=budget_bytes)


@dataclass(frozen=True, slots=True)
class _Windows:
    """The candidate spans (none cyclic) and, per span (positions, bytes), the positions its device copy is gone if
    its copies are to hide: from where its offload has landed (``release``) to where its reload starts
    (``prefetch``)."""

    spans: list[Span]
    first: np.ndarray
    last: np.ndarray
    size: np.ndarray
    release: np.ndarray
    prefetch: np.ndarray
    usable: np.ndarray
    """Whether both copies fit in the compute between the span's uses and the window is not empty."""


def _hidden_windows(program: Program, hardware: Hardware, uses: Uses, live: np.ndarray,
                    config: XlaHiddenConfig) -> _Windows:
    """Each candidate span's window, each copy timed as if it had the link to itself."""
    times = np.asarray(op_times(program, hardware), dtype=np.float64)
    end = np.cumsum(times)
    start = end - times
    min_bytes = int(live.max()) // config.min_span_parts if config.min_bytes is None else config.min_bytes
    spans = [s for s in idle_spans(program, uses, min_bytes=min_bytes) if not s.cyclic]
    first, last, size = positions_arrays(spans)
    offload_s = hardware.d2h_latency_s + size / hardware.d2h_bw
    prefetch_s = hardware.h2d_latency_s + size / hardware.h2d_bw
    hideable = start[last] - end[first] >= offload_s + prefetch_s
    release = np.maximum(np.searchsorted(start, end[first] + offload_s, side="left"), first + 1)
    prefetch = np.searchsorted(start, start[last] - prefetch_s, side="right") - 1
    return _Windows(spans, first, last, size, release, prefetch, hideable & (release < prefetch))


def _taken(windows: _Windows, excess: np.ndarray) -> np.ndarray:
    """Which spans go to host memory: at the position furthest over the budget (``excess``, bytes over it at each
    position), the largest usable span whose window covers it, until none is over or nothing usable covers it
    (the budget is then not met)."""
    excess = excess.copy()
    taken = np.zeros(len(windows.spans), dtype=bool)
    release, prefetch, size = windows.release, windows.prefetch, windows.size
    while True:
        p = int(excess.argmax())
        if excess[p] <= 0:
            return taken
        covering = np.flatnonzero(windows.usable & ~taken & (release <= p) & (p < prefetch))
        if covering.size == 0:
            return taken
        i = int(covering[np.argmax(size[covering])])
        taken[i] = True
        excess[release[i]:prefetch[i]] -= size[i]


def _placements(windows: _Windows, taken: np.ndarray, uses: Uses) -> list[Placed]:
    """The taken spans' copies, in span order: an offload right after the use before the span unless the host copy
    is still current, the release and the reload's start at the window's ends, a wait right before the next use."""
    first, last = windows.first, windows.last
    placed: list[Placed] = []
    copied_at: dict[int, int] = {}  # storage -> position of its latest chosen offload
    for i in sorted(np.flatnonzero(taken), key=lambda i: (first[i], i)):
        s = windows.spans[i].storage
        a, b = int(first[i]), int(last[i])
        if s not in copied_at or written_between(uses.writes.get(s, []), copied_at[s], a):
            copied_at[s] = a + 1
            placed.append(Placed(a + 1, Kind.OFFLOAD, s))
        placed += [Placed(int(windows.release[i]), Kind.RELEASE, s),
                   Placed(int(windows.prefetch[i]), Kind.PREFETCH, s, order=b), Placed(b, Kind.WAIT, s)]
    return placed
