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
from hyperoffload.policies.spans import idle_spans, positions_arrays, storage_uses

POLICY = "xla-hidden"


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaHiddenConfig:
    """Knobs of the budgeted host offload."""

    min_bytes: int | None = None
    """Storages smaller than this (bytes) are not candidates; None: 1/10,000 of the no-offload peak (the
    HyperOffload planner's default, so both choose among the same spans)."""


def plan_xla_hidden(program: Program, hardware: Hardware, budget_bytes: int,
                    config: XlaHiddenConfig = XlaHiddenConfig()) -> Plan:
    """Offload only spans whose copies hide in the compute between their uses, until the budget is met."""
    n = len(program.ops)
    live = np.asarray(check_plan(plan_without_offload(program)).live_bytes, dtype=np.int64)
    if n == 0 or live.max() <= budget_bytes:
        return emit_plan(program, (), policy=POLICY, budget_bytes=budget_bytes)
    times = np.asarray(op_times(program, hardware), dtype=np.float64)
    end = np.cumsum(times)
    start = end - times
    uses = storage_uses(program, list(range(n)))
    min_bytes = int(live.max()) // 10_000 if config.min_bytes is None else config.min_bytes
    spans = [s for s in idle_spans(program, uses, min_bytes=min_bytes) if not s.cyclic]
    first, last, size = positions_arrays(spans)
    offload_s = hardware.d2h_latency_s + size / hardware.d2h_bw
    prefetch_s = hardware.h2d_latency_s + size / hardware.h2d_bw
    hideable = start[last] - end[first] >= offload_s + prefetch_s
    # Positions the device copy is gone: from where the offload has landed to where the reload starts.
    release = np.maximum(np.searchsorted(start, end[first] + offload_s, side="left"), first + 1)
    prefetch = np.searchsorted(start, start[last] - prefetch_s, side="right") - 1
    usable = hideable & (release < prefetch)
    excess = live - budget_bytes
    taken = np.zeros(len(spans), dtype=bool)
    while True:
        p = int(excess.argmax())
        if excess[p] <= 0:
            break
        covering = np.flatnonzero(usable & ~taken & (release <= p) & (p < prefetch))
        if covering.size == 0:
            break  # over budget here and nothing hideable covers it: the budget is not met
        i = int(covering[np.argmax(size[covering])])
        taken[i] = True
        excess[release[i]:prefetch[i]] -= size[i]
    placed: list[Placed] = []
    copied_at: dict[int, int] = {}  # storage -> position of its latest chosen offload
    for i in sorted(np.flatnonzero(taken), key=lambda i: (first[i], i)):
        s = spans[i].storage
        a, b = int(first[i]), int(last[i])
        if s not in copied_at or written_between(uses.writes.get(s, []), copied_at[s], a):
            copied_at[s] = a + 1
            placed.append(Placed(a + 1, Kind.OFFLOAD, s))
        placed += [Placed(int(release[i]), Kind.RELEASE, s), Placed(int(prefetch[i]), Kind.PREFETCH, s, order=b),
                   Placed(b, Kind.WAIT, s)]
    return emit_plan(program, placed, policy=POLICY, budget_bytes=budget_bytes)
