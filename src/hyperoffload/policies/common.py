"""What the baseline policies share: cache instructions placed at op positions, and the budget verdict.

Baselines decide *where* in the captured order each offload, release, prefetch and wait goes
(position ``p``: just before the op at position ``p``; ``len(program.ops)``: after the last op).
``emit_plan`` interleaves them with the computes. A baseline models a system that does not plan
against the budget (or cannot meet it), so whether its plan fits is found afterwards: ``fit_budget``
attaches the budget to a plan whose own accounting stays within it, and otherwise returns the plan
without one, so that its peak reports what the policy needs (``compare`` shows it as not feasible).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from hyperoffload.instructions import RULES
from hyperoffload.ir import Program, Value
from hyperoffload.plans import Instr, Kind, Plan, check_plan

_RANK = {kind: rule.emit_rank for kind, rule in RULES.items() if rule.emit_rank is not None}
"""Order within one position, per instruction kind (``KindRule.emit_rank``, smaller first): copies out first (they
read what the previous op wrote), then releases (memory back before anything new is allocated), then prefetches,
then the waits right before the op."""


@dataclass(frozen=True, slots=True)
class Placed:
    """A cache instruction for ``storage`` just before the op at ``position`` of the captured order."""

    position: int
    kind: Kind
    storage: int
    order: int = 0
    """Tie-break among instructions of the same kind at one position (smaller first), e.g. a deadline."""


def emit_plan(program: Program, placed: Iterable[Placed], *, policy: str, budget_bytes: int,
              initial_remote: frozenset[int] = frozenset()) -> Plan:
    """The plan with ``placed`` interleaved with the computes in captured order, budget attached if met."""
    n = len(program.ops)
    at: list[list[tuple[int, int, int, Placed]]] = [[] for _ in range(n + 1)]
    for k, item in enumerate(placed):
        if not 0 <= item.position <= n:
            raise ValueError(f"{policy}: instruction placed at position {item.position}, outside 0..{n}")
        at[item.position].append((_RANK[item.kind], item.order, k, item))
    instructions: list[Instr] = []
    for p in range(n + 1):
        instructions.extend(Instr(item.kind, item.storage) for *_, item in sorted(at[p], key=lambda e: e[:3]))
        if p < n:
            instructions.append(Instr(Kind.COMPUTE, p))
    plan = Plan(program=program, instructions=tuple(instructions), policy=policy, initial_remote=initial_remote)
    return fit_budget(plan, budget_bytes)


def fit_budget(plan: Plan, budget_bytes: int) -> Plan:
    """``plan`` with ``budget_bytes`` attached if its own accounting never exceeds it; otherwise ``plan``
    without a budget: its peak is then what the policy needs (checked and simulated without a limit)."""
    return replace(plan, budget_bytes=budget_bytes) if check_plan(plan).peak_bytes <= budget_bytes else plan


def elements(value: Value) -> int:
    """Elements of a tensor (the unit DeepSpeed's limits are stated in)."""
    return math.prod(value.shape)


def written_between(writes: list[int], lo: int, hi: int) -> bool:
    """Whether any position in ``writes`` (ascending) lies in ``[lo, hi]``."""
    k = bisect.bisect_left(writes, lo)
    return k < len(writes) and writes[k] <= hi


__all__ = ["Placed", "elements", "emit_plan", "fit_budget", "written_between"]
