"""Discrete-event simulation of a Plan on a hardware profile: one compute stream, two copy lanes, one network lane
and, for a step with host ops, the host CPU.

Time advances from event to event (an op ends, a copy's latency ends, a copy's data has
moved). Rules, in the order a real runtime would follow them:

* Each stream runs its instructions in plan order, one at a time.
* A copy is issued when the compute stream reaches it: it starts no earlier than the moment
  every compute-stream instruction before it in the plan has started. An offload also waits
  for the op that last wrote its value; a prefetch for the offload that filled remote memory.
* Device memory is allocated in plan order (an op's outputs when it starts, a prefetch's
  buffer when the compute stream reaches the prefetch, as a caching allocator does when the copy
  is issued) and never above the budget: an allocation that does not fit waits for memory to be
  freed, and so does the compute stream behind it (a memory stall). Frees happen when the last
  use of a value finishes (or, for a release, when its offload and the ops before it that read
  the value have finished).
* While both lanes move data, each gets ``duplex_share`` of its bandwidth.
* Where the profile charges ``issue_s`` (a runtime whose one thread issues copies and runs ops), an
  op runs that much longer for each cache instruction issued since the op before it.
* A lane op (``Op.lane``: an indexed prefetch of KV blocks, a write to a remote cache) is a copy
  on its lane of ``Op.transfer_bytes``, no faster than ``cost.lane_op_time``. It is issued, and its
  outputs allocated, when the compute stream reaches it; it starts once every op it depends on has
  finished; an op that depends on it waits for it (a copy stall).
* A collective (``Op.collective``: FSDP's all-gathers and reduce-scatters) runs on the network lane, one at a
  time in plan order, for ``cost.collective_op_time``, as NCCL runs one communicator's collectives in order on
  streams of their own. It is issued, waits and holds its outputs as a lane op does; an op that depends on it
  waits for it (a network stall). The network lane is independent of the copy lanes: the links between devices
  (NVLink, a SuperPod's fabric) are not the host links (``docs/design.md``, "The network lane", says where this
  holds and where it does not).
* A host op (``Op.lane`` ``"host"``: an optimizer step on the CPU over host state) runs on the host lane, one at a
  time in plan order, for ``cost.host_op_time``. It is issued and waits as a lane op does, and an op that depends on
  it waits for it (a host stall). The host lane is independent of the compute stream, the copy lanes and the
  network (``docs/design.md``, "Host compute"). A step without host ops has no host lane.

The plan is checked first (``check_plan``); an invalid plan raises ``PlanError`` naming the
instruction and is never simulated. Results are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from hyperoffload.analysis import memory_profile
from hyperoffload.analysis.dependency_bound import dependency_bound
from hyperoffload.cost import (collective_op_time, host_op_time, host_ranks, host_time, lane_op_time, network_time,
                               op_times)
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.instructions import (COMPUTE, D2H, H2D, HOST, NET, RULES, alloc_bytes, copy_traffic,
                                      inputs_end_on_device)
from hyperoffload.instructions import STREAMS  # noqa: F401 (re-exported)
from hyperoffload.ir import Program
from hyperoffload.memo import per_program
from hyperoffload.plans import Kind, Plan, PlanError, check_plan, op_storages, op_writes, owned_outputs
_EPS = 1e-12


class Interval(NamedTuple):
    """Busy time of one stream for one instruction (seconds from the start of the step). (A named tuple, as
    ``Stall``: immutable like a frozen dataclass and faster to make; a simulation of an 8B training step makes
    some 20k.)"""

    stream: str
    start: float
    end: float
    instruction: int
    label: str


class Stall(NamedTuple):
    """The compute stream waiting, with work left, on a copy, a collective, a host op or memory (seconds)."""

    cause: str
    """``"copy"``, ``"network"``, ``"host"`` or ``"memory"``."""
    start: float
    end: float
    instruction: int
    """The instruction the compute stream was waiting to run."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """The figures of ``docs/figures.md`` for one simulated plan (seconds, bytes)."""

    compute_s: float
    step_s: float
    exposed_s: float
    lower_bound_s: float
    slowdown: float
    peak_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    stalls: int
    stall_copy_s: float
    stall_memory_s: float
    budget_bytes: int | None
    excess_bytes: int | None
    """max(0, no-offload peak - budget); None without a budget."""
    bound_s: float | None
    """max(compute_s, excess / h2d_bw, excess / d2h_bw); None without a budget."""
    duplex_bound_s: float | None = None
    """``bound_s`` with the link's both-directions penalty: moving the excess each way at once takes at
    least excess * min(1 / duplex_share, 2) / bandwidth (both lanes at the shared rate, or one after the
    other, whichever is faster). None without a budget."""
    dependency_bound_s: float | None = None
    """The step time no order of the program's ops can beat, whatever the memory
    (``analysis.dependency_bound``): a decode step's block fetch starts only once selection has run, and
    what depends on it only once it has landed, on one compute stream. Equal to ``compute_s`` for a step
    without lane ops."""
    steady_state: bool = False
    """True when the plan keeps state in remote memory between steps and ``step_s`` is the period of
    consecutive steps (two were simulated)."""
    network_s: float = 0.0
    """Seconds the step's collectives occupy the network lane, one after another (``cost.collective_op_time``);
    0 for a step of one rank. No plan steps faster: ``lower_bound_s`` and ``bound_s`` count it."""
    stall_network_s: float = 0.0
    """Seconds the compute stream waited on collectives."""
    host_s: float = 0.0
    """Seconds the step's host ops occupy the host lane, one after another (``cost.host_op_time``); 0 for a step
    without host ops. No plan steps faster: ``lower_bound_s`` and ``bound_s`` count it."""
    stall_host_s: float = 0.0
    """Seconds the compute stream waited on host ops."""

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class _Measured(NamedTuple):
    """What a simulation measured beyond its intervals, from which its ``Figures`` are worked out."""

    hardware: Hardware
    per_step: Plan
    """The plan of one step (the figures count one step's work)."""
    compute_s: float
    step_s: float
    peak_bytes: int
    steady_state: bool
    counted_from: int
    """The first instruction of the step whose stalls the figures count (0: every stall)."""


class _LazyFigures:
    """``Timeline.figures``: given, or worked out from the simulation's measurements when first read."""

    def __get__(self, timeline: Timeline | None, owner: type | None = None) -> Figures | None:
        if timeline is None:
            return None  # the field's default
        found = timeline.__dict__.get("_figures")
        if found is None and timeline.measured is not None:
            found = timeline.__dict__["_figures"] = _figures(timeline.stalls, timeline.measured)
        return found

    def __set__(self, timeline: Timeline, figures: Figures | None) -> None:
        timeline.__dict__["_figures"] = figures


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """Everything a simulation produced. Its ``figures`` (with the traffic and the bounds) are worked out when
    first read, so a planner that compares many candidates by ``step_s`` and ``peak_bytes`` need not pay for
    them."""

    intervals: tuple[Interval, ...]
    memory: tuple[tuple[float, int], ...]
    """(time, device bytes after the change), in time order."""
    stalls: tuple[Stall, ...]
    plan: Plan
    """The plan these instruction indices refer to: the plan given, or two consecutive steps of it
    when it was timed in steady state."""
    figures: Figures | None = _LazyFigures()
    """The figures of ``docs/figures.md`` (None for a timeline made without figures or a simulation)."""
    measured: _Measured | None = None
    """What the simulation measured, that the figures are worked out from."""

    @property
    def step_s(self) -> float:
        """Simulated step time (seconds; in steady state, the period of consecutive steps)."""
        return self.measured.step_s if self.measured is not None else self.figures.step_s

    @property
    def peak_bytes(self) -> int:
        """The most device bytes allocated at once."""
        return self.measured.peak_bytes if self.measured is not None else self.figures.peak_bytes


def _figures(stalls: tuple[Stall, ...], m: _Measured) -> Figures:
    """The figures of a simulation from its stalls and measurements: one step's traffic and the bounds."""
    hardware, step, compute_s, step_s = m.hardware, m.per_step, m.compute_s, m.step_s
    counted = [st for st in stalls if st.instruction >= m.counted_from] if m.counted_from else stalls
    h2d_bytes, d2h_bytes = plan_traffic(step)
    network_s = network_time(step.program, hardware)
    host_s = host_time(step.program, hardware)
    # The compute stream, the network lane and the host lane each run their ops one at a time.
    busiest = max(compute_s, network_s, host_s)
    lower_bound = max(busiest, h2d_bytes / hardware.h2d_bw, d2h_bytes / hardware.d2h_bw)
    budget = step.budget_bytes
    excess = bound = duplex_bound = None
    if budget is not None:
        excess, bound, duplex_bound = budget_bounds(step.program, hardware, busiest, budget)
    return Figures(
        compute_s=compute_s, step_s=step_s, exposed_s=step_s - compute_s, lower_bound_s=lower_bound,
        slowdown=step_s / compute_s if compute_s else 1.0, peak_bytes=m.peak_bytes, h2d_bytes=h2d_bytes,
        d2h_bytes=d2h_bytes, stalls=len(counted),
        stall_copy_s=sum(s.end - s.start for s in counted if s.cause == "copy"),
        stall_memory_s=sum(s.end - s.start for s in counted if s.cause == "memory"),
        budget_bytes=budget, excess_bytes=excess, bound_s=bound, duplex_bound_s=duplex_bound,
        dependency_bound_s=dependency_bound(step.program, hardware, compute_s), steady_state=m.steady_state,
        network_s=network_s, stall_network_s=sum(s.end - s.start for s in counted if s.cause == "network"),
        host_s=host_s, stall_host_s=sum(s.end - s.start for s in counted if s.cause == "host"))


class _Copy:
    __slots__ = ("instr", "start", "latency_end", "remaining")

    def __init__(self, instr: int, start: float, latency_end: float, remaining: float) -> None:
        self.instr, self.start, self.latency_end, self.remaining = instr, start, latency_end, remaining


def budget_bounds(program, hardware: Hardware, compute_s: float, budget_bytes: int,
                  peak_bytes: int | None = None) -> tuple[int, float, float]:
    """``(excess_bytes, bound_s, duplex_bound_s)`` of ``Figures`` for ``program`` at ``budget_bytes``;
    ``peak_bytes`` is the no-offload peak the excess is measured from (default: ``program``'s own)."""
    peak = memory_profile(program).peak_bytes if peak_bytes is None else peak_bytes
    excess = max(0, peak - budget_bytes)
    # Lane ops' bytes cross whatever the plan does (the step itself moves them): they add to the excess.
    forced_h2d, forced_d2h = lane_traffic(program)
    bound = max(compute_s, (excess + forced_h2d) / hardware.h2d_bw, (excess + forced_d2h) / hardware.d2h_bw)
    both_ways = min(1 / hardware.duplex_share, 2.0)
    duplex = max(bound, excess * both_ways / min(hardware.h2d_bw, hardware.d2h_bw))
    return excess, bound, duplex


@per_program
def lane_traffic(program) -> tuple[int, int]:
    """Bytes the program's own lane ops move per step: (remote -> device, device -> remote); once per program
    (every simulation of its plans asks)."""
    return (sum(op.transfer_bytes for op in program.ops if op.lane == "h2d"),
            sum(op.transfer_bytes for op in program.ops if op.lane == "d2h"))


def plan_traffic(plan: Plan) -> tuple[int, int]:
    """Bytes a plan moves per step, its cache instructions and the program's lane ops together:
    (remote -> device, device -> remote)."""
    lane_h2d, lane_d2h = lane_traffic(plan.program)
    copied_h2d, copied_d2h = copy_traffic(plan)
    return lane_h2d + copied_h2d, lane_d2h + copied_d2h


def simulate(plan: Plan, hardware: Hardware | str, *, release_waits: bool = False) -> Timeline:
    """Simulate ``plan`` on ``hardware`` (a profile or its name); raise ``PlanError`` if the plan is invalid.

    ``release_waits``: a release of a storage whose offload is still in flight stops the compute stream until that
    offload has landed, as the cache operators' runtime on the CPU does (``AsyncCopies(release_waits=True)``, which
    ``train_step`` uses there); by default a release lets compute run on and its bytes come back when the copy lands.

    A plan that keeps storages in remote memory between steps (they start the step there and are
    sent back by its end, and every other input ends where it started) is simulated for two
    consecutive steps and timed in steady state: ``step_s`` is the time from the end of the first
    step's compute to the end of the second's, the peak and stalls cover both steps, and the
    timeline shows both.
    """
    hardware = as_hardware(hardware)
    if not _keeps_state_remote(plan):
        return _simulate(plan, hardware, release_waits=release_waits)
    from hyperoffload.repeat import repeat_plan

    single = plan
    doubled, starts = repeat_plan(plan, 2)
    try:
        timeline = _simulate(doubled, hardware, per_step=single, release_waits=release_waits)
    except PlanError:
        check_plan(plan)  # report the error against the plan as given, where it can be found
        raise
    # A step's ops end with its last op, on whichever stream it ran (a collective on the network, a lane op on its
    # copy lane, the rest on the compute stream).
    instrs = doubled.instructions
    ends = [max((iv.end for iv in timeline.intervals
                 if lo <= iv.instruction < hi and instrs[iv.instruction].kind is Kind.COMPUTE), default=0.0)
            for lo, hi in ((starts[0], starts[1]), (starts[1], len(instrs)))]
    m = timeline.measured
    # The steady step's own stalls are those from the second step's first instruction on.
    steady = m._replace(step_s=max(ends[1] - ends[0], m.compute_s, network_time(single.program, hardware),
                                   host_time(single.program, hardware)),
                        steady_state=True, counted_from=starts[1])
    return Timeline(intervals=timeline.intervals, memory=timeline.memory, stalls=timeline.stalls,
                    plan=timeline.plan, measured=steady)


def _keeps_state_remote(plan: Plan) -> bool:
    """Whether the plan starts some inputs in remote memory and ends every input where it started, so
    that it can run step after step. (A plan that leaves inputs elsewhere is timed as a single step.)"""
    if not plan.initial_remote:
        return False
    return all(here == (s not in plan.initial_remote) for s, here in inputs_end_on_device(plan).items())


@per_program
def _op_facts(program: Program) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[frozenset[int], ...]]:
    """Per op id: the bytes it allocates (storages its outputs own), the storages it reads (``op_storages``)
    and those it writes (mutates or creates); once per program, as a planner simulates many plans of one
    program."""
    values = program.values
    return (tuple(sum(values[o].alloc_bytes for o in outs) for outs in owned_outputs(program)),
            op_storages(program)[1],
            op_writes(program))


