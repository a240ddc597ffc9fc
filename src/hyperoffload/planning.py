"""Parse the budget, pick the policy, plan, verify: the one way every caller turns a step into a checked plan.

``hyperoffload.plan`` returns the plan; ``plan_checked`` also returns what planning measured (the budget in
bytes, the planning time, the simulated timeline). The ``torch.compile`` backend, ``train_step``, ``compare``
and the CLI all plan through ``plan_checked``. A budget as written becomes the bytes a plan is made for through
``budgets.parse_budget`` (``plan_checked`` and a caller that needs the bytes before planning: ``compare``, which
plans every policy for the same bytes); ``resolve_budget`` adds what a report says about them (the hideable
budget's note, whether the device holds it), for the CLI.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hyperoffload.budgets import hideable_note, parse_budget
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.host_memory import check_host_memory
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """A device-memory budget as written, resolved on one step and hardware profile."""

    text: str
    """The budget as written (``"40GiB"``, ``"50%"``, ``"hideable"``), stripped; for bytes given as an int, the
    number."""
    budget_bytes: int
    """What it comes to on this step and profile (bytes): what ``plan_checked`` plans for."""
    device_memory_bytes: int
    """The profile's device memory (bytes)."""
    hideable_note: str | None = None
    """For ``"hideable"``: why it came to the smallest budget the planner can meet rather than the one the link
    sets (``budgets.hideable_note``); None otherwise."""

    @property
    def over_device(self) -> bool:
        """Whether the budget is more than the device has: a plan for it is then a what-if that does not fit."""
        return self.budget_bytes > self.device_memory_bytes

    def as_dict(self) -> dict:
        """The budget as written and resolved, with ``over_device``."""
        return {"budget": self.text, "budget_bytes": self.budget_bytes,
                "device_memory_bytes": self.device_memory_bytes, "over_device": self.over_device,
                "hideable_note": self.hideable_note}


def resolve_budget(budget: int | str, program: Program, hardware: Hardware | str) -> Budget:
    """``budget`` (bytes, or text: ``"40GiB"``, ``"50%"`` of ``program``'s no-offload peak, ``"hideable"`` on
    ``hardware``, a profile or its name) resolved on this step and profile; a ``ValueError`` names a budget that
    does not read as one or is out of range (``budgets.parse_budget``)."""
    hardware = as_hardware(hardware)
    budget_bytes = parse_budget(budget, program, hardware)
    text = budget.strip() if isinstance(budget, str) else str(budget)
    note = hideable_note(program, hardware) if text.lower() == "hideable" else None
    return Budget(text=text, budget_bytes=budget_bytes, device_memory_bytes=hardware.memory_bytes,
                  hideable_note=note)


def plan_checked(program: Program, hardware: Hardware | str, budget: int | str, *, policy: str = "hyperoffload",
                 config: PlannerConfig | None = None, passes: Sequence[PlanPass] = (),
                 simulate: bool = True, host_memory: bool = True) -> Planned:
    """Plan ``program`` on ``hardware`` (a profile or its name) under ``budget`` (bytes, or text: ``"40GiB"``,
    ``"50%"`` of the no-offload peak, ``"hideable"``) with ``policy``, run ``passes`` on the plan, and verify it
    (``simulate``: also simulate it on ``hardware`` and check the timeline). ``config`` tunes the hyperoffload
    planner (another policy takes none). ``host_memory``: refuse a plan that keeps more in host memory than a node
    of ``hardware`` has (``host_memory.HostMemoryExceeded``; nothing to check where the profile states none)."""
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
    if host_memory:
        check_host_memory(plan, hardware)
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


__all__ = ["Budget", "PlanPass", "Planned", "plan", "plan_checked", "resolve_budget"]
