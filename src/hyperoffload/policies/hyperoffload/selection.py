"""Greedy selection of idle spans and their schedule on the two copy lanes, for one order, margin and start.

Where the profile is furthest over budget, the selection takes the span whose offload and prefetch hide in the
compute between its uses and that relieves the most over-budget time per byte moved. Where nothing hideable covers
the position, it first stretches a span it has already chosen over it, with the copies that span has booked (the
compute stream waits for them instead; spans kept in remote memory between steps included), and only then takes a new
span that cannot be hidden. Each offload goes right
after the use before its span, each release where the lane model says the offload has finished, each prefetch as late
as its deadline needs; a storage whose remote copy is still current is released without a second offload.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hyperoffload.ir import Phase, Program
from hyperoffload.plans import Plan
from hyperoffload.policies.hyperoffload.context import Choice, PassContext
from hyperoffload.policies.hyperoffload.passes import (current_copy, full_window, plan_from_choices, prefetch_early,
                                                       reuse_remote_copies, widened)
from hyperoffload.policies.lanes import Lane
from hyperoffload.policies.spans import Span, positions_arrays


def plan_selection_pass(ctx: PassContext) -> Plan:
    """The plan of one selection pass: the spans chosen and scheduled, then the post-passes, then the emission."""
    choices, excess = _Selection(ctx).run()
    choices = reuse_remote_copies(ctx, choices)
    if ctx.config.early_prefetch:
        choices = prefetch_early(ctx, choices, excess)
    return plan_from_choices(ctx, choices)


def spans_across_the_turn(program: Program, order: Sequence[int], spans: Sequence[Span]) -> dict[int, int]:
    """Storage -> index of its span from a use in the forward pass to one after it, for the storages of the step's
    state (those with a cyclic span) that have one: what ``PlannerConfig.state_first_turn`` keeps away."""
    ops = program.ops
    forward = [ops[op_id].phase is Phase.FORWARD for op_id in order]
    state = {span.storage for span in spans if span.cyclic}
    return {span.storage: i for i, span in enumerate(spans)
            if not span.cyclic and span.storage in state and forward[span.first] and not forward[span.last]}


@dataclass(frozen=True, slots=True, kw_only=True)
class _SpanTimes:
    """Per-span arrays of one pass (positions, bytes, seconds), and the same as lists for the per-span placement,
    which runs for each of ``candidates_per_step`` spans at every selection step: Python lists and bisect give the
    same answers as the arrays and np.searchsorted at a fraction of their cost per item."""

    first: np.ndarray
    last: np.ndarray
    size: np.ndarray
    cyclic: np.ndarray
    offload_s: np.ndarray
    prefetch_s: np.ndarray
    start_at: np.ndarray
    """Each position's start; position n: after the step's last op."""
    latest: np.ndarray
    """The last position a prefetch may start at and still land before the use after the span, the lanes aside."""
    lo1: np.ndarray
    """With hi1 and hi2, the windows if each span had the lanes to itself (an upper bound used to rank candidates):
    freed positions [lo1, hi1) and, for cyclic spans, also [0, hi2) at the start of the step."""
    hi1: np.ndarray
    hi2: np.ndarray
    favour: np.ndarray | None
    """Selection scores' factors, above 1 for cyclic spans in the state-first start (``PlannerConfig.state_first``)."""
    latency_bytes: float
    starts: list[float]
    starts_at: list[float]
    offload_l: list[float]
    prefetch_l: list[float]
    ready_l: list[float]
    end_s: float


def _span_times(ctx: PassContext) -> _SpanTimes:
    hardware, step, margin = ctx.hardware, ctx.step, ctx.margin
    first, last, size = positions_arrays(ctx.spans)
    cyclic = first >= last
    n = step.live.size
    total = step.end[-1]
    start_at = np.append(step.start, total)
    offload_s = hardware.d2h_latency_s + size / (hardware.d2h_bw * margin)
    prefetch_s = hardware.h2d_latency_s + size / (hardware.h2d_bw * margin)
    ready = step.end[first]  # when the use before the span is done
    lo1 = np.minimum(np.maximum(np.searchsorted(start_at, ready + offload_s, side="left"), first + 1), n)
    latest = np.searchsorted(step.start, step.start[last] - prefetch_s, side="right") - 1
    favour = 1.0 + ctx.config.state_first_tie * cyclic if ctx.state_first else None
    return _SpanTimes(
        first=first, last=last, size=size, cyclic=cyclic, offload_s=offload_s, prefetch_s=prefetch_s,
        start_at=start_at, latest=latest, lo1=lo1, hi1=np.where(cyclic, n, np.minimum(latest, last)),
        hi2=np.where(cyclic, np.maximum(latest, 0), 0), favour=favour,
        latency_bytes=hardware.h2d_latency_s * hardware.h2d_bw, starts=step.start.tolist(),
        starts_at=start_at.tolist(), offload_l=offload_s.tolist(), prefetch_l=prefetch_s.tolist(),
        ready_l=ready.tolist(), end_s=float(total))


