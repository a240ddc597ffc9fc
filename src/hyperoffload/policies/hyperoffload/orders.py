"""The execution orders the planner starts from, their names, and how much of the step's peak the step makes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hyperoffload.analysis import memory_profile
from hyperoffload.ir import Program
from hyperoffload.memo import per_program
from hyperoffload.plans import state_storages
from hyperoffload.policies.hyperoffload.config import PlannerConfig
from hyperoffload.policies.reorder import hoist_updates, overlap_lane_ops, sink_views

Order = tuple[int, ...]
"""Op ids in the order they run."""


@dataclass(frozen=True, slots=True)
class ExecutionOrders:
    """The orders of ``candidate_orders`` by what they are (equal where they coincide)."""

    captured: Order
    anchored: Order
    """Every optimizer update hoisted, in one piece, to where its gradient is final."""
    eager: Order
    """Every optimizer op hoisted as early as its inputs allow."""
    partly: tuple[Order, ...]
    """One per ``PlannerConfig.partly_hoisted`` share: the updates whose gradients are final in that share of the
    backward pass hoisted, the large ones left in the optimizer phase."""

    @property
    def hoisting_small(self) -> Order:
        """The last of ``all()``: the last partly hoisted order (``partly_hoisted``'s share 1.0: every small update
        hoisted), or ``eager`` where ``partly_hoisted`` is empty."""
        return self.all()[-1]

    def all(self) -> tuple[Order, ...]:
        """Captured, anchored, eager, then the partly hoisted ones."""
        return self.captured, self.anchored, self.eager, *self.partly


def candidate_orders(program: Program, config: PlannerConfig = PlannerConfig()) -> list[Order]:
    """Execution orders the planner starts from: the captured one, then the refined ones that differ
    from it (optimizer updates hoisted into the backward pass, see ``reorder``): each update in one piece
    where its gradient is final, and each op as early as its inputs allow. In all, the step's own lane
    ops (a decode step's block fetches) get independent compute to overlap (``overlap_lane_ops``), and each
    view op runs just before the first op that needs it (``sink_views``: a captured step detaches every
    parameter at its start, which would count as a use there).

    The anchored order moves each moment once per step and wins on slow links (PCIe); the eager one
    runs AdamW's gradient-free ``exp_avg_sq.mul_`` at the step's start, so those moments cross twice,
    which a fast link (NVLink-C2C) hides and which then leaves the planner a slightly better schedule. The
    partly hoisted ones (``PlannerConfig.partly_hoisted``) leave the large updates (an output projection's, an
    embedding's) in the optimizer phase and hoist the others whose gradients are final in the first share of the
    backward pass (``reorder.early_updates``): the first layers' only, which on a PCIe-class link at a budget just
    under the peak fills the early backward pass's idle offload direction without crowding the link right after the
    peak, or all of them, which keeps the large states' traffic out of the backward pass at any budget."""
    return list(dict.fromkeys(execution_orders(program, config).all()))


def execution_orders(program: Program, config: PlannerConfig = PlannerConfig()) -> ExecutionOrders:
    """The orders of ``candidate_orders`` by what they are, computed once per program and the config's fields that
    shape them: every search and every smallest-budget question starts here."""
    return _orders_for(program, tuple(share for share, _ in config.partly_hoisted), config.big_state_share,
                       config.lane_lookahead_ops)


@per_program
def _orders_for(program: Program, shares: tuple[float, ...], big_state_share: float,
                lookahead: int) -> ExecutionOrders:
    def finished(order: Order | None) -> Order:
        return sink_views(program, overlap_lane_ops(program, order, lookahead))

    return ExecutionOrders(
        captured=finished(None),
        anchored=finished(hoist_updates(program)),
        eager=finished(hoist_updates(program, anchored=False)),
        partly=tuple(finished(hoist_updates(program, share=share, big_state_share=big_state_share))
                     for share in shares))


def order_name(program: Program, order: Sequence[int], config: PlannerConfig = PlannerConfig()) -> str:
    """Which of ``candidate_orders`` ``order`` is: "captured", "refined" (every update hoisted where its gradient
    is final), "eager" (each op as early as its inputs allow), "partly 15%" (the partly hoisted order of that
    ``PlannerConfig.partly_hoisted`` share), or "other"; where orders coincide, the first of these names."""
    names = ("captured", "refined", "eager", *(f"partly {share:.0%}" for share, _ in config.partly_hoisted))
    return next((name for name, candidate in zip(names, execution_orders(program, config).all())
                 if candidate == tuple(order)), "other")


@per_program
def made_share(program: Program) -> float:
    """Share of the captured no-offload peak held by storages the step makes (not its state)."""
    profile = memory_profile(program)
    state = state_storages(program)
    made = sum(program.values[s].alloc_bytes for s in profile.peak_storages if s not in state)
    return made / profile.peak_bytes if profile.peak_bytes else 0.0
