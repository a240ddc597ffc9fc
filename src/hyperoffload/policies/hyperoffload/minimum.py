"""The smallest budget the planner can meet: what each position holds whatever it offloads, and which op sets it.

Every op's own inputs and outputs stay on the device, and a storage can leave only across a span of at least one op
between two of its uses, and only if it is a candidate (``PlannerConfig.min_span_bytes``; near the smallest budget
also ``PlannerConfig.small_storage_bytes`` and the scalars).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hyperoffload.ir import Program
from hyperoffload.memo import per_program
from hyperoffload.plans import check_plan, plan_without_offload
from hyperoffload.policies.hyperoffload.config import InfeasibleBudget, PlannerConfig, PositionBudget
from hyperoffload.policies.hyperoffload.orders import candidate_orders
from hyperoffload.policies.spans import Span, Uses, idle_spans, storage_uses
from hyperoffload.units import format_bytes
from hyperoffload.variants import has_remote_kv, remote_kv_variant, smallest_pool_variant, speculative_variant


@dataclass(frozen=True, slots=True)
class OrderFacts:
    """What planning in one execution order starts from (positions in ``order``; bytes)."""

    order: list[int]
    live: np.ndarray
    """Device bytes at each position with no offload (``check_plan``'s accounting)."""
    uses: Uses
    spans: list[Span]
    min_span_bytes: int
    scalars: bool = False
    """Whether the 0-dim storages are candidates too, however small (``idle_spans``): with the smaller storages
    (``with_smaller_storages``)."""


def _min_span_bytes(config: PlannerConfig, live: np.ndarray, *, small: bool) -> int:
    """The smallest candidate storage (bytes): the configured one, else a share of the peak, with ``small`` no more
    than ``PlannerConfig.small_storage_bytes``."""
    if config.min_span_bytes is not None:
        return config.min_span_bytes
    share = int(live.max()) // config.min_span_parts if live.size else 0
    return min(share, config.small_storage_bytes) if small else share


def _with_scalars(config: PlannerConfig) -> bool:
    """Whether the smaller storages' candidates take the 0-dim storages too: unless ``PlannerConfig.min_span_bytes``
    is set. A scalar moves for one copy's latency. An optimizer's step-dependent factors (AdamW's bias corrections)
    are scalars computed once and read by every update: in an order that hoists updates into the backward pass they
    stay on the device across all of it, and without them as candidates that order needs their bytes more than the
    captured order at the smallest budget, so that only the captured one could plan there."""
    return config.min_span_bytes is None


def order_facts(program: Program, order: Sequence[int], config: PlannerConfig, *, small: bool = True) -> OrderFacts:
    """What planning in ``order`` starts from. With ``small``, the candidates are the most this planner takes
    (``PlannerConfig.small_storage_bytes``, and the scalars)."""
    order = list(order)
    live = np.asarray(check_plan(plan_without_offload(program, order)).live_bytes, dtype=np.int64)
    min_span_bytes = _min_span_bytes(config, live, small=small)
    scalars = small and _with_scalars(config)
    uses = storage_uses(program, order)
    return OrderFacts(order, live, uses, idle_spans(program, uses, min_bytes=min_span_bytes, scalars=scalars),
                      min_span_bytes, scalars)


def with_smaller_storages(program: Program, facts: OrderFacts, config: PlannerConfig) -> OrderFacts | None:
    """``facts`` with storages from ``PlannerConfig.small_storage_bytes`` up and the scalars as candidates; None
    where that takes no more."""
    least = _min_span_bytes(config, facts.live, small=True)
    scalars = _with_scalars(config)
    if least >= facts.min_span_bytes and (facts.scalars or not scalars):
        return None
    return replace(facts, spans=idle_spans(program, facts.uses, min_bytes=least, scalars=scalars),
                   min_span_bytes=least, scalars=scalars)


def minimum_budget(program: Program, config: PlannerConfig = PlannerConfig(),
                   order: Sequence[int] | None = None) -> tuple[int, str]:
    """The smallest budget (bytes) this planner can meet with the ops in ``order``, and what sets it.

    Without an order: the smallest over the execution orders the planner tries (``candidate_orders``) and, for
    a decode step with a remote-KV form (``variants``), over the forms it plans at small budgets (the KV cache
    remote without a pool, with the smallest pool, and with speculative prefetch), which need far less than
    the step as captured once the cache is long: ``plan_hyperoffload`` meets every budget from this one up."""
    if order is not None:
        return smallest_budget(program, order_facts(program, order, config))
    return _least_over_forms(program, config)


@per_program
def _least_over_forms(program: Program, config: PlannerConfig) -> tuple[int, str]:
    """``minimum_budget`` in any order, answered once per program and config (it is asked again for the same program:
    the hideable budget, and then why it is what it is; every row of a table of budgets)."""
    return min((_least_over_orders(form, config, label) for label, form in _small_budget_forms(program)),
               key=lambda r: r[0])


def _least_over_orders(program: Program, config: PlannerConfig, label: str) -> tuple[int, str]:
    least, why = min((minimum_budget(program, config, o) for o in candidate_orders(program, config)),
                     key=lambda r: r[0])
    return least, f"in the step's form {label}, {why}" if label else why


def _small_budget_forms(program: Program) -> list[tuple[str, Program]]:
    """(label, form) of each form ``driver._plan_forms`` may plan at a budget below the captured step's smallest;
    the captured step's label is empty."""
    if not has_remote_kv(program):
        return [("", program)]
    return [("", program),
            ("with the KV cache in remote memory and no block pool", remote_kv_variant(program, None)),
            ("with the KV cache in remote memory and the smallest block pool",
             smallest_pool_variant(program)),
            ("with the KV cache in remote memory and speculative block prefetch", speculative_variant(program))]


def unavoidable_bytes(facts: OrderFacts) -> PositionBudget:
    """Bytes each position of ``facts.order`` (at least one) holds on the device whatever this planner offloads:
    the least budget it can meet there."""
    live = facts.live
    removable = np.zeros(live.size + 1, dtype=np.int64)
    for span in facts.spans:
        removable[span.first + 1] += span.nbytes
        removable[span.last] -= span.nbytes
        if span.cyclic:  # the span wraps: it also covers the step from its start up to the first use
            removable[0] += span.nbytes
            removable[live.size] -= span.nbytes
    return PositionBudget.per_position(live - np.cumsum(removable)[:-1])


def smallest_budget(program: Program, facts: OrderFacts) -> tuple[int, str]:
    """The smallest budget (bytes) planning from ``facts`` meets, and what sets it."""
    if facts.live.size == 0:
        return 0, "the step has no ops"
    unavoidable = unavoidable_bytes(facts)
    p = int(unavoidable.at.argmax())
    op = program.ops[facts.order[p]]
    values = program.values
    working = {values[v].storage for v in (*op.inputs, *op.outputs)}
    own = sum(values[s].alloc_bytes for s in working)
    why = (f"op {op.name} ({op.target}) needs {format_bytes(own)} of its own inputs and outputs on the device, and "
           f"{format_bytes(unavoidable.most - own)} more by storages used by the ops right before and after it "
           f"or smaller than {format_bytes(facts.min_span_bytes)}")
    return unavoidable.most, why


def below_smallest(budget_bytes: int, least: int, why: str) -> InfeasibleBudget:
    """The refusal of a budget below the smallest, ``least`` (bytes), and ``why`` that is the smallest."""
    return InfeasibleBudget(f"a budget of {format_bytes(budget_bytes)} is below the smallest this planner can meet, "
                            f"{format_bytes(least)} ({least} bytes): {why}", least)
