"""Offload policies: functions Program x Hardware x budget (bytes) -> Plan."""

from collections.abc import Callable

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program, ValueKind
from hyperoffload.plans import Plan, plan_without_offload
from hyperoffload.policies.common import fit_budget
from hyperoffload.policies.distance import DistanceConfig, plan_distance
from hyperoffload.policies.hyperoffload import InfeasibleBudget, PlannerConfig, minimum_budget, plan_hyperoffload
from hyperoffload.policies.kv_naive import plan_kv_naive
from hyperoffload.policies.layerwise import LayerwiseConfig, plan_layerwise
from hyperoffload.policies.paged import plan_paged
from hyperoffload.policies.reactive import ReactiveConfig, plan_reactive
from hyperoffload.policies.xla_hidden import XlaHiddenConfig, plan_xla_hidden
from hyperoffload.policies.zero_infinity import ZeroInfinityConfig, plan_zero_infinity
from hyperoffload.variants import has_remote_kv

Policy = Callable[[Program, Hardware, int], Plan]


def plan_none(program: Program, hardware: Hardware, budget_bytes: int) -> Plan:
    """No offload: the step as captured, with the budget attached when its peak fits it. Otherwise the plan
    has no budget and its peak is what the step needs."""
    return fit_budget(plan_without_offload(program), budget_bytes)


POLICIES: dict[str, Policy] = {"hyperoffload": plan_hyperoffload, "none": plan_none, "reactive": plan_reactive,
                               "distance": plan_distance, "zero-infinity": plan_zero_infinity,
                               "layerwise": plan_layerwise, "xla-hidden": plan_xla_hidden, "kv-naive": plan_kv_naive,
                               "paged": plan_paged}
BASELINES = tuple(name for name in POLICIES if name != "hyperoffload")
"""Every policy but ours, in the order tables list them."""
KV_ONLY = frozenset({"kv-naive", "paged"})
"""Policies that move only a KV cache: on a step without one they are the captured step, so comparisons
of such steps leave them out unless asked for."""


def policies_for(program: Program) -> list[str]:
    """The registered policies that apply to ``program``: all of them, less those that move only a KV
    cache when the step has none, and ``paged`` when the step has no remote-KV form."""
    has_kv = any(program.values[v].kind is ValueKind.KV_CACHE for v in program.inputs)
    # ``paged`` pages NSA's selected blocks: it needs the step's remote-KV form.
    return [name for name in POLICIES
            if (has_kv or name not in KV_ONLY) and (name != "paged" or has_remote_kv(program))]


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None


__all__ = ["BASELINES", "KV_ONLY", "POLICIES", "DistanceConfig", "InfeasibleBudget", "LayerwiseConfig",
           "PlannerConfig", "Policy", "ReactiveConfig", "XlaHiddenConfig", "ZeroInfinityConfig", "get_policy",
           "minimum_budget", "policies_for", "plan_distance", "plan_hyperoffload", "plan_kv_naive", "plan_layerwise",
           "plan_paged",
           "plan_none", "plan_reactive", "plan_xla_hidden", "plan_zero_infinity"]
