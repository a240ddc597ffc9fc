"""What ``hyperoffload run`` reports: a planned step executed on this machine over an emulated link, measured.

``run_report`` plans a captured step (``planning.plan_checked``) on the executor-calibrated profile, runs the plan
against the unplanned step (``runtime.measure.measure_run``) and, for a decode step whose plan keeps the KV cache
in remote memory, checks that form of the step against the on-device one. ``RunReport.as_dict()`` is the object
``run --json`` prints; ``run_summary`` is the same report as ``run`` prints it for people.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from hyperoffload.analysis import memory_profile
from hyperoffload.capture import Captured
from hyperoffload.hardware import Hardware
from hyperoffload.planning import plan_checked
from hyperoffload.plans import Plan, plan_without_offload
from hyperoffload.policies import PlannerConfig
from hyperoffload.report.figures import console_text
from hyperoffload.runtime import EmulatedLink, run_plan
from hyperoffload.runtime import measure
from hyperoffload.runtime.measure import RunConfig, RunFigures, max_abs_diff
from hyperoffload.simulate import simulate
from hyperoffload.units import format_bandwidth, format_bytes, format_seconds
from hyperoffload.variants import find_captured, kv_placement


@dataclass(frozen=True, slots=True, kw_only=True)
class RunReport:
    """One measured run of a planned step (seconds, bytes)."""

    captured: Captured
    plan: Plan
    policy: str
    budget_bytes: int
    figures: RunFigures
    run_config: RunConfig
    link_bw: float
    """The emulated link's bandwidth each way (bytes per second)."""
    copy_latency_s: float
    threads: int
    """Compute threads the step ran with."""
    launch_s: float
    """The calibrated profile's per-op launch cost (seconds)."""
    sim_step_s_uncalibrated: float
    """The plan simulated on the profile before the executor's dispatch costs were added (seconds)."""
    max_abs_diff_vs_device_kv: float | None = None
    """For a plan of a decode step's remote-KV form: that form's outputs against the on-device cache's, both
    unplanned; None otherwise."""

    @property
    def feasible(self) -> bool:
        """Whether the measured peak stayed within the budget asked for (a policy such as ``none`` may not)."""
        return self.figures.measured_peak_bytes <= self.budget_bytes

    @property
    def exact(self) -> bool:
        """Whether the planned step's outputs equal the unplanned step's bit for bit (and the on-device cache's)."""
        return self.figures.max_abs_diff == 0.0 and self.max_abs_diff_vs_device_kv in (None, 0.0)

    def as_dict(self) -> dict:
        """The object ``hyperoffload run --json`` prints."""
        program = self.captured.program
        result = {"workload": program.meta.get("workload", program.name), "mode": program.mode,
                  "policy": self.policy, "link_bw": self.link_bw, "copy_latency_s": self.copy_latency_s,
                  "threads": self.threads, "steps": self.run_config.steps, **self.figures.as_dict(),
                  "launch_s": self.launch_s, "sim_step_s_uncalibrated": self.sim_step_s_uncalibrated,
                  "budget_bytes": self.budget_bytes, "feasible": self.feasible,
                  "static_layout": self.run_config.arena, **kv_placement(self.plan.program)}
        if self.max_abs_diff_vs_device_kv is not None:
            result["max_abs_diff_vs_device_kv"] = self.max_abs_diff_vs_device_kv
        return result


def run_report(captured: Captured, hardware: Hardware, uncalibrated: Hardware, budget: int | str, *,
               policy: str = "hyperoffload", config: PlannerConfig | None = None,
               run_config: RunConfig = RunConfig(), threads: int,
               stage: Callable[[str], None] = lambda text: None,
               progress: Callable[[str, int, int], None] | None = None,
               check_plan: Callable[[Plan], object] | None = None) -> RunReport:
    """Plan ``captured``'s step on ``hardware`` (the profile with the executor's dispatch costs;
    ``uncalibrated`` without them) under ``budget`` with ``policy``, and measure it over an emulated link of
    ``hardware``'s bandwidths. ``stage(text)`` hears each step as it starts, ``progress(phase, done, total)`` the
    timed steps. ``check_plan(plan)``, if given, is called with the plan before anything runs (the ranks of a
    sharded step check that they all hold the same one: ``same_plan.check_same_plan``). Raises ``BudgetExceeded``
    or ``TransferError`` if the run does."""
    program = captured.program
    stage(f"Planning {len(program.ops):,} ops with {policy}...")
    planned = plan_checked(program, hardware, budget, policy=policy, config=config)
    plan = planned.plan
    if check_plan is not None:
        check_plan(plan)
    # A decode plan may run the step's remote-KV form: its inputs are that capture's.
    form = find_captured(plan.program, program) or captured
    stage("Running the planned and the unplanned step...")
    with EmulatedLink.for_hardware(hardware) as link:
        figures = measure.measure_run(plan, form.inputs, link, hardware, run_config, progress=progress)
    # max_abs_diff compares with the remote form unplanned; close the chain to the on-device cache.
    kv_diff = None if form is captured else _form_diff(captured, plan.program, form)
    return RunReport(captured=captured, plan=plan, policy=policy, budget_bytes=planned.budget_bytes, figures=figures,
                     run_config=run_config, link_bw=hardware.h2d_bw, copy_latency_s=hardware.h2d_latency_s,
                     threads=threads, launch_s=hardware.launch_s,
                     sim_step_s_uncalibrated=simulate(plan, uncalibrated).figures.step_s,
                     max_abs_diff_vs_device_kv=kv_diff)


