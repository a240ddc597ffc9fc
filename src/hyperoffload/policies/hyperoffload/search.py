"""The search for the fastest plan: over execution orders and sets of candidate storages, then in each order over
its starts (bandwidth margins, op times stretched to the window bound, state first), each refined against the op
times it was simulated at. Every candidate is simulated and the fastest kept.

Every order gets one quick pass (the first margin, no refinement); the full search runs in the order whose quick
plan was fastest and in any within ``PlannerConfig.quick_tolerance`` of it: one or two full passes instead of one
per order keep planning an 8B step within seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hyperoffload.analysis.window_bound import window_bound
from hyperoffload.cost import op_times
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Plan, plan_without_offload
from hyperoffload.policies.hyperoffload.config import POLICY, PlannerConfig, PositionBudget
from hyperoffload.policies.hyperoffload.context import PassContext, _Step, _step_of
from hyperoffload.policies.hyperoffload.minimum import (_below_smallest, _minimum, _order_facts, _OrderFacts,
                                                        _unavoidable, _with_smaller_storages)
from hyperoffload.policies.hyperoffload.orders import _orders, candidate_orders, made_share
from hyperoffload.policies.hyperoffload.selection import _plan_for_margin
from hyperoffload.simulate import Timeline, simulate

_Hint = tuple[tuple[int, ...], float | None, int | None]
"""What an earlier search chose: its execution order, bandwidth margin (None: every margin) and smallest candidate
storage (bytes; None: the usual ones, or smaller ones where the budget needs them)."""


@dataclass(frozen=True, slots=True)
class _Tried:
    """A candidate plan, how it simulated, the bandwidth margin it was made for, whether it started from
    op times stretched to the window bound and whether it took state first (``PlannerConfig.state_first``)."""

    plan: Plan
    timeline: Timeline
    margin: float
    stretched: bool = False
    state_first: bool = False

    @property
    def step_s(self) -> float:
        return self.timeline.step_s

    @property
    def start(self) -> tuple[float, bool, bool]:
        return self.margin, self.stretched, self.state_first


@dataclass(frozen=True, slots=True)
class _Start:
    """Where a pass in one order starts: its margin, whether stretched or state first, and the op times it plans
    against."""

    margin: float
    stretched: bool
    state_first: bool
    step: _Step

    @property
    def key(self) -> tuple[float, bool, bool]:
        return self.margin, self.stretched, self.state_first


def _search(program: Program, hardware: Hardware, budget: PositionBudget, config: PlannerConfig,
            hint: _Hint | None = None) -> tuple[Plan, _Hint | None]:
    """The fastest plan found whose live bytes never exceed ``budget``, and the order, margin and candidates it was
    made with. With a ``hint`` from an earlier search, plans only in that order, in that margin unless it is None,
    and with those candidates (smaller ones where the budget needs them)."""
    first = _orders(program, config)[0]
    orders = [hint[0]] if hint else candidate_orders(program, config) if config.reorder else [first]
    leading = _order_facts(program, orders[0], config, small=False)
    if orders[0] == first and (leading.live.size == 0 or (leading.live <= budget.at).all()):
        base = plan_without_offload(program, order=first)
        return Plan(program=program, instructions=base.instructions, policy=POLICY, budget_bytes=budget.most), None
    candidates = _candidates(program, [leading] + [_order_facts(program, o, config, small=False) for o in orders[1:]],
                             budget, config, hint)
    feasible = [f for f, (least, _) in candidates if budget.least >= least or (budget.at >= _unavoidable(f)).all()]
    if not feasible:
        least, why = min((smallest for _, smallest in candidates), key=lambda r: r[0])
        raise _below_smallest(budget.least, least, why)
    times_by_op = np.asarray(op_times(program, hardware), dtype=np.float64)
    if hint:
        return _search_hinted(program, hardware, budget, config, hint, feasible[0], times_by_op)
    return _search_orders(program, hardware, budget, config, leading, feasible, times_by_op)


def _candidates(program: Program, facts: list[_OrderFacts], budget: PositionBudget, config: PlannerConfig,
                hint: _Hint | None) -> list[tuple[_OrderFacts, tuple[int, str]]]:
    """Each order's facts with the smallest budget they meet: near the smallest budget the usual candidates meet,
    every order also starts from smaller ones (the quick passes rank them with the rest); with a hint, only the
    candidates it names."""
    candidates = [(f, _minimum(program, f)) for f in facts]
    if budget.least < config.small_storages_below * min(least for _, (least, _) in candidates):
        more = [g for g in (_with_smaller_storages(program, f, config) for f in facts) if g is not None]
        candidates += [(g, _minimum(program, g)) for g in more]
    if hint and hint[2] is not None:
        candidates = [(f, m) for f, m in candidates if f.min_span_bytes <= hint[2]]
    return candidates


def _search_hinted(program: Program, hardware: Hardware, budget: PositionBudget, config: PlannerConfig,
                   hint: _Hint, facts: _OrderFacts, times_by_op: np.ndarray) -> tuple[Plan, _Hint]:
    """The full search in the hint's order and candidates, at its margin if it names one."""
    margins = config.bandwidth_margins if hint[1] is None else (hint[1],)
    best, _ = _plan_in_order(program, hardware, budget, facts, times_by_op, replace(config, bandwidth_margins=margins))
    return best.plan, (tuple(facts.order), best.margin, facts.min_span_bytes)