_EVENTS_PER_INSTRUCTION = 3
"""The most events one instruction makes the simulator stop at (its compute ends, or its copy's latency and then its
data phase end); the event loop gives up past a generous multiple of this."""


def _stuck(program, instrs, hardware: Hardware, t: float, nxt: float, running: int, active) -> PlanError:
    """The error for an event loop that cannot advance: the time it is stuck at and what was running then."""
    busy = [i for i in (running, *(c.instr for c in active if c is not None)) if i >= 0]
    where = "; ".join(instrs[i].describe(program) for i in busy) or "nothing"
    return PlanError(busy[0] if busy else -1,
                     f"the simulation cannot advance from t = {t!r} s to the next event at {nxt!r} s (running: "
                     f"{where}): some time is not a finite number of seconds. Every latency, launch cost, "
                     f"bandwidth and FLOP rate of the hardware profile {hardware.name!r} and every op's cost must be "
                     f"finite (the profile's own checks refuse them; was it changed after it was made?)")


def _simulate(plan: Plan, hardware: Hardware, per_step: Plan | None = None, *, release_waits: bool = False) -> Timeline:
    """Simulate ``plan``; figures that count one step's work (compute, bytes) come from ``per_step``.

    The steps: check the plan; work out what each instruction waits for, allocates and frees (``_Facts``, one
    method per instruction kind); run the event loop (``_run_events``); refuse a plan that leaves instructions
    unrun (a deadlock); measure what the figures are worked out from."""
    check = check_plan(plan)
    facts = _Facts(plan, hardware, check, release_waits=release_waits)
    run = _run_events(plan, hardware, facts, check.initial_bytes)
    memory = run.memory
    _refuse_unfinished(plan, run.finish, memory[-1][1])
    step = per_step or plan
    compute_s = float(sum(op_times(step.program, hardware))) if per_step else float(sum(facts.cost))
    step_s = max((iv.end for iv in run.intervals), default=0.0)
    peak = max(usage for _, usage in memory)  # every change of device bytes is in the record
    memory.sort(key=lambda e: e[0])
    measured = _Measured(hardware=hardware, per_step=step, compute_s=compute_s, step_s=step_s, peak_bytes=peak,
                         steady_state=False, counted_from=0)
    return Timeline(intervals=tuple(run.intervals), memory=tuple(memory), stalls=tuple(run.stalls), plan=plan,
                    measured=measured)


