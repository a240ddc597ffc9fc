"""Measure a plan for real: step time, device bytes and exactness against the unplanned step, next to the
simulator's prediction for the same plan.

``measure_run`` runs, on real tensors and over one transfer backend:

1. the unplanned step (``run_plan`` of the no-offload plan) on copies of the inputs: the reference;
2. one planned step in place on other copies, compared with the reference over outputs and updated
   inputs (``max_abs_diff``; 0.0 means bit-identical);
3. the planned step, step after step on donated state with each step's last offloads overlapping the
   next step, as a training loop runs it: ``wall_s`` is the median step time after ``warmup`` steps;
4. in turn with those (rounds of one unplanned step and two planned steps, the second of which is timed),
   the unplanned step through the same executor (``unplanned_wall_s``: what compute alone costs when run
   this way, the simulator's ``compute_s`` as measured), so that load from other work on the machine falls
   on both alike;
5. the simulator on ``hardware`` (for the emulated link: ``cpu-emulated`` at the link's speed):
   ``sim_step_s`` and ``sim_error = |sim_step_s - wall_s| / wall_s``.

Figure names follow ``docs/figures.md``.

**Dispatch calibration.** The ``cpu-emulated`` profile's ``launch_s`` is the cost of one bare aten call
from Python, but the executor pays more per op: it looks up the op's arguments, records its results and counts
their bytes, and it pays that on views too, which the cost model charges nothing because they launch no kernel
on an accelerator. On a step of small ops this alone makes the simulated ``compute_s`` fall well short of what
the executor takes (docs/runtime.md, "Calibrating the simulator to the executor", has the figures and the
command). ``executor_dispatch_s`` measures the executor's cost per op on a synthetic chain of tiny ops
(independent of the workload), and ``for_executor`` sets the profile's ``launch_s`` to it, spread over the ops
that the cost model charges, so the simulated compute stream pays one dispatch per op the executor runs.
``executor_issue_s`` likewise measures what each cache instruction costs the executor's one thread on the
emulated link (issuing the copy, the copy threads' hand-offs, the bookkeeping), which ``for_executor`` sets
as the profile's ``issue_s``.

**Custom operators.** An operator implemented in Python (``hyperoffload::nsa_select``, the cache lane ops of
``hyperoffload.cache_ops``) runs many aten calls and loops; the roofline charges it one kernel. ``for_executor``
measures each such op on the step's own inputs (``custom_op_costs``) and has the profile charge it that
(``hyperoffload.cost.with_measured_op_costs``).

**Op shapes timed through the executor.** Given the step's inputs, ``for_executor`` also runs the unplanned
step (and a decode step's remote-KV forms) through the executor and charges every compute op whose target and
shapes (``cost.op_signature``) ran there its mean time per call, dispatch included (``executor_op_costs``). On
a CPU the roofline misjudges small kernels both ways: attention, batched matmuls and ``arange`` take several
times their roofline, elementwise ops less than the spread dispatch cost; what timing them changes in the
simulator's error is in docs/runtime.md (same section). The dispatch calibration above remains for op shapes
not timed (plans of other forms of the step).

**Warm-up.** A fresh process runs its first second or so of small ops slower (allocator, first-call paths,
clock ramp-up), so the first timing a process makes needs a longer warm-up than later ones. Which timing is
the first is the caller's knowledge, not this module's: ``executor_op_costs`` takes ``warm_up_s``, and
``for_executor`` warms up its first measured form only.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from hyperoffload.cost import with_measured_op_costs
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Plan, plan_without_offload
from hyperoffload.runtime.async_executor import AsyncExecutor
from hyperoffload.runtime.interpreter import run_plan
from hyperoffload.runtime.reference import replayed_random_numbers, wait_for_work
from hyperoffload.runtime.step_results import PlanRun
from hyperoffload.runtime.transfers import Transfers
from hyperoffload.simulate import simulate


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """How many steps ``measure_run`` times."""

    steps: int = 5
    """Timed steps of the planned (and of the unplanned) step, after warm-up."""
    warmup: int = 2
    """Untimed steps first (allocator, caches, copy threads reaching their rhythm)."""
    overlap: bool = True
    """Let a step's last offloads of state overlap the next step, as a training loop does."""
    arena: bool = False
    """Run the planned steps from one arena (``plan.layout``, else ``assign_offsets(plan)``; see
    ``hyperoffload.runtime.arena_step``); the unplanned step runs as always."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be 0 or more, got {self.warmup}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFigures:
    """What ``measure_run`` measured (seconds, bytes)."""

    wall_s: float
    """Median planned step time after warm-up."""
    step_walls_s: tuple[float, ...]
    """Every timed planned step."""
    unplanned_wall_s: float
    """Median step time of the unplanned step through the same executor."""
    wall_min_s: float
    """Fastest timed planned step: on a shared machine, the one least disturbed by other work."""
    unplanned_min_s: float
    """Fastest timed unplanned step."""
    measured_peak_bytes: int
    """Largest device-tier bytes the executor held over every planned step."""
    budget_bytes: int | None
    max_abs_diff: float
    """Largest difference of outputs and updated inputs between the planned and the unplanned step."""
    sim_step_s: float
    """The simulator's ``step_s`` for the plan on ``hardware``."""
    sim_compute_s: float
    """The simulator's ``compute_s`` (the unplanned step's predicted time)."""
    sim_error: float
    """``|sim_step_s - wall_s| / wall_s``."""
    sim_error_min: float
    """``|sim_step_s - wall_min_s| / wall_min_s``: the error against the least disturbed step."""
    h2d_bytes: int
    d2h_bytes: int
    copy_wait_s: float
    """Median per step: time the compute thread waited for copies."""
    memory_wait_s: float
    """Median per step: time the compute thread waited for an offload to free memory under the budget."""
    arena_bytes: int = 0
    """Bytes of the arena the planned step ran from (``RunConfig.arena``); 0 otherwise."""
    arena_copied_bytes: int = 0
    """Bytes of op results the checked step allocated outside the arena and copied in (ops with no usable
    ``out=`` overload); 0 without an arena."""

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def executor_dispatch_s(ops: int = 400, repeats: int = 15) -> float:
    """Seconds the plan executor spends per op on a chain of ``ops`` tiny ops (elementwise ops and views on a
    4-element tensor, whose kernels take next to nothing): the best of ``repeats`` runs."""
    from torch import nn

    from hyperoffload.capture import capture_prefill_step
    from hyperoffload.runtime.interpreter import execute_plan
    from hyperoffload.runtime.prepared_plan import prepare_plan
    from hyperoffload.runtime.transfers import SyncTransfers

    class Chain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for k in range(ops // 4):  # four ops a round on average, a quarter of them views
                x = (x * 1.5 + 0.5).view(2, 2).neg().view(4) if k % 2 else torch.relu(x - 1.0) * 2.0
            return x

    captured = capture_prefill_step(Chain(), (torch.ones(4),), name="dispatch")
    prepared = prepare_plan(plan_without_offload(captured.program))
    transfers = SyncTransfers()
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        run = execute_plan(prepared, list(captured.inputs), transfers)
        best = min(best, run.wall_s)
    return best / len(captured.program.ops)


def executor_issue_s(values: int = 100, repeats: int = 9) -> float:
    """Seconds the plan executor spends per cache instruction on the emulated link: a step of tiny ops that
    makes ``values`` side values and adds them up at the end, run as is and with each side value sent out
    right after it is made and brought back right before it is added (offload, release, prefetch, wait; on
    a link of 1 TB/s the copies have long landed when they are waited for, as in a plan whose copies are
    hidden), the best of ``repeats`` runs each; the difference per cache instruction. It is what issuing
    and the bookkeeping cost the one thread that also runs the ops."""
    from torch import nn

    from hyperoffload.capture import capture_prefill_step
    from hyperoffload.plans import Instr, Kind
    from hyperoffload.runtime.emulated_link import EmulatedLink
    from hyperoffload.runtime.interpreter import execute_plan
    from hyperoffload.runtime.prepared_plan import prepare_plan

    class SideValues(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            sides = []
            for _ in range(values):
                x = torch.relu(x - 1.0) * 1.5
                sides.append(x * 0.5)
            total = sides[0]
            for side in sides[1:]:
                total = total + side
            return total

    captured = capture_prefill_step(SideValues(), (torch.ones(4),), name="issue")
    program = captured.program
    plain = plan_without_offload(program)
    readers: dict[int, list[int]] = {}
    for op in program.ops:
        for v in op.inputs:
            readers.setdefault(v, []).append(op.id)
    # A side value is made by one op and read by one add much later: send it out and back in between.
    away = {v for op in program.ops for v in op.outputs
            if program.values[v].owns_storage and len(readers.get(v, ())) == 1 and readers[v][0] > op.id + 2}
    back_before: dict[int, list[int]] = {}
    for v in sorted(away):
        back_before.setdefault(readers[v][0], []).append(v)
    steps: list[Instr] = []
    for op in program.ops:
        for v in back_before.get(op.id, ()):
            steps += [Instr(Kind.PREFETCH, v), Instr(Kind.WAIT, v)]
        steps.append(Instr(Kind.COMPUTE, op.id))
        for v in op.outputs:
            if v in away:
                steps += [Instr(Kind.OFFLOAD, v), Instr(Kind.RELEASE, v)]
    trips = Plan(program=program, instructions=tuple(steps))
    issued = sum(i.kind is not Kind.COMPUTE for i in steps)
    best = {}
    with EmulatedLink(h2d_bw=1e12, d2h_bw=1e12) as link:
        for name, plan in (("plain", plain), ("trips", trips)):
            prepared = prepare_plan(plan)
            best[name] = min(execute_plan(prepared, list(captured.inputs), link).wall_s for _ in range(repeats + 1))
    return max(0.0, best["trips"] - best["plain"]) / issued if issued else 0.0


def custom_op_costs(program: Program, inputs: Sequence[torch.Tensor], repeats: int = 5) -> dict[str, float]:
    """Seconds per call of each op target of ``program`` outside the ``aten`` namespace, measured by running the
    program's graph unplanned on clones of ``inputs`` (real tensors; ``inputs`` are never changed): one warm-up
    run, then the median over ``repeats`` runs of the target's time per call. An op on the compute stream is
    timed by the wall clock around its call, as the compute thread waits for it; a lane op by the calling
    thread's CPU time, as ``hyperoffload.runtime.emulated_link`` times a lane kernel on its copy thread. The
    executor's own dispatch (looking up arguments, recording results) is not included. Empty if the program
    has no such op or no graph, or ``inputs`` are fake tensors."""
    from torch._subclasses.fake_tensor import is_fake

    watched = {op.name: op for op in program.ops if not op.target.startswith("aten.")}
    if not watched or program.graph is None or any(is_fake(t) for t in inputs):
        return {}
    calls: dict[str, int] = defaultdict(int)
    for op in watched.values():
        calls[op.target] += 1

    class Timed(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node):
            op = watched.get(node.name)
            if op is None:
                return super().run_node(node)
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            clock = time.thread_time if op.lane else time.perf_counter
            start = clock()
            result = self.call_function(node.target, args, kwargs)
            if op.collective is not None:  # on a real group: done when the other ranks have taken part
                wait_for_work(result)
            spent[op.target] += clock() - start
            return result

    runs: list[dict[str, float]] = []
    for k in range(repeats + 1):  # the first run warms up (allocator, first-call paths)
        spent: dict[str, float] = defaultdict(float)
        with torch.no_grad():  # as the executor runs ops
            Timed(program.graph).run(*[t.clone() for t in inputs])
        if k:
            runs.append(spent)
    return {target: statistics.median(run[target] for run in runs) / n for target, n in calls.items()}


WARM_UP_S = 1.5
"""Seconds of warm-up the first ``executor_op_costs`` of a process needs before timing (its default and
``for_executor``'s); later ones in the same process need only two runs (``warm_up_s=0``)."""


def executor_op_costs(program: Program, inputs: Sequence[torch.Tensor], repeats: int = 11,
                      warm_up_s: float = WARM_UP_S) -> dict[str, float]:
    """Seconds per call of each op signature (``cost.op_signature``) of ``program``'s compute ops, measured by
    running the unplanned step through the plan executor (synchronous copies) on clones of ``inputs``: after
    warm-up runs (two, and more until ``warm_up_s`` seconds have passed: ``WARM_UP_S`` for the first timing in a
    process, 0 for later ones), ``repeats`` runs time each op from the end of the instruction before it to the
    end of its own (its arguments looked up, the call, its results recorded: all the executor's one thread
    spends on it). Per op the fastest time is kept, scaled so that the ops add up
    to the fastest run, then the mean over the ops of each signature. The step's first instruction, which also
    pays for starting the step, and lane ops, which run on copy lanes when planned, are left out. Empty if
    ``inputs`` are fake tensors."""
    from torch._subclasses.fake_tensor import is_fake

    from hyperoffload.cost import op_signature
    from hyperoffload.runtime.interpreter import execute_plan
    from hyperoffload.runtime.prepared_plan import prepare_plan
    from hyperoffload.runtime.transfers import SyncTransfers

    if any(is_fake(t) for t in inputs) or not program.ops:
        return {}
    plan = plan_without_offload(program)
    prepared = prepare_plan(plan)
    transfers = SyncTransfers()
    runs: list[list[float]] = []
    gc.collect()
    gc.freeze()  # the cyclic collector would otherwise land on whichever op allocates when it runs
    try:
        # Two runs at least, and until warm_up_s has passed: two runs of a step of small ops miss a fresh process's
        # slow first second (see "Warm-up" above).
        warm_until = time.perf_counter() + warm_up_s
        k = 0
        while k < 2 or time.perf_counter() < warm_until:
            execute_plan(prepared, [t.clone() for t in inputs], transfers)
            k += 1
        for _ in range(repeats):
            stamps: list[float] = []
            start = time.perf_counter()
            execute_plan(prepared, [t.clone() for t in inputs], transfers,
                         on_instruction=lambda i, stamps=stamps: stamps.append(time.perf_counter()))
            runs.append([b - a for a, b in zip([start, *stamps], stamps)])
    finally:
        gc.unfreeze()
    # Per op the fastest of the runs (another process on the machine only ever slows an op down), scaled so
    # that the ops add up to the fastest whole run: the fastest times of each op, taken from different runs,
    # add up to less than any one run took.
    per_op = [min(times) for times in zip(*runs)]
    fastest = min(sum(run[1:]) for run in runs)
    scale = fastest / sum(per_op[1:]) if sum(per_op[1:]) > 0 else 1.0
    per_op = [t * scale for t in per_op]
    by_signature: dict[str, list[float]] = defaultdict(list)
    for i, ins in enumerate(plan.instructions[1:], start=1):
        op = program.ops[ins.target]
        if op.lane is None:
            by_signature[op_signature(op, program)].append(per_op[i])
    return {signature: statistics.fmean(times) for signature, times in by_signature.items()}


def _measurable_forms(program: Program,
                      inputs: Sequence[torch.Tensor] | None) -> Iterator[tuple[Program, Sequence[torch.Tensor]]]:
    """The forms of ``program``'s step whose custom ops ``for_executor`` measures, each with inputs that run it:
    the step itself when ``inputs`` are given, and for a decode step with a remote-KV form
    (``hyperoffload.variants``) that form without a pool, with speculative prefetch and with the smallest pool,
    between them every cache lane op the policies may plan (captured on first use and kept for the policies)."""
    if inputs is not None:
        yield program, inputs
    forms = program.remote_kv
    if forms is not None:
        for pool, speculative in ((None, False), (None, True), (forms.smallest_pool, False)):
            form = forms.captured(pool, speculative)
            yield form.program, form.inputs


def for_executor(hardware: Hardware, program: Program, dispatch_s: float, issue_s: float | None = None,
                 inputs: Sequence[torch.Tensor] | None = None, warm_up_s: float = WARM_UP_S) -> Hardware:
    """``hardware`` with ``launch_s`` set so that the cost model charges ``dispatch_s`` (seconds) for every op of
    ``program`` (views included) while charging launch overhead only on ops that are not views, and, if
    given, ``issue_s`` (seconds) per cache instruction (``executor_issue_s``).

    Ops outside the ``aten`` namespace are charged what they were measured to take on this machine
    (``custom_op_costs``): a compute op its time per call plus ``launch_s``, a lane op the longer of its link
    time and its kernel's time (``hyperoffload.cost.with_measured_op_costs``). They are measured on the step's
    ``inputs`` if given (the ``Captured.inputs`` of ``program``) and on the inputs of its remote-KV forms if it
    has any; a custom op found in neither keeps the roofline.

    With the same inputs, every compute op (views included) whose signature (target and shapes) runs in those
    forms is charged its time through the executor (``executor_op_costs``), which replaces both the roofline
    and the dispatch estimate: the roofline misjudges small CPU kernels both ways (attention, batched matmuls
    and ``arange`` take several times their roofline, elementwise ops less than the spread dispatch cost).
    ``warm_up_s``: seconds of warm-up before the first form is timed (``executor_op_costs``; the default suits
    the first timing of a process, 0 a process that has timed steps already); later forms warm up by two runs."""
    launched = sum(not op.is_view for op in program.ops)
    if not launched:
        return hardware
    launch_s = dispatch_s * len(program.ops) / launched
    changes = {"launch_s": launch_s} if issue_s is None else {"launch_s": launch_s, "issue_s": issue_s}
    profile = hardware.replace(**changes)
    sources = dict(profile.sources)
    sources["launch_s"] = (f"plan executor's dispatch cost per op ({dispatch_s * 1e6:.1f} us, measured on a chain of "
                           f"tiny ops), times {len(program.ops)} ops / {launched} that are not views")
    if issue_s is not None:
        sources["issue_s"] = (f"plan executor's cost per cache instruction on the emulated link "
                              f"({issue_s * 1e6:.1f} us, measured on a chain of tiny ops sent out and back)")
    profile = dataclasses.replace(profile, sources=MappingProxyType(sources))
    lanes: dict[str, bool] = {}
    costs: dict[str, float] = {}
    shapes: dict[str, float] = {}
    for k, (form, form_inputs) in enumerate(_measurable_forms(program, inputs)):
        lanes.update((op.target, op.lane is not None) for op in form.ops)
        for target, seconds in custom_op_costs(form, form_inputs).items():
            costs.setdefault(target, seconds)  # the step's own form first, then its remote-KV forms
        for signature, seconds in executor_op_costs(form, form_inputs, warm_up_s=0.0 if k else warm_up_s).items():
            shapes.setdefault(signature, seconds)
    # The executor dispatches a custom compute op like any other (``launch_s``); a lane op's kernel runs on its
    # lane, where the executor's dispatch is not. Ops of a measured signature are charged that, which already
    # includes the dispatch; the others keep the roofline with ``launch_s``.
    return with_measured_op_costs(profile, {**{t: c if lanes[t] else c + launch_s for t, c in costs.items()},
                                            **shapes})


def max_abs_diff(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference over pairs of tensors (inf if shapes, dtypes or counts differ)."""
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if a.numel() and not torch.equal(a, b):
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    return worst


def measure_run(plan: Plan, inputs: Sequence[torch.Tensor], transfers: Transfers | Hardware | str, hardware: Hardware,
                config: RunConfig = RunConfig(),
                progress: Callable[[str, int, int], None] | None = None) -> RunFigures:
    """Measure ``plan`` on copies of ``inputs`` (never changed) with ``transfers`` doing the copies; simulate it
    on ``hardware``. ``progress(phase, done, total)`` is called as steps complete."""
    report = progress or (lambda phase, done, total: None)
    program = plan.program
    unplanned = plan_without_offload(program)

    report("reference step", 0, 1)
    ref_inputs = [t.clone() for t in inputs]
    # The checked step starts from the reference's random state, so random ops (dropout) draw the same
    # numbers in both and the comparison is bit for bit.
    with replayed_random_numbers():
        reference = run_plan(unplanned, ref_inputs)
    report("reference step", 1, 1)

    with AsyncExecutor(transfers) as executor:
        report("planned step, checked", 0, 1)
        checked_inputs = [t.clone() for t in inputs]
        checked = executor.run(plan, checked_inputs, arena=config.arena)
        arena_bytes, arena_copied = checked.arena_bytes, checked.arena_copied_bytes
        diff = max_abs_diff([*checked.outputs, *checked_inputs], [*reference.outputs, *ref_inputs])
        peak = checked.peak_bytes
        report("planned step, checked", 1, 1)
        del checked, checked_inputs, ref_inputs, reference

        unplanned_walls, walls, runs = _time_steps(executor, unplanned, plan, inputs, config, report)
    peak = max(peak, *(r.peak_bytes for r in runs))
    timed = runs[config.warmup:]

    figures = simulate(plan, hardware).figures
    wall = statistics.median(walls[config.warmup:])
    fastest = min(walls[config.warmup:])
    return RunFigures(
        wall_s=wall, step_walls_s=tuple(walls[config.warmup:]),
        unplanned_wall_s=statistics.median(unplanned_walls[config.warmup:]), wall_min_s=fastest,
        unplanned_min_s=min(unplanned_walls[config.warmup:]), measured_peak_bytes=peak,
        budget_bytes=plan.budget_bytes, max_abs_diff=diff, sim_step_s=figures.step_s,
        sim_compute_s=figures.compute_s, sim_error=abs(figures.step_s - wall) / wall,
        sim_error_min=abs(figures.step_s - fastest) / fastest,
        h2d_bytes=timed[-1].h2d_bytes, d2h_bytes=timed[-1].d2h_bytes,
        copy_wait_s=statistics.median(r.copy_wait_s for r in timed),
        memory_wait_s=statistics.median(r.memory_wait_s for r in timed), arena_bytes=arena_bytes,
        arena_copied_bytes=arena_copied)


def _time_steps(executor: AsyncExecutor, unplanned: Plan, plan: Plan, inputs: Sequence[torch.Tensor],
                config: RunConfig, report: Callable[[str, int, int], None]) -> tuple[list[float], list[float],
                                                                                     list[PlanRun]]:
    """Warm-up + timed rounds of one unplanned step and two planned steps back to back, each plan on its own
    donated copy of ``inputs``, so that both see the same machine (other work on it moves every wall time).
    Only the second planned step of a round is timed: it starts while the first one's last offloads are still
    in flight, as every step of a training loop does. Returns the unplanned steps' wall times, the timed
    planned steps' wall times, and the results of the timed planned steps."""
    for p in (unplanned, plan):
        executor.prepare(p)  # checking a plan is not part of a step
    states = {unplanned: [t.clone() for t in inputs], plan: [t.clone() for t in inputs]}
    unplanned_walls: list[float] = []
    walls: list[float] = []
    runs: list[PlanRun] = []
    phase = "steps (unplanned and planned in turn)"
    report(phase, 0, config.warmup + config.steps)
    # The program, plan and graph are long-lived; frozen, the cyclic collector stops rescanning them during
    # the steps (several ms a step otherwise).
    gc.collect()
    gc.freeze()
    try:
        _rounds(executor, unplanned, plan, states, unplanned_walls, walls, runs, config, phase, report)
    finally:
        gc.unfreeze()
    executor.synchronize()
    return unplanned_walls, walls, runs


def _rounds(executor: AsyncExecutor, unplanned: Plan, plan: Plan, states: dict, unplanned_walls: list[float],
            walls: list[float], runs: list[PlanRun], config: RunConfig, phase: str,
            report: Callable[[str, int, int], None]) -> None:
    """The rounds of ``_time_steps``, appending to its lists."""
    total = config.warmup + config.steps
    for k in range(total):
        for p, timed in ((unplanned, unplanned_walls), (plan, None), (plan, walls)):
            start = time.perf_counter()
            run = executor.step(p, states[p], overlap=config.overlap, arena=config.arena and p is plan)
            wall = time.perf_counter() - start
            states[p] = list(run.state)
            if timed is not None:
                timed.append(wall)
            if timed is walls:
                # Keep the figures only: a step's state or outputs would keep memory the plan gives back.
                runs.append(dataclasses.replace(run, outputs=(), state=(), live_bytes=()))
            del run
        report(phase, k + 1, total)


__all__ = ["RunConfig", "RunFigures", "custom_op_costs", "executor_dispatch_s", "executor_issue_s", "executor_op_costs",
           "for_executor",
           "max_abs_diff", "measure_run"]
