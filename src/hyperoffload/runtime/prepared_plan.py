"""What a step of a plan needs that does not depend on the tensors, worked out once for many steps.

``prepare_plan`` checks the plan (``PlanError`` if invalid) and precomputes, per value and per instruction,
what the interpreter reads at every step: storage ids, fx nodes, last reads, the bytes each instruction
allocates, and whether the plan can run step after step on its own state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from hyperoffload.host_optimizer import refuse_host_ops
from hyperoffload.instructions import alloc_bytes, inputs_end_on_device
from hyperoffload.plans import Kind, Plan, PlanCheck, check_plan, owned_outputs
from hyperoffload.remote_layout import RemoteLayout, remote_layout
from hyperoffload.runtime.arena import ArenaSlots


@dataclass(frozen=True, slots=True, eq=False)
class PreparedPlan:
    """What every step of a plan needs that does not depend on the tensors (``prepare_plan``)."""

    plan: Plan
    checked: PlanCheck
    storage_of: tuple[int, ...]
    """Storage id of every value."""
    nodes: dict[str, torch.fx.Node]
    last_read: tuple[int, ...]
    """Index of the last instruction reading each value (-1 if none)."""
    alloc: tuple[int, ...]
    """Bytes each instruction allocates in the plan's accounting (what must fit under the budget)."""
    repeatable: str | None
    """Why the plan cannot run step after step on its own state, or None if it can."""
    remote: RemoteLayout
    """Where each OFFLOAD's remote copy lives in the step's host buffer (``remote_layout``)."""
    arena: ArenaSlots | None = None
    """The arena layout to run from, when asked for (``with_arena``)."""


def prepare_plan(plan: Plan) -> PreparedPlan:
    """Check ``plan`` (``PlanError`` if invalid) and precompute what running it needs; reuse it across steps."""
    program = plan.program
    refuse_host_ops(plan)  # a host-optimizer form: simulated only, the runtime has no host lane
    if program.graph is None:
        raise ValueError(f"program {program.name} has no fx graph to execute; build it with a capture function")
    checked = check_plan(plan)
    values = program.values
    last_read = [-1] * len(values)
    for i, ins in enumerate(plan.instructions):
        if ins.kind is Kind.COMPUTE:
            for v in program.ops[ins.target].inputs:
                last_read[v] = i
    op_alloc = [sum(values[o].alloc_bytes for o in owned) for owned in owned_outputs(program)]
    alloc = alloc_bytes(program, plan.instructions, op_alloc)
    return PreparedPlan(plan=plan, checked=checked, storage_of=tuple(v.storage for v in values),
                        nodes={n.name: n for n in program.graph.graph.nodes}, last_read=tuple(last_read),
                        alloc=tuple(alloc), repeatable=_why_not_repeatable(plan),
                        remote=remote_layout(plan))


def _why_not_repeatable(plan: Plan) -> str | None:
    """Why ``plan`` cannot run on its own results (it leaves an input in another tier than it starts in)."""
    program = plan.program
    moved = [program.values[s].name for s, here in inputs_end_on_device(plan).items()
             if here != (s not in plan.initial_remote)]
    if not moved:
        return None
    return (f"the plan leaves {moved[0]} (and {len(moved) - 1} more) in a different tier than it starts in, so "
            f"it cannot run step after step on its own state; run it in place (donate=False) or add the missing "
            f"prefetch or offload")