def _refuse_unfinished(plan: Plan, finish: list[float], usage: int) -> None:
    """Raise ``PlanError`` for the first instruction the event loop never finished (releases have no end)."""
    instrs = plan.instructions
    unfinished = [i for i in range(len(instrs)) if finish[i] < 0 and instrs[i].kind is not Kind.RELEASE]
    if unfinished:
        i = unfinished[0]
        raise PlanError(i, f"{instrs[i].describe(plan.program)} can never run: the plan deadlocks "
                           f"(device memory {usage} bytes, budget {plan.budget_bytes})")


class _Facts:
    """What the event loop knows of each instruction before it runs (per instruction index unless said): the
    bytes it allocates and frees, what it waits for, which stream or copy lane it occupies.

    Worked out in one pass over the plan, one method per instruction kind (named as ``Kind``'s values and
    dispatched on it, as ``torch.fx.Interpreter.run_node`` dispatches on a node's op), each reading and updating
    the storages' history so far (last writer, last offload, readers, transfer in flight)."""

    __slots__ = ("program", "hardware", "values", "cost", "n", "budget", "issuing", "alloc", "op_reads", "op_writes",
                 "after", "wait_for", "on_lane", "on_net", "on_host", "fixed_s", "copy_bytes", "queues",
                 "compute_stream", "has_lanes", "has_host", "host_ranks", "lanes", "op_instr",
                 "deps", "lane_deps", "frees_after", "deferred_frees", "last_writer", "last_offload", "readers_since",
                 "pending_transfer", "last_transfer", "allocating", "blocked_releases", "outstanding", "freed_bytes",
                 "release_bytes", "is_wait", "release_waits")

    def __init__(self, plan: Plan, hardware: Hardware, check, *, release_waits: bool = False) -> None:
        program, instrs = plan.program, plan.instructions
        self.program, self.hardware, self.values = program, hardware, program.values
        self.release_waits = release_waits
        self.cost = op_times(program, hardware)
        self.n = n = len(instrs)
        self.budget = plan.budget_bytes
        self.issuing = _issue_delays(instrs, hardware.issue_s)
        op_alloc, self.op_reads, self.op_writes = _op_facts(program)
        self.alloc = alloc = alloc_bytes(program, instrs, op_alloc)
        self.after = [-1] * n  # a copy's data dependency (instruction that must finish first)
        self.wait_for = [-1] * n  # the transfer a WAIT (or, with ``release_waits``, a release) stops the stream for
        self.on_lane = [False] * n  # beside the compute stream: prefetches, offloads, lane ops and collectives
        self.on_net = [False] * n  # collectives
        self.on_host = [False] * n  # host ops
        self.fixed_s = [0.0] * n  # a collective's seconds on the network lane, a host op's on the host lane
        self.copy_bytes = [0] * n
        # The instructions of the copy lanes H2D and D2H, the network and the host, in plan order; the lanes the
        # event loop visits (the host only where the step has host ops).
        self.queues = ([], [], [], [])
        self.has_host = program.has_host_ops()
        self.lanes = (0, 1, 2, 3) if self.has_host else (0, 1, 2)
        self.host_ranks = host_ranks(program, hardware) if self.has_host else 1
        self.compute_stream: list[int] = []
        # Lane ops and collectives wait for the ops they depend on, and compute ops for the lane ops and collectives
        # they depend on; a step without either (every unsharded training step) needs none of this bookkeeping.
        self.has_lanes = has_lanes = program.has_side_ops()
        self.op_instr = ({ins.target: i for i, ins in enumerate(instrs) if ins.kind is Kind.COMPUTE}
                         if has_lanes else {})
        self.deps = side_waits(program) if has_lanes else ()
        # Lane op or collective: the ops it waits for; compute op: the lane ops and collectives it waits for.
        self.lane_deps: list[tuple[int, ...]] = [()] * n
        # Storages each instruction frees once it finishes (check_plan's automatic frees after a last use); an
        # offload that is a storage's last use frees it only once its last reader has finished too (``offload``).
        self.frees_after = list(check.frees_after)
        # A RELEASE, or an offload that is a storage's last use (by instruction index) -> (the storage, the
        # instructions that must finish before its bytes come back).
        self.deferred_frees: dict[int, tuple[int, list[int]]] = {}
        self.last_writer: dict[int, int] = {}
        self.last_offload: dict[int, int] = {}
        self.readers_since: dict[int, int] = {}
        self.pending_transfer: dict[int, int] = {}
        self.last_transfer: dict[int, int] = {}  # storage -> its latest offload or prefetch so far
        handle = {kind: getattr(self, kind.value) for kind in Kind}
        for i, (kind, target) in enumerate(instrs):
            handle[kind](i, target)
        self.allocating = [i for i in range(n) if alloc[i] > 0]
        self._count_frees()
        # WAITs, and with ``release_waits`` the releases of storages whose offload is in flight: both have a transfer
        # the compute stream stops at.
        self.is_wait = [transfer >= 0 for transfer in self.wait_for]

    def _count_frees(self) -> None:
        """Who holds back each deferred free, the bytes each instruction frees once it finishes and each deferred
        free's bytes."""
        values = self.values
        self.blocked_releases: dict[int, list[int]] = {}  # instruction -> the deferred frees it holds back
        self.outstanding: dict[int, int] = {}  # deferred free -> how many instructions still hold it back
        self.release_bytes: dict[int, int] = {}
        for r, (storage, needs) in self.deferred_frees.items():
            self.outstanding[r] = len(needs)
            self.release_bytes[r] = values[storage].alloc_bytes
            for x in needs:
                self.blocked_releases.setdefault(x, []).append(r)
        self.freed_bytes = [sum(values[s].alloc_bytes for s in frees) if frees else 0 for frees in self.frees_after]

    def _copy(self, i: int, s: int, kind: Kind) -> None:
        """An offload or a prefetch (``COPIES``): storage ``s``'s bytes on its kind's copy lane."""
        self.on_lane[i], self.copy_bytes[i] = True, self.values[s].alloc_bytes
        self.queues[0 if RULES[kind].stream == H2D else 1].append(i)
        self.pending_transfer[s] = i
        self.last_transfer[s] = i

    def compute(self, i: int, op_id: int) -> None:
        for s in self.op_reads[op_id]:
            self.readers_since[s] = i
        for s in self.op_writes[op_id]:
            self.last_writer[s] = i
        op = self.program.ops[op_id]
        if op.lane is None and op.collective is None:
            self.compute_stream.append(i)
            if self.has_lanes:
                self.lane_deps[i] = tuple(self.op_instr[d] for d in self.deps[op_id])
            return
        self.on_lane[i] = True
        self.lane_deps[i] = tuple(self.op_instr[d] for d in self.deps[op_id])
        if op.collective is not None:
            self.on_net[i] = True
            self.fixed_s[i] = collective_op_time(op, self.hardware)
            self.queues[2].append(i)
            return
        if op.lane == HOST:
            self.on_host[i] = True
            self.fixed_s[i] = host_op_time(op, self.hardware, self.host_ranks)
            self.queues[3].append(i)
            return
        # A lane op moves its bytes, or, where the profile measured its kernel as slower than the link (a Python
        # kernel on an emulated link), takes that long: as many bytes as the lane moves then.
        hardware = self.hardware
        lane_bw, lane_latency = ((hardware.h2d_bw, hardware.h2d_latency_s) if op.lane == "h2d"
                                 else (hardware.d2h_bw, hardware.d2h_latency_s))
        self.copy_bytes[i] = max(op.transfer_bytes, (lane_op_time(op, hardware) - lane_latency) * lane_bw)
        self.queues[0 if op.lane == "h2d" else 1].append(i)

    def wait(self, i: int, s: int) -> None:
        self.wait_for[i] = self.pending_transfer.pop(s)
        self.compute_stream.append(i)

    def offload(self, i: int, s: int) -> None:
        self.after[i] = self.last_writer.get(s, -1)
        self.last_offload[s] = i
        self._copy(i, s, Kind.OFFLOAD)
        frees = self.frees_after[i]
        if s in frees:
            # The copy may land while the op that last read the storage still runs (the offload waits only for
            # the last writer): its bytes come back when both are done.
            self.frees_after[i] = tuple(x for x in frees if x != s)
            reader = self.readers_since.get(s, -1)
            self.deferred_frees[i] = (s, [i] if reader < 0 else [i, reader])

    def prefetch(self, i: int, s: int) -> None:
        self.after[i] = self.last_offload.get(s, -1)
        self._copy(i, s, Kind.PREFETCH)

    def release(self, i: int, s: int) -> None:
        """Frees its storage (``FREES_TARGET``). The bytes come back once the last reader has finished and the
        storage's last copy has landed, whether or not a WAIT for that copy came first: a waited offload may
        still be moving when its last reader ends, and a prefetched storage is not there to free before its
        copy lands."""
        needs = [self.readers_since.get(s, -1), self.last_transfer.get(s, -1)]
        self.deferred_frees[i] = (s, [x for x in dict.fromkeys(needs) if x >= 0])
        offload = self.pending_transfer.get(s, -1)  # an offload: a release never comes while a prefetch is in flight
        if self.release_waits and offload >= 0:
            self.wait_for[i] = offload  # the compute stream stops here until the offload has landed
            self.compute_stream.append(i)


