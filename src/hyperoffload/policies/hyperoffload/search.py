"""The search for the fastest plan: over execution orders and sets of candidate storages, then in each order over
its starts (``order_search``). Every candidate is simulated and the fastest kept; where the profile states a
node's host memory, the fastest of those that keep no more in host memory than a rank's share of it
(``Tried.rank``), or, where none does, the one that keeps the least.

Every order gets one quick pass (the first margin, no refinement); the full search runs in the order whose quick
plan was fastest and in any within ``PlannerConfig.quick_tolerance`` of it: one or two full passes instead of one
per order keep the planning time close to that of a single order's search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hyperoffload.analysis.window_bound import window_bound
from hyperoffload.cost import op_times
from hyperoffload.hardware import Hardware
from hyperoffload.host_memory import host_bytes_per_rank
from hyperoffload.ir import Program
from hyperoffload.plans import Plan, plan_without_offload
from hyperoffload.policies.hyperoffload.config import POLICY, PlannerConfig, PositionBudget
from hyperoffload.policies.hyperoffload.minimum import (OrderFacts, below_smallest, order_facts, smallest_budget,
                                                        unavoidable_bytes, with_smaller_storages)
from hyperoffload.policies.hyperoffload.order_search import OrderOutcome, SearchContext, Simulations, plan_in_order
from hyperoffload.policies.hyperoffload.orders import Order, candidate_orders, execution_orders


@dataclass(frozen=True, slots=True)
class SearchHint:
    """What an earlier search chose, for a later one to search there only."""

    order: Order
    """The execution order it planned in."""
    margin: float | None = None
    """The bandwidth margin of its plan (None: every margin)."""
    min_span_bytes: int | None = None
    """Its smallest candidate storage (bytes; None: the usual ones, or smaller ones where the budget needs them)."""


def search_plan(program: Program, hardware: Hardware, budget: PositionBudget, config: PlannerConfig,
                hint: SearchHint | None = None) -> tuple[Plan, SearchHint | None]:
    """The fastest plan found whose live bytes never exceed ``budget``, and the order, margin and candidates it was
    made with (None where the step needs no offload). With a ``hint`` from an earlier search, plans only in that
    order, in that margin unless it is None, and with those candidates (smaller ones where the budget needs them)."""
    orders = _orders_to_search(program, config, hint)
    leading = order_facts(program, orders[0], config, small=False)
    if orders[0] == execution_orders(program, config).captured and _fits_unplanned(leading, budget):
        return _unplanned(program, orders[0], budget), None
    facts = [leading] + [order_facts(program, o, config, small=False) for o in orders[1:]]
    feasible = _feasible(_candidates(program, facts, budget, config, hint), budget)
    search = SearchContext(program=program, hardware=hardware, budget=budget, config=config,
                           times_by_op=np.asarray(op_times(program, hardware), dtype=np.float64),
                           simulations=Simulations(hardware), host_bytes=host_bytes_per_rank(program, hardware))
    if hint:
        return _search_hinted(search, hint, feasible[0])
    return _search_orders(search, leading, feasible)


def _orders_to_search(program: Program, config: PlannerConfig, hint: SearchHint | None) -> list[Order]:
    """The hint's order; else the candidate orders, or the captured one alone without ``PlannerConfig.reorder``."""
    if hint:
        return [hint.order]
    return candidate_orders(program, config) if config.reorder else [execution_orders(program, config).captured]


def _fits_unplanned(facts: OrderFacts, budget: PositionBudget) -> bool:
    """Whether the step in ``facts.order`` fits ``budget`` with no offload."""
    return facts.live.size == 0 or bool((facts.live <= budget.at).all())


def _unplanned(program: Program, order: Order, budget: PositionBudget) -> Plan:
    """The step in ``order`` with no offload, as this planner's plan for ``budget``."""
    base = plan_without_offload(program, order=order)
    return Plan(program=program, instructions=base.instructions, policy=POLICY, budget_bytes=budget.most)


def _candidates(program: Program, facts: list[OrderFacts], budget: PositionBudget, config: PlannerConfig,
                hint: SearchHint | None) -> list[tuple[OrderFacts, tuple[int, str]]]:
    """Each order's facts with the smallest budget they meet: near the smallest budget the usual candidates meet,
    every order also starts from smaller ones (the quick passes rank them with the rest); with a hint, only the
    candidates it names."""
    candidates = [(f, smallest_budget(program, f)) for f in facts]
    if budget.least < config.small_storages_below * min(least for _, (least, _) in candidates):
        more = [g for g in (with_smaller_storages(program, f, config) for f in facts) if g is not None]
        candidates += [(g, smallest_budget(program, g)) for g in more]
    if hint and hint.min_span_bytes is not None:
        candidates = [(f, m) for f, m in candidates if f.min_span_bytes <= hint.min_span_bytes]
    return candidates


def _feasible(candidates: list[tuple[OrderFacts, tuple[int, str]]], budget: PositionBudget) -> list[OrderFacts]:
    """The candidates that can meet ``budget``; refuses it where none can, saying which sets the smallest."""
    feasible = [f for f, (least, _) in candidates if budget.least >= least or budget.holds(unavoidable_bytes(f))]
    if not feasible:
        least, why = min((smallest for _, smallest in candidates), key=lambda r: r[0])
        raise below_smallest(budget.least, least, why)
    return feasible


