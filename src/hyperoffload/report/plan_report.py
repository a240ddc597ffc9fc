"""What ``hyperoffload plan`` reports about one plan: its simulated figures, memory layout and bounds.

``plan_report`` plans a step (``planning.plan_checked``), then measures the plan against the bounds no plan can
beat and replays its memory through the static arena and the caching allocator model. ``PlanReport.as_dict()``
is the object ``plan --json`` prints; ``plan_summary`` is the same report as ``plan`` prints it for people.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Group
from rich.text import Text

from hyperoffload.allocator_model import fragmentation_figures
from hyperoffload.analysis import memory_profile
from hyperoffload.analysis.link_bound import link_bound
from hyperoffload.analysis.traffic_bound import traffic_bound
from hyperoffload.analysis.window_bound import window_bound
from hyperoffload.hardware import Hardware
from hyperoffload.host_memory import host_memory_need
from hyperoffload.ir import Program
from hyperoffload.planning import plan_checked
from hyperoffload.report.figures import console_text, figures_table, step_fields, step_title
from hyperoffload.plans import Plan, plan_digest
from hyperoffload.policies import PlannerConfig
from hyperoffload.simulate import Figures, Timeline
from hyperoffload.units import format_bytes, format_seconds
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
        need = host_memory_need(self.plan, self.hardware)
        if self.program.meta.get("world", 1) == 1:
            return {"remote_bytes": need.per_rank}
        return {"remote_bytes": need.per_rank, "ranks_per_node": need.ranks_per_node,
                "remote_bytes_per_node": need.per_node, "host_memory_bytes": need.host_memory_bytes}


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


def plan_summary(report: PlanReport) -> Group:
    """``report`` for people: the figures table, then where the KV cache is (a step that keeps it remote), the
    plan's memory in an arena and under the caching allocator, and the simulated step against the bounds (or the
    budget the policy does not meet)."""
    lines = [*_kv_lines(report), _memory_line(report)]
    if not report.feasible:  # a policy may not meet the budget (``none`` never offloads): say so
        lines.append(console_text(f"[yellow]policy {report.policy} does not meet the budget: it needs "
                                  f"{format_bytes(report.figures.peak_bytes)}, the budget is "
                                  f"{format_bytes(report.budget_bytes)}[/yellow]"))
    elif report.figures.bound_s is not None:
        lines.append(_bounds_line(report))
    return Group(figures_table(report.figures, title=report.title, hardware=report.hardware), *lines)


def _kv_lines(report: PlanReport) -> list[Text]:
    """Where a plan that keeps the KV cache remote keeps it, and which peak its figures are measured from."""
    kv, figures = report.kv, report.figures
    if kv.get("kv") != "remote":
        return []
    pool = "no block pool" if kv["pool_blocks"] is None else f"a block pool of {kv['pool_blocks']} blocks per " \
        f"sequence and layer"
    if kv["speculative"]:
        pool = "no block pool: each layer prefetches its previous selection before it selects"
    # The figures are of the step as it runs, with the cache remote: its excess is measured from that form's
    # peak, and the blocks it fetches are in bound_s as the step's own traffic. Say so, or "excess_bytes 0 B"
    # reads as if nothing had to leave.
    return [console_text(f"KV cache: in remote memory, {pool}; a step fetches {kv['fetch_share']:.1%} of its selected "
                         f"blocks (stated reselection {kv['reselection']}); step_s / dependency_bound_s = "
                         f"{figures.step_s / figures.dependency_bound_s:.3f}", highlight=False),
            console_text(f"excess_bytes and bound_s are measured from this form's no-offload peak, "
                         f"{format_bytes(memory_profile(report.plan.program).peak_bytes)}, with the selected blocks' "
                         f"traffic in bound_s; with the KV cache on the device the step peaks at "
                         f"{format_bytes(memory_profile(report.program).peak_bytes)}", highlight=False)]


def _memory_line(report: PlanReport) -> Text:
    """The plan's memory in one static arena and under the caching allocator model, at the budget."""
    memory, budget = report.memory, report.budget_bytes
    arena = "the plan's static arena" if report.plan.layout is not None else "a static arena would take"
    over = ""
    if memory["arena_bytes"] > budget:
        over = f", [yellow]{format_bytes(memory['arena_bytes'] - budget)} over the budget"
        over += (": --static-layout plans for one that fits[/yellow]" if report.policy == "hyperoffload"
                 else "[/yellow]")
    return console_text(f"memory: {arena} {format_bytes(memory['arena_bytes'])} ({memory['arena_stalls']} stalls)"
                        f"{over}; the caching allocator model reserves "
                        f"{format_bytes(memory['allocator_reserved_bytes'])} with {memory['allocator_stalls']} "
                        f"free-and-retry stalls and {memory['allocator_failures']} out-of-memory failures at this "
                        f"budget")


def _bounds_line(report: PlanReport) -> Text:
    """The simulated step over each bound no plan can beat, and the budget below which no plan offloads for free."""
    step_s, figures = report.figures.step_s, report.figures
    window, traffic, any_order = report.window_bound_s, report.traffic_bound_s, report.link_bound_s
    return console_text(
        f"planned in {report.plan_s:.1f} s; step_s / bound_s = {step_s / figures.bound_s:.3f}, step_s / "
        f"lower_bound_s = {step_s / figures.lower_bound_s:.3f}, step_s / window_bound_s = {step_s / window:.3f} (no "
        f"plan in this op order can beat window_bound_s {format_seconds(window)}, nor traffic_bound_s "
        f"{format_seconds(traffic)}, what has to cross the link at all; step_s / traffic_bound_s = "
        f"{step_s / traffic:.3f}); below {format_bytes(report.free_budget_bytes)} no plan in this order can offload "
        f"for free; {report.bound_scope} can beat link_bound_s {format_seconds(any_order)} (step_s / link_bound_s = "
        f"{step_s / any_order:.3f})")


__all__ = ["PlanReport", "plan_report", "plan_summary"]
