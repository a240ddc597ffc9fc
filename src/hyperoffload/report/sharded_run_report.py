"""What ``hyperoffload run --world N`` reports: one FSDP2-sharded step run for real on N gloo ranks of this machine,
each rank's planned step measured against its unplanned one.

``sharded_run_report(config)`` starts the ranks (``runtime.ranks.run_on_ranks``); each rank, in the same order as
every other (so that their collectives meet):

1. measures the link between the ranks with all-gathers (``runtime.interconnect``): the profile the rank plans on
   is the cpu-emulated one as one node of N devices joined by that link;
2. builds the workload with real random weights (the same seed on every rank), shards it with ``fully_shard`` over
   a 1-D CPU mesh of the group, and captures its own step on the group (``capture.sharded``): the graph's
   collectives are gloo's;
3. warms up (the same number of unplanned steps on every rank, from the slowest rank's step time) and measures
   the executor's costs (``runtime.measure.for_executor``); rank 0's calibrated profile is then every rank's, so
   that the ranks plan alike;
4. plans its step under the budget (``report.run_report.run_report``), checks that every rank holds the same plan
   (``same_plan.check_same_plan``: ranks that differ fail with ``PlanMismatch`` rather than wait on each other),
   and runs the unplanned and the planned steps over an emulated link, in the same order on every rank.

``ShardedRunReport.as_dict()`` is the object ``run --world N --json`` prints; ``sharded_run_summary`` the table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from hyperoffload.hardware import Hardware
from hyperoffload.runtime.interconnect import Interconnect
from hyperoffload.runtime.measure import WARM_UP_S, RunConfig
from hyperoffload.runtime.ranks import RankSetup, run_on_ranks
from hyperoffload.units import format_bandwidth, format_bytes, format_seconds

WARM_UP_STEPS_MAX = 50
"""The most unplanned steps a rank runs to warm up before the executor's costs are measured."""


