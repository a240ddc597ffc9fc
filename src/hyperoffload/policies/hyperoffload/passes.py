"""What follows the choice of spans: widening a chosen span to its whole idle time where nothing else frees a
position, dropping offloads whose remote copy is still current, moving prefetches early, and emitting the plan.

Each pass takes the pass's context and the choices so far, and returns new choices (span index -> ``Choice``, in
the order chosen: the emitted instructions follow it) without changing what it was given.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from hyperoffload.plans import Instr, Kind, Plan, compute_instructions
from hyperoffload.policies.hyperoffload.config import POLICY, InfeasibleBudget
from hyperoffload.policies.hyperoffload.context import Choice, PassContext
from hyperoffload.policies.hyperoffload.in_flight import held_by_collectives
from hyperoffload.policies.spans import Span

_Copies = Mapping[int, list[tuple[int, float]]]
"""Storage -> (span first, offload landed, seconds) of the chosen spans that sent a copy of it out."""


def current_copy(out: list[tuple[int, float]] | tuple, span: Span, writes: Mapping[int, list[int]]) -> float | None:
    """When the remote copy this span can reuse landed (an earlier chosen span's offload with no write
    of the storage since), or None if the span needs its own offload."""
    w = writes.get(span.storage, [])
    for first, landed in out:
        if first <= span.first:
            k = bisect.bisect_right(w, first)
            if not (k < len(w) and w[k] <= span.first):
                return landed
    return None


def full_window(span: Span, writes: Mapping[int, list[int]], out_until: _Copies) -> Choice:
    """Out right after the use before the span, back right before the use after it."""
    if span.cyclic:
        return Choice(span.first + 1 if writes.get(span.storage) else -1, span.first + 1, span.last, 0)
    landed = current_copy(out_until.get(span.storage, ()), span, writes)
    return Choice(span.first + 1 if landed is None else -1, span.first + 1, span.last)


def _widen(ctx: PassContext, p: int, choices: Mapping[int, Choice]) -> int:
    """A chosen span whose whole idle time covers ``p`` but whose window does not: the largest."""
    best = -1
    n = ctx.positions
    for i, choice in choices.items():
        span = ctx.spans[i]
        idle = (span.first + 1 <= p or p < span.last) if span.cyclic else (span.first + 1 <= p < span.last)
        window = any(lo <= p < hi for lo, hi in choice.freed(n))
        if idle and not window and (best < 0 or span.nbytes > ctx.spans[best].nbytes):
            best = i
    if best < 0:
        raise InfeasibleBudget(f"no storage can leave the device at op position {p}", -1)
    return best


def widened(ctx: PassContext, p: int, choices: Mapping[int, Choice], out_until: _Copies) -> tuple[int, Choice]:
    """The chosen span ``_widen`` stretches to free ``p``, and its choice over its whole idle time."""
    i = _widen(ctx, p, choices)
    span = ctx.spans[i]
    choice = full_window(span, ctx.writes, out_until)
    if choices[i].offload >= 0:  # it copies itself out; the copy it would otherwise reuse is its own
        choice = replace(choice, offload=span.first + 1)
    return i, choice


def reuse_remote_copies(ctx: PassContext, choices: Mapping[int, Choice]) -> dict[int, Choice]:
    """Drop each chosen span's offload where the storage already has a current copy in remote memory: one an
    earlier chosen span of the step sent out with no write since, or, for a storage kept there between steps
    (a chosen cyclic span), the one sent out after the last step's last write, up to the step's first write.
    Selection reuses a copy made by a span chosen before (``current_copy``); this catches the spans chosen
    first of the two. Without it, at small budgets many parameters went out twice a step."""
    by_storage: dict[int, list[int]] = {}
    for i in choices:
        by_storage.setdefault(ctx.spans[i].storage, []).append(i)
    reused = dict(choices)
    for storage, chosen in by_storage.items():
        reused.update(_reused_copies(ctx, ctx.writes.get(storage, []), chosen, choices))
    return reused


def _reused_copies(ctx: PassContext, w: list[int], chosen: list[int],
                   choices: Mapping[int, Choice]) -> dict[int, Choice]:
    """The choices of one storage's chosen spans that drop their offload (``reuse_remote_copies``); ``w``: the
    positions that write the storage."""
    spans = ctx.spans
    # The use before the span whose offload made the remote copy (-1: the copy sent out after the previous
    # step's last write), or None while there is none. A span that drops its offload keeps its release:
    # releasing it earlier, where the memory would be free, made the step slower.
    copy_at = -1 if any(spans[i].cyclic for i in chosen) else None
    reused: dict[int, Choice] = {}
    for i in sorted(chosen, key=lambda i: (spans[i].cyclic, spans[i].first)):  # the cyclic span ends the step
        span, choice = spans[i], choices[i]
        if choice.offload < 0:
            continue
        stale = copy_at is None or bisect.bisect_right(w, span.first) > bisect.bisect_right(w, copy_at)
        if stale:
            copy_at = span.first
        else:
            reused[i] = replace(choice, offload=-1, offload_begin=-1.0)
    return reused


def prefetch_early(ctx: PassContext, choices: Mapping[int, Choice], excess: np.ndarray) -> dict[int, Choice]:
    """Move each prefetch earlier while the budget allows (``excess``, bytes over the budget at each position
    with ``choices``, stays <= 0), keeping prefetches in the order of their deadlines so the H2D lane serves them
    first-due first. Bytes a collective still holds after its position count as live there
    (``in_flight.held_by_collectives``): a prefetch into room a reduce-scatter has not freed yet would make the ops
    after it wait for memory."""
    excess = excess + held_by_collectives(ctx.program, ctx.hardware, ctx.order, ctx.step.start)
    moved = dict(choices)
    floor = 0
    for i in sorted(choices, key=lambda i: (ctx.spans[i].last, i)):
        choice, size = moved[i], ctx.spans[i].nbytes
        p = _earliest_prefetch(choice, excess, size, floor)
        if p < choice.prefetch:
            excess[p:choice.prefetch] += size
            moved[i] = replace(choice, prefetch=p)
        floor = moved[i].prefetch
    return moved


def _earliest_prefetch(choice: Choice, excess: np.ndarray, size: int, floor: int) -> int:
    """The earliest position, from ``floor`` and after the storage leaves, from which on every position up to the
    choice's prefetch has room for ``size`` bytes more."""
    lowest = max(floor, choice.release + 1 if choice.prefetch >= choice.release else choice.resumes + 1)
    p = choice.prefetch
    if lowest < p:
        blocked = np.flatnonzero(excess[lowest:p] + size > 0)
        p = lowest + int(blocked[-1]) + 1 if blocked.size else lowest
    return p


