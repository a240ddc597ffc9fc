"""``zero-infinity``: DeepSpeed ZeRO-3 with parameter and optimizer offload (ZeRO-Infinity), one device.

What DeepSpeed does (``docs/references.md``): parameters live in CPU (or NVMe) memory and are
gathered to the device before the module that uses them runs, ahead of time from a recorded trace of
the module order: the prefetcher keeps fetching the next parameters in the trace while fewer than
``prefetch_bucket_elements`` (5e7) are in flight, and while fewer than ``max_live_elements`` (1e9)
are on the device; parameters under ``persistence_threshold`` elements (1e5) stay on the device. A
parameter is released after its module ran unless the trace says it is used again within
``max_reuse_distance`` elements (1e9) of other parameters' fetches. Optimizer state (and the
optimizer step) live off the device; gradients are moved off the device as the backward pass
produces them.

How faithful: the IR has no host compute, so the optimizer step runs on the device here: each
moment and gradient is fetched before its update and the moments are sent back after it. DeepSpeed
runs the step on the CPU and moves only gradients out and updated parameters in, so this model moves
more bytes than the real system in the optimizer phase. A "module visit" is a run of uses of a
storage within one phase (forward, backward, optimizer): that is when DeepSpeed gathers a parameter
(module forward, module backward, optimizer step). The trace is the order of those visits in the
captured step. Activations stay on the device (no activation offload or checkpointing).
Parameters and optimizer state start the step in remote memory and are back there at its end, so
the plan is timed in steady state.

Budget: DeepSpeed has no device budget, only these limits. If the plan's peak is over the budget it
is returned without one, and its peak is what the policy needs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program, ValueKind
from hyperoffload.plans import Kind, Plan
from hyperoffload.policies.common import Placed, elements, emit_plan, written_between
from hyperoffload.policies.spans import storage_uses

POLICY = "zero-infinity"


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroInfinityConfig:
    """DeepSpeed's defaults (``stage3_*`` settings), in tensor elements."""

    prefetch_bucket_elements: int = 50_000_000
    """Fetching ahead continues while fewer elements than this are in flight."""
    max_live_elements: int = 1_000_000_000
    """... and while fewer elements than this are on the device."""
    max_reuse_distance: int = 1_000_000_000
    """A parameter used again within this many fetched elements is not released in between."""
    persistence_threshold: int = 100_000
    """Tensors with fewer elements stay on the device."""


_OFFLOADED = (ValueKind.PARAMETER, ValueKind.OPTIMIZER_STATE, ValueKind.GRADIENT)


def plan_zero_infinity(program: Program, hardware: Hardware, budget_bytes: int,
                       config: ZeroInfinityConfig = ZeroInfinityConfig()) -> Plan:
    """Parameters, optimizer state and gradients off the device between visits, fetched ahead by trace."""
    values = program.values
    inputs = {values[v].storage for v in program.inputs} - {values[v].storage for v in program.constants}
    managed = {s for s in range(len(values)) if values[s].owns_storage and values[s].kind in _OFFLOADED
               and elements(values[s]) >= config.persistence_threshold
               and (s in inputs or values[s].kind is ValueKind.GRADIENT)}
    uses = storage_uses(program, list(range(len(program.ops))))
    visits = {s: _visits(program, uses.positions.get(s, ())) for s in managed}
    kept = _kept_between_visits(program, visits, config)
    placed: list[Placed] = []
    # (first position of the visit, storage, elements, first position its device copy is gone), trace order
    fetches: list[tuple[int, int, int, int]] = []
    leaves: dict[int, list[int]] = {}  # position -> storages whose device copy goes there
    for s, runs in visits.items():
        around = _around_visits(s, runs, kept, s in inputs, uses.writes.get(s, []), elements(values[s]))
        placed += around.placed
        fetches += around.fetches
        for p in around.gone_at:
            leaves.setdefault(p, []).append(s)
    fetches.sort()
    placed += _schedule_fetches(fetches, leaves, len(program.ops), config)
    remote = frozenset(s for s in managed if s in inputs)
    return emit_plan(program, placed, policy=POLICY, budget_bytes=budget_bytes, initial_remote=remote)


