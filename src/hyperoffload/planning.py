"""Parse the budget, pick the policy, plan, verify: the one way every caller turns a step into a checked plan.

``hyperoffload.plan`` returns the plan; ``plan_checked`` also returns what planning measured (the budget in
bytes, the planning time, the simulated timeline). The ``torch.compile`` backend, ``train_step``, ``compare``
and the CLI all plan through ``plan_checked``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hyperoffload.budgets import parse_budget
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Plan
from hyperoffload.policies import PlannerConfig, get_policy, plan_hyperoffload
from hyperoffload.simulate import Timeline
from hyperoffload.verify import verify

PlanPass = Callable[[Plan], Plan]
"""A pure function from a plan to a plan, run on the policy's plan before it is verified."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """A verified plan and what planning it measured."""

    plan: Plan
    budget_bytes: int
    """The budget the plan was made for (bytes; a percentage or ``"hideable"`` resolved on the step)."""
    plan_s: float
    """Wall time the policy and the passes took (seconds, a real CPU timing; verification not included)."""
    timeline: Timeline | None
    """The plan simulated on the hardware (and checked against the simulation); None when not asked for."""


def plan_checked(program: Program, hardware: Hardware | str, budget: int | str, *, policy: str = "hyperoffload",
                 config: PlannerConfig | None = None, passes: Sequence[PlanPass] = (),
                 simulate: bool = True) -> Planned:
    """Plan ``program`` on ``hardware`` (a profile or its name) under ``budget`` (bytes, or text: ``"40GiB"``,
    ``"50%"`` of the no-offload peak, ``"hideable"``) with ``policy``, run ``passes`` on the plan, and verify it
    (``simulate``: also simulate it on ``hardware`` and check the timeline). ``config`` tunes the hyperoffload
    planner (another policy takes none)."""
    hardware = as_hardware(hardware)
    planner = get_policy(policy)
    if config is not None:
        if policy != "hyperoffload":
            raise ValueError(f"a PlannerConfig tunes the hyperoffload planner; policy {policy!r} takes none")
        planner = _configured(config)
    budget_bytes = parse_budget(budget, program, hardware)
    start = time.perf_counter()
    plan = planner(program, hardware, budget_bytes)
    for plan_pass in passes:
        plan = plan_pass(plan)
    plan_s = time.perf_counter() - start
    timeline = verify(plan, hardware if simulate else None)
    return Planned(plan=plan, budget_bytes=budget_bytes, plan_s=plan_s, timeline=timeline)


def plan(program: Program, hardware: Hardware | str, budget: int | str, *, policy: str = "hyperoffload",
         config: PlannerConfig | None = None) -> Plan:
    """Plan ``program`` on ``hardware`` (a profile or its name) under ``budget`` (bytes, or text such as
    ``"40GiB"``, ``"50%"``, ``"hideable"``) with ``policy``; returns a verified ``hyperoffload.plans.Plan``."""
    return plan_checked(program, hardware, budget, policy=policy, config=config, simulate=False).plan


def _configured(config: PlannerConfig) -> Callable[[Program, Hardware, int], Plan]:
    def planner(program: Program, hardware: Hardware, budget_bytes: int) -> Plan:
        return plan_hyperoffload(program, hardware, budget_bytes, config=config)

    return planner


__all__ = ["PlanPass", "Planned", "plan", "plan_checked"]
