"""``plan_hyperoffload``: the step's forms, each planned within the budget (with a static layout, within its
arena), the fastest kept."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hyperoffload.budgets import check_budget_bytes
from hyperoffload.gc_pause import collector_paused
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.ir import Program
from hyperoffload.layout import Layout, arena_use, assign_offsets, prefetch_into_arena
from hyperoffload.plans import Kind, Plan
from hyperoffload.policies.hyperoffload.config import InfeasibleBudget, PlannerConfig, PositionBudget
from hyperoffload.policies.hyperoffload.minimum import below_smallest, minimum_budget, order_facts, unavoidable_bytes
from hyperoffload.policies.hyperoffload.orders import execution_orders
from hyperoffload.policies.hyperoffload.search import SearchHint, search_plan
from hyperoffload.simulate import simulate
from hyperoffload.units import format_bytes
from hyperoffload.variants import (has_remote_kv, largest_pool_form, remote_kv_form, smallest_pool_variant,
                                   speculative_variant)


def plan_hyperoffload(program: Program, hardware: Hardware | str, budget_bytes: int,
                      config: PlannerConfig = PlannerConfig()) -> Plan:
    """The fastest plan found whose device memory never exceeds ``budget_bytes``: its live bytes, and
    with ``config.static_layout`` its arena (``plan.layout``), which then is all the memory it reserves.

    A decode step with a remote-KV form (``variants``) is also planned in that form, with the largest
    block pool that fits the budget, or, if none fits, without a pool, with the smallest pool (planned to
    move other state out to make room for it) and with speculative prefetch of each layer's previous
    selection; the faster plan wins, the smaller peak on a tie. Such a plan's program is the remote-KV form.

    The cyclic garbage collector is paused while planning (``gc_pause``): planning makes no cycles, and the
    collector's walks over the captured program took a large share of the planning time."""
    budget_bytes = check_budget_bytes(budget_bytes, least=0)
    hardware = as_hardware(hardware)
    with collector_paused():
        return _plan_forms(program, hardware, budget_bytes, config)


def _plan_forms(program: Program, hardware: Hardware, budget_bytes: int, config: PlannerConfig) -> Plan:
    """The fastest plan (the smaller peak on a tie) over the step's forms that meet the budget."""
    if not has_remote_kv(program):
        return _plan_program(program, hardware, budget_bytes, config)
    tried: list[tuple[float, int, Plan]] = []
    failure: InfeasibleBudget | None = None
    for form in _forms(program, budget_bytes):
        try:
            plan = _plan_program(form, hardware, budget_bytes, config)
        except InfeasibleBudget as error:
            failure = error if failure is None or error.min_budget_bytes < failure.min_budget_bytes else failure
            continue
        timeline = simulate(plan, hardware)  # its step time and peak only: the bounds are not worked out
        tried.append((timeline.step_s, timeline.peak_bytes, plan))
    if not tried:
        least, why = minimum_budget(program, config)
        if failure.min_budget_bytes == least:  # below every form's smallest: say which form sets it
            raise below_smallest(budget_bytes, least, why)
        raise failure
    return min(tried, key=lambda t: t[:2])[2]


def _forms(program: Program, budget_bytes: int) -> list[Program]:
    """A decode step with a remote-KV form: as captured, and with the largest block pool that fits the budget or,
    where none fits, without a pool, with the smallest and with speculative prefetch."""
    remote = largest_pool_form(program, budget_bytes) or remote_kv_form(program, None)
    if remote.pool_blocks is not None:
        return [program, remote.program]
    # No pool fits the step as captured; one may once the planner moves other state (weights) out. Or
    # guess instead: prefetch each layer's previous selection a layer ahead, for a pool's hits in
    # transient memory, at the price of moving those blocks every step.
    return [program, remote.program, smallest_pool_variant(program), speculative_variant(program)]


def _plan_program(program: Program, hardware: Hardware, budget_bytes: int, config: PlannerConfig) -> Plan:
    """The fastest plan of one form within the budget; with ``config.static_layout``, within its arena."""
    if not config.static_layout:
        return search_plan(program, hardware, PositionBudget.uniform(budget_bytes, len(program.ops)), config)[0]
    # Prefetching early into whatever live bytes are free scatters long-lived residencies over the arena's
    # top (a weight prefetched right after the peak for the end of the step sits above everything there),
    # which the layout then has to make room for. Planned just in time and moved early only into free slots
    # of the packed arena (prefetch_into_arena), the step is faster at some budgets and slower at others:
    # both are planned and the faster kept.
    # The just-in-time plan searches only the execution order and bandwidth margin the first search chose: the
    # order is what takes the time, and the same one won both wherever it was measured; trying every margin
    # again changed no step time and cost planning time.
    variants = [config, replace(config, early_prefetch=False)] if config.early_prefetch else [config]
    found, failure, hint = [], None, None
    for variant in variants:
        try:
            plan, hint, step_s = plan_in_arena(program, hardware, budget_bytes, variant, hint)
            found.append((step_s, plan))
        except InfeasibleBudget as error:
            failure = failure or error
    if not found:
        raise failure
    return min(found, key=lambda t: t[0])[1]


