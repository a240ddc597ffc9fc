"""Several policies on one step, hardware profile and budget; and sweeps of one quantity.

Each policy plans the same Program for the same budget; every plan is verified (``verify``) and
simulated on the same profile, and its figures are those of ``docs/figures.md``. A policy that
does not meet the budget is reported, not dropped: ``feasible`` is False and ``peak_bytes`` is what
it needs (the HyperOffload planner, which refuses budgets below the smallest it can meet, is shown
planned at that smallest budget). ``excess_bytes``, ``bound_s`` and ``duplex_bound_s`` are always
those of the compared budget, so rows can be read against each other; ``window_bound_s`` is the
fastest any plan in the same op order could step at that budget (``analysis.window_bound``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hyperoffload.analysis import memory_profile, window_bound
from hyperoffload.budgets import parse_budget
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.ir import Program
from hyperoffload.host_memory import HostMemoryNeed, host_memory_need
from hyperoffload.plans import Plan, check_plan
from hyperoffload.planning import plan_checked
from hyperoffload.policies import InfeasibleBudget, policies_for
from hyperoffload.simulate import Timeline, budget_bounds
from hyperoffload.units import format_bytes, parse_bandwidth


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyResult:
    """One policy's plan for the compared budget, verified and simulated."""

    program: Program
    """The step as given to ``compare`` (the plan may run another form of it: ``plan.program``)."""
    hardware: Hardware
    policy: str
    budget_bytes: int
    """The compared budget (bytes); the plan itself may carry another (see ``feasible``)."""
    feasible: bool
    """Whether the plan's device memory stays within ``budget_bytes``, in plan order and simulated, and what it keeps
    in host memory within a node's (``host_memory``)."""
    plan_s: float
    """Wall time the policy took to plan (seconds, a real CPU timing)."""
    plan: Plan
    timeline: Timeline
    note: str = ""
    """Why the budget is not met, when it is not."""
    window_bound_s: float | None = None
    """The fastest any plan in this plan's op order could step at the compared budget
    (``analysis.window_bound``); None when the plan does not meet the budget."""
    host_memory: HostMemoryNeed | None = None
    """What the plan keeps in host memory, per rank and per node, against a node's (None: not measured)."""

    @property
    def step_s(self) -> float:
        return self.timeline.figures.step_s

    @property
    def misses(self) -> str:
        """What keeps the plan from the budget, in a few words ("" when it meets it): the device bytes it needs, or
        the host memory a node would need for it."""
        if self.feasible:
            return ""
        peak = self.timeline.figures.peak_bytes
        if peak <= self.budget_bytes and self.host_memory is not None and not self.host_memory.fits:
            return f"keeps {format_bytes(self.host_memory.per_node)} in a node's host memory"
        return f"needs {format_bytes(peak)}"

    def as_dict(self) -> dict:
        """The row ``compare --json`` prints: the step (``workload``, ``mode``) and profile (``hardware``), then the
        figures of ``docs/figures.md`` with ``policy``, ``feasible`` and ``budget_bytes``, and last the step's ranks
        (``world``)."""
        figures = self.timeline.figures.as_dict()
        return {"workload": self.program.meta.get("workload", self.program.name), "mode": self.program.mode,
                "hardware": self.hardware.name, "policy": self.policy, "feasible": self.feasible, **figures,
                "budget_bytes": self.budget_bytes,
                "plan_s": self.plan_s, "instructions": len(self.plan.instructions), "note": self.note,
                "window_bound_s": self.window_bound_s,
                "host_memory_fits": self.host_memory is None or self.host_memory.fits,
                "world": self.program.meta.get("world", 1)}


_REFUSALS = 4
"""How many budgets a policy that refuses budgets below its smallest is tried at before giving up."""


