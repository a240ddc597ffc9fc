"""``verify(plan)``: the invariants of ``docs/invariants.md``, checked on a plan and on its simulation.

Statically (``check_plan``): every op reads values that are on the device; a prefetch follows a
finished offload; nothing still needed is released without a remote copy; the budget holds in plan
order. With a hardware profile, also on the simulated timeline, independently of how the simulator
enforces them: every prefetch starts after the offload it reads from has landed, every op that reads
a prefetched value starts after the prefetch landed, and device memory never exceeds the budget (which copy each
kind reads and writes, and what it waits on, is read from ``instructions.RULES``).
A plan with a static layout also has it checked: no two live storages share bytes, and the arena fits
the budget. Errors name the policy that made the plan.
"""

from __future__ import annotations

from hyperoffload.hardware import Hardware
from hyperoffload.instructions import COMPUTE, RULES, Tier, WaitsOn, stream_of
from hyperoffload.layout import LayoutError, check_layout, residencies
from hyperoffload.plans import Kind, Plan, PlanCheck, PlanError, check_plan
from hyperoffload.simulate import Timeline, simulate

_TOLERANCE_S = 1e-12


class VerificationError(AssertionError):
    """A plan breaks an invariant; the message names the policy and the instruction."""


def verify(plan: Plan, hardware: Hardware | None = None) -> Timeline | None:
    """Check ``plan``; with ``hardware`` also simulate it and check the timeline. Returns the timeline."""
    try:
        checked = check_plan(plan)
    except PlanError as error:
        raise VerificationError(f"plan from policy {plan.policy!r} is invalid: {error}") from error
    if plan.layout is not None:
        _check_layout(plan, checked)
    if hardware is None:
        return None
    timeline = simulate(plan, hardware)
    _check_timeline(plan, timeline)
    return timeline


def _check_layout(plan: Plan, checked: PlanCheck) -> None:
    """A plan's static layout covers exactly its residencies, never places two live ones on the same
    bytes, and fits its budget."""
    layout = plan.layout
    if layout.residencies != tuple(residencies(plan, checked)):
        raise VerificationError(f"plan from policy {plan.policy!r}: its layout does not match its allocations")
    try:
        check_layout(layout)
    except LayoutError as error:
        raise VerificationError(f"plan from policy {plan.policy!r}: {error}") from error
    if plan.budget_bytes is not None and layout.arena_bytes > plan.budget_bytes:
        raise VerificationError(f"plan from policy {plan.policy!r}: its arena of {layout.arena_bytes} bytes is over "
                                f"its budget of {plan.budget_bytes}")


def _check_timeline(plan: Plan, timeline: Timeline) -> None:
    # Interval indices refer to the simulated plan (two steps of ``plan`` in steady state).
    program, instrs = timeline.plan.program, timeline.plan.instructions
    fail = lambda i, why: VerificationError(  # noqa: E731
        f"plan from policy {plan.policy!r}, instruction #{i} ({instrs[i].describe(program)}): {why}")
    budget = plan.budget_bytes
    if budget is not None and timeline.figures.peak_bytes > budget:
        raise VerificationError(f"plan from policy {plan.policy!r} reaches {timeline.figures.peak_bytes} bytes on "
                                f"the device, over its budget of {budget}")
    by_instruction = {iv.instruction: iv for iv in timeline.intervals}
    # (tier, storage) -> when the latest copy into that tier's copy of the storage landed, and the kind that made it
    # (a copy, or a lane op's compute, whose outputs land on the device).
    landed: dict[tuple[Tier, int], tuple[float, Kind]] = {}
    finished_op: dict[int, float] = {}  # op id -> when it finished (this step's copy of it, in steady state)
    for i, ins in enumerate(instrs):
        interval = by_instruction.get(i)
        if interval is None:
            continue
        assert interval.stream == stream_of(program, ins)  # instructions.RULES
        rule = RULES[ins.kind]
        if rule.copies:
            filled = landed.get((rule.reads, ins.target))
            if rule.waits_on is WaitsOn.FILLER and filled is not None and interval.start + _TOLERANCE_S < filled[0]:
                raise fail(i, f"the {ins.kind.value} starts before the {filled[1].value} it reads from has landed")
            landed[(rule.writes, ins.target)] = (interval.end, ins.kind)
        elif ins.kind is Kind.COMPUTE and program.ops[ins.target].stream != COMPUTE:
            op = program.ops[ins.target]
            what = "collective" if op.collective is not None else "lane op"
            for d in program.dependencies()[op.id]:
                before = finished_op.get(d)
                if before is not None and interval.start + _TOLERANCE_S < before:
                    raise fail(i, f"the {what} starts before {program.ops[d].name}, which it depends on, has finished")
            finished_op[op.id] = interval.end
            for v in op.outputs:
                landed[(rule.writes, program.values[v].storage)] = (interval.end, ins.kind)
        elif ins.kind is Kind.COMPUTE:
            op = program.ops[ins.target]
            finished_op[op.id] = interval.end
            for s in {program.values[v].storage for v in op.inputs}:
                filled = landed.get((rule.reads, s))
                # A view waits for no side op (simulate.side_waits): the ops that read it wait instead.
                if op.is_view and filled is not None and filled[1] is Kind.COMPUTE:
                    continue
                if filled is not None and interval.start + _TOLERANCE_S < filled[0]:
                    raise fail(i, f"starts before the prefetch of {program.values[s].name} has landed")
