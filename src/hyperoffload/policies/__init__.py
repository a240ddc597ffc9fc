"""Offload policies: functions Program x Hardware x budget (bytes) -> Plan."""

from collections.abc import Callable

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program, ValueKind
from hyperoffload.plans import Plan, plan_without_offload
from hyperoffload.policies.common import fit_budget
from hyperoffload.host_optimizer import is_sharded_training
from hyperoffload.policies.distance import DistanceConfig, plan_distance
from hyperoffload.policies.fsdp_cpu_offload import plan_fsdp_cpu_offload
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
                               "paged": plan_paged, "fsdp-cpu-offload": plan_fsdp_cpu_offload}
BASELINES = tuple(name for name in POLICIES if name != "hyperoffload")
"""Every policy but ours, in the order tables list them."""
KV_ONLY = frozenset({"kv-naive", "paged"})
"""Policies that move only a KV cache: on a step without one they are the captured step, so comparisons
of such steps leave them out unless asked for."""
SHARDED_ONLY = frozenset({"fsdp-cpu-offload"})
"""Policies that model a sharded training step only (``host_optimizer.is_sharded_training``): they refuse any other
step, so comparisons leave them out of others."""
HOST_COMPUTE = frozenset({"fsdp-cpu-offload", "zero-infinity"})
"""Policies that run a sharded training step's optimizer on the host CPU: on such a step they need the profile's
host memory bandwidth (``Hardware.host_mem_bw``) and refuse a profile without one."""


def policies_for(program: Program, hardware: Hardware | None = None) -> list[str]:
    """The registered policies that apply to ``program``: all of them, less those that move only a KV
    cache when the step has none, ``paged`` when the step has no remote-KV form, those of sharded training steps
    (``SHARDED_ONLY``) on any other step, and, on a sharded training step and a ``hardware`` profile that states no
    host memory bandwidth, those that compute on the host (``HOST_COMPUTE``, which would refuse it)."""
    has_kv = any(program.values[v].kind is ValueKind.KV_CACHE for v in program.inputs)
    sharded = is_sharded_training(program)
    no_host = sharded and hardware is not None and not hardware.host_mem_bw
    # ``paged`` pages NSA's selected blocks: it needs the step's remote-KV form.
    return [name for name in POLICIES
            if (has_kv or name not in KV_ONLY) and (name != "paged" or has_remote_kv(program))
            and (sharded or name not in SHARDED_ONLY) and not (no_host and name in HOST_COMPUTE)]


def computes_on_host(policy: str, program: Program) -> bool:
    """Whether ``policy``'s plans of ``program`` run ops on the host CPU (``HOST_COMPUTE`` on a sharded training
    step): such plans are simulated only, as the runtime has no host lane (``host_optimizer.refuse_host_ops``)."""
    return policy in HOST_COMPUTE and is_sharded_training(program)


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None


__all__ = ["BASELINES", "HOST_COMPUTE", "KV_ONLY", "POLICIES", "SHARDED_ONLY", "DistanceConfig", "InfeasibleBudget",
           "LayerwiseConfig", "PlannerConfig", "Policy", "ReactiveConfig", "XlaHiddenConfig", "ZeroInfinityConfig",
           "computes_on_host", "get_policy", "minimum_budget", "policies_for", "plan_distance", "plan_fsdp_cpu_offload", "plan_hyperoffload",
           "plan_kv_naive", "plan_layerwise", "plan_paged",
           "plan_none", "plan_reactive", "plan_xla_hidden", "plan_zero_infinity"]