def run_policy(program: Program, hardware: Hardware, budget_bytes: int, policy: str,
               peak_bytes: int | None = None) -> PolicyResult:
    """Plan ``program`` with ``policy`` for ``budget_bytes``, verify the plan and simulate it on ``hardware``."""
    note = ""
    start = time.perf_counter()
    target = budget_bytes
    for _ in range(_REFUSALS):
        attempt = time.perf_counter()
        try:
            # Every policy is shown, and one that keeps more in host memory than a node has is marked below.
            planned = plan_checked(program, hardware, target, policy=policy, host_memory=False)
            break
        except InfeasibleBudget as error:
            if error.min_budget_bytes <= target:
                raise
            # Show what it needs: plan at the smallest budget it names (which may name a larger one again).
            target = error.min_budget_bytes
            note = f"refuses the budget; planned at the smallest it can meet ({target} bytes)"
    else:
        raise InfeasibleBudget(f"{policy} refused {_REFUSALS} budgets in a row, the last {target} bytes", target)
    plan, timeline = planned.plan, planned.timeline
    plan_s = attempt - start + planned.plan_s  # the refused budgets' planning too, not the verification
    peak = max(check_plan(plan).peak_bytes, timeline.figures.peak_bytes)
    feasible = peak <= budget_bytes
    if not feasible and not note:
        note = "does not meet the budget: the peak shown is what it needs"
    host = host_memory_need(plan, hardware)
    if not host.fits:
        feasible = False
        note = "; ".join(filter(None, (note, f"keeps {format_bytes(host.per_node)} in a node's host memory, more "
                                             f"than its {format_bytes(host.host_memory_bytes)}")))

    timeline = _with_budget_figures(timeline, plan, program, hardware, budget_bytes, peak_bytes)
    window = None
    if feasible:
        window = window_bound(plan.program, hardware, budget_bytes, plan.compute_order()).seconds
    return PolicyResult(program=program, hardware=hardware, policy=policy, budget_bytes=budget_bytes,
                        feasible=feasible, plan_s=plan_s, plan=plan, timeline=timeline, note=note,
                        window_bound_s=window, host_memory=host)


def _with_budget_figures(timeline: Timeline, plan: Plan, program: Program, hardware: Hardware, budget: int,
                         peak_bytes: int | None) -> Timeline:
    """``timeline`` of ``plan`` whose figures state the compared budget's excess (from ``program``'s peak)
    and bounds (a plan that does not meet the budget was simulated without one, or with the one it could
    meet)."""
    f = timeline.figures
    if f.budget_bytes == budget:
        return timeline
    peak = memory_profile(program).peak_bytes if peak_bytes is None else peak_bytes
    # The compute stream, the network and the host each run their ops one at a time (as ``simulate`` bounds them).
    busiest = max(f.compute_s, f.network_s, f.host_s)
    excess, bound, duplex = budget_bounds(plan.program, hardware, busiest, budget, peak)
    return replace(timeline, figures=replace(f, budget_bytes=budget, excess_bytes=excess, bound_s=bound,
                                             duplex_bound_s=duplex))


def compare(program: Program, hardware: Hardware | str, budget: int | str,
            policies: Sequence[str] | None = None) -> list[PolicyResult]:
    """Every policy in ``policies`` (default: those that apply to the step on ``hardware``, ``policies_for``) for
    the same budget, in that order. ``hardware`` is a profile or its name; ``budget`` is
    bytes, or text as ``plan`` takes it (``"40GiB"``, ``"50%"``, ``"hideable"``)."""
    hardware = as_hardware(hardware)
    budget_bytes = parse_budget(budget, program, hardware)
    names = policies_for(program, hardware) if policies is None else list(policies)
    peak = memory_profile(program).peak_bytes
    return [run_policy(program, hardware, budget_bytes, name, peak) for name in names]


# --- sweeps -------------------------------------------------------------------------------------------

Setting = Callable[[Program, Hardware, str, str], tuple[Hardware, int, float]]
"""(program, hardware, budget text, value text) -> (hardware, budget bytes, x for plotting)."""


def _vary_h2d(program: Program, hardware: Hardware, budget: str, value: str) -> tuple[Hardware, int, float]:
    varied = hardware.replace(h2d_bw=parse_bandwidth(value))
    return varied, parse_budget(budget, program, varied), varied.h2d_bw