def plan_in_arena(program: Program, hardware: Hardware, budget_bytes: int, config: PlannerConfig,
                  given: SearchHint | None = None) -> tuple[Plan, SearchHint, float]:
    """The fastest plan found whose static arena fits ``budget_bytes`` (see ``_plan_program``), searched in
    the order, margin and candidates ``given`` only if given; what it was made with, and its simulated step time
    (seconds)."""
    arena = _ArenaPlanning(program=program, hardware=hardware, budget_bytes=budget_bytes, config=config)
    plan, hint = _searched(arena, PositionBudget.uniform(budget_bytes, len(program.ops)), given)
    plan, hint = _replanned_until_it_fits(arena, plan, hint)
    return _with_prefetches_in_arena(plan, hardware, hint)


@dataclass(frozen=True, slots=True, kw_only=True)
class _ArenaPlanning:
    """What planning within a static arena plans for."""

    program: Program
    hardware: Hardware
    budget_bytes: int
    """What the arena must fit (bytes)."""
    config: PlannerConfig


def _searched(arena: _ArenaPlanning, budget: PositionBudget, hint: SearchHint | None) -> tuple[Plan, SearchHint]:
    """``search_plan``'s plan and hint for ``budget``; where the step needed no offload, the hint of its captured
    order (every margin, any candidates)."""
    plan, found = search_plan(arena.program, arena.hardware, budget, arena.config, hint)
    return plan, found or SearchHint(execution_orders(arena.program, arena.config).captured)


def _replanned_until_it_fits(arena: _ArenaPlanning, plan: Plan, hint: SearchHint) -> tuple[Plan, SearchHint]:
    """``plan`` laid out; where its arena rises above the budget, re-planned in the hint's order for fewer live bytes
    there (``_lowered``) until the arena fits, at most ``PlannerConfig.layout_attempts`` times; with the hint of the
    plan that fits."""
    target = PositionBudget.uniform(arena.budget_bytes, len(arena.program.ops))
    floor: PositionBudget | None = None  # the least the planner can hold at each position of the hint's order
    for replans in range(arena.config.layout_attempts + 1):
        layout = assign_offsets(plan)
        if layout.arena_bytes <= arena.budget_bytes:
            return replace(plan, budget_bytes=arena.budget_bytes, layout=layout), hint
        if replans == arena.config.layout_attempts:
            break
        if floor is None:
            floor = unavoidable_bytes(order_facts(arena.program, hint.order, arena.config))
        lowered = _lowered(plan, layout, arena.budget_bytes, target, floor)
        if lowered.holds(target):  # no position gets lower: the search would make the same plan
            break
        target = lowered
        plan, hint = _searched_for_room(arena, target, hint, layout)
    raise InfeasibleBudget(f"no static layout within {format_bytes(arena.budget_bytes)} found after "
                           f"{replans} re-plans (the last needs {format_bytes(layout.arena_bytes)}); "
                           f"give a larger budget, or plan without a static layout", layout.arena_bytes)


def _lowered(plan: Plan, layout: Layout, budget_bytes: int, target: PositionBudget,
             floor: PositionBudget) -> PositionBudget:
    """Fragmentation: where the packing rises above the budget, the live bytes to plan for there, lower than
    ``target`` by what it is over, no lower than ``floor``. Only those positions: lowering the whole step's budget by
    the worst overshoot moved more than the layout needs and cost step time everywhere."""
    at = [i for i, ins in enumerate(plan.instructions) if ins.kind is Kind.COMPUTE]
    top, live = arena_use(layout, np.asarray(at))
    over = np.maximum(top - budget_bytes, 0)
    lowered = np.minimum(target.at, np.where(over > 0, live - over, budget_bytes))
    return PositionBudget.per_position(np.maximum(lowered, floor.at))


def _searched_for_room(arena: _ArenaPlanning, target: PositionBudget, hint: SearchHint,
                       layout: Layout) -> tuple[Plan, SearchHint]:
    """The search again in the hint's order, for ``target``; refused where that is below the smallest budget."""
    try:
        return _searched(arena, target, hint)
    except InfeasibleBudget as error:
        raise _no_room(arena.budget_bytes, layout, error) from None


def _with_prefetches_in_arena(plan: Plan, hardware: Hardware, hint: SearchHint) -> tuple[Plan, SearchHint, float]:
    """``plan``, whose arena fits, or the same with prefetches moved early into the arena's free slots where that
    simulates faster (earlier is not always faster: the H2D lane may be busy with more urgent work); with its hint
    and step time (seconds)."""
    moved, _ = prefetch_into_arena(plan, plan.layout)
    step_s = simulate(plan, hardware).step_s
    moved_s = simulate(moved, hardware).step_s if moved is not plan else step_s
    return (moved, hint, moved_s) if moved_s < step_s else (plan, hint, step_s)


def _no_room(budget_bytes: int, layout: Layout, error: InfeasibleBudget) -> InfeasibleBudget:
    """The refusal where making room for the layout's fragmentation would need planning below the smallest budget."""
    return InfeasibleBudget(
        f"at {format_bytes(budget_bytes)} the plan's live bytes fit, but its static layout needs "
        f"{format_bytes(layout.arena_bytes)} (packing loses {format_bytes(layout.overhead_bytes)}); "
        f"making room for that would need planning below the smallest budget, "
        f"{format_bytes(error.min_budget_bytes)}. Give at least about "
        f"{format_bytes(error.min_budget_bytes + layout.overhead_bytes)}, or plan without a static "
        f"layout", error.min_budget_bytes + layout.overhead_bytes)
