"""``distance``: MindSpore's public fixed-distance offload heuristic (the ``hyper_offload`` pass).

What MindSpore's code does (``docs/references.md``): for each tensor, its users sorted by execution
position; a gap between consecutive uses longer than ``select_distance`` nodes (default 100) gets a
device->host copy after the tensor's producer and a host->device copy before the first user after
the gap; at most ``select_num`` tensors (default 100). Each host->device copy is moved
``prefetch_distance`` nodes (default 50) earlier, but not before its source copy; device memory is
released ``release_distance`` nodes (default 0) after the last user before the gap. No cost model,
no bandwidth term, no budget.

How faithful: nodes are the ops of the captured order (views included). "After the producer" is
after the op that last wrote the storage before the gap, or the start of the step for a step input
not yet written; a storage whose remote copy is still current (not written since) is not copied out
again. Which ``select_num`` tensors are taken when more qualify is not documented; here the first
ones in execution order (by the start of their first long gap), as a pass over the graph meets them
(unverified). The compute stream waits for each prefetch right before its first user.

Budget: the heuristic ignores it. If the plan's peak is over the budget the plan is returned without
one, and its peak is what the policy needs.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Kind, Plan
from hyperoffload.policies.common import Placed, emit_plan, written_between
from hyperoffload.policies.spans import storage_uses

POLICY = "distance"


@dataclass(frozen=True, slots=True, kw_only=True)
class DistanceConfig:
    """MindSpore's defaults (counts of nodes, i.e. ops of the captured order)."""

    select_distance: int = 100
    """A gap between two uses longer than this is offloaded."""
    select_num: int = 100
    """At most this many tensors are offloaded."""
    prefetch_distance: int = 50
    """Each prefetch is issued this many ops before the use that needs it."""
    release_distance: int = 0
    """Device memory is released this many ops after the last use before the gap."""


def plan_distance(program: Program, hardware: Hardware, budget_bytes: int,
                  config: DistanceConfig = DistanceConfig()) -> Plan:
    """Offload the long gaps of the first ``select_num`` tensors that have one, at fixed distances."""
    n = len(program.ops)
    uses = storage_uses(program, list(range(n)))
    gaps: dict[int, list[tuple[int, int]]] = {}
    for s, positions in uses.positions.items():
        if program.values[s].alloc_bytes == 0:
            continue
        long = [(a, b) for a, b in itertools.pairwise(positions) if b - a > config.select_distance]
        if long:
            gaps[s] = long
    chosen = sorted(gaps, key=lambda s: (gaps[s][0][0], s))[:config.select_num]
    placed: list[Placed] = []
    for s in chosen:
        writes = uses.writes.get(s, [])
        copied_at = -1  # position of the latest offload of s (a copy of s as it was before that position)
        for a, b in gaps[s]:
            release = min(a + 1 + config.release_distance, b)
            if copied_at < 0 or written_between(writes, copied_at, a):
                k = bisect.bisect_right(writes, a) - 1
                copied_at = writes[k] + 1 if k >= 0 else 0  # right after the producer (or the step's start)
                placed.append(Placed(copied_at, Kind.OFFLOAD, s))
            prefetch = max(b - config.prefetch_distance, release)
            placed += [Placed(release, Kind.RELEASE, s), Placed(prefetch, Kind.PREFETCH, s, order=b),
                       Placed(b, Kind.WAIT, s)]
    return emit_plan(program, placed, policy=POLICY, budget_bytes=budget_bytes)