def _form_diff(captured: Captured, variant, form: Captured) -> float:
    """Largest difference of the step's outputs between its captured form and another form of it (the
    remote-KV decode step), each run unplanned on fresh copies of its own inputs."""
    device = run_plan(plan_without_offload(captured.program), [t.clone() for t in captured.inputs]).outputs
    other = run_plan(plan_without_offload(variant), [t.clone() for t in form.inputs]).outputs
    return max_abs_diff(list(other), list(device))


def run_summary(report: RunReport, *, budget_text: str) -> Group:
    """``report`` for people: a table of the measured and simulated figures, titled with the budget as written
    (``budget_text``), then one sentence on what moving the bytes cost against the unplanned step and what the
    simulator predicted."""
    return Group(_run_table(report, budget_text), _run_sentence(report))


def _run_table(report: RunReport, budget_text: str) -> Table:
    """The measured figures, each against what it is measured from (the unplanned step, the simulator, the budget)."""
    figures, budget, policy = report.figures, report.budget_bytes, report.policy
    program, run_config = report.captured.program, report.run_config
    table = Table(title=f"{program.name} {program.mode}, {policy}, budget {format_bytes(budget)} "
                        f"({budget_text}), emulated link {format_bandwidth(report.link_bw)} each way",
                  title_justify="left")
    for column in ("figure", "value", "note"):
        table.add_column(column)
    table.add_row("wall_s", format_seconds(figures.wall_s),
                  f"median of {run_config.steps} steps; fastest {format_seconds(figures.wall_min_s)}")
    table.add_row("unplanned_wall_s", format_seconds(figures.unplanned_wall_s), "the same step without offloading")
    table.add_row("sim_step_s", format_seconds(figures.sim_step_s),
                  f"simulated; compute alone {format_seconds(figures.sim_compute_s)}")
    table.add_row("sim_error", f"{figures.sim_error:.3f}", f"{figures.sim_error_min:.3f} against the fastest step")
    table.add_row("measured_peak_bytes", format_bytes(figures.measured_peak_bytes),
                  f"budget {format_bytes(budget)}: within" if report.feasible else
                  f"over the budget of {format_bytes(budget)}: policy {policy} does not meet it")
    if run_config.arena:
        table.add_row("arena_bytes", format_bytes(figures.arena_bytes),
                      f"the one buffer the planned steps ran from ({format_bytes(report.plan.layout.live_peak_bytes)} "
                      f"live at peak)")
        table.add_row("arena_copied_bytes", format_bytes(figures.arena_copied_bytes),
                      "op results made outside the arena and copied in (no out= form); the rest are written "
                      "into their slots")
    table.add_row("max_abs_diff", f"{figures.max_abs_diff:g}",
                  "bit-identical to the unplanned step" if figures.max_abs_diff == 0.0
                  else "DIFFERS from the unplanned step")
    kv_diff = report.max_abs_diff_vs_device_kv
    if kv_diff is not None:
        kv = kv_placement(report.plan.program)
        pool = "speculative prefetch" if kv["speculative"] else "no pool" if kv["pool_blocks"] is None \
            else f"a pool of {kv['pool_blocks']} blocks"
        table.add_row("max_abs_diff_vs_device_kv", f"{kv_diff:g}",
                      f"KV cache in remote memory ({pool}): outputs "
                      + ("bit-identical to the on-device cache's" if kv_diff == 0.0
                         else "DIFFER from the on-device cache's"))
    table.add_row("moved per step", f"{format_bytes(figures.h2d_bytes)} in, {format_bytes(figures.d2h_bytes)} out",
                  f"waited {format_seconds(figures.copy_wait_s)} for copies, {format_seconds(figures.memory_wait_s)} "
                  f"for memory")
    return table


def _run_sentence(report: RunReport) -> Text:
    """What the bytes moved bought (the peak kept down) and cost (time against the unplanned step), measured and
    simulated."""
    figures = report.figures
    peak = memory_profile(report.captured.program).peak_bytes
    moved = f"{format_bytes(figures.h2d_bytes)} each way" if figures.h2d_bytes == figures.d2h_bytes else \
        f"{format_bytes(figures.h2d_bytes)} in and {format_bytes(figures.d2h_bytes)} out"
    return console_text(
        f"Moving {moved} per step kept the step at {format_bytes(figures.measured_peak_bytes)} "
        f"({figures.measured_peak_bytes / peak:.0%} of its {format_bytes(peak)} peak), "
        f"{figures.wall_s / figures.unplanned_wall_s:.2f}x the unplanned step's time; the simulator predicted "
        f"{figures.sim_step_s / figures.sim_compute_s:.2f}x (its planned step over its unplanned one, which is the "
        f"compute alone).", highlight=False)


__all__ = ["RunReport", "run_report", "run_summary"]