def plan_from_choices(ctx: PassContext, choices: Mapping[int, Choice]) -> Plan:
    """The plan: at each position, offloads, releases, prefetches (first due first) and waits, then the op
    (after the last op, offloads and releases only)."""
    spans, order, n = ctx.spans, ctx.order, ctx.positions
    offloads, releases, prefetches, waits = _by_position(ctx, choices)
    computes = compute_instructions(ctx.program)
    instructions: list[Instr] = []
    done = 0  # ops emitted so far; only positions with cache instructions are visited
    for p in sorted({*offloads, *releases, *prefetches, *waits}):
        instructions.extend(computes[op] for op in order[done:p])
        done = p
        instructions.extend(Instr(Kind.OFFLOAD, spans[i].storage) for i in offloads.get(p, ()))
        instructions.extend(Instr(Kind.RELEASE, spans[i].storage) for i in releases.get(p, ()))
        if p == n:
            break
        instructions.extend(Instr(Kind.PREFETCH, spans[i].storage)
                            for i in sorted(prefetches.get(p, ()), key=lambda i: spans[i].last))
        instructions.extend(Instr(Kind.WAIT, spans[i].storage) for i in waits.get(p, ()))
    instructions.extend(computes[op] for op in order[done:])
    initial_remote = frozenset(spans[i].storage for i in choices if spans[i].cyclic)
    return Plan(program=ctx.program, instructions=tuple(instructions), policy=POLICY,
                budget_bytes=ctx.budget.most, initial_remote=initial_remote)


def _by_position(ctx: PassContext, choices: Mapping[int, Choice]) -> tuple[dict[int, list[int]], ...]:
    """The chosen spans at each position of their offload, release, prefetch and wait, in the order chosen."""
    offloads: dict[int, list[int]] = {}
    releases: dict[int, list[int]] = {}
    prefetches: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    for i, choice in choices.items():
        if choice.offload >= 0:
            offloads.setdefault(choice.offload, []).append(i)
        releases.setdefault(choice.release, []).append(i)
        prefetches.setdefault(choice.prefetch, []).append(i)
        waits.setdefault(ctx.spans[i].last, []).append(i)
    return offloads, releases, prefetches, waits