def _search_orders(program: Program, hardware: Hardware, budget: PositionBudget, config: PlannerConfig,
                   captured: _OrderFacts, feasible: list[_OrderFacts], times_by_op: np.ndarray) -> tuple[Plan, _Hint]:
    """A quick pass in each order worth one, then the full search in those whose quick plan came close to the
    fastest; the fastest plan of all."""
    considered = _considered(program, hardware, budget, config, captured, feasible, times_by_op)
    _, anchored, eager, *_ = _orders(program, config)
    if any(tuple(f.order) == eager != anchored for f in considered):
        # Where the eager order is worth a pass (links fast enough to offload for free), the stretched start
        # never won; it would cost a pass of its own.
        config = replace(config, stretch_to_window_bound=False)
    simulated: dict = {}  # passes often make a plan another made already: one simulation each
    quick = _quick_passes(program, hardware, budget, config, considered, times_by_op, simulated)
    fastest = min(best.step_s for (best, _), _ in quick)
    full = [(_plan_in_order(program, hardware, budget, f, times_by_op, config, seeds=tried, simulated=simulated)[0], f)
            for (best, tried), f in _faster_per_order(quick)
            if best.step_s <= fastest * (1 + config.quick_tolerance)]
    best, facts = min(full, key=lambda t: t[0].step_s)
    return best.plan, (tuple(facts.order), best.margin, facts.min_span_bytes)


def _considered(program: Program, hardware: Hardware, budget: PositionBudget, config: PlannerConfig,
                captured: _OrderFacts, feasible: list[_OrderFacts], times_by_op: np.ndarray) -> list[_OrderFacts]:
    """The feasible candidates whose order is worth a pass at this budget; all of them where none is."""
    first, anchored, eager, *partly = _orders(program, config)
    # A partly hoisted order gets its pass from its least share of the captured order's peak up (see
    # PlannerConfig.partly_hoisted); below, it would only cost planning time.
    peak = captured.live.max()
    skipped = set(partly) - {order for order, (_, least) in zip(partly, config.partly_hoisted)
                            if budget.least >= least * peak} - {first, anchored, eager}
    # The eager order moves the second moments twice per step; only a link that can make offloading free at
    # this budget hides that, and elsewhere its pass would only cost planning time.
    if eager != anchored and any(tuple(f.order) == eager for f in feasible) and not _offload_can_be_free(
            program, hardware, budget.least, first, times_by_op):
        skipped.add(eager)
    # Where an order is the only one that meets the budget, it gets its pass all the same.
    return [f for f in feasible if tuple(f.order) not in skipped] or feasible


def _quick_passes(program: Program, hardware: Hardware, budget: PositionBudget, config: PlannerConfig,
                  considered: list[_OrderFacts], times_by_op: np.ndarray, simulated: dict
                  ) -> list[tuple[tuple[_Tried, tuple[_Tried, ...]], _OrderFacts]]:
    """A quick pass (the first margin, no refinement) with each order's first set of candidates, and with the
    fastest order's second set (``PlannerConfig.small_storage_bytes``; it comes after the usual one in
    ``considered``), each with the candidates it was made from. On a tie the first order's plan wins."""
    quick_config = replace(config, bandwidth_margins=config.bandwidth_margins[:1], refinements=0, state_first=False)
    firsts: dict[tuple[int, ...], _OrderFacts] = {}
    for f in considered:
        firsts.setdefault(tuple(f.order), f)
    quick = [(_plan_in_order(program, hardware, budget, f, times_by_op, quick_config, simulated=simulated), f)
             for f in firsts.values()]
    leader = tuple(min(quick, key=lambda t: t[0][0].step_s)[1].order)
    return quick + [(_plan_in_order(program, hardware, budget, f, times_by_op, quick_config, simulated=simulated), f)
                    for f in considered if tuple(f.order) == leader and f is not firsts[leader]]


def _faster_per_order(quick: list[tuple[tuple[_Tried, tuple[_Tried, ...]], _OrderFacts]]) -> list:
    """Of an order's two sets of candidates (``PlannerConfig.small_storage_bytes``), the one whose quick plan is
    faster (the first on a tie)."""
    by_order: dict[tuple[int, ...], tuple] = {}
    for (best, tried), f in quick:
        kept = by_order.get(tuple(f.order))
        if kept is None or best.step_s < kept[0][0].step_s:
            by_order[tuple(f.order)] = ((best, tried), f)
    return list(by_order.values())


def _offload_can_be_free(program: Program, hardware: Hardware, budget_bytes: int, order: Sequence[int],
                         times_by_op: np.ndarray) -> bool:
    """Whether a plan in ``order`` could offload down to ``budget_bytes`` at no cost in step time: the
    window bound (``analysis.window_bound``) equals the step's compute time."""
    return window_bound(program, hardware, budget_bytes, order).seconds <= float(times_by_op.sum()) * (1 + 1e-9)


