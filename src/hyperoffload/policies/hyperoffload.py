"""The HyperOffload planner: budgeted selection of idle spans and their schedule, checked by simulation.

Every storage (parameters, gradients, optimizer state, saved activations, KV cache) idles between
two of its uses; each such span is a candidate to spend in remote memory. The planner:

1. measures each op's time with the cost model and the no-offload memory profile in plan order;
2. finds the smallest budget it can meet (every op's own inputs and outputs stay on the device,
   and a storage can leave only across a span of at least one op) and refuses smaller ones;
3. selects spans greedily where the profile is furthest over budget, preferring spans whose
   offload and prefetch hide in the compute between their uses and that relieve the most
   over-budget time per byte moved (a span that cannot be hidden is taken only when nothing
   hideable covers the position);
4. schedules them on the two copy lanes: each offload right after the use before its span, each
   release where the lane model says the offload has finished, each prefetch as late as its
   deadline needs (latest deadline first), then as early as the budget allows, in deadline order;
   a storage whose remote copy is still current is released without a second offload;
5. repeats 3-4 while the schedule leaves positions over budget, for several bandwidth margins (and, where
   saved activations are much of the peak, once more taking the step's state first where spans tie:
   ``PlannerConfig.state_first``), simulates each candidate plan and returns the fastest. The plan's own
   accounting never exceeds the budget, so neither does the simulation;
6. does all that in the captured order and in the refined execution orders (each optimizer update
   run where its gradient is final, which frees gradients early; ``reorder``, ``candidate_orders``):
   one quick pass per order (the first margin, no refinement), then the full search in the order whose
   quick plan was fastest and in any within ``PlannerConfig.quick_tolerance`` of it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from weakref import WeakKeyDictionary

import numpy as np

from hyperoffload.analysis import memory_profile
from hyperoffload.analysis.window_bound import window_bound
from hyperoffload.budgets import check_budget_bytes
from hyperoffload.cost import op_times
from hyperoffload.gc_pause import collector_paused
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.ir import Program
from hyperoffload.layout import arena_use, assign_offsets, prefetch_into_arena
from hyperoffload.plans import (Instr, Kind, Plan, check_plan, compute_instructions, plan_without_offload,
                                state_storages)
from hyperoffload.policies.lanes import Lane
from hyperoffload.policies.reorder import hoist_updates, overlap_lane_ops, sink_views
from hyperoffload.policies.spans import Span, Uses, idle_spans, positions_arrays, storage_uses
from hyperoffload.simulate import Timeline, simulate
from hyperoffload.units import format_bytes
from hyperoffload.variants import has_remote_kv, largest_pool_variant, remote_kv_variant, speculative_variant

POLICY = "hyperoffload"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """Knobs of the HyperOffload planner."""

    min_span_bytes: int | None = None
    """Storages smaller than this (bytes) stay on the device, where a copy's latency would dominate and
    the choice would not matter; None: 1/10,000 of the step's no-offload peak, and at budgets near the smallest
    those take, also ``SMALL_STORAGE_BYTES`` (``SMALL_STORAGES_BELOW``)."""
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
    small update gets it from ``STRETCHED_PARTLY_FROM`` of its peak up."""
    state_first: bool = True
    """Also plan each order from a start that, among candidate spans that relieve about as much, takes the step's
    state (its cyclic spans: parameters, optimizer state, kept remote between steps) before what the step makes
    (``STATE_FIRST_TIE``), at the first margin. Where saved activations are much of the peak, both often
    cover the whole over-budget stretch and tie; activations can leave only during the forward pass and come
    back only during the backward pass, one direction at a time, while the state's copies can run beside
    them (``analysis.link_bound``). ``llama3-8b`` training at batch 4 on ``h100-sxm``: 60% of the peak 1.658 ->
    1.292 x ``bound_s``, 80% 1.099 -> 1.000; ``deepseek-v2-lite`` training on ``mi300x`` at 70%: 1.902 ->
    1.705 (``bench/activation_heavy.py``). Taken instead of the usual start it lost where the state is most of
    the peak (batch 1 at 70%: 1.375 against 1.294), so it is an extra start, refined on its own, and the faster
    plan is kept."""
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
    quick_tolerance: float = 0.05
    """Each order gets a quick pass; the full search runs in the fastest and in every order whose quick
    plan is within this share of it."""