def _visits(program: Program, positions: Sequence[int]) -> list[list[int]]:
    """A storage's visits: runs of its uses (``positions``) within one phase, [first, last] positions."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and program.ops[runs[-1][1]].phase is program.ops[p].phase:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return runs


@dataclass(frozen=True, slots=True)
class _AroundVisits:
    """What one managed storage's visits need: its fetches (first position of the visit, storage, elements, first
    position its device copy is gone), its offloads and releases, and the positions its device copy goes."""

    fetches: list[tuple[int, int, int, int]]
    placed: list[Placed]
    gone_at: list[int]


def _around_visits(s: int, runs: list[list[int]], kept: set[tuple[int, int]], is_input: bool, writes: list[int],
                   nelem: int) -> _AroundVisits:
    """Storage ``s`` fetched before each visit not ``kept`` from the one before (a step input also before its first),
    sent out after a visit that wrote it (a gradient is made on the device, an input starts with a current remote
    copy) and released after each visit not followed by a kept one; a storage the step makes is freed after its last
    use instead."""
    fetches: list[tuple[int, int, int, int]] = []
    placed: list[Placed] = []
    gone_at: list[int] = []
    stale = not is_input
    gone = 0
    for k, (a, b) in enumerate(runs):
        if (k == 0 and is_input) or (k > 0 and (s, k) not in kept):
            fetches.append((a, s, nelem, gone))
        gone = b + 1
        stale = stale or written_between(writes, a, b)
        last = k == len(runs) - 1
        if last and not is_input:
            gone_at.append(b + 1)  # freed after its last use
            continue
        if not last and (s, k + 1) in kept:
            continue
        if stale:
            placed.append(Placed(b + 1, Kind.OFFLOAD, s))
            stale = False
        placed.append(Placed(b + 1, Kind.RELEASE, s))
        gone_at.append(b + 1)
    return _AroundVisits(fetches, placed, gone_at)


def _kept_between_visits(program: Program, visits: dict[int, list[list[int]]],
                         config: ZeroInfinityConfig) -> set[tuple[int, int]]:
    """(storage, visit index) of parameter visits that need no fetch: the previous visit was within
    ``max_reuse_distance`` elements of other parameters' visits, so the parameter stayed on the device."""
    values = program.values
    params = sorted((a, elements(values[s])) for s, runs in visits.items()
                    if values[s].kind is ValueKind.PARAMETER for a, _ in runs)
    starts = [a for a, _ in params]
    before = [0]
    for _, nelem in params:
        before.append(before[-1] + nelem)
    kept = set()
    for s, runs in visits.items():
        if values[s].kind is not ValueKind.PARAMETER:
            continue
        for k in range(1, len(runs)):
            lo = bisect.bisect_right(starts, runs[k - 1][1])
            hi = bisect.bisect_left(starts, runs[k][0])
            if before[hi] - before[lo] <= config.max_reuse_distance:
                kept.add((s, k))
    return kept


def _schedule_fetches(fetches: list[tuple[int, int, int, int]], leaves: dict[int, list[int]], n: int,
                      config: ZeroInfinityConfig) -> list[Placed]:
    """Prefetches in trace order: each no later than its visit, and ahead of it while fewer than the
    bucket's elements are in flight and fewer than the live limit are on the device; a wait before use."""
    placed: list[Placed] = []
    size = {s: nelem for _, s, nelem, _ in fetches}
    on_device: set[int] = set()
    in_flight: dict[int, int] = {}  # position of the visit -> elements fetched for it, not yet used
    flying = live = 0
    k = 0
    for p in range(n):
        for s in leaves.get(p, ()):
            if s in on_device:
                on_device.discard(s)
                live -= size[s]
        flying -= in_flight.pop(p, 0)  # fetched ahead for visits starting here: now in use
        while k < len(fetches):
            first, s, nelem, gone = fetches[k]
            due = first <= p
            if not due and (p < gone or flying >= config.prefetch_bucket_elements
                            or live >= config.max_live_elements):
                break
            placed += [Placed(p, Kind.PREFETCH, s, order=first), Placed(first, Kind.WAIT, s)]
            on_device.add(s)
            live += nelem
            if first > p:
                flying += nelem
                in_flight[first] = in_flight.get(first, 0) + nelem
            k += 1
    return placed
