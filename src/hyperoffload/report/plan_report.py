"""What ``hyperoffload plan`` reports about one plan: its simulated figures, memory layout and bounds.

``plan_report`` plans a step (``planning.plan_checked``), then measures the plan against the bounds no plan can
beat and replays its memory through the static arena and the caching allocator model. ``PlanReport.as_dict()``
is the object ``plan --json`` prints; the CLI prints the same report as tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hyperoffload.allocator_model import fragmentation_figures
from hyperoffload.analysis.link_bound import link_bound
from hyperoffload.analysis.traffic_bound import traffic_bound
from hyperoffload.analysis.window_bound import window_bound
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.planning import plan_checked
from hyperoffload.report.figures import step_fields, step_title
from hyperoffload.plans import Plan, plan_digest, remote_bytes
from hyperoffload.policies import PlannerConfig
from hyperoffload.simulate import Figures, Timeline
from hyperoffload.units import format_bytes
from hyperoffload.variants import has_remote_kv, kv_placement


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanReport:
    """One policy's verified plan of a step, with its figures and bounds (seconds, bytes)."""

    program: Program
    """The step as captured (a decode step with a remote-KV form: the on-device form; ``plan.program`` is the
    form the plan runs)."""
    hardware: Hardware
    policy: str
    plan: Plan
    timeline: Timeline
    budget_bytes: int
    plan_s: float
    """Wall time the policy took to plan (seconds)."""
    memory: dict
    """The static arena and caching-allocator replay at the budget (``allocator_model.fragmentation_figures``)."""
    window_bound_s: float
    """No plan in this plan's op order can step faster at this budget (``analysis.window_bound``)."""
    free_budget_bytes: int
    """Below this budget no plan in this op order can offload for free."""
    link_bound_s: float
    """No plan in any op order can step faster (of this form of the step: ``analysis.link_bound``)."""
    traffic_bound_s: float | None
    """What has to cross the link at all in this op order, as time (a linear program); None when no plan in this
    order meets the budget."""

    @property
    def figures(self) -> Figures:
        return self.timeline.figures

    @property
    def feasible(self) -> bool:
        """Whether the plan stays within the budget (a policy such as ``none`` may not)."""
        return self.figures.peak_bytes <= self.budget_bytes

    @property
    def kv(self) -> dict:
        """Where the plan's step keeps its KV cache (``variants.kv_placement``; empty without one)."""
        return kv_placement(self.plan.program)

    @property
    def bound_scope(self) -> str:
        """Which plans ``link_bound_s`` holds against, in words."""
        if not has_remote_kv(self.program):
            return "no plan in any order"
        where = "remote" if self.kv.get("kv") == "remote" else "on the device"
        return f"no plan of this form of the step (its KV cache {where}), in any order,"

    @property
    def title(self) -> str:
        program = self.program
        title = (f"{step_title(program)} on {self.hardware.name}, {self.policy}, budget "
                 f"{format_bytes(self.budget_bytes)}")
        if self.figures.steady_state:
            title += " (two consecutive steps: state stays in remote memory between them)"
        return title

    def as_dict(self) -> dict:
        """The object ``hyperoffload plan --json`` prints (docs/figures.md names each figure)."""
        program = self.program
        return {**step_fields(program), "hardware": self.hardware.name, "policy": self.policy, **self.figures.as_dict(),
                "budget_bytes": self.budget_bytes, "feasible": self.feasible, "plan_s": self.plan_s,
                "device_memory_bytes": self.hardware.memory_bytes, "instructions": len(self.plan.instructions),
                "static_layout": self.plan.layout is not None, "window_bound_s": self.window_bound_s,
                "traffic_bound_s": self.traffic_bound_s, "link_bound_s": self.link_bound_s,
                "free_budget_bytes": self.free_budget_bytes, **self.remote, **self.memory, **self.kv,
                "plan_digest": plan_digest(self.plan)}

    @property
    def remote(self) -> dict:
        """Remote memory the plan needs: ``remote_bytes`` for this step (one rank's, for a sharded step), and for
        a step sharded over ranks, ``remote_bytes_per_node`` for the ranks sharing one node's host memory
        (``ranks_per_node``), against the profile's ``host_memory_bytes`` (0: not stated)."""
        per_rank = remote_bytes(self.plan)
        world = self.program.meta.get("world", 1)
        if world == 1:
            return {"remote_bytes": per_rank}
        ranks = min(world, self.hardware.devices_per_node)
        return {"remote_bytes": per_rank, "ranks_per_node": ranks, "remote_bytes_per_node": per_rank * ranks,
                "host_memory_bytes": self.hardware.host_memory_bytes}


def plan_report(program: Program, hardware: Hardware, budget: int | str, *, policy: str = "hyperoffload",
                config: PlannerConfig | None = None,
                stage: Callable[[str], None] = lambda text: None) -> PlanReport:
    """Plan ``program`` with ``policy`` under ``budget`` (bytes or text, as ``hyperoffload.plan`` takes it), verify
    and simulate it, and measure it against the bounds; ``stage(text)`` hears each step as it starts."""
    budget_text = format_bytes(budget) if isinstance(budget, int) else budget
    stage(f"Planning {len(program.ops):,} ops for {budget_text} on {hardware.name}...")
    planned = plan_checked(program, hardware, budget, policy=policy, config=config)
    plan, budget_bytes = planned.plan, planned.budget_bytes
    stage("Laying out memory and replaying the caching allocator...")
    # At the budget asked for, whatever the policy's plan claims (``none`` claims none); frees ordered by the
    # simulated copies.
    memory = fragmentation_figures(plan, budget_bytes, planned.timeline)
    window = window_bound(plan.program, hardware, budget_bytes, plan.compute_order())
    any_order = link_bound(plan.program, hardware, budget_bytes).seconds
    stage("Bounding what has to cross the link in this order (a linear program)...")
    traffic = traffic_bound(plan.program, hardware, budget_bytes, plan.compute_order()).seconds
    return PlanReport(program=program, hardware=hardware, policy=policy, plan=plan, timeline=planned.timeline,
                      budget_bytes=budget_bytes, plan_s=planned.plan_s, memory=memory,
                      window_bound_s=window.seconds, free_budget_bytes=window.free_budget_bytes,
                      link_bound_s=any_order, traffic_bound_s=traffic if math.isfinite(traffic) else None)


__all__ = ["PlanReport", "plan_report"]
