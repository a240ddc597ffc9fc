"""The search in one execution order: a selection pass from each of its starts (bandwidth margins, op times
stretched to the window bound, state first), each simulated and then refined against the op times it was simulated
at; the fastest plan is kept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyperoffload.analysis.window_bound import window_bound
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Plan
from hyperoffload.policies.hyperoffload.config import PlannerConfig, PositionBudget
from hyperoffload.policies.hyperoffload.context import PassContext, StepProfile, back_to_back
from hyperoffload.policies.hyperoffload.minimum import OrderFacts
from hyperoffload.policies.hyperoffload.orders import execution_orders, made_share
from hyperoffload.policies.hyperoffload.selection import plan_selection_pass, spans_across_the_turn
from hyperoffload.policies.spans import Span, idle_spans
from hyperoffload.remote_layout import remote_bytes
from hyperoffload.simulate import Timeline, simulate


class Simulations:
    """The timelines of the plans one search simulated, by what each plan does (its instructions and the storages it
    starts remote): passes often make a plan another made already, and each is simulated once. Every plan of one
    search has the same program, budget and hardware."""

    __slots__ = ("hardware", "_by_plan")

    def __init__(self, hardware: Hardware) -> None:
        self.hardware = hardware
        self._by_plan: dict[tuple, Timeline] = {}

    def timeline(self, plan: Plan) -> Timeline:
        """``plan`` simulated on the search's hardware."""
        key = (plan.instructions, plan.initial_remote)
        if key not in self._by_plan:
            self._by_plan[key] = simulate(plan, self.hardware)
        return self._by_plan[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchContext:
    """What every pass of one search plans for; the passes read it and change none of it."""

    program: Program
    hardware: Hardware
    budget: PositionBudget
    config: PlannerConfig
    times_by_op: np.ndarray
    """Each op's time on ``hardware`` (seconds, by op id; ``cost.op_times``)."""
    simulations: Simulations
    """The plans the search has simulated so far."""
    host_bytes: int = 0
    """A rank's share of a node's host memory (bytes; 0: no limit): a plan that keeps more in host memory ranks
    after every plan that fits it (``Tried.rank``)."""


@dataclass(frozen=True, slots=True)
class Tried:
    """A candidate plan, how it simulated, the bandwidth margin it was made for, whether it started from
    op times stretched to the window bound and whether it took state first (``PlannerConfig.state_first``)."""

    plan: Plan
    timeline: Timeline
    margin: float
    stretched: bool = False
    state_first: bool = False
    turn: bool = False
    """With ``state_first``: whether state read on both sides of the turn from forward to backward was kept away
    across it first (``PlannerConfig.state_first_turn``)."""
    over_host_bytes: int = 0
    """What the plan keeps in host memory beyond a rank's share of its node (bytes; ``SearchContext.host_bytes``)."""

    @property
    def step_s(self) -> float:
        return self.timeline.step_s

    @property
    def rank(self) -> tuple[int, float]:
        """What the search keeps the least of: first what the plan keeps beyond the host memory it has, then the
        step time."""
        return self.over_host_bytes, self.timeline.step_s

    @property
    def start(self) -> tuple[float, bool, bool, bool]:
        return self.margin, self.stretched, self.state_first, self.turn


@dataclass(frozen=True, slots=True)
class OrderOutcome:
    """The search in one order: its fastest plan, the unrefined plans it started from and what it planned from."""

    best: Tried
    tried: tuple[Tried, ...]
    facts: OrderFacts


@dataclass(frozen=True, slots=True)
class _Start:
    """Where a pass in one order starts: its margin, whether stretched or state first, and the op times it plans
    against."""

    margin: float
    stretched: bool
    state_first: bool
    step: StepProfile
    turn: bool = False

    @property
    def key(self) -> tuple[float, bool, bool, bool]:
        return self.margin, self.stretched, self.state_first, self.turn


def plan_in_order(search: SearchContext, facts: OrderFacts, seeds: Sequence[Tried] = ()) -> OrderOutcome:
    """The fastest plan found with the compute ops in ``facts.order``, and the unrefined plans it started from
    (one per margin, one against op times stretched to the window bound, one state first); ``seeds``, plans made
    in that order (unrefined), stand for their starts instead of planning them again."""
    starts = _starts(search, facts, search.times_by_op[facts.order], done={t.start for t in seeds})
    tried = [*seeds, *(_attempt(search, facts, s.step, s.margin, s.stretched, s.state_first, s.turn)
                       for s in starts)]
    # The state-first starts are refined on their own (the faster of the two): refining only the best start of all
    # made plans slower where a state-first start had been the best before.
    refined = [_refined(search, facts, [t for t in tried if t.state_first is family]) for family in (False, True)
               if any(t.state_first is family for t in tried)]
    return OrderOutcome(min(refined, key=lambda t: t.rank), tuple(tried), facts)


def _attempt(search: SearchContext, facts: OrderFacts, step: StepProfile, margin: float, stretched: bool,
             state_first: bool, turn: bool = False) -> Tried:
    """The plan of one selection pass in ``facts.order`` against ``step``'s op times, simulated."""
    spans = _with_small_state_at_the_turn(search, facts) if turn else facts.spans
    plan = plan_selection_pass(PassContext(
        program=search.program, hardware=search.hardware, budget=search.budget, step=step, spans=spans,
        writes=facts.uses.writes, order=facts.order, margin=margin, config=search.config, state_first=state_first,
        turn=turn))
    over = max(0, remote_bytes(plan) - search.host_bytes) if search.host_bytes else 0
    return Tried(plan, search.simulations.timeline(plan), margin, stretched, state_first, turn, over)


def _with_small_state_at_the_turn(search: SearchContext, facts: OrderFacts) -> list[Span]:
    """``facts.spans`` and, for the state-first start at the turn (``PlannerConfig.state_first_turn``), every span of
    the storages of the step's state it keeps away across the turn that are smaller than ``facts`` takes but at least
    ``PlannerConfig.small_storage_bytes``, in one rank of a sharded step: FSDP's parameter shards are many and small
    (an attention projection's is 4 MiB on ``llama3-8b`` x 8, below a 10,000th of the 41.8 GiB peak), and each is
    state like the larger ones. A step of one device keeps its usual candidates: there the smaller state made the
    start slower (``deepseek-v2-lite``'s experts, from 4 MiB up to a 10,000th of its 1.35 TiB peak)."""
    least = search.config.small_storage_bytes
    if least >= facts.min_span_bytes or search.program.meta.get("world", 1) == 1:
        return list(facts.spans)
    smaller = [span for span in idle_spans(search.program, facts.uses, min_bytes=least)
               if span.nbytes < facts.min_span_bytes]
    turning = spans_across_the_turn(search.program, facts.order, smaller)
    return [*facts.spans, *(span for span in smaller if span.storage in turning)]


def _starts(search: SearchContext, facts: OrderFacts, times: np.ndarray,
            done: set[tuple[float, bool, bool, bool]]) -> list[_Start]:
    """The starts not ``done`` yet: one per margin, then state first where the step makes enough of its peak
    (``PlannerConfig.state_first_from``), and again keeping state away across the turn from forward to backward
    where the step has such state (``PlannerConfig.state_first_turn``), then stretched to the window bound where
    that start is tried."""
    config = search.config
    step = back_to_back(times, facts.live)
    starts = [_Start(margin, False, False, step) for margin in config.bandwidth_margins]
    if config.state_first and made_share(search.program) >= config.state_first_from:
        starts.append(_Start(config.bandwidth_margins[0], False, True, step))
        if config.state_first_turn and spans_across_the_turn(search.program, facts.order,
                                                             _with_small_state_at_the_turn(search, facts)):
            starts.append(_Start(config.bandwidth_margins[0], False, True, step, turn=True))
    stretched = _stretched_start(search, facts, times, done)
    return [s for s in starts + ([stretched] if stretched else []) if s.key not in done]


def _stretched_start(search: SearchContext, facts: OrderFacts, times: np.ndarray, done: set) -> _Start | None:
    """The start against ``times`` stretched to the order's window bound (``PlannerConfig.stretch_to_window_bound``)
    in the anchored order, and in the one hoisting every small update from ``stretched_partly_from`` of its peak up;
    None elsewhere, where a seed made it already, or where the bound is the compute time."""
    config, live, order = search.config, facts.live, tuple(facts.order)
    orders = execution_orders(search.program, config)
    anchored = order == orders.anchored != orders.captured
    hoisting_small = order == orders.hoisting_small and live.size and (
        search.budget.most >= config.stretched_partly_from * live.max())
    margin = config.bandwidth_margins[0]
    if not (config.stretch_to_window_bound and times.size and (anchored or hoisting_small)) or (
            (margin, True, False, False) in done):
        return None
    bound = window_bound(search.program, search.hardware, search.budget.most, facts.order).seconds
    compute = times.sum()
    if compute <= 0 or bound <= compute * (1 + 1e-9):  # no compute time to stretch, or nothing to gain
        return None
    return _Start(margin, True, False, back_to_back(times * (bound / compute), live))


def _refined(search: SearchContext, facts: OrderFacts, family: list[Tried]) -> Tried:
    """The fastest of ``family`` (starts alike in taking state first or not), planned again against the op times
    the best plan so far really ran at (its stalls included), so the lane model sees the gaps the copies actually
    have, while that is faster."""
    order = facts.order
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    best = min(family, key=lambda t: t.rank)
    for _ in range(search.config.refinements):
        observed = _observed_step(best.timeline, facts.live, position)
        if observed is None:
            break
        refined = _attempt(search, facts, observed, best.margin, best.stretched, best.state_first, best.turn)
        if refined.rank >= best.rank:
            break
        best = refined
    return best


def _observed_step(timeline: Timeline, live: np.ndarray, position: np.ndarray) -> StepProfile | None:
    """Per-position start and end times of the ops as simulated (the last simulated step);
    ``position[op id]`` is the op's position in the order planned."""
    n = live.size
    per_position: dict[int, tuple[float, float]] = {}
    op_of = {i: int(position[ins.target % n]) for i, ins in enumerate(timeline.plan.instructions)}
    for iv in timeline.intervals:
        if iv.stream == "compute":
            per_position[op_of[iv.instruction]] = (iv.start, iv.end)  # later steps overwrite earlier ones
    if len(per_position) < 2:
        return None
    start = np.zeros(n)
    end = np.zeros(n)
    origin = min(s for s, _ in per_position.values())
    previous_end = 0.0
    for p in range(n):
        if p in per_position:
            start[p], end[p] = per_position[p][0] - origin, per_position[p][1] - origin
        else:  # ops that cost nothing have no interval
            start[p] = end[p] = previous_end
        previous_end = end[p]
    return StepProfile(start=start, end=end, times=end - start, live=live)