def _side_stall(finish: list[float], deps: tuple[int, ...], on_net: list[bool], on_host: list[bool]) -> str:
    """Why the compute stream waits for the unfinished side ops among ``deps``: ``"network"`` if a collective is among
    them, else ``"host"`` if a host op is, else ``"copy"``."""
    waiting = [d for d in deps if finish[d] < 0]
    if any(on_net[d] for d in waiting):
        return "network"
    return "host" if any(on_host[d] for d in waiting) else "copy"


@per_program
def side_waits(program: Program) -> tuple[tuple[int, ...], ...]:
    """Per op id, the ops it waits for to finish before it starts where the step has side ops (lane ops,
    collectives): a side op waits for every op it depends on; a compute op for the side ops it depends on. A view
    (``Op.is_view``) reads no bytes and waits for nothing, so the side ops it depends on are waited for by the ops
    that read it (as on a device, where a view is made on the host and only a kernel waits for its input's copy).
    The interpreter waits for a running collective by the same rule.
    Op ids are a valid order, so a view's waits are known before its readers'."""
    ops, deps = program.ops, program.dependencies()
    through_view: list[tuple[int, ...]] = [()] * len(ops)  # a view: the side ops its readers wait for
    waits: list[tuple[int, ...]] = []
    for op in ops:
        side = op.stream != "compute"
        found = dict.fromkeys(d for d in deps[op.id] if side or ops[d].stream != "compute")
        for d in deps[op.id]:
            found.update(dict.fromkeys(through_view[d]))
        if op.is_view and not side:
            through_view[op.id] = tuple(found)
            waits.append(())
        else:
            waits.append(tuple(found))
    return tuple(waits)