@dataclass(frozen=True, slots=True)
class _OrderSearch:
    """What every pass in one order plans for; ``simulated`` holds the timelines of plans simulated before in the
    same search (same budget and hardware), by instructions."""

    program: Program
    hardware: Hardware
    budget: PositionBudget
    facts: _OrderFacts
    config: PlannerConfig
    simulated: dict

    def attempt(self, step: _Step, margin: float, stretched: bool, state_first: bool) -> _Tried:
        """The plan of one selection pass against ``step``'s op times, simulated."""
        plan = _plan_for_margin(PassContext(
            program=self.program, hardware=self.hardware, budget=self.budget, step=step, spans=self.facts.spans,
            writes=self.facts.uses.writes, order=self.facts.order, margin=margin, config=self.config,
            state_first=state_first))
        key = (plan.instructions, plan.initial_remote)
        if key not in self.simulated:
            self.simulated[key] = simulate(plan, self.hardware)
        return _Tried(plan, self.simulated[key], margin, stretched, state_first)


def _plan_in_order(program: Program, hardware: Hardware, budget: PositionBudget, facts: _OrderFacts,
                   times_by_op: np.ndarray, config: PlannerConfig, seeds: Sequence[_Tried] = (),
                   simulated: dict | None = None) -> tuple[_Tried, tuple[_Tried, ...]]:
    """The fastest plan found with the compute ops in ``facts.order``, and the unrefined plans it started from
    (one per margin, one against op times stretched to the window bound, one state first); ``seeds``, plans made
    in that order (unrefined), stand for their starts instead of planning them again."""
    search = _OrderSearch(program, hardware, budget, facts, config, {} if simulated is None else simulated)
    starts = _starts(search, times_by_op[facts.order], done={t.start for t in seeds})
    tried = [*seeds, *(search.attempt(s.step, s.margin, s.stretched, s.state_first) for s in starts)]
    # The state-first start is refined on its own: refined from the best start alone, the order hoisting every
    # small update on h100-sxm at 70% of the peak lost 4% where the state-first start was the best before.
    refined = [_refined(search, [t for t in tried if t.state_first is family]) for family in (False, True)
               if any(t.state_first is family for t in tried)]
    return min(refined, key=lambda t: t.step_s), tuple(tried)


def _starts(search: _OrderSearch, times: np.ndarray, done: set[tuple[float, bool, bool]]) -> list[_Start]:
    """The starts not ``done`` yet: one per margin, then state first where the step makes enough of its peak
    (``PlannerConfig.state_first_from``), then stretched to the window bound where that start is tried."""
    config, live = search.config, search.facts.live
    step = _step_of(times, live)
    starts = [_Start(margin, False, False, step) for margin in config.bandwidth_margins]
    if config.state_first and made_share(search.program) >= config.state_first_from:
        starts.append(_Start(config.bandwidth_margins[0], False, True, step))
    stretched = _stretched_start(search, times, done)
    return [s for s in starts + ([stretched] if stretched else []) if s.key not in done]


def _stretched_start(search: _OrderSearch, times: np.ndarray, done: set) -> _Start | None:
    """The start against ``times`` stretched to the order's window bound (``PlannerConfig.stretch_to_window_bound``)
    in the anchored order, and in the one hoisting every small update from ``stretched_partly_from`` of its peak up;
    None elsewhere, where a seed made it already, or where the bound is the compute time."""
    config, live, order = search.config, search.facts.live, tuple(search.facts.order)
    orders = _orders(search.program, config)
    first, anchored, hoisting_small = orders[0], orders[1], orders[-1]  # the last: partly_hoisted's share 1.0
    stretched_order = order == anchored != first or (
        order == hoisting_small and live.size and search.budget.most >= config.stretched_partly_from * live.max())
    margin = config.bandwidth_margins[0]
    if not (config.stretch_to_window_bound and times.size and stretched_order) or (margin, True, False) in done:
        return None
    bound = window_bound(search.program, search.hardware, search.budget.most, search.facts.order).seconds
    if bound <= times.sum() * (1 + 1e-9):
        return None
    return _Start(margin, True, False, _step_of(times * (bound / times.sum()), live))


def _refined(search: _OrderSearch, family: list[_Tried]) -> _Tried:
    """The fastest of ``family`` (starts alike in taking state first or not), planned again against the op times
    the best plan so far really ran at (its stalls included), so the lane model sees the gaps the copies actually
    have, while that is faster."""
    order = search.facts.order
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    best = min(family, key=lambda t: t.step_s)
    for _ in range(search.config.refinements):
        observed = _observed_step(best.timeline, search.facts.live, position)
        if observed is None:
            break
        refined = search.attempt(observed, best.margin, best.stretched, best.state_first)
        if refined.step_s >= best.step_s:
            break
        best = refined
    return best


def _observed_step(timeline: Timeline, live: np.ndarray, position: np.ndarray) -> _Step | None:
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
    return _Step(start=start, end=end, times=end - start, live=live)
