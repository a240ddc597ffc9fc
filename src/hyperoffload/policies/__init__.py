"""Offload policies: functions Program x Hardware x budget (bytes) -> Plan."""

from collections.abc import Callable

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Plan, plan_without_offload
from hyperoffload.policies.hyperoffload import InfeasibleBudget, PlannerConfig, minimum_budget, plan_hyperoffload

Policy = Callable[[Program, Hardware, int], Plan]


def plan_none(program: Program, hardware: Hardware, budget_bytes: int) -> Plan:
    """No offload: the step as captured. Its peak is what the step needs; a smaller budget is not met."""
    return plan_without_offload(program)


POLICIES: dict[str, Policy] = {"hyperoffload": plan_hyperoffload, "none": plan_none}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "InfeasibleBudget", "PlannerConfig", "Policy", "get_policy", "minimum_budget", "plan_hyperoffload",
           "plan_none"]