def _issue_delays(instrs, issue_s: float) -> list[float]:
    """Seconds each compute instruction runs longer for the cache instructions issued since the one before it
    (``Hardware.issue_s``: where the same thread issues copies and runs ops, an op starts only once the cache
    instructions before it have been issued); 0 for the others."""
    issuing = [0.0] * len(instrs)
    pending_issue = 0
    for i, ins in enumerate(instrs):
        if ins.kind is Kind.COMPUTE:
            issuing[i], pending_issue = pending_issue * issue_s, 0
        else:
            pending_issue += 1
    return issuing


class _Run(NamedTuple):
    """What the event loop recorded."""

    finish: list[float]
    """Per instruction, when it finished (-1: never)."""
    memory: list[tuple[float, int]]
    """(time, device bytes after the change), in the order the changes were made."""
    intervals: list[Interval]
    stalls: list[Stall]


class _Stream:
    """The compute stream's state in the event loop."""

    __slots__ = ("todo", "reach", "running", "until", "end")

    def __init__(self, todo: list[int], end: int) -> None:
        self.todo = todo
        """The stream's instructions not yet started, the next one last."""
        self.end = end
        self.reach = todo[-1] if todo else end
        """Every instruction before this plan position (the next to start, or the plan's end once the stream is
        done) has been reached, which is what lets a copy be issued."""
        self.running = -1
        """The op running (-1: none), until ``until`` (seconds)."""
        self.until = 0.0