class InjectedFault(RuntimeError):
    """Raised by the rank ``ShardedRunConfig.fault_rank`` names (a testing aid)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedRunConfig:
    """What every rank runs: the step, the budget, the emulated link and the run."""

    workload: str
    """A built-in workload's name."""
    mode: str
    """``"train"`` or ``"prefill"`` (FSDP2 shards those)."""
    world: int
    """Ranks (processes), 2 or more."""
    budget: str | int
    """Each rank's device budget: bytes, or text (``"50%"`` of the rank's no-offload peak, ``"hideable"``)."""
    hardware: Mapping[str, Any]
    """The cpu-emulated profile with the emulated link's bandwidths and latencies, as ``profile_fields`` gives it
    (a profile does not pickle)."""
    batch: int | None = None
    seq: int | None = None
    policy: str = "hyperoffload"
    static_layout: bool = False
    """Plan with a static layout and run the planned steps from its arena (hyperoffload only)."""
    run_config: RunConfig = RunConfig()
    threads: int = 1
    """torch compute threads of each rank."""
    warm_up_s: float = WARM_UP_S
    """Seconds of unplanned steps each rank runs before the executor's costs are timed (``runtime.measure``'s
    "Warm-up" says why), counted in steps of the slowest rank so that every rank runs as many."""
    timeout_s: float = 300.0
    """The gloo group's timeout (seconds; ``runtime.ranks.RankSetup``)."""
    fault_rank: int | None = None
    """A testing aid: this rank raises ``InjectedFault`` as its first planned step starts (the other ranks are then
    inside that step, waiting in its first collective). None: no fault."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankResult:
    """One rank's measured run (bytes, seconds)."""

    rank: int
    plan_digest: str
    """The plan's digest (``plans.plan_digest``): the same on every rank, checked before the first step."""
    interconnect: Interconnect
    """The link between the ranks, as measured (the same on every rank)."""
    run: Mapping[str, Any]
    """The rank's ``RunReport.as_dict()``: the figures ``run`` prints for an unsharded step."""

    @property
    def measured_peak_bytes(self) -> int:
        return self.run["measured_peak_bytes"]

    @property
    def budget_bytes(self) -> int:
        return self.run["budget_bytes"]

    @property
    def max_abs_diff(self) -> float:
        """Largest difference of the planned step's outputs and updated state from the unplanned FSDP2 step's."""
        return self.run["max_abs_diff"]

    @property
    def exact(self) -> bool:
        return self.max_abs_diff == 0.0

    @property
    def feasible(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    def as_dict(self) -> dict:
        return {"rank": self.rank, **self.run, "exact": self.exact, "plan_digest": self.plan_digest}


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedRunReport:
    """Every rank's measured run of one sharded step."""

    config: ShardedRunConfig
    ranks: tuple[RankResult, ...]

    @property
    def interconnect(self) -> Interconnect:
        return self.ranks[0].interconnect

    @property
    def exact(self) -> bool:
        """Whether every rank's planned step equals its unplanned step bit for bit."""
        return all(r.exact for r in self.ranks)

    @property
    def feasible(self) -> bool:
        """Whether every rank's measured peak stayed within its budget."""
        return all(r.feasible for r in self.ranks)

    def as_dict(self) -> dict:
        """The object ``hyperoffload run --world N --json`` prints."""
        c, link = self.config, self.config.hardware
        return {"workload": c.workload, "mode": c.mode, "world": c.world, "policy": c.policy,
                "budget": str(c.budget), "link_bw": link["h2d_bw"], "copy_latency_s": link["h2d_latency_s"],
                "threads_per_rank": c.threads, "steps": c.run_config.steps, "static_layout": c.static_layout,
                "backend": "gloo", **self.interconnect.as_dict(), "exact": self.exact, "feasible": self.feasible,
                "ranks": [r.as_dict() for r in self.ranks]}


def profile_fields(hardware: Hardware) -> dict[str, Any]:
    """``hardware``'s fields as plain values that pickle (a profile's tables are read-only mappings, which do
    not); ``profile_from_fields`` makes the profile again."""
    return {f.name: dict(value) if isinstance(value, Mapping) else value
            for f in dataclasses.fields(hardware) for value in (getattr(hardware, f.name),)}


def profile_from_fields(fields: Mapping[str, Any]) -> Hardware:
    """The profile ``profile_fields`` gave ``fields`` of."""
    return Hardware(**{name: MappingProxyType(dict(value)) if isinstance(value, Mapping) else value
                       for name, value in fields.items()})


def sharded_run_report(config: ShardedRunConfig, *,
                       on_line: Callable[[int, str], None] = lambda rank, text: None) -> ShardedRunReport:
    """Run ``config``'s step on ``config.world`` gloo ranks (the module docstring says what each does) and return
    every rank's figures; ``on_line(rank, text)`` hears each rank's progress. Raises ``runtime.ranks.RankFailed``
    if any rank fails (all are stopped then)."""
    setup = RankSetup(world=config.world, threads=config.threads, timeout_s=config.timeout_s)
    results = run_on_ranks(_rank_run, config, setup, on_line=on_line)
    return ShardedRunReport(config=config, ranks=tuple(results))


def _rank_run(rank: int, config: ShardedRunConfig, say: Callable[[str], None]) -> RankResult:
    """One rank's part of ``sharded_run_report``, in its own process with the group initialized."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperoffload.planning import resolve_budget
    from hyperoffload.policies import PlannerConfig
    from hyperoffload.report.run_report import run_report
    from hyperoffload.runtime.interconnect import measure_interconnect
    from hyperoffload.runtime.measure import executor_dispatch_s, executor_issue_s, for_executor
    from hyperoffload.same_plan import check_same_plan
    from hyperoffload.workloads import capture_workload, get_workload

    say("measuring the link between the ranks (gloo all-gathers)...")
    link = measure_interconnect()
    say(f"link between the ranks: {format_bandwidth(link.bw)} each way, {format_seconds(link.latency_s)} per ring "
        f"step")
    profile = link.on(profile_from_fields(config.hardware))
    say(f"capturing this rank's {config.mode} step of {config.workload} (FSDP2 over {config.world} ranks, real "
        f"weights)...")
    mesh = init_device_mesh("cpu", (config.world,))
    captured = capture_workload(get_workload(config.workload), config.mode, batch=config.batch, seq=config.seq,
                                fake=False, world=config.world, mesh=mesh)
    program = captured.program
    steps = _warm_up(captured, config.warm_up_s)
    say(f"warmed up ({steps} unplanned steps); measuring the executor's costs per op and per cache instruction...")
    calibrated = for_executor(profile, program, executor_dispatch_s(), executor_issue_s(), inputs=captured.inputs,
                              warm_up_s=0.0)
    shared = [profile_fields(calibrated)]
    dist.broadcast_object_list(shared, src=0)  # rank 0's costs on every rank: the ranks must plan alike
    calibrated = profile_from_fields(shared[0])
    budget = resolve_budget(config.budget, program, calibrated)
    if rank == 0 and budget.hideable_note:
        say(f"note: {budget.hideable_note}")
    digests: list[str] = []
    report = run_report(captured, calibrated, profile, budget.budget_bytes, policy=config.policy,
                        config=PlannerConfig(static_layout=True) if config.static_layout else None,
                        run_config=config.run_config, threads=config.threads, stage=say,
                        progress=_fault(config.fault_rank) if rank == config.fault_rank else None,
                        check_plan=lambda plan: digests.append(check_same_plan(plan)))
    say(f"done: peak {format_bytes(report.figures.measured_peak_bytes)} of {format_bytes(report.budget_bytes)}, "
        f"max_abs_diff {report.figures.max_abs_diff:g}")
    return RankResult(rank=rank, plan_digest=digests[0], interconnect=link, run=report.as_dict())


def _warm_up(captured, warm_up_s: float) -> int:
    """Warm this rank up with unplanned steps before the executor's costs are timed (a fresh process runs its first
    second or so of small ops slower: ``runtime.measure.WARM_UP_S``), as many on every rank: two, and more until
    the slowest rank's step time fills ``warm_up_s`` seconds, at most ``WARM_UP_STEPS_MAX``. Returns how many it
    ran."""
    import time

    import torch
    import torch.distributed as dist

    from hyperoffload.plans import plan_without_offload
    from hyperoffload.runtime import run_plan

    plan = plan_without_offload(captured.program)
    for _ in range(2):
        start = time.perf_counter()
        run_plan(plan, [t.clone() for t in captured.inputs])
    step_s = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    more = min(WARM_UP_STEPS_MAX - 2, max(0, math.ceil(warm_up_s / max(float(step_s), 1e-6)) - 2))
    for _ in range(more):
        run_plan(plan, [t.clone() for t in captured.inputs])
    return 2 + more


def _fault(rank: int) -> Callable[[str, int, int], None]:
    def progress(phase: str, done: int, total: int) -> None:
        if phase == "planned step, checked" and done == 0:
            raise InjectedFault(f"injected fault on rank {rank} as its first planned step starts")

    return progress


def sharded_run_summary(report: ShardedRunReport, *, budget_text: str) -> Group:
    """``report`` for people: a row per rank, then a sentence on whether every rank met its budget and matched
    the unplanned step."""
    c, link = report.config, report.interconnect
    budget = format_bytes(report.ranks[0].budget_bytes)
    table = Table(title=f"{c.workload} {c.mode}, FSDP2 over {c.world} gloo ranks, {c.policy}, budget {budget} "
                        f"({budget_text}) per rank, emulated link {format_bandwidth(c.hardware['h2d_bw'])} each way; "
                        f"ranks joined by {format_bandwidth(link.bw)} (measured), {c.threads} thread(s) each",
                  title_justify="left")
    for column in ("rank", "measured_peak_bytes", "budget_bytes", "max_abs_diff", "wall_s", "unplanned_wall_s",
                   "sim_step_s", "sim_error", "moved per step"):
        table.add_column(column, justify="left" if column in ("rank", "moved per step") else "right")
    for r in report.ranks:
        run = r.run
        table.add_row(str(r.rank), format_bytes(r.measured_peak_bytes) + ("" if r.feasible else " OVER"),
                      format_bytes(r.budget_bytes), f"{r.max_abs_diff:g}" + ("" if r.exact else " DIFFERS"),
                      format_seconds(run["wall_s"]), format_seconds(run["unplanned_wall_s"]),
                      format_seconds(run["sim_step_s"]), f"{run['sim_error']:.3f}",
                      f"{format_bytes(run['h2d_bytes'])} in, {format_bytes(run['d2h_bytes'])} out")
    if report.exact and report.feasible:
        verdict = (f"Every rank ran the same plan (digest {report.ranks[0].plan_digest[:12]}) within its budget, "
                   f"bit-identical to the unplanned FSDP2 step.")
    else:
        bad = [f"rank {r.rank} " + " and ".join(([] if r.feasible else ["went over its budget"])
                                                 + ([] if r.exact else ["differs from the unplanned step"]))
               for r in report.ranks if not (r.exact and r.feasible)]
        verdict = "; ".join(bad) + "."
    return Group(table, Text(verdict))


__all__ = ["InjectedFault", "RankResult", "ShardedRunConfig", "ShardedRunReport", "profile_fields",
           "profile_from_fields", "sharded_run_report", "sharded_run_summary"]