class InfeasibleBudget(ValueError):
    """The budget is below the smallest one this planner can meet; ``min_budget_bytes`` says which."""

    def __init__(self, message: str, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


@dataclass
class _Step:
    """Per-position arrays of the captured order (seconds, bytes)."""

    start: np.ndarray
    end: np.ndarray
    times: np.ndarray
    live: np.ndarray


SMALL_STORAGE_BYTES = 4 * 2**20
"""Where a budget is below ``SMALL_STORAGES_BELOW`` times the smallest the planner meets with storages from 1/10,000
of the peak up, it also plans each order with the storages from this size up (bytes; the default
``PlannerConfig.min_span_bytes``), and the quick passes rank both sets. A share of the peak grows with the model
while its activations grow with the hidden size only: ``llama3-70b`` training peaks at 794 GiB, so 1/10,000 of it
(81 MiB) left every 64 MiB activation (sequence x hidden in bf16) on the device, and the smallest budget the
planner met was 54.8 GiB, 49 GiB of it such storages; with them it is 11.8 GiB (the embedding's AdamW update), and
at 54.9 and 59.6 GiB the plans step in 18.86 and 18.73 s, not 23.37 and 23.20 s (only the captured order met those
budgets without them). ``llama3-8b``'s 8 MiB key and value activations, under its 10.9 MiB share, took its
smallest from 6.89 to 5.89 GiB."""
SMALL_STORAGES_BELOW = 1.5
"""See ``SMALL_STORAGE_BYTES``. Not at every budget: the more spans the selection ranks, the more tie, and at
``llama3-70b``'s hideable budget and 70% of its peak the plans from 16 MiB up were 1.4% and 0.8% slower (the quick
passes would drop them, for twice the planning); at 1.45 times its smallest (10% of its peak) they were 0.7%
faster."""


def _min_span_bytes(config: PlannerConfig, live: np.ndarray, *, small: bool) -> int:
    if config.min_span_bytes is not None:
        return config.min_span_bytes
    share = int(live.max()) // 10_000 if live.size else 0
    return min(share, SMALL_STORAGE_BYTES) if small else share


_Hint = tuple[tuple[int, ...], float | None, int | None]
"""What an earlier search chose: its execution order, bandwidth margin (None: every margin) and smallest candidate
storage (bytes; None: the usual ones, or smaller ones where the budget needs them)."""


@dataclass(frozen=True, slots=True)
class _OrderFacts:
    """What planning in one execution order starts from (positions in ``order``; bytes)."""

    order: list[int]
    live: np.ndarray
    """Device bytes at each position with no offload (``check_plan``'s accounting)."""
    uses: Uses
    spans: list[Span]
    min_span_bytes: int


def _order_facts(program: Program, order: Sequence[int], config: PlannerConfig, *,
                 small: bool = True) -> _OrderFacts:
    """With ``small``, the candidates are the most this planner takes (``SMALL_STORAGE_BYTES``)."""
    order = list(order)
    live = np.asarray(check_plan(plan_without_offload(program, order)).live_bytes, dtype=np.int64)
    min_span_bytes = _min_span_bytes(config, live, small=small)
    uses = storage_uses(program, order)
    return _OrderFacts(order, live, uses, idle_spans(program, uses, min_bytes=min_span_bytes), min_span_bytes)


def _with_smaller_storages(program: Program, facts: _OrderFacts, config: PlannerConfig) -> _OrderFacts | None:
    """``facts`` with storages from ``SMALL_STORAGE_BYTES`` up as candidates; None where that takes no more."""
    least = _min_span_bytes(config, facts.live, small=True)
    if least >= facts.min_span_bytes:
        return None
    return replace(facts, spans=idle_spans(program, facts.uses, min_bytes=least), min_span_bytes=least)


def minimum_budget(program: Program, config: PlannerConfig = PlannerConfig(),
                   order: Sequence[int] | None = None) -> tuple[int, str]:
    """The smallest budget (bytes) this planner can meet with the ops in ``order``, and what sets it.

    Without an order: the smallest over the execution orders the planner tries (``candidate_orders``) and, for
    a decode step with a remote-KV form (``variants``), over the forms it plans at small budgets (the KV cache
    remote without a pool, with the smallest pool, and with speculative prefetch), which need far less than
    the step as captured once the cache is long: ``plan_hyperoffload`` meets every budget from this one up."""
    if order is None:
        # Asked again for the same program (the hideable budget, and then why it is what it is; every row of a
        # table of budgets): the default question is answered once per program.
        cached = _MINIMUM.get(program) if config == PlannerConfig() else None
        if cached is None:
            cached = min((_least_over_orders(form, config, label) for label, form in _small_budget_forms(program)),
                         key=lambda r: r[0])
            if config == PlannerConfig():
                _MINIMUM[program] = cached
        return cached
    return _minimum(program, _order_facts(program, order, config))


def _least_over_orders(program: Program, config: PlannerConfig, label: str) -> tuple[int, str]:
    least, why = min((minimum_budget(program, config, o) for o in candidate_orders(program)), key=lambda r: r[0])
    return least, f"in the step's form {label}, {why}" if label else why


def _small_budget_forms(program: Program) -> list[tuple[str, Program]]:
    """(label, form) of each form ``_plan_forms`` may plan at a budget below the captured step's smallest; the
    captured step's label is empty."""
    if not has_remote_kv(program):
        return [("", program)]
    return [("", program),
            ("with the KV cache in remote memory and no block pool", remote_kv_variant(program, None)),
            ("with the KV cache in remote memory and the smallest block pool",
             remote_kv_variant(program, program.meta["nsa_top_n"])),
            ("with the KV cache in remote memory and speculative block prefetch", speculative_variant(program))]


_MINIMUM: WeakKeyDictionary[Program, tuple[int, str]] = WeakKeyDictionary()


def _unavoidable(facts: _OrderFacts) -> np.ndarray:
    """Bytes each position of ``facts.order`` holds on the device whatever this planner offloads."""
    live = facts.live
    removable = np.zeros(live.size + 1, dtype=np.int64)
    for span in facts.spans:
        removable[span.first + 1] += span.nbytes
        removable[span.last] -= span.nbytes
        if span.cyclic:  # the span wraps: it also covers the step from its start up to the first use
            removable[0] += span.nbytes
            removable[live.size] -= span.nbytes
    return live - np.cumsum(removable)[:-1]


def _minimum(program: Program, facts: _OrderFacts) -> tuple[int, str]:
    if facts.live.size == 0:
        return 0, "the step has no ops"
    unavoidable = _unavoidable(facts)
    p = int(unavoidable.argmax())
    op = program.ops[facts.order[p]]
    values = program.values
    working = {values[v].storage for v in (*op.inputs, *op.outputs)}
    own = sum(values[s].alloc_bytes for s in working)
    why = (f"op {op.name} ({op.target}) needs {format_bytes(own)} of its own inputs and outputs on the device, and "
           f"{format_bytes(int(unavoidable[p]) - own)} more by storages used by the ops right before and after it "
           f"or smaller than {format_bytes(facts.min_span_bytes)}")
    return int(unavoidable[p]), why


def candidate_orders(program: Program) -> list[tuple[int, ...]]:
    """Execution orders the planner starts from: the captured one, then the refined ones that differ
    from it (optimizer updates hoisted into the backward pass, see ``reorder``): each update in one piece
    where its gradient is final, and each op as early as its inputs allow. In all, the step's own lane
    ops (a decode step's block fetches) get independent compute to overlap (``overlap_lane_ops``), and each
    view op runs just before the first op that needs it (``sink_views``: a captured step detaches every
    parameter at its start, which would count as a use there).

    The anchored order moves each moment once per step and wins on slow links (PCIe); the eager one
    runs AdamW's gradient-free ``exp_avg_sq.mul_`` at the step's start, so those moments cross twice,
    which a fast link (NVLink-C2C) hides and which then leaves the planner a slightly better schedule. The
    partly hoisted ones (``PARTLY_HOISTED``) leave the large updates (an output projection's, an embedding's)
    in the optimizer phase and hoist the others whose gradients are final in the first share of the backward
    pass (``reorder.early_updates``): the first layers' only, which on a PCIe-class link at a budget just under
    the peak fills the early backward pass's idle offload direction without crowding the link right after the
    peak, or all of them, which keeps the large states' traffic out of the backward pass at any budget."""
    return list(dict.fromkeys(_orders(program)))


STRETCHED_PARTLY_FROM = 0.45
"""The least budget, as a share of its own unplanned peak, at which the order hoisting every small update (the last
of ``PARTLY_HOISTED``) also gets the stretched start (``PlannerConfig.stretch_to_window_bound``). Measured on
``llama3-8b`` training: on ``h100-sxm`` at 70% of the captured peak it wins, 0.901 s against 0.935 s (1.294 x
``bound_s`` against 1.343); at 60% and 50% there, at 70% and 60% on ``a100-80g`` and from 80% to 60% on
``ascend-910c`` it changes nothing and costs 0.1-1 s of planning (scratch A/B runs, the planner otherwise
unchanged). Below, it made ``h100-sxm`` at 10% 3% faster (2.834 s against 2.918 s) but took planning there from
7.6 s to 8.5 s, too close to the 10 s target on a slow hour of a 2-core machine."""

STATE_FIRST_TIE = 0.01
"""In the state-first start (``PlannerConfig.state_first``), a cyclic span's selection score counts this share
more: enough to break ties and near-ties in its favour, not to take a span that relieves clearly less."""

STATE_FIRST_FROM = 0.4
"""The least share of the captured peak that storages the step makes (saved activations) must hold for the
state-first start (``PlannerConfig.state_first``) to be tried. Measured on ``llama3-8b`` training on
``h100-sxm``: at batch 1 (0.30 of the peak) it won one row, 20% of the peak by 1.5%, and cost 2-3 s of
planning at every budget; at batch 2 (0.46) and 4 (0.63) and on ``deepseek-v2-lite`` (0.89) it wins most rows
by up to 22%."""


def made_share(program: Program) -> float:
    """Share of the captured no-offload peak held by storages the step makes (not its state)."""
    cached = _MADE_SHARE.get(program)
    if cached is None:
        profile = memory_profile(program)
        state = state_storages(program)
        made = sum(program.values[s].alloc_bytes for s in profile.peak_storages if s not in state)
        cached = _MADE_SHARE[program] = made / profile.peak_bytes if profile.peak_bytes else 0.0
    return cached


_MADE_SHARE: WeakKeyDictionary[Program, float] = WeakKeyDictionary()

PARTLY_HOISTED = ((0.15, 0.6), (1.0, 0.0))
"""The partly hoisted candidate orders: for each, the share of the backward pass whose updates it hoists
(``reorder.early_updates``; the large ones never move), and the least budget, as a share of the captured
order's peak, at which it gets a pass (elsewhere it gets one only where it is the only order that meets the
budget).

Measured on ``llama3-8b`` training (``bench/plan_tables.py``; scratch sweeps of the share with the order
given): hoisting the first 15% wins at 80% of the peak on ``h100-sxm`` (1.017 x ``bound_s``; 1.065 in the
captured order, and shares from 0.10 to 0.19 gave 1.017-1.040) and is no better below 60% of the peak,
where its pass would only cost planning time. Hoisting every small update wins at 80% on ``a100-80g``
(1.033; 1.062 at 0.15) and at almost every budget from 70% down on every PCIe-class profile, and at the
smallest budget, where the fully refined order does not fit, it is 14-20% faster than the captured order on
every profile. Shares in between were now a little better than both (0.4 at 80% on ``a100-80g``: 1.025),
now much worse (0.4-0.6 at 80% on ``h100-sxm``: 1.136-1.140): no share is best everywhere, so both ends are
planned and the simulator keeps the faster."""


def _orders(program: Program) -> tuple[tuple[int, ...], ...]:
    """The captured, anchored refined, eager refined and partly hoisted orders (one per ``PARTLY_HOISTED``) of
    ``candidate_orders`` (equal where they coincide), computed once per program: every search and every
    smallest-budget question starts here."""
    cached = _ORDERS.get(program)
    if cached is None:
        cached = _ORDERS[program] = tuple(sink_views(program, overlap_lane_ops(program, order)) for order in (
            None,
            hoist_updates(program),
            hoist_updates(program, anchored=False),
            *(hoist_updates(program, share=share) for share, _ in PARTLY_HOISTED)))
    return cached


_ORDERS: WeakKeyDictionary[Program, tuple[tuple[int, ...], ...]] = WeakKeyDictionary()


def order_name(program: Program, order: Sequence[int]) -> str:
    """Which of ``candidate_orders`` ``order`` is: "captured", "refined" (every update hoisted where its gradient
    is final), "eager" (each op as early as its inputs allow), "partly 15%" (the partly hoisted order of that
    ``PARTLY_HOISTED`` share), or "other"; where orders coincide, the first of these names."""
    names = ("captured", "refined", "eager", *(f"partly {share:.0%}" for share, _ in PARTLY_HOISTED))
    return next((name for name, candidate in zip(names, _orders(program)) if candidate == tuple(order)), "other")


def plan_hyperoffload(program: Program, hardware: Hardware | str, budget_bytes: int,
                      config: PlannerConfig = PlannerConfig()) -> Plan:
    """The fastest plan found whose device memory never exceeds ``budget_bytes``: its live bytes, and
    with ``config.static_layout`` its arena (``plan.layout``), which then is all the memory it reserves.

    A decode step with a remote-KV form (``variants``) is also planned in that form, with the largest
    block pool that fits the budget, or, if none fits, without a pool, with the smallest pool (planned to
    move other state out to make room for it) and with speculative prefetch of each layer's previous
    selection; the faster plan wins, the smaller peak on a tie. Such a plan's program is the remote-KV form.

    The cyclic garbage collector is paused while planning (``gc_pause``): planning makes no cycles, and the
    collector's walks over the captured program took about a fifth of the planning time."""
    budget_bytes = check_budget_bytes(budget_bytes, least=0)
    with collector_paused():
        return _plan_forms(program, as_hardware(hardware), budget_bytes, config)


def _plan_forms(program: Program, hardware: Hardware, budget_bytes: int, config: PlannerConfig) -> Plan:
    if not has_remote_kv(program):
        return _plan_program(program, hardware, budget_bytes, config)
    tried: list[tuple[float, int, Plan]] = []
    failure: InfeasibleBudget | None = None
    remote = largest_pool_variant(program, budget_bytes) or remote_kv_variant(program, None)
    forms = [program, remote]
    if remote.meta.get("pool_blocks") is None:
        # No pool fits the step as captured; one may once the planner moves other state (weights) out. Or
        # guess instead: prefetch each layer's previous selection a layer ahead, for a pool's hits in
        # transient memory, at the price of moving those blocks every step.
        forms += [remote_kv_variant(program, program.meta["nsa_top_n"]), speculative_variant(program)]
    for form in forms:
        try:
            plan = _plan_program(form, hardware, budget_bytes, config)
        except InfeasibleBudget as error:
            failure = error if failure is None or error.min_budget_bytes < failure.min_budget_bytes else failure
            continue
        figures = simulate(plan, hardware).figures
        tried.append((figures.step_s, figures.peak_bytes, plan))
    if not tried:
        least, why = minimum_budget(program, config)
        if failure.min_budget_bytes == least:  # below every form's smallest: say which form sets it
            raise _below_smallest(budget_bytes, least, why)
        raise failure
    return min(tried, key=lambda t: t[:2])[2]


def _plan_program(program: Program, hardware: Hardware, budget_bytes: int, config: PlannerConfig) -> Plan:
    if not config.static_layout:
        return _search(program, hardware, budget_bytes, config)[0]
    # Prefetching early into whatever live bytes are free scatters long-lived residencies over the arena's
    # top (a weight prefetched right after the peak for the end of the step sits above everything there),
    # which the layout then has to make room for. Planned just in time and moved early only into free slots
    # of the packed arena (prefetch_into_arena), the step is often faster: llama3-8b training on h100-sxm,
    # 0.756 s against 0.830 s at 80% of the peak, and 2.73 s against 2.93 s at 20%; at other budgets it is
    # slower. Both are planned and the faster kept.
    # The just-in-time plan searches only the execution order and bandwidth margin the first search chose: the
    # order is what takes the time, and the same one has won both on every budget measured; trying every
    # margin again changed no step time on llama3-8b training from 90% to 10% and cost 15-20% of planning.
    variants = [config, replace(config, early_prefetch=False)] if config.early_prefetch else [config]
    found, failure, hint = [], None, None
    for variant in variants:
        try:
            plan, hint, step_s = _plan_in_arena(program, hardware, budget_bytes, variant, hint)
            found.append((step_s, plan))
        except InfeasibleBudget as error:
            failure = failure or error
    if not found:
        raise failure
    return min(found, key=lambda t: t[0])[1]


def _plan_in_arena(program: Program, hardware: Hardware, budget_bytes: int, config: PlannerConfig,
                   given: _Hint | None = None) -> tuple[Plan, _Hint, float]:
    """The fastest plan found whose static arena fits ``budget_bytes`` (see ``_plan_program``), searched in
    the order, margin and candidates ``given`` only if given; what it was made with, and its simulated step time
    (seconds)."""
    plan, hint = _search(program, hardware, budget_bytes, config, given)
    first = _orders(program)[0]
    target: np.ndarray | None = None  # live bytes each position of the hint's order may hold
    floor: np.ndarray | None = None  # the least the planner can hold there (the hint's order never changes)
    for attempt in range(config.layout_attempts + 1):
        layout = assign_offsets(plan)
        if layout.arena_bytes <= budget_bytes:
            plan = replace(plan, budget_bytes=budget_bytes, layout=layout)
            # The arena may have room the live-byte schedule left unused: prefetch into it where that
            # simulates faster (earlier is not always faster: the H2D lane may be busy with more urgent work).
            moved, _ = prefetch_into_arena(plan, layout)
            chosen = hint or (first, None, None)
            step_s = simulate(plan, hardware).figures.step_s
            moved_s = simulate(moved, hardware).figures.step_s if moved is not plan else step_s
            return (moved, chosen, moved_s) if moved_s < step_s else (plan, chosen, step_s)
        if attempt == config.layout_attempts:
            break
        # Fragmentation: where the packing rises above the budget, plan for fewer live bytes, by what it is
        # over there, and pack again. Only those positions: lowering the whole step's budget by the worst
        # overshoot moved more than the layout needs and cost step time everywhere.
        hint = hint or (first, None, None)  # the unplanned step fit; its order, every margin, any candidates
        at = [i for i, ins in enumerate(plan.instructions) if ins.kind is Kind.COMPUTE]
        top, live = arena_use(layout, np.asarray(at))
        over = np.maximum(top - budget_bytes, 0)
        lowered = np.minimum(np.full(len(at), budget_bytes) if target is None else target,
                             np.where(over > 0, live - over, budget_bytes))
        # No lower than the planner can go at each position; if that leaves nothing lower, packing again is moot.
        if floor is None:
            floor = _unavoidable(_order_facts(program, hint[0], config))
        lowered = np.maximum(lowered, floor)
        if (lowered >= (budget_bytes if target is None else target)).all():
            break
        target = lowered
        try:
            plan, hint = _search(program, hardware, target, config, hint)
        except InfeasibleBudget as error:
            raise InfeasibleBudget(
                f"at {format_bytes(budget_bytes)} the plan's live bytes fit, but its static layout needs "
                f"{format_bytes(layout.arena_bytes)} (packing loses {format_bytes(layout.overhead_bytes)}); "
                f"making room for that would need planning below the smallest budget, "
                f"{format_bytes(error.min_budget_bytes)}. Give at least about "
                f"{format_bytes(error.min_budget_bytes + layout.overhead_bytes)}, or plan without a static "
                f"layout", error.min_budget_bytes + layout.overhead_bytes) from None
    raise InfeasibleBudget(f"no static layout within {format_bytes(budget_bytes)} found after "
                           f"{attempt} re-plans (the last needs {format_bytes(layout.arena_bytes)}); "
                           f"give a larger budget, or plan without a static layout", layout.arena_bytes)


def _search(program, hardware, budget_bytes: int | np.ndarray, config, hint: _Hint | None = None):
    """The fastest plan found whose live bytes never exceed ``budget_bytes``, and the order, margin and candidates
    it was made with. With a ``hint`` from an earlier search, plans only in that order, in that margin unless it
    is None, and with those candidates (smaller ones where the budget needs them). ``budget_bytes`` may be an array:
    the bytes each position of the hint's order may hold."""
    first, anchored, eager, *partly = _orders(program)
    orders = [hint[0]] if hint else candidate_orders(program) if config.reorder else [first]
    budget = np.asarray(budget_bytes, dtype=np.int64)
    facts = [_order_facts(program, orders[0], config, small=False)]
    if orders[0] == first and (facts[0].live.size == 0 or (facts[0].live <= budget).all()):
        base = plan_without_offload(program, order=first)
        return Plan(program=program, instructions=base.instructions, policy=POLICY,
                    budget_bytes=int(budget.max(initial=0))), None
    facts += [_order_facts(program, order, config, small=False) for order in orders[1:]]
    smallest = [_minimum(program, f) for f in facts]
    # Near the smallest budget the usual candidates meet, every order also starts from smaller ones; the quick
    # passes rank them with the rest.
    if budget.min() < SMALL_STORAGES_BELOW * min(least for least, _ in smallest):
        more = [g for g in (_with_smaller_storages(program, f, config) for f in facts) if g is not None]
        facts, smallest = facts + more, smallest + [_minimum(program, g) for g in more]
    if hint and hint[2] is not None:
        facts, smallest = zip(*[(f, m) for f, m in zip(facts, smallest) if f.min_span_bytes <= hint[2]])
    feasible = [f for f, (least, _) in zip(facts, smallest)
                if (budget >= least if budget.ndim == 0 else budget >= _unavoidable(f)).all()]
    if not feasible:
        least, why = min(smallest, key=lambda r: r[0])
        raise _below_smallest(int(budget.min()), least, why)
    times_by_op = np.asarray(op_times(program, hardware), dtype=np.float64)
    if hint:
        margins = config.bandwidth_margins if hint[1] is None else (hint[1],)
        best, _ = _plan_in_order(program, hardware, budget, feasible[0], times_by_op,
                                 replace(config, bandwidth_margins=margins))
        return best.plan, (tuple(feasible[0].order), best.margin, feasible[0].min_span_bytes)
    # Every order gets one quick pass (the first margin, no refinement); the full search runs in the
    # fastest and in any other within ``config.quick_tolerance`` of it, where full passes may rank otherwise.
    # One or two full passes instead of one per order keep planning an 8B step within seconds.
    quick_config = replace(config, bandwidth_margins=config.bandwidth_margins[:1], refinements=0, state_first=False)
    # The eager order moves the second moments twice per step; only a link that can make offloading free at
    # this budget hides that, and elsewhere its pass would only cost planning time.
    # Where it is the only order that meets the budget, it gets its pass all the same.
    # A partly hoisted order gets its pass from its least share of the captured order's peak up (see
    # PARTLY_HOISTED); below, it would only cost planning time. Where it is the only order that meets the
    # budget, it gets its pass all the same.
    peak = facts[0].live.max()  # without a hint, the first order is the captured one
    skipped = set(partly) - {order for order, (_, least) in zip(partly, PARTLY_HOISTED)
                            if budget.min() >= least * peak} - {first, anchored, eager}
    if eager != anchored and any(tuple(f.order) == eager for f in feasible) and not _offload_can_be_free(
            program, hardware, int(budget.min()), first, times_by_op):
        skipped.add(eager)
    considered = [f for f in feasible if tuple(f.order) not in skipped] or feasible
    if any(tuple(f.order) == eager != anchored for f in considered):
        # Where the eager order is worth a pass (links fast enough to offload for free), the stretched start
        # never won; it would cost a pass of its own.
        quick_config = replace(quick_config, stretch_to_window_bound=False)
        config = replace(config, stretch_to_window_bound=False)
    simulated: dict = {}  # passes often make a plan another made already: one simulation each
    # An order's second set of candidates (SMALL_STORAGE_BYTES; it comes after the usual one in ``considered``)
    # gets a quick pass where the usual set cannot plan that order, or where that order's is the fastest.
    firsts: dict[tuple[int, ...], _OrderFacts] = {}
    for f in considered:  # in their order: on a tie the first order's plan wins
        firsts.setdefault(tuple(f.order), f)
    quick: list[tuple[tuple[_Tried, tuple[_Tried, ...]], _OrderFacts]] = [
        (_plan_in_order(program, hardware, budget, f, times_by_op, quick_config, simulated=simulated), f)
        for f in firsts.values()]
    leader = tuple(min(quick, key=lambda t: t[0][0].step_s)[1].order)
    quick += [(_plan_in_order(program, hardware, budget, f, times_by_op, quick_config, simulated=simulated), f)
              for f in considered if tuple(f.order) == leader and f is not firsts[leader]]
    fastest = min(best.step_s for (best, _), _ in quick)
    # Of an order's two sets of candidates (SMALL_STORAGE_BYTES), only the one whose quick plan is faster.
    by_order: dict[tuple[int, ...], tuple] = {}
    for (best, tried), f in quick:
        kept = by_order.get(tuple(f.order))
        if kept is None or best.step_s < kept[0][0].step_s:
            by_order[tuple(f.order)] = ((best, tried), f)
    full = [(_plan_in_order(program, hardware, budget, f, times_by_op, config, seeds=tried, simulated=simulated)[0], f)
            for (best, tried), f in by_order.values() if best.step_s <= fastest * (1 + config.quick_tolerance)]
    best, facts = min(full, key=lambda t: t[0].step_s)
    return best.plan, (tuple(facts.order), best.margin, facts.min_span_bytes)


def _below_smallest(budget_bytes: int, least: int, why: str) -> InfeasibleBudget:
    return InfeasibleBudget(f"a budget of {format_bytes(budget_bytes)} is below the smallest this planner can meet, "
                            f"{format_bytes(least)} ({least} bytes): {why}", least)


def _offload_can_be_free(program, hardware, budget_bytes, order, times_by_op: np.ndarray) -> bool:
    """Whether a plan in ``order`` could offload down to ``budget_bytes`` at no cost in step time: the
    window bound (``analysis.window_bound``) equals the step's compute time."""
    return window_bound(program, hardware, budget_bytes, order).seconds <= float(times_by_op.sum()) * (1 + 1e-9)


def _plan_in_order(program, hardware, budget_bytes, facts: _OrderFacts, times_by_op: np.ndarray,
                   config: PlannerConfig, seeds: Sequence[_Tried] = (), simulated: dict | None = None
                   ) -> tuple[_Tried, tuple[_Tried, ...]]:
    """The fastest plan found with the compute ops in ``facts.order``, and the unrefined plans it started from
    (one per margin, one against op times stretched to the window bound, one state first); ``seeds``, plans made
    in that order (unrefined), stand for their starts instead of planning them again. ``simulated`` holds the
    timelines of plans simulated before in the same search (same budget and hardware), by instructions."""
    simulated = {} if simulated is None else simulated

    def timeline(plan: Plan) -> Timeline:
        key = (plan.instructions, plan.initial_remote)
        if key not in simulated:
            simulated[key] = simulate(plan, hardware)
        return simulated[key]

    order, live, uses, spans = facts.order, facts.live, facts.uses, facts.spans
    times = times_by_op[order]
    steps = {False: _step_of(times, live)}
    starts = [(margin, False, False) for margin in config.bandwidth_margins]
    if config.state_first and made_share(program) >= STATE_FIRST_FROM:
        starts.append((config.bandwidth_margins[0], False, True))
    tried = list(seeds)
    done = {(t.margin, t.stretched, t.state_first) for t in seeds}
    orders = _orders(program)
    first, anchored, hoisting_small = orders[0], orders[1], orders[-1]  # the last: PARTLY_HOISTED's share 1.0
    stretched_start = (config.bandwidth_margins[0], True, False)
    stretched_order = tuple(order) == anchored != first or (
        tuple(order) == hoisting_small and live.size and np.max(budget_bytes) >= STRETCHED_PARTLY_FROM * live.max())
    # Where a quick pass's seed already made the stretched start, there is no bound to compute again.
    if config.stretch_to_window_bound and times.size and stretched_order and stretched_start not in done:
        bound = window_bound(program, hardware, int(np.max(budget_bytes)), order).seconds
        if bound > times.sum() * (1 + 1e-9):
            steps[True] = _step_of(times * (bound / times.sum()), live)
            starts.append(stretched_start)
    for margin, stretched, state_first in starts:
        if (margin, stretched, state_first) in done:
            continue
        plan = _plan_for_margin(program, hardware, budget_bytes, steps[stretched], spans, uses.writes, margin, config,
                                order, state_first=state_first)
        tried.append(_Tried(plan, timeline(plan), margin, stretched, state_first))
    # Refine with the simulator: plan again against the op times the best plan really ran at (its
    # stalls included), so the lane model sees the gaps the copies actually have; keep what is faster. The
    # state-first start is refined on its own: refined from the best start alone, the order hoisting every small
    # update on h100-sxm at 70% of the peak lost 4% where the state-first start was the best before refinement.
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    refined_bests = []
    for family in (False, True):
        starts_of = [t for t in tried if t.state_first is family]
        if not starts_of:
            continue
        best = min(starts_of, key=lambda t: t.step_s)
        for _ in range(config.refinements):
            stretched = _observed_step(best.timeline, live, position)
            if stretched is None:
                break
            plan = _plan_for_margin(program, hardware, budget_bytes, stretched, spans, uses.writes, best.margin,
                                    config, order, state_first=family)
            refined = _Tried(plan, timeline(plan), best.margin, best.stretched, family)
            if refined.step_s >= best.step_s:
                break
            best = refined
        refined_bests.append(best)
    return min(refined_bests, key=lambda t: t.step_s), tuple(tried)


def _step_of(times: np.ndarray, live: np.ndarray) -> _Step:
    end = np.cumsum(times)
    return _Step(start=end - times, end=end, times=times, live=live)


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
        return self.timeline.figures.step_s


def _observed_step(timeline: Timeline, live: np.ndarray, position: np.ndarray) -> _Step | None:
    """Per-position start and end times of the ops as simulated (the last simulated step);
    ``position[op id]`` is the op's position in the order planned."""
    n = live.size
    compute = [iv for iv in timeline.intervals if iv.stream == "compute"]
    per_position: dict[int, tuple[float, float]] = {}
    op_of = {i: int(position[ins.target % n]) for i, ins in enumerate(timeline.plan.instructions)}
    for iv in compute:
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


@dataclass
class _Choice:
    """Where a chosen span's instructions go (positions: before the op at that position; ``n`` is
    after the step's last op)."""

    offload: int
    """Position of its OFFLOAD, or -1 when a remote copy is still current."""
    release: int
    prefetch: int
    resumes: int = 0
    """Cyclic spans: first position of the step at which the storage is no longer on the device (an
    offload still landing from the previous step holds it until then)."""
    offload_begin: float = -1.0
    """When the offload's lane reservation begins (seconds) if not at its position's start."""

    def freed(self, n: int) -> list[tuple[int, int]]:
        """Positions [lo, hi) during which the storage is off the device."""
        if self.prefetch >= self.release:
            return [(self.release, self.prefetch)]
        return [(self.release, n), (self.resumes, self.prefetch)]  # cyclic: wraps past the step's end

    def covered(self, over: np.ndarray, n: int) -> float:
        return sum(over[hi] - over[lo] for lo, hi in self.freed(n) if hi > lo)


def _plan_for_margin(program, hardware, budget, step: _Step, spans: list[Span], writes, margin, config,
                     order: list[int], *, state_first: bool = False) -> Plan:
    first, last, size = positions_arrays(spans)
    cyclic = first >= last
    n = step.live.size
    total = step.end[-1]
    start_at = np.append(step.start, total)  # position n: after the step's last op
    offload_s = hardware.d2h_latency_s + size / (hardware.d2h_bw * margin)
    prefetch_s = hardware.h2d_latency_s + size / (hardware.h2d_bw * margin)
    # Windows if each span had the lanes to itself (an upper bound used to rank candidates): freed
    # positions [lo1, hi1) and, for cyclic spans, also [0, hi2) at the start of the step.
    ready = step.end[first]  # when the use before the span is done
    lo1 = np.minimum(np.maximum(np.searchsorted(start_at, ready + offload_s, side="left"), first + 1), n)
    latest = np.searchsorted(step.start, step.start[last] - prefetch_s, side="right") - 1
    hi1 = np.where(cyclic, n, np.minimum(latest, last))
    hi2 = np.where(cyclic, np.maximum(latest, 0), 0)
    latency_bytes = hardware.h2d_latency_s * hardware.h2d_bw
    d2h, h2d = Lane(float(offload_s.min(initial=np.inf))), Lane(float(prefetch_s.min(initial=np.inf)))
    # The per-span placement below runs some 20 times per selection step: it works on Python lists and
    # bisect, which give the same answers as the arrays and np.searchsorted at a fraction of their cost per item.
    starts, starts_at = step.start.tolist(), start_at.tolist()  # lanes search these with bisect
    offload_l, prefetch_l, ready_l, end_s = offload_s.tolist(), prefetch_s.tolist(), ready.tolist(), float(total)
    choices: dict[int, _Choice] = {}
    free = np.ones(len(spans), dtype=bool)  # spans not chosen yet
    out_until: dict[int, list[tuple[int, float]]] = {}  # storage -> (span first, offload landed) of chosen spans
    excess = (step.live - budget).astype(np.float64)
    # Selection scores, scaled up for cyclic spans in the state-first start (``PlannerConfig.state_first``).
    favour = 1.0 + STATE_FIRST_TIE * cyclic if state_first else None

    def window(i: int, p: int) -> _Choice | None:
        """Lane-aware placement of span i, if it frees position p."""
        span = spans[i]
        if span.cyclic:
            return _cyclic_window(i, p)
        landed = _current_copy(out_until.get(span.storage, ()), span, writes)
        if landed is None:
            q = d2h.earliest(starts, span.first + 1, offload_l[i], p + 1)
            if q < 0:
                return None
            done, offload = starts[q] + offload_l[i], q
        else:
            done, offload = max(ready_l[i], landed), -1
        release = max(bisect.bisect_left(starts, done), span.first + 1)
        if release > p:
            return None
        q = h2d.latest(starts, span.last, prefetch_l[i], starts[span.last], p + 1)
        if q < 0:
            return None
        return _Choice(offload, release, q)

    def _cyclic_window(i: int, p: int) -> _Choice | None:
        span = spans[i]
        prefetch = h2d.latest(starts, span.last, prefetch_l[i], starts[span.last], 0)
        if prefetch < 0:
            return None
        begin = -1.0
        if writes.get(span.storage):  # changed this step: the copy from the last step is stale
            q = d2h.earliest(starts_at, span.first + 1, offload_l[i], n + 1)
            if q < 0:  # the lane is booked to the end: go out after the step, once the lane is free
                q, begin = n, max(end_s, max(d2h.ends, default=end_s))
            landed, offload = (begin if begin >= 0 else starts_at[q]) + offload_l[i], q
        else:
            landed, offload = ready_l[i], -1
        if landed <= end_s:
            release, resumes = max(bisect.bisect_left(starts_at, landed), span.first + 1), 0
        else:  # lands during the next step: the storage is still on the device when that step starts
            release, resumes = n, bisect.bisect_left(starts, landed - end_s)
        if not (release <= p or resumes <= p < prefetch):
            return None
        return _Choice(offload, release, prefetch, resumes, begin)

    over = None  # over[k]: compute time of the over-budget positions before k; kept while they stay the same
    while True:
        p = int(excess.argmax())
        need = excess[p]
        if need <= 0:
            break
        if over is None:
            over = np.concatenate([[0.0], np.cumsum(np.where(excess > 0, step.times, 0.0))])
        covers = (lo1 <= p) & (p < hi1) | (p < hi2)
        candidates = np.flatnonzero(free & covers)
        covered = over[hi1[candidates]] - over[np.minimum(lo1[candidates], hi1[candidates])] + over[hi2[candidates]]
        bound = covered * np.minimum(size[candidates], need) / (size[candidates] + latency_bytes)
        if favour is not None:
            bound *= favour[candidates]
        best: tuple[float, int, _Choice] | None = None
        for i in candidates[np.argsort(-bound, kind="stable")][:config.candidates_per_step]:
            choice = window(int(i), p)
            if choice is None:
                continue
            score = choice.covered(over, n) * min(size[i], need) / (size[i] + latency_bytes)
            if favour is not None:
                score *= favour[i]
            if best is None or score > best[0]:
                best = (score, int(i), choice)
        if best is None:  # nothing hides here: take the span that idles longest around p, unhidden
            best = _unhidden(p, need, free, over, spans, first, last, size, cyclic, n, writes, out_until)
        if best is None:  # every span that could free p is taken: stretch one to its whole idle time
            i = _widen(p, choices, spans, size, cyclic, first, last, n, writes)
            over = None
            for lo, hi in choices[i].freed(n):
                excess[lo:hi] += size[i]
            had_offload = choices[i].offload >= 0
            choices[i] = _full_window(spans[i], writes, out_until)
            if had_offload:  # it copies itself out; the copy it would otherwise reuse is its own
                choices[i] = replace(choices[i], offload=spans[i].first + 1)
            for lo, hi in choices[i].freed(n):
                excess[lo:hi] -= size[i]
            continue
        _, i, choice = best
        choices[i] = choice
        free[i] = False
        span = spans[i]
        landed = 0.0
        if choice.offload >= 0:
            begin = choice.offload_begin if choice.offload_begin >= 0 else start_at[choice.offload]
            d2h.reserve(begin, begin + offload_s[i])
            landed = begin + offload_s[i]
            if not span.cyclic:
                out_until.setdefault(span.storage, []).append((span.first, landed))
        if span.cyclic:
            # Kept in remote memory between steps, the storage has a current copy there from the step's start
            # (once the last step's offload has landed) to its first write: spans before that need no offload.
            out_until.setdefault(span.storage, []).append((-1, max(0.0, landed - total)))
        begin = step.start[choice.prefetch]
        h2d.reserve(begin, begin + prefetch_s[i])
        for lo, hi in choice.freed(n):
            was_over = excess[lo:hi] > 0
            excess[lo:hi] -= size[i]
            if over is not None and (was_over != (excess[lo:hi] > 0)).any():
                over = None
    _reuse_remote_copies(choices, spans, writes)
    if config.early_prefetch:
        _prefetch_early(choices, spans, excess, size, n)
    return _emit(program, spans, choices, int(np.max(budget)), order)


def _reuse_remote_copies(choices: dict[int, _Choice], spans: list[Span], writes) -> None:
    """Drop each chosen span's offload where the storage already has a current copy in remote memory: one an
    earlier chosen span of the step sent out with no write since, or, for a storage kept there between steps
    (a chosen cyclic span), the one sent out after the last step's last write, up to the step's first write.
    Selection reuses a copy made by a span chosen before (``_current_copy``); this catches the spans chosen
    first of the two. Without it, on ``llama3-8b`` training on ``gh200`` at 10% of the peak, 135 parameters
    went out twice a step, 12 GiB of needless offloads."""
    by_storage: dict[int, list[int]] = {}
    for i in choices:
        by_storage.setdefault(spans[i].storage, []).append(i)
    for storage, chosen in by_storage.items():
        w = writes.get(storage, [])
        # The use before the span whose offload made the remote copy (-1: the copy sent out after the previous
        # step's last write), or None while there is none. A span that drops its offload keeps its release:
        # releasing it earlier, where the memory would be free, was slower (gh200 at 10% of the peak: 1.155
        # against 1.143 x bound_s).
        copy_at = -1 if any(spans[i].cyclic for i in chosen) else None
        for i in sorted(chosen, key=lambda i: (spans[i].cyclic, spans[i].first)):  # the cyclic span ends the step
            span, choice = spans[i], choices[i]
            if choice.offload < 0:
                continue
            stale = copy_at is None or bisect.bisect_right(w, span.first) > bisect.bisect_right(w, copy_at)
            if stale:
                copy_at = span.first
            else:
                choices[i] = replace(choice, offload=-1, offload_begin=-1.0)


def _prefetch_early(choices: dict[int, _Choice], spans: list[Span], excess: np.ndarray, size, n: int) -> None:
    """Move each prefetch earlier while the budget allows (``excess`` stays <= 0), keeping prefetches
    in the order of their deadlines so the H2D lane serves them first-due first."""
    floor = 0
    for i in sorted(choices, key=lambda i: (spans[i].last, i)):
        choice = choices[i]
        lowest = max(floor, choice.release + 1 if choice.prefetch >= choice.release else choice.resumes + 1)
        p = choice.prefetch
        if lowest < p:  # the earliest position from which on every position up to p has room for it
            blocked = np.flatnonzero(excess[lowest:p] + size[i] > 0)
            p = lowest + int(blocked[-1]) + 1 if blocked.size else lowest
        if p < choice.prefetch:
            excess[p:choice.prefetch] += size[i]
            choices[i] = replace(choice, prefetch=p)
        floor = choices[i].prefetch


def _unhidden(p, need, free, over, spans, first, last, size, cyclic, n, writes, out_until):
    """The span whose whole idle time around ``p`` relieves the most over-budget time, placed without
    regard to the lanes: out right after its use, back right before its next (the compute stream may
    wait for the copies, but the budget holds)."""
    inside = ~cyclic & (first + 1 <= p) & (p < last)
    wrapped = cyclic & ((first + 1 <= p) | (p < last))
    candidates = np.flatnonzero(free & (inside | wrapped))
    if candidates.size == 0:
        return None
    lo = first[candidates] + 1
    hi = last[candidates]
    idle = np.where(cyclic[candidates], over[n] - over[np.minimum(lo, n)] + over[hi], over[hi] - over[lo])
    i = int(candidates[np.argmax(idle * np.minimum(size[candidates], need))])
    return 0.0, i, _full_window(spans[i], writes, out_until)


def _full_window(span: Span, writes, out_until) -> _Choice:
    """Out right after the use before the span, back right before the use after it."""
    if span.cyclic:
        return _Choice(span.first + 1 if writes.get(span.storage) else -1, span.first + 1, span.last, 0)
    landed = _current_copy(out_until.get(span.storage, ()), span, writes)
    return _Choice(span.first + 1 if landed is None else -1, span.first + 1, span.last)


def _widen(p, choices, spans, size, cyclic, first, last, n, writes) -> int:
    """A chosen span whose whole idle time covers ``p`` but whose window does not: the largest."""
    best = -1
    for i, choice in choices.items():
        span = spans[i]
        idle = (span.first + 1 <= p or p < span.last) if span.cyclic else (span.first + 1 <= p < span.last)
        window = any(lo <= p < hi for lo, hi in choice.freed(n))
        if idle and not window and (best < 0 or size[i] > size[best]):
            best = i
    if best < 0:
        raise InfeasibleBudget(f"no storage can leave the device at op position {p}", -1)
    return best


def _current_copy(out: list[tuple[int, float]] | tuple, span: Span, writes) -> float | None:
    """When the remote copy this span can reuse landed (an earlier chosen span's offload with no write
    of the storage since), or None if the span needs its own offload."""
    w = writes.get(span.storage, [])
    for first, landed in out:
        if first <= span.first:
            k = bisect.bisect_right(w, first)
            if not (k < len(w) and w[k] <= span.first):
                return landed
    return None


def _emit(program, spans: list[Span], choices: dict[int, _Choice], budget: int, order: list[int]) -> Plan:
    """The plan: at each position, offloads, releases, prefetches (first due first) and waits, then the op
    (after the last op, offloads and releases only)."""
    n = len(order)
    offloads: dict[int, list[int]] = {}
    releases: dict[int, list[int]] = {}
    prefetches: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    initial_remote = set()
    for i, choice in choices.items():
        if choice.offload >= 0:
            offloads.setdefault(choice.offload, []).append(i)
        releases.setdefault(choice.release, []).append(i)
        prefetches.setdefault(choice.prefetch, []).append(i)
        waits.setdefault(spans[i].last, []).append(i)
        if spans[i].cyclic:
            initial_remote.add(spans[i].storage)
    computes = compute_instructions(program)
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
    return Plan(program=program, instructions=tuple(instructions), policy=POLICY, budget_bytes=budget,
                initial_remote=frozenset(initial_remote))