def _run_events(plan: Plan, hardware: Hardware, facts: _Facts, initial_bytes: int) -> _Run:
    """Advance from event to event (an op ends, a copy's latency ends, a copy's data has moved); at each, run the
    five steps until none changes anything. Every step's guard here is only a cheap necessary condition; the step
    checks the rest (the guards keep the steps' calls off the many events where they have nothing to do)."""
    n = facts.n
    run = _Run(finish=[-1.0] * n, memory=[(0.0, initial_bytes)], intervals=[], stalls=[])
    to_allocate = facts.allocating[::-1]  # allocations not yet made, the next (in plan order) last
    allocate, free = _ledger(facts, run.memory, to_allocate)
    finished = _finisher(facts, run.finish, free)
    for storage, needs in facts.deferred_frees.values():
        if not needs:  # released before anything read or copied it this step: free from the start
            free(facts.values[storage].alloc_bytes, 0.0)
    cs = _Stream(facts.compute_stream[::-1], n)
    # What runs on each lane (0: H2D, 1: D2H, 2: the network, 3: the host, only for a step with host ops).
    active: list[_Copy | None] = [None, None, None, None] if facts.has_host else [None, None, None]
    has_host = facts.has_host
    issued = [not nbytes for nbytes in facts.alloc]  # whether each instruction's buffer is allocated (or needs none)
    issue_copies = _copy_issuer(facts, run.memory, to_allocate, allocate, issued, cs)
    start_compute = _compute_starter(plan, facts, run, to_allocate, allocate, cs)
    start_copies = _copy_starter(facts, run.finish, issued, active, cs)
    finish_copies = _copy_finisher(plan, run.intervals, active, finished)
    next_event = _clock(plan, hardware, active, cs)
    t = 0.0
    while True:
        # Run the five steps in turn until none changes anything: the loop ends at a step that changes nothing and
        # was the last to change something, the other four having changed nothing since. (A step that changes
        # nothing has no effect, so running them all once more, round after round, would end in the same state.)
        last = -1  # the step that last changed something
        while True:
            # 0. Prefetches and lane ops are issued, and their buffers allocated, when the compute stream reaches
            # them, in plan order, and while the budget has room.
            if to_allocate and to_allocate[-1] < cs.reach and issue_copies(t):
                last = 0
            elif last == 0:
                break
            # 1. The compute stream starts its next instruction.
            if cs.running < 0 and cs.todo and start_compute(t):
                last = 1
            elif last == 1:
                break
            # 2. Copy lanes start their next copies, the network its next collective, the host its next host op.
            if None in active and start_copies(t):
                last = 2
            elif last == 2:
                break
            # 3. The running compute finishes (one of zero duration at once).
            if cs.running >= 0 and cs.until <= t + _EPS:
                finished(cs.running, t)
                cs.running = -1
                last = 3
            elif last == 3:
                break
            # 4. Copies, collectives and host ops finish.
            if (active[0] is not None or active[1] is not None or active[2] is not None
                    or (has_host and active[3] is not None)) and finish_copies(t):
                last = 4
            elif last in (4, -1):  # -1: a whole first round without change
                break
        t = next_event(t)
        if t is None:
            return run