def _search_hinted(search: SearchContext, hint: SearchHint, facts: OrderFacts) -> tuple[Plan, SearchHint]:
    """The full search in the hint's order and candidates, at its margin if it names one."""
    margins = search.config.bandwidth_margins if hint.margin is None else (hint.margin,)
    outcome = plan_in_order(replace(search, config=replace(search.config, bandwidth_margins=margins)), facts)
    return outcome.best.plan, _hint_of(outcome)


def _search_orders(search: SearchContext, captured: OrderFacts,
                   feasible: list[OrderFacts]) -> tuple[Plan, SearchHint]:
    """A quick pass in each order worth one, then the full search in those whose quick plan came close to the
    fastest; the fastest plan of all."""
    considered = _considered(search, captured, feasible)
    orders = execution_orders(search.program, search.config)
    if any(tuple(f.order) == orders.eager != orders.anchored for f in considered):
        # Where the eager order is worth a pass (links fast enough to offload for free), the stretched start
        # never won; it would cost a pass of its own.
        search = replace(search, config=replace(search.config, stretch_to_window_bound=False))
    quick = _quick_passes(search, considered)
    fits = min(outcome.best.over_host_bytes for outcome in quick)  # 0 where some plan fits the host memory
    fastest = min(outcome.best.step_s for outcome in quick if outcome.best.over_host_bytes == fits)
    full = [plan_in_order(search, outcome.facts, seeds=outcome.tried) for outcome in _faster_per_order(quick)
            if outcome.best.over_host_bytes == fits
            and outcome.best.step_s <= fastest * (1 + search.config.quick_tolerance)]
    best = min(full, key=lambda outcome: outcome.best.rank)
    return best.best.plan, _hint_of(best)


def _hint_of(outcome: OrderOutcome) -> SearchHint:
    return SearchHint(tuple(outcome.facts.order), outcome.best.margin, outcome.facts.min_span_bytes)


def _considered(search: SearchContext, captured: OrderFacts, feasible: list[OrderFacts]) -> list[OrderFacts]:
    """The feasible candidates whose order is worth a pass at this budget; all of them where none is."""
    orders, budget = execution_orders(search.program, search.config), search.budget
    # A partly hoisted order gets its pass from its least share of the captured order's peak up (see
    # PlannerConfig.partly_hoisted); below, it would only cost planning time.
    peak = captured.live.max()
    skipped = set(orders.partly) - {order for order, (_, least) in zip(orders.partly, search.config.partly_hoisted)
                                    if budget.least >= least * peak} - {orders.captured, orders.anchored, orders.eager}
    # The eager order moves the second moments twice per step; only a link that can make offloading free at
    # this budget hides that, and elsewhere its pass would only cost planning time.
    if orders.eager != orders.anchored and any(tuple(f.order) == orders.eager for f in feasible) and not (
            _offload_can_be_free(search, orders.captured)):
        skipped.add(orders.eager)
    # Where an order is the only one that meets the budget, it gets its pass all the same.
    return [f for f in feasible if tuple(f.order) not in skipped] or feasible


def _quick_passes(search: SearchContext, considered: list[OrderFacts]) -> list[OrderOutcome]:
    """A quick pass (the first margin, no refinement) with each order's first set of candidates, and with the
    fastest order's second set (``PlannerConfig.small_storage_bytes``; it comes after the usual one in
    ``considered``). On a tie the first order's plan wins."""
    config = search.config
    quick = replace(search, config=replace(config, bandwidth_margins=config.bandwidth_margins[:1], refinements=0,
                                           state_first=False))
    firsts: dict[Order, OrderFacts] = {}
    for f in considered:
        firsts.setdefault(tuple(f.order), f)
    passes = [plan_in_order(quick, f) for f in firsts.values()]
    leader = tuple(min(passes, key=lambda outcome: outcome.best.rank).facts.order)
    seconds = [plan_in_order(quick, f) for f in considered if tuple(f.order) == leader and f is not firsts[leader]]
    return passes + seconds


def _faster_per_order(quick: list[OrderOutcome]) -> list[OrderOutcome]:
    """Of an order's two sets of candidates (``PlannerConfig.small_storage_bytes``), the one whose quick plan is
    faster (the first on a tie)."""
    by_order: dict[Order, OrderOutcome] = {}
    for outcome in quick:
        kept = by_order.get(tuple(outcome.facts.order))
        if kept is None or outcome.best.rank < kept.best.rank:
            by_order[tuple(outcome.facts.order)] = outcome
    return list(by_order.values())


def _offload_can_be_free(search: SearchContext, order: Sequence[int]) -> bool:
    """Whether a plan in ``order`` could offload down to the budget's least at no cost in step time: the
    window bound (``analysis.window_bound``) equals the step's compute time."""
    bound = window_bound(search.program, search.hardware, search.budget.least, order).seconds
    return bound <= float(search.times_by_op.sum()) * (1 + 1e-9)
