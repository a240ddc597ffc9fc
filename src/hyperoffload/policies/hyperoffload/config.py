"""What the HyperOffload planner is tuned with, the budgets it plans for and the error it refuses a budget with."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLICY = "hyperoffload"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """Knobs of the HyperOffload planner."""

    min_span_bytes: int | None = None
    """Storages smaller than this (bytes) stay on the device, where a copy's latency would dominate and
    the choice would not matter; None: 1/``min_span_parts`` of the step's no-offload peak, and at budgets near the
    smallest those take, also ``small_storage_bytes`` (``small_storages_below``)."""
    min_span_parts: int = 10_000
    """Without ``min_span_bytes``, the usual candidates are the storages from the step's no-offload peak divided by
    this many parts up (a count; 10,000: 10.9 MiB on ``llama3-8b`` training): a share of the peak keeps the
    selection's ranking short on large steps, where storages that small would not change the plan."""
    small_storage_bytes: int = 4 * 2**20
    """Where a budget is below ``small_storages_below`` times the smallest the planner meets with the usual
    candidates (``min_span_parts``), it also plans each order with the storages from this size up (bytes; with
    ``min_span_bytes`` unset), and the quick passes rank both sets. A share of the peak grows with the model
    while its activations grow with the hidden size only: ``llama3-70b`` training peaks at 794 GiB, so 1/10,000 of it
    (81 MiB) left every 64 MiB activation (sequence x hidden in bf16) on the device, and the smallest budget the
    planner met was 54.8 GiB, 49 GiB of it such storages; with them it is 11.8 GiB (the embedding's AdamW update),
    and at 54.9 and 59.6 GiB the plans step in 18.86 and 18.73 s, not 23.37 and 23.20 s (only the captured order met
    those budgets without them). ``llama3-8b``'s 8 MiB key and value activations, under its 10.9 MiB share, took its
    smallest from 6.89 to 5.89 GiB."""
    small_storages_below: float = 1.5
    """The budget, as a multiple of the smallest the usual candidates meet, below which the smaller storages
    (``small_storage_bytes``) are candidates too (a ratio). Not at every budget: the more spans the selection ranks,
    the more tie, and at ``llama3-70b``'s hideable budget and 70% of its peak the plans from 16 MiB up were 1.4%
    and 0.8% slower (the quick passes would drop them, for twice the planning); at 1.45 times its smallest (10% of
    its peak) they were 0.7% faster."""
    bandwidth_margins: tuple[float, ...] = (1.0, 0.7)
    """Shares of the link bandwidth the schedule assumes; one plan per margin is simulated."""
    candidates_per_step: int = 16
    """How many of the best-ranked spans get an exact, lane-aware placement at each selection step."""
    early_prefetch: bool = True
    """After selection, move each prefetch as early as the budget allows (in deadline order)."""
    refinements: int = 2
    """Re-plans against the op times the best plan so far was simulated at (kept only if faster)."""
    stretch_to_window_bound: bool = True
    """Also plan the anchored refined order against its op times stretched to the order's window bound (no plan
    in that order steps faster, ``analysis.window_bound``), at the first margin: the lane model then books copies
    into the time the step will take rather than into compute alone. There, where moments come back during
    the backward pass, that start often wins (llama3-8b training on h100-sxm at 70% of the peak: 0.93 s
    against 1.10 s); in the captured order it rarely did, in the eager one never, and they skip it (each
    start costs a plan and a simulation, about 1.5 s on llama3-8b at small budgets). The order hoisting every
    small update gets it from ``stretched_partly_from`` of its peak up."""
    stretched_partly_from: float = 0.45
    """The least budget, as a share of its own unplanned peak, at which the order hoisting every small update (the
    last of ``partly_hoisted``) also gets the stretched start (``stretch_to_window_bound``). Measured on
    ``llama3-8b`` training: on ``h100-sxm`` at 70% of the captured peak it wins, 0.901 s against 0.935 s (1.294 x
    ``bound_s`` against 1.343); at 60% and 50% there, at 70% and 60% on ``a100-80g`` and from 80% to 60% on
    ``ascend-910c`` it changes nothing and costs 0.1-1 s of planning (A/B runs, the planner otherwise unchanged).
    Below, it made ``h100-sxm`` at 10% 3% faster (2.834 s against 2.918 s) but took planning there from 7.6 s to
    8.5 s, too close to the 10 s target on a slow hour of a 2-core machine."""
    state_first: bool = True
    """Also plan each order from a start that, among candidate spans that relieve about as much, takes the step's
    state (its cyclic spans: parameters, optimizer state, kept remote between steps) before what the step makes
    (``state_first_tie``), at the first margin. Where saved activations are much of the peak, both often
    cover the whole over-budget stretch and tie; activations can leave only during the forward pass and come
    back only during the backward pass, one direction at a time, while the state's copies can run beside
    them (``analysis.link_bound``). ``llama3-8b`` training at batch 4 on ``h100-sxm``: 60% of the peak 1.658 ->
    1.292 x ``bound_s``, 80% 1.099 -> 1.000; ``deepseek-v2-lite`` training on ``mi300x`` at 70%: 1.902 ->
    1.705 (``bench/activation_heavy.py``). Taken instead of the usual start it lost where the state is most of
    the peak (batch 1 at 70%: 1.375 against 1.294), so it is an extra start, refined on its own, and the faster
    plan is kept. Tried only from ``state_first_from`` up."""
    state_first_tie: float = 0.01
    """In the state-first start (``state_first``), the share by which a cyclic span's selection score counts more
    (a ratio): enough to break ties and near-ties in its favour, not to take a span that relieves clearly less."""
    state_first_from: float = 0.4
    """The least share of the captured peak that storages the step makes (saved activations) must hold for the
    state-first start (``state_first``) to be tried. Measured on ``llama3-8b`` training on ``h100-sxm``: at batch 1
    (0.30 of the peak) it won one row, 20% of the peak by 1.5%, and cost 2-3 s of planning at every budget; at
    batch 2 (0.46) and 4 (0.63) and on ``deepseek-v2-lite`` (0.89) it wins most rows by up to 22%."""
    static_layout: bool = False
    """Give the plan a static arena layout (``hyperoffload.layout``) and re-plan for fewer live bytes where
    the arena rises above the budget until it fits: the budget then bounds reserved memory. Off by default:
    the packing loses 3-8% to fragmentation on llama3-8b training plans, and making room for that costs
    up to 8% of step time (4.7% at half the peak on h100-sxm) and planning takes 1.7-3.2x as long: it plans twice,
    with prefetches as early as the live bytes allow and just in time, and keeps the faster
    (``bench/fragmentation.py --cost``)."""
    layout_attempts: int = 4
    """Re-plans allowed to make room for the layout's fragmentation before giving up."""
    reorder: bool = True
    """Also try the refined execution orders (optimizer updates hoisted into the backward pass, see
    ``reorder``) and keep the fastest plan."""
    partly_hoisted: tuple[tuple[float, float], ...] = ((0.15, 0.6), (1.0, 0.0))
    """The partly hoisted candidate orders (``candidate_orders``): for each, the share of the backward pass whose
    updates it hoists (``reorder.early_updates``; the large ones never move), and the least budget, as a share of
    the captured order's peak, at which it gets a pass (elsewhere it gets one only where it is the only order that
    meets the budget). The last share should be 1.0: that order is the one ``stretched_partly_from`` speaks of.

    Measured on ``llama3-8b`` training (``bench/plan_tables.py``; sweeps of the share with the order given):
    hoisting the first 15% wins at 80% of the peak on ``h100-sxm`` (1.017 x ``bound_s``; 1.065 in the captured
    order, and shares from 0.10 to 0.19 gave 1.017-1.040) and is no better below 60% of the peak, where its pass
    would only cost planning time. Hoisting every small update wins at 80% on ``a100-80g`` (1.033; 1.062 at 0.15)
    and at almost every budget from 70% down on every PCIe-class profile, and at the smallest budget, where the
    fully refined order does not fit, it is 14-20% faster than the captured order on every profile. Shares in
    between were now a little better than both (0.4 at 80% on ``a100-80g``: 1.025), now much worse (0.4-0.6 at 80%
    on ``h100-sxm``: 1.136-1.140): no share is best everywhere, so both ends are planned and the simulator keeps
    the faster."""
    quick_tolerance: float = 0.05
    """Each order gets a quick pass; the full search runs in the fastest and in every order whose quick
    plan is within this share of it."""


class InfeasibleBudget(ValueError):
    """The budget is below the smallest one this planner can meet; ``min_budget_bytes`` says which."""

    def __init__(self, message: str, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


@dataclass(frozen=True, slots=True, eq=False)
class PositionBudget:
    """Device bytes each position of an execution order may hold: the same everywhere for a budget as given, lower
    at some positions where a static layout needs room for its fragmentation (``driver._plan_in_arena``)."""

    at: np.ndarray
    """Bytes at each position (int64, one per op of the step)."""
    most: int
    """The largest of ``at`` (bytes): the plan's ``budget_bytes`` and what the window bound is computed for."""
    least: int
    """The smallest of ``at`` (bytes): what the budget is measured by against the smallest one and the peak."""

    @classmethod
    def uniform(cls, budget_bytes: int, positions: int) -> PositionBudget:
        """``budget_bytes`` at each of ``positions`` positions."""
        return cls(np.full(positions, budget_bytes, dtype=np.int64), budget_bytes, budget_bytes)

    @classmethod
    def per_position(cls, at: np.ndarray) -> PositionBudget:
        """The bytes ``at`` each position (at least one)."""
        at = np.asarray(at, dtype=np.int64)
        return cls(at, int(at.max()), int(at.min()))