def _ledger(facts: _Facts, memory: list[tuple[float, int]], to_allocate: list[int]):
    """Device memory: ``allocate(i, t)`` makes instruction ``i``'s allocation (the next in plan order) at ``t``;
    ``free(nbytes, when)`` gives bytes back. Each change is appended to ``memory``, whose last entry is thus the
    bytes allocated now."""
    alloc = facts.alloc

    def allocate(i: int, t: float) -> None:
        memory.append((t, memory[-1][1] + alloc[i]))
        to_allocate.pop()

    def free(nbytes: int, when: float) -> None:
        if nbytes:
            memory.append((when, memory[-1][1] - nbytes))

    return allocate, free


def _finisher(facts: _Facts, finish: list[float], free):
    """``finished(i, when)``: instruction ``i`` ends at ``when``; the storages it was the last use of, and the
    deferred frees it was the last to hold back, are given back."""
    freed_bytes, blocked_releases, outstanding = facts.freed_bytes, facts.blocked_releases, facts.outstanding
    release_bytes = facts.release_bytes

    def finished(i: int, when: float) -> None:
        finish[i] = when
        free(freed_bytes[i], when)
        for r in blocked_releases.get(i, ()):
            outstanding[r] -= 1
            if outstanding[r] == 0:
                free(release_bytes[r], when)

    return finished


def _copy_issuer(facts: _Facts, memory: list[tuple[float, int]], to_allocate: list[int], allocate, issued: list[bool],
                 cs: _Stream):
    """Step 0, ``issue_copies(t)``: allocate the buffers of the prefetches and lane ops the compute stream has
    reached, in plan order, while the budget has room; whether it allocated any."""
    on_lane, alloc, budget = facts.on_lane, facts.alloc, facts.budget

    def issue_copies(t: float) -> bool:
        changed = False
        reach = cs.reach
        while to_allocate:
            i = to_allocate[-1]
            if not on_lane[i] or i >= reach or (budget is not None and memory[-1][1] + alloc[i] > budget):
                break
            allocate(i, t)
            issued[i] = True
            changed = True
        return changed

    return issue_copies


def _compute_starter(plan: Plan, facts: _Facts, run: _Run, to_allocate: list[int], allocate, cs: _Stream):
    """Step 1, ``start_compute(t)``: the compute stream starts its next instruction, or records why it cannot (a
    stall on a copy or on memory, closed when the instruction starts or the reason changes); whether it started."""
    program, instrs = plan.program, plan.instructions
    is_wait, wait_for, has_lanes, lane_deps = facts.is_wait, facts.wait_for, facts.has_lanes, facts.lane_deps
    on_net, on_host = facts.on_net, facts.on_host
    alloc, budget, cost, issuing, ops = facts.alloc, facts.budget, facts.cost, facts.issuing, program.ops
    finish, memory, intervals, stalls, todo, end = run.finish, run.memory, run.intervals, run.stalls, cs.todo, cs.end
    stall_since: float | None = None
    stall_cause = ""

    def start_compute(t: float) -> bool:
        nonlocal stall_since, stall_cause
        i = todo[-1]
        if is_wait[i]:
            why = "copy" if finish[wait_for[i]] < 0 else ""
        elif has_lanes and any(finish[d] < 0 for d in lane_deps[i]):
            why = _side_stall(finish, lane_deps[i], on_net, on_host)
        elif alloc[i] and (to_allocate[-1] != i or (budget is not None and memory[-1][1] + alloc[i] > budget)):
            why = "memory"  # no room under the budget, or an earlier prefetch waits for room first
        else:
            why = ""
        if why:
            if stall_since is None:
                stall_since, stall_cause = t, why
            elif stall_cause != why:  # the reason changed: close one stall, open the next
                if t > stall_since + _EPS:
                    stalls.append(Stall(stall_cause, stall_since, t, i))
                stall_since, stall_cause = t, why
            return False
        if stall_since is not None:
            if t > stall_since + _EPS:
                stalls.append(Stall(stall_cause, stall_since, t, i))
            stall_since = None
        todo.pop()
        cs.reach = todo[-1] if todo else end
        if is_wait[i]:
            finish[i] = t
            return True
        if alloc[i]:
            allocate(i, t)
        target = instrs[i].target
        duration = cost[target] + issuing[i]
        cs.running, cs.until = i, t + duration
        if duration > 0:
            intervals.append(Interval(COMPUTE, t, t + duration, i, ops[target].name))
        return True

    return start_compute