class _Selection:
    """One greedy selection pass over ``ctx``: the lanes' reservations, the spans chosen so far and the bytes still
    over the budget at each position change as it runs; ``run`` hands back the choices and the excess."""

    def __init__(self, ctx: PassContext) -> None:
        self.ctx = ctx
        self.t = t = _span_times(ctx)
        self.n = ctx.positions
        self.d2h = Lane(float(t.offload_s.min(initial=np.inf)))
        self.h2d = Lane(float(t.prefetch_s.min(initial=np.inf)))
        self.choices: dict[int, Choice] = {}
        self.free = np.ones(len(ctx.spans), dtype=bool)  # spans not chosen yet
        self.window = np.full((3, len(ctx.spans)), -1, dtype=np.int64)
        """Release, prefetch and resume position (``Choice.resumes``) of each chosen span (-1: not chosen)."""
        self.out_until: dict[int, list[tuple[int, float]]] = {}  # storage -> (span first, offload landed)
        self.excess = (ctx.step.live - ctx.budget.at).astype(np.float64)
        self.over: np.ndarray | None = None
        """over[k]: compute time of the over-budget positions before k; kept while they stay the same."""

    def run(self) -> tuple[dict[int, Choice], np.ndarray]:
        """The chosen spans (index -> choice, in the order chosen) and the bytes over budget at each position."""
        if self.ctx.turn:
            self._state_away_at_the_turn()
        while True:
            p = int(self.excess.argmax())
            need = self.excess[p]
            if need <= 0:
                return dict(self.choices), self.excess.copy()
            if self.over is None:
                self.over = np.concatenate([[0.0], np.cumsum(np.where(self.excess > 0, self.ctx.step.times, 0.0))])
            best = self._hidden(p, need)
            if best is None:  # nothing hides here: stretch a chosen span over p, else take one unhidden
                stretched = self._stretched(p, need) if self.ctx.config.stretch_chosen else None
                if stretched is not None:
                    self._replace(*stretched)
                    continue
                best = self._unhidden(p, need)
            if best is None:  # every span that could free p is taken: stretch one to its whole idle time
                self._widen(p)
            else:
                self._take(*best)

    def _state_away_at_the_turn(self) -> None:
        """The first choices of the state-first start at the turn (``PlannerConfig.state_first_turn``): each storage of
        the step's state that the forward pass reads and a later op reads again before the step writes it (an FSDP
        parameter shard, which every layer's all-gather reads in the forward and again in the backward pass) is kept in
        remote memory between steps (its cyclic span) and leaves after its forward use with no offload, its remote copy
        still current, to come back for its use after the forward pass. At the turn from forward to backward, where the
        step peaks, it is then off the device at the cost of prefetches alone, and the forward pass's D2H lane, which
        carries the saved activations, moves less (``analysis.link_bound``'s phases). Where the cyclic span cannot be
        placed the storage is left to the greedy; where only the span into the backward pass cannot, the storage stays
        kept remote between steps, as the state-first start prefers anyway."""
        spans = self.ctx.spans
        turning = spans_across_the_turn(self.ctx.program, self.ctx.order, spans)
        for i, span in enumerate(spans):
            if not span.cyclic or span.storage not in turning:
                continue
            home = self._cyclic_window(i, 0) or self._cyclic_window(i, max(span.last - 1, 0))
            if home is None:
                continue
            self._take(i, home)
            j = turning[span.storage]
            away = self._window(j, (spans[j].first + spans[j].last) // 2)
            if away is not None and away.offload < 0:
                self._take(j, away)
        self.over = None

    def _hidden(self, p: int, need: float) -> tuple[int, Choice] | None:
        """The best-scoring lane-aware placement among the best-ranked spans that could free ``p``."""
        t, over = self.t, self.over
        best: tuple[float, int, Choice] | None = None
        for i in self._ranked(p, need)[:self.ctx.config.candidates_per_step]:
            choice = self._window(int(i), p)
            if choice is None:
                continue
            score = choice.covered(over, self.n) * min(t.size[i], need) / (t.size[i] + t.latency_bytes)
            if t.favour is not None:
                score *= t.favour[i]
            if best is None or score > best[0]:
                best = (score, int(i), choice)
        return None if best is None else best[1:]

    def _ranked(self, p: int, need: float) -> np.ndarray:
        """The spans not chosen yet whose own window covers ``p``, best upper bound of their score first."""
        t, over = self.t, self.over
        covers = (t.lo1 <= p) & (p < t.hi1) | (p < t.hi2)
        candidates = np.flatnonzero(self.free & covers)
        covered = over[t.hi1[candidates]] - over[np.minimum(t.lo1[candidates], t.hi1[candidates])] + over[
            t.hi2[candidates]]
        bound = covered * np.minimum(t.size[candidates], need) / (t.size[candidates] + t.latency_bytes)
        if t.favour is not None:
            bound *= t.favour[candidates]
        return candidates[np.argsort(-bound, kind="stable")]

    def _window(self, i: int, p: int) -> Choice | None:
        """Lane-aware placement of span i, if it frees position p."""
        span, t = self.ctx.spans[i], self.t
        if span.cyclic:
            return self._cyclic_window(i, p)
        landed = current_copy(self.out_until.get(span.storage, ()), span, self.ctx.writes)
        if landed is None:
            q = self.d2h.earliest(t.starts, span.first + 1, t.offload_l[i], p + 1)
            if q < 0:
                return None
            done, offload = t.starts[q] + t.offload_l[i], q
        else:
            done, offload = max(t.ready_l[i], landed), -1
        release = max(bisect.bisect_left(t.starts, done), span.first + 1)
        if release > p:
            return None
        q = self.h2d.latest(t.starts, span.last, t.prefetch_l[i], t.starts[span.last], p + 1)
        if q < 0:
            return None
        return Choice(offload, release, q)

    def _cyclic_window(self, i: int, p: int) -> Choice | None:
        span, t, n = self.ctx.spans[i], self.t, self.n
        prefetch = self.h2d.latest(t.starts, span.last, t.prefetch_l[i], t.starts[span.last], 0)
        if prefetch < 0:
            return None
        begin = -1.0
        if self.ctx.writes.get(span.storage):  # changed this step: the copy from the last step is stale
            q = self.d2h.earliest(t.starts_at, span.first + 1, t.offload_l[i], n + 1)
            if q < 0:  # the lane is booked to the end: go out after the step, once the lane is free
                q, begin = n, max(t.end_s, max(self.d2h.ends, default=t.end_s))
            landed, offload = (begin if begin >= 0 else t.starts_at[q]) + t.offload_l[i], q
        else:
            landed, offload = t.ready_l[i], -1
        if landed <= t.end_s:
            release, resumes = max(bisect.bisect_left(t.starts_at, landed), span.first + 1), 0
        else:  # lands during the next step: the storage is still on the device when that step starts
            release, resumes = n, bisect.bisect_left(t.starts, landed - t.end_s)
        if not (release <= p or resumes <= p < prefetch):
            return None
        return Choice(offload, release, prefetch, resumes, begin)

    def _stretched(self, p: int, need: float) -> tuple[int, Choice] | None:
        """A chosen span whose idle time covers ``p`` but whose window does not, stretched over ``p`` with the copies
        it has booked: released earlier, where its offload lands after ``p`` (an offload booked after ``p``, or after
        the step for a span kept in remote memory between steps, goes right after the use before the span instead), or
        prefetched later, as late as its use allows.
        Where the lanes are too busy for anything to hide (a forward pass whose saved activations leave slower than it
        computes), this moves no more bytes, where a new unhidden span adds a round trip on those lanes; the compute
        stream waits for the booked copy instead. Of the stretches, the one with the least such wait at ``p``
        (seconds, in the lane-free time the pass plans against), and of equal waits the one that relieves most, but
        a span kept in remote memory between steps is prefetched later only where no other stretch is left (its
        prefetch is the state's one crossing of the step; ranked with the rest, it made ``llama3-70b`` x 4 of
        ``gh200-nvl`` at its smallest budget slower, docs/results.md); None
        where no chosen span can be stretched over ``p``. The stretch covers the whole over-budget stretch of
        positions around ``p`` that its idle time covers, not ``p`` alone. The lanes' reservations stay where they
        were booked."""
        t = self.t
        release, prefetch, resumes = self.window
        chosen = release >= 0
        # On the device at p between the use before its span and the release (a cyclic span: after its last use in
        # the step), or between the prefetch and the use after it (a cyclic span: before its first use).
        late_release = chosen & (t.first < p) & (p < release) & (t.cyclic | (prefetch > p))
        early_prefetch = chosen & (prefetch <= p) & (p < t.last) & np.where(t.cyclic, resumes <= p, release <= p)
        candidates = np.flatnonzero(late_release | early_prefetch)
        if candidates.size == 0:
            return None
        later = np.minimum(np.maximum(t.latest[candidates], p + 1), t.last[candidates])
        wait = np.where(late_release[candidates], t.start_at[release[candidates]] - t.starts[p],
                        t.start_at[later] + t.prefetch_s[candidates] - t.start_at[t.last[candidates]])
        relieved = np.minimum(t.size[candidates], need)
        last_resort = (t.cyclic & early_prefetch)[candidates]
        k = int(np.lexsort((-relieved, np.maximum(wait, 0.0), last_resort))[0])
        i, choice = int(candidates[k]), self.choices[int(candidates[k])]
        below = np.flatnonzero(self.excess[:p] <= 0)  # the over-budget stretch around p: [lo, hi)
        above = np.flatnonzero(self.excess[p:] <= 0)
        lo, hi = (int(below[-1]) + 1 if below.size else 0), (p + int(above[0]) if above.size else self.n)
        if late_release[i]:
            if choice.offload >= p:
                choice = replace(choice, offload=int(t.first[i]) + 1, offload_begin=-1.0)
            return i, replace(choice, release=max(lo, int(t.first[i]) + 1, choice.offload), resumes=0)
        return i, replace(choice, prefetch=int(min(max(later[k], hi), t.last[i])))

    def _replace(self, i: int, choice: Choice) -> None:
        """Give chosen span i ``choice`` in place of its own (its lane reservations stay)."""
        self._free(i, self.choices[i], -1)
        self._choose(i, choice)
        self._free(i, choice, 1)

    def _choose(self, i: int, choice: Choice) -> None:
        """Record ``choice`` as span i's, in ``choices`` and in ``window``."""
        self.choices[i] = choice
        self.window[:, i] = choice.release, choice.prefetch, choice.resumes

    def _unhidden(self, p: int, need: float) -> tuple[int, Choice] | None:
        """The span whose whole idle time around ``p`` relieves the most over-budget time, placed without
        regard to the lanes: out right after its use, back right before its next (the compute stream may
        wait for the copies, but the budget holds)."""
        t, over, n = self.t, self.over, self.n
        first, last, cyclic = t.first, t.last, t.cyclic
        inside = ~cyclic & (first + 1 <= p) & (p < last)
        wrapped = cyclic & ((first + 1 <= p) | (p < last))
        candidates = np.flatnonzero(self.free & (inside | wrapped))
        if candidates.size == 0:
            return None
        lo = first[candidates] + 1
        hi = last[candidates]
        idle = np.where(cyclic[candidates], over[n] - over[np.minimum(lo, n)] + over[hi], over[hi] - over[lo])
        i = int(candidates[np.argmax(idle * np.minimum(t.size[candidates], need))])
        return i, full_window(self.ctx.spans[i], self.ctx.writes, self.out_until)

    def _widen(self, p: int) -> None:
        """Stretch a chosen span to its whole idle time to free ``p`` (``passes.widened``)."""
        self._replace(*widened(self.ctx, p, self.choices, self.out_until))

    def _free(self, i: int, choice: Choice, sign: int) -> None:
        """Take span i's bytes off (``sign`` 1) or back onto (-1) the excess where ``choice`` frees them."""
        size = self.t.size[i] * sign
        for lo, hi in choice.freed(self.n):
            was_over = self.excess[lo:hi] > 0
            self.excess[lo:hi] -= size
            if self.over is not None and (was_over != (self.excess[lo:hi] > 0)).any():
                self.over = None

    def _take(self, i: int, choice: Choice) -> None:
        """Choose span i as placed by ``choice``: book its copies on the lanes and take its bytes off the excess."""
        t, span = self.t, self.ctx.spans[i]
        self._choose(i, choice)
        self.free[i] = False
        landed = 0.0
        if choice.offload >= 0:
            begin = choice.offload_begin if choice.offload_begin >= 0 else t.start_at[choice.offload]
            self.d2h.reserve(begin, begin + t.offload_s[i])
            landed = begin + t.offload_s[i]
            if not span.cyclic:
                self.out_until.setdefault(span.storage, []).append((span.first, landed))
        if span.cyclic:
            # Kept in remote memory between steps, the storage has a current copy there from the step's start
            # (once the last step's offload has landed) to its first write: spans before that need no offload.
            self.out_until.setdefault(span.storage, []).append((-1, max(0.0, landed - t.end_s)))
        begin = self.ctx.step.start[choice.prefetch]
        self.h2d.reserve(begin, begin + t.prefetch_s[i])
        self._free(i, choice, 1)