def _vary_d2h(program: Program, hardware: Hardware, budget: str, value: str) -> tuple[Hardware, int, float]:
    varied = hardware.replace(d2h_bw=parse_bandwidth(value))
    return varied, parse_budget(budget, program, varied), varied.d2h_bw


def _vary_budget(program: Program, hardware: Hardware, budget: str, value: str) -> tuple[Hardware, int, float]:
    budget_bytes = parse_budget(value, program, hardware)
    return hardware, budget_bytes, float(budget_bytes)


def _vary_nsa_block(program: Program, hardware: Hardware, budget: str, value: str) -> tuple[Hardware, int, float]:
    # ``program`` is already the step captured at this block size (``sweep``'s ``recapture``).
    return hardware, parse_budget(budget, program, hardware), float(value)


VARIES: dict[str, tuple[Setting, str]] = {
    "h2d-bw": (_vary_h2d, "host-to-device bandwidth (bytes/s)"),
    "d2h-bw": (_vary_d2h, "device-to-host bandwidth (bytes/s)"),
    "budget": (_vary_budget, "device-memory budget (bytes)"),
    "nsa-block": (_vary_nsa_block, "NSA selection block (tokens)"),
}
"""What a sweep can vary: how one value sets up the hardware and budget, and the x axis's meaning."""
RECAPTURED = frozenset({"nsa-block"})
"""Varied quantities that change the step itself: ``sweep`` needs a ``recapture`` for them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepPoint:
    """The comparison at one value of the varied quantity."""

    vary: str
    """What the sweep varies (a key of ``VARIES``)."""
    value: str
    """The value as given (``"16GB/s"``, ``"60%"``)."""
    x: float
    """The value in base units (bytes/s or bytes)."""
    hardware: Hardware
    results: tuple[PolicyResult, ...]

    def rows(self) -> list[dict]:
        """The rows ``sweep --json`` prints for this value, one per policy: ``PolicyResult.as_dict`` with what is
        varied, its value as given and ``x``."""
        return [{"workload": row["workload"], "mode": row["mode"], "hardware": row["hardware"], "vary": self.vary,
                 "value": self.value, "x": self.x, **row} for row in (r.as_dict() for r in self.results)]


def sweep(program: Program, hardware: Hardware | str, *, vary: str, values: Sequence[str], budget: str | None,
          policies: Sequence[str] | None = None,
          recapture: Callable[[str], Program] | None = None) -> list[SweepPoint]:
    """``compare`` at each of ``values`` of ``vary`` (a key of ``VARIES``). The budget text is parsed at each
    point against that point's profile and step (so ``hideable`` follows the bandwidth, and a percentage the
    step's own peak); unused when varying the budget. A quantity of the step itself (``RECAPTURED``) takes
    ``recapture(value)``, the step captured at that value."""
    hardware = as_hardware(hardware)
    if vary not in VARIES:
        raise ValueError(f"cannot vary {vary!r}; choose one of: {', '.join(VARIES)}")
    if not values:
        raise ValueError("a sweep needs at least one value, e.g. --values 8GB/s,16GB/s,32GB/s")
    if budget is None and vary != "budget":
        raise ValueError(f"varying {vary} needs a --budget (bytes, a percentage or hideable)")
    if vary in RECAPTURED and recapture is None:
        raise ValueError(f"varying {vary} changes the step: it needs a recapture function")
    setting, _ = VARIES[vary]
    points = []
    for value in values:
        step = recapture(value.strip()) if vary in RECAPTURED else program
        varied, budget_bytes, x = setting(step, hardware, budget or "", value.strip())
        points.append(SweepPoint(vary=vary, value=value.strip(), x=x, hardware=varied,
                                 results=tuple(compare(step, varied, budget_bytes, policies))))
    return points


__all__ = ["VARIES", "PolicyResult", "SweepPoint", "compare", "run_policy", "sweep"]