def _copy_starter(facts: _Facts, finish: list[float], issued: list[bool], active: list[_Copy | None], cs: _Stream):
    """Step 2, ``start_copies(t)``: each idle copy lane starts its next copy, an idle network its next collective and
    an idle host its next host op, once the compute stream has reached it, its buffer is issued and what it waits
    for has finished; whether any lane started one. A collective or a host op is a ``_Copy`` of no bytes whose fixed
    part is its whole time."""
    queues, after, has_lanes, lane_deps = facts.queues, facts.after, facts.has_lanes, facts.lane_deps
    copy_bytes, hardware, fixed_s, lanes = facts.copy_bytes, facts.hardware, facts.fixed_s, facts.lanes
    latency = (hardware.h2d_latency_s, hardware.d2h_latency_s)
    lane_pos = [0, 0, 0, 0]

    def start_copies(t: float) -> bool:
        changed = False
        reach = cs.reach
        for lane in lanes:
            if active[lane] is not None:
                continue
            queue = queues[lane]
            if lane_pos[lane] >= len(queue):
                continue
            i = queue[lane_pos[lane]]
            if i >= reach or (after[i] >= 0 and finish[after[i]] < 0) or not issued[i]:
                continue
            if has_lanes and any(finish[d] < 0 for d in lane_deps[i]):
                continue
            lane_pos[lane] += 1
            active[lane] = _Copy(i, t, t + (latency[lane] if lane < 2 else fixed_s[i]), float(copy_bytes[i]))
            changed = True
        return changed

    return start_copies


def _copy_finisher(plan: Plan, intervals: list[Interval], active: list[_Copy | None], finished):
    """Step 4, ``finish_copies(t)``: the copies whose latency has passed and whose data has moved end, and the
    collective and host op whose time has passed; whether any did."""
    program, instrs = plan.program, plan.instructions
    streams = (H2D, D2H, NET, HOST)
    lanes = tuple(range(len(active)))

    def finish_copies(t: float) -> bool:
        changed = False
        for lane in lanes:
            copy = active[lane]
            if copy is not None and copy.latency_end <= t + _EPS and copy.remaining <= _EPS:
                intervals.append(Interval(streams[lane], copy.start, t, copy.instr,
                                          instrs[copy.instr].describe(program)))
                active[lane] = None
                finished(copy.instr, t)
                changed = True
        return changed

    return finish_copies


def _clock(plan: Plan, hardware: Hardware, active: list[_Copy | None], cs: _Stream):
    """``next_event(t)``: the time of the next event after ``t`` (the running compute ends, a copy's latency ends,
    a copy's data phase ends, both lanes moving data sharing the link, a collective or a host op ends), with the
    copies' data moved until then;
    None once nothing runs. Raises ``PlanError`` (``_stuck``) where time would not advance to a finite time."""
    bandwidth = (hardware.h2d_bw, hardware.d2h_bw)
    duplex_share = hardware.duplex_share
    # Every event ends something (an op, a copy's latency, a copy's data phase): at most three per instruction.
    # More means a time that never advances (NaN, or an infinite latency that slipped past the profile's checks):
    # refuse it rather than loop for ever.
    events_left = 4 * _EVENTS_PER_INSTRUCTION * len(plan.instructions) + 16
    has_host = len(active) > 3

    def next_event(t: float) -> float | None:
        nonlocal events_left
        h2d, d2h, net = active[0], active[1], active[2]
        moving_h2d = h2d is not None and h2d.latency_end <= t + _EPS
        moving_d2h = d2h is not None and d2h.latency_end <= t + _EPS
        share = duplex_share if moving_h2d and moving_d2h else 1.0
        nxt = cs.until if cs.running >= 0 else None
        if net is not None:
            nxt = net.latency_end if nxt is None or net.latency_end < nxt else nxt
        if has_host:
            host = active[3]
            if host is not None:
                nxt = host.latency_end if nxt is None or host.latency_end < nxt else nxt
        for copy, moving, bw in ((h2d, moving_h2d, bandwidth[0]), (d2h, moving_d2h, bandwidth[1])):
            if copy is not None:
                end = t + copy.remaining / (bw * share) if moving else copy.latency_end
                nxt = end if nxt is None or end < nxt else nxt
        if nxt is None:
            return None
        events_left -= 1
        if not t <= nxt < math.inf or events_left < 0:  # also NaN, which compares false
            raise _stuck(plan.program, plan.instructions, hardware, t, nxt, cs.running, active)
        for copy, moving, bw in ((h2d, moving_h2d, bandwidth[0]), (d2h, moving_d2h, bandwidth[1])):
            if moving:
                rate = bw * share
                if t + copy.remaining / rate <= nxt * (1 + 1e-12):
                    copy.remaining = 0.0  # this copy's data phase ends now (no float residue)
                else:
                    copy.remaining -= (nxt - t) * rate
        return nxt

    return next_event
