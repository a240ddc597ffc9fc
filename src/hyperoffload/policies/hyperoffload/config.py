"""What the HyperOffload planner is tuned with, the budgets it plans for and the error it refuses a budget with."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperoffload.policies.reorder import BIG_STATE_SHARE, LOOKAHEAD_OPS
from hyperoffload.policies.spans import MIN_SPAN_PARTS

POLICY = "hyperoffload"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """Knobs of the HyperOffload planner. What its defaults were chosen on, and the commands that measure it, are in
    ``docs/design.md`` ("Tuning the planner")."""

    min_span_bytes: int | None = None
    """Storages smaller than this (bytes) stay on the device, where a copy's latency would dominate and
    the choice would not matter; None: 1/``min_span_parts`` of the step's no-offload peak, and at budgets near the
    smallest those take, also ``small_storage_bytes`` (``small_storages_below``)."""
    min_span_parts: int = MIN_SPAN_PARTS
    """Without ``min_span_bytes``, the usual candidates are the storages from the step's no-offload peak divided by
    this many parts up (a count): a share of the peak keeps the selection's ranking short on large steps, where
    storages that small would not change the plan."""
    small_storage_bytes: int = 4 * 2**20
    """Where a budget is below ``small_storages_below`` times the smallest the planner meets with the usual
    candidates (``min_span_parts``), it also plans each order with the storages from this size up and the scalars
    (0-dim storages, ``minimum._with_scalars``) (bytes; with ``min_span_bytes`` unset), and the quick passes rank both
    sets. A share of the peak grows with the model
    while its activations grow with the hidden size only: on a large model's step the share leaves every
    activation (sequence x hidden) on the device, and those then make most of the smallest budget the usual
    candidates meet; with them as candidates it is far smaller, and near it the plans are faster."""
    small_storages_below: float = 1.5
    """The budget, as a multiple of the smallest the usual candidates meet, below which the smaller storages
    (``small_storage_bytes``) are candidates too (a ratio). Not at every budget: the more spans the selection ranks,
    the more tie, and at larger budgets the plans with them were slower (the quick passes would drop them, for
    twice the planning); near the smallest budget they were faster."""
    bandwidth_margins: tuple[float, ...] = (1.0, 0.7)
    """Shares of the link bandwidth the schedule assumes; one plan per margin is simulated."""
    candidates_per_step: int = 16
    """How many of the best-ranked spans get an exact, lane-aware placement at each selection step."""
    stretch_chosen: bool = True
    """Where no span's copies hide at a position, first stretch a span already chosen over it with the copies it has
    booked (the compute stream waits for them) before taking a new span whose copies cannot hide
    (``selection._Selection._stretched``): where the lanes are the bottleneck, a new span adds a round trip on them
    (docs/results.md, "One rank of an FSDP2-sharded step", has what it changed)."""
    early_prefetch: bool = True
    """After selection, move each prefetch as early as the budget allows (in deadline order)."""
    refinements: int = 2
    """Re-plans against the op times the best plan so far was simulated at (kept only if faster)."""
    stretch_to_window_bound: bool = True
    """Also plan the anchored refined order against its op times stretched to the order's window bound (no plan
    in that order steps faster, ``analysis.window_bound``), at the first margin: the lane model then books copies
    into the time the step will take rather than into compute alone. There, where moments come back during
    the backward pass, that start often wins; in the captured order it rarely did, in the eager one never, and
    they skip it (each start costs a plan and a simulation). The order hoisting every small update gets it from
    ``stretched_partly_from`` of its peak up."""
    stretched_partly_from: float = 0.45
    """The least budget, as a share of its own unplanned peak, at which the order hoisting every small update (the
    last of ``partly_hoisted``) also gets the stretched start (``stretch_to_window_bound``): near the peak on a fast
    link it wins, elsewhere above this share it changes nothing and costs a pass; below, the little it won did
    not pay for the planning time it took."""
    state_first: bool = True
    """Also plan each order from a start that, among candidate spans that relieve about as much, takes the step's
    state (its cyclic spans: parameters, optimizer state, kept remote between steps) before what the step makes
    (``state_first_tie``), at the first margin. Where saved activations are much of the peak, both often
    cover the whole over-budget stretch and tie; activations can leave only during the forward pass and come
    back only during the backward pass, one direction at a time, while the state's copies can run beside
    them (``analysis.link_bound``). Taken instead of the usual start it lost where the state is most of the
    peak, so it is an extra start, refined on its own, and the faster plan is kept. Tried only from
    ``state_first_from`` up."""
    state_first_tie: float = 0.1
    """In the state-first start (``state_first``), the share by which a cyclic span's selection score counts more
    (a ratio): enough to take state before activations that relieve a little more, not to take a span that
    relieves clearly less. Sharded steps need more than ties broken: there the forward pass's link is what
    activations leave on, and state moved in the backward pass beside the prefetches (a tie share of 0.01 kept
    0.98 GiB of ``llama3-8b``'s state remote on 8 ranks of ``dgx-h100`` at 70% and stepped in 633 ms; 0.1 keeps
    7.23 GiB there, 556 ms; docs/results.md, "One rank of an FSDP2-sharded step")."""
    state_first_turn: bool = True
    """Where the state-first start is tried, try it a second time that first keeps in remote memory each storage of
    the step's state that the forward pass reads and a later op reads again before the step writes it (FSDP's
    parameter shards), away from its forward use to its next, with no offload (its copy from the last step is
    current): off the device at the turn from forward to backward for the price of its prefetches, where each
    saved activation off there costs the forward pass's D2H lane an offload. In one rank of a sharded step such
    state counts from ``small_storage_bytes`` up, below the candidates' share of the peak (``min_span_parts``): a
    sharded model's parameter shards are many and small. The faster of the two state-first plans is refined and
    kept if it beats the others (docs/results.md, "One rank of an FSDP2-sharded step", has what it changed)."""
    state_first_from: float = 0.4
    """The least share of the captured peak that storages the step makes (saved activations) must hold for the
    state-first start (``state_first``) to be tried: below it the start rarely won and still cost a pass at every
    budget; above it, it wins most budgets."""
    static_layout: bool = False
    """Give the plan a static arena layout (``hyperoffload.layout``) and re-plan for fewer live bytes where
    the arena rises above the budget until it fits: the budget then bounds reserved memory. Off by default:
    the packing loses some memory to fragmentation, making room for that costs step time wherever the plan is
    link-bound, and planning takes longer: it plans twice, with prefetches as early as the live bytes allow
    and just in time, and keeps the faster."""
    layout_attempts: int = 4
    """Re-plans allowed to make room for the layout's fragmentation before giving up."""
    reorder: bool = True
    """Also try the refined execution orders (optimizer updates hoisted into the backward pass, see
    ``reorder``) and keep the fastest plan."""
    lane_lookahead_ops: int = LOOKAHEAD_OPS
    """In every order, how far ahead of it (in ops) a lane op (a decode step's block fetch) may be issued and
    independent work pulled forward to run while a fetch is in flight (``reorder.overlap_lane_ops``): enough
    for the rest of a transformer layer, not so far that ops of distant layers (and their memory) move."""
    partly_hoisted: tuple[tuple[float, float], ...] = ((0.15, 0.6), (1.0, 0.0))
    """The partly hoisted candidate orders (``candidate_orders``): for each, the share of the backward pass whose
    updates it hoists (``reorder.early_updates``; the large ones, ``big_state_share``, never move), and the least
    budget, as a share of the captured order's peak, at which it gets a pass (elsewhere it gets one only where it
    is the only order that meets the budget). The last share should be 1.0: that order is the one
    ``stretched_partly_from`` speaks of.

    Hoisting the first layers' updates wins just under the peak on a fast link and is no better below the
    least budget given here, where its pass would only cost planning time; hoisting every small update wins near
    the peak on slower links, at almost every smaller budget on PCIe-class links, and at the smallest budget,
    where the fully refined order does not fit. Shares in between were now a little better than both, now much
    worse: no share is best everywhere, so both ends are planned and the simulator keeps the faster."""
    big_state_share: float = BIG_STATE_SHARE
    """In a partly hoisted order (``partly_hoisted``), an update whose state tensors include one of more than this
    share of the step's largest input stays in the optimizer phase (a ratio; ``reorder.early_updates``): those
    (an output projection's moments, an embedding's) are what makes the peak, and hoisted, their update would need
    them on the device right after it, where the link is busiest. A share of the largest input, not of all the
    inputs together: the model's other tensors grow with its size as well, and on ``llama3-70b`` 1/64 of all its
    inputs left even the output projection's 4 GiB moments below it, so the partly hoisted orders hoisted them into
    the start of the backward pass, where every saved activation is still live (docs/results.md)."""
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
    at some positions where a static layout needs room for its fragmentation (``driver.plan_in_arena``), or the
    least the planner can hold there (``minimum.unavoidable_bytes``)."""

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

    def holds(self, other: PositionBudget) -> bool:
        """Whether every position may hold at least what ``other`` has there."""
        return bool((self.at >= other.at).all())
