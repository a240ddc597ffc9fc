"""Discrete-event simulation of a Plan on a hardware profile: one compute stream, two copy lanes.

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

The plan is checked first (``check_plan``); an invalid plan raises ``PlanError`` naming the
instruction and is never simulated. Results are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from hyperoffload.analysis import memory_profile
from hyperoffload.analysis.dependency_bound import dependency_bound
from hyperoffload.cost import lane_op_time, op_times
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.instructions import COMPUTE, COPIES, D2H, H2D, RULES, alloc_bytes, copy_traffic, inputs_end_on_device
from hyperoffload.instructions import STREAMS  # noqa: F401 (re-exported)
from hyperoffload.ir import Program
from hyperoffload.memo import per_program
from hyperoffload.plans import Kind, Plan, PlanError, check_plan, op_storages, op_writes, owned_outputs
_EPS = 1e-12


class Interval(NamedTuple):
    """Busy time of one stream for one instruction (seconds from the start of the step). (A named tuple, as
    ``Stall``: immutable like a frozen dataclass and 2.5 times faster to make; a simulation of an 8B training
    step makes some 20k.)"""

    stream: str
    start: float
    end: float
    instruction: int
    label: str


class Stall(NamedTuple):
    """The compute stream waiting, with work left, on a copy or on memory (seconds)."""

    cause: str
    """``"copy"`` or ``"memory"``."""
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
    lower_bound = max(compute_s, h2d_bytes / hardware.h2d_bw, d2h_bytes / hardware.d2h_bw)
    budget = step.budget_bytes
    excess = bound = duplex_bound = None
    if budget is not None:
        excess, bound, duplex_bound = budget_bounds(step.program, hardware, compute_s, budget)
    return Figures(
        compute_s=compute_s, step_s=step_s, exposed_s=step_s - compute_s, lower_bound_s=lower_bound,
        slowdown=step_s / compute_s if compute_s else 1.0, peak_bytes=m.peak_bytes, h2d_bytes=h2d_bytes,
        d2h_bytes=d2h_bytes, stalls=len(counted),
        stall_copy_s=sum(s.end - s.start for s in counted if s.cause == "copy"),
        stall_memory_s=sum(s.end - s.start for s in counted if s.cause == "memory"),
        budget_bytes=budget, excess_bytes=excess, bound_s=bound, duplex_bound_s=duplex_bound,
        dependency_bound_s=dependency_bound(step.program, hardware, compute_s), steady_state=m.steady_state)


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


def simulate(plan: Plan, hardware: Hardware | str) -> Timeline:
    """Simulate ``plan`` on ``hardware`` (a profile or its name); raise ``PlanError`` if the plan is invalid.

    A plan that keeps storages in remote memory between steps (they start the step there and are
    sent back by its end, and every other input ends where it started) is simulated for two
    consecutive steps and timed in steady state: ``step_s`` is the time from the end of the first
    step's compute to the end of the second's, the peak and stalls cover both steps, and the
    timeline shows both.
    """
    hardware = as_hardware(hardware)
    if not _keeps_state_remote(plan):
        return _simulate(plan, hardware)
    from hyperoffload.repeat import repeat_plan

    single = plan
    doubled, starts = repeat_plan(plan, 2)
    try:
        timeline = _simulate(doubled, hardware, per_step=single)
    except PlanError:
        check_plan(plan)  # report the error against the plan as given, where it can be found
        raise
    ends = [max((iv.end for iv in timeline.intervals if iv.stream == COMPUTE and lo <= iv.instruction < hi),
                default=0.0) for lo, hi in ((starts[0], starts[1]), (starts[1], len(doubled.instructions)))]
    m = timeline.measured
    # The steady step's own stalls are those from the second step's first instruction on.
    steady = m._replace(step_s=max(ends[1] - ends[0], m.compute_s), steady_state=True, counted_from=starts[1])
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


def _simulate(plan: Plan, hardware: Hardware, per_step: Plan | None = None) -> Timeline:
    """Simulate ``plan``; figures that count one step's work (compute, bytes) come from ``per_step``."""
    check = check_plan(plan)
    program, instrs = plan.program, plan.instructions
    values = program.values
    cost = op_times(program, hardware)
    n = len(instrs)
    budget = plan.budget_bytes

    # Where the same thread issues copies and runs ops (``issue_s``), an op starts only once the cache
    # instructions before it have been issued.
    issuing = [0.0] * n
    pending_issue = 0
    for i, ins in enumerate(instrs):
        if ins.kind is Kind.COMPUTE:
            issuing[i], pending_issue = pending_issue * hardware.issue_s, 0
        else:
            pending_issue += 1

    # Static facts per instruction: bytes it allocates (``instructions.RULES``), what it must wait for.
    op_alloc, op_reads, op_writes = _op_facts(program)
    alloc = alloc_bytes(program, instrs, op_alloc)
    after: list[int] = [-1] * n  # a copy's data dependency (instruction that must finish first)
    last_writer: dict[int, int] = {}
    last_offload: dict[int, int] = {}
    readers_since: dict[int, int] = {}
    # Storages each instruction frees once it finishes (check_plan's automatic frees after a last use); an
    # offload that is a storage's last use frees it only once its last reader has finished too (below).
    frees_after = list(check.frees_after)
    # A RELEASE, or an offload that is a storage's last use (by instruction index) -> (the storage, the
    # instructions that must finish before its bytes come back).
    deferred_frees: dict[int, tuple[int, list[int]]] = {}
    compute_stream: list[int] = []
    lane_queue = {H2D: [], D2H: []}
    pending_transfer: dict[int, int] = {}
    last_transfer: dict[int, int] = {}  # storage -> its latest offload or prefetch so far
    wait_for = [-1] * n
    on_lane = [False] * n  # copies: prefetches, offloads and lane ops
    copy_bytes = [0] * n
    # Lane ops wait for the ops they depend on, and compute ops for the lane ops they depend on; a step
    # without lane ops (every training step) needs none of this bookkeeping.
    has_lanes = program.has_lane_ops()
    op_instr = {ins.target: i for i, ins in enumerate(instrs) if ins.kind is Kind.COMPUTE} if has_lanes else {}
    deps = program.dependencies() if has_lanes else ()
    lane_deps: list[tuple[int, ...]] = [()] * n  # lane op: the ops it waits for; compute op: the lane ops
    for i, ins in enumerate(instrs):
        if ins.kind in COPIES:  # an offload or a prefetch: its storage's bytes on its copy lane
            on_lane[i], copy_bytes[i] = True, values[ins.target].alloc_bytes
            lane_queue[RULES[ins.kind].stream].append(i)
        if ins.kind is Kind.COMPUTE:
            op = program.ops[ins.target]
            for s in op_reads[ins.target]:
                readers_since[s] = i
            for s in op_writes[ins.target]:
                last_writer[s] = i
            if op.lane is None:
                compute_stream.append(i)
                if has_lanes:
                    lane_deps[i] = tuple(op_instr[d] for d in deps[ins.target] if program.ops[d].lane is not None)
            else:
                # A lane op moves its bytes, or, where the profile measured its kernel as slower than the link
                # (a Python kernel on an emulated link), takes that long: as many bytes as the lane moves then.
                lane_bw, lane_latency = ((hardware.h2d_bw, hardware.h2d_latency_s) if op.lane == "h2d"
                                         else (hardware.d2h_bw, hardware.d2h_latency_s))
                on_lane[i] = True
                copy_bytes[i] = max(op.transfer_bytes, (lane_op_time(op, hardware) - lane_latency) * lane_bw)
                lane_deps[i] = tuple(op_instr[d] for d in deps[ins.target])
                lane_queue[H2D if op.lane == "h2d" else D2H].append(i)
        elif ins.kind is Kind.WAIT:
            wait_for[i] = pending_transfer.pop(ins.target)
            compute_stream.append(i)
        elif ins.kind is Kind.OFFLOAD:
            after[i] = last_writer.get(ins.target, -1)
            last_offload[ins.target] = i
            pending_transfer[ins.target] = i
            if ins.target in frees_after[i]:
                # The copy may land while the op that last read the storage still runs (the offload waits
                # only for the last writer): its bytes come back when both are done.
                frees_after[i] = tuple(x for x in frees_after[i] if x != ins.target)
                reader = readers_since.get(ins.target, -1)
                deferred_frees[i] = (ins.target, [i] if reader < 0 else [i, reader])
            last_transfer[ins.target] = i
        elif ins.kind is Kind.PREFETCH:
            after[i] = last_offload.get(ins.target, -1)
            pending_transfer[ins.target] = i
            last_transfer[ins.target] = i
        else:  # RELEASE: frees its storage (FREES_TARGET)
            # The bytes come back once the last reader has finished and the storage's last copy has landed,
            # whether or not a WAIT for that copy came first: a waited offload may still be moving when its
            # last reader ends, and a prefetched storage is not there to free before its copy lands.
            needs = [readers_since.get(ins.target, -1), last_transfer.get(ins.target, -1)]
            deferred_frees[i] = (ins.target, [x for x in dict.fromkeys(needs) if x >= 0])
    allocating = [i for i in range(n) if alloc[i] > 0]
    blocked_releases: dict[int, list[int]] = {}
    outstanding: dict[int, int] = {}
    for r, (_, needs) in deferred_frees.items():
        outstanding[r] = len(needs)
        for x in needs:
            blocked_releases.setdefault(x, []).append(r)
    freed_bytes = [sum(values[s].alloc_bytes for s in frees) if frees else 0 for frees in frees_after]
    is_wait = [ins.kind is Kind.WAIT for ins in instrs]

    finish = [-1.0] * n
    issued = [alloc[i] == 0 for i in range(n)]
    usage = check.initial_bytes
    peak = usage
    memory: list[tuple[float, int]] = [(0.0, usage)]
    intervals: list[Interval] = []
    stalls: list[Stall] = []
    t = 0.0
    # The compute stream: the next instruction to start is compute_stream[compute_pos]; every instruction
    # before plan position ``reach`` (that one, or n once the stream is done) has been reached, which is what
    # lets a copy be issued.
    compute_pos, n_stream = 0, len(compute_stream)
    reach = compute_stream[0] if compute_stream else n
    compute_busy_until = 0.0
    compute_running = -1
    next_alloc, n_allocating = 0, len(allocating)  # the next allocation in plan order
    # Copy lanes, indexed 0 (H2D) and 1 (D2H).
    lanes = (H2D, D2H)
    queues = (lane_queue[H2D], lane_queue[D2H])
    lane_pos = [0, 0]
    active: list[_Copy | None] = [None, None]
    bandwidth = (hardware.h2d_bw, hardware.d2h_bw)
    latency = (hardware.h2d_latency_s, hardware.d2h_latency_s)
    stall_since: float | None = None
    stall_cause = ""

    def allocate(i: int) -> None:
        """Allocate instruction ``i``'s bytes (the next allocation in plan order) at time t."""
        nonlocal usage, peak, next_alloc
        usage += alloc[i]
        peak = max(peak, usage)
        memory.append((t, usage))
        next_alloc += 1

    def free(nbytes: int, when: float) -> None:
        nonlocal usage
        if nbytes:
            usage -= nbytes
            memory.append((when, usage))

    def finished(i: int, when: float) -> None:
        finish[i] = when
        free(freed_bytes[i], when)
        for r in blocked_releases.get(i, ()):
            outstanding[r] -= 1
            if outstanding[r] == 0:
                free(values[deferred_frees[r][0]].alloc_bytes, when)

    for storage, needs in deferred_frees.values():
        if not needs:  # released before anything read or copied it this step: free from the start
            free(values[storage].alloc_bytes, 0.0)

    # Every event ends something (an op, a copy's latency, a copy's data phase): at most three per instruction.
    # More means a time that never advances (NaN, or an infinite latency that slipped past the profile's checks):
    # refuse it rather than loop for ever.
    events_left = 4 * _EVENTS_PER_INSTRUCTION * n + 16
    while True:
        # At time t, run the five steps below in turn until none of them changes anything: the loop ends at a
        # step that changes nothing and was the last to change something, the other four having changed
        # nothing since. (A step that changes nothing has no effect, so running them all once more, round
        # after round, would end in the same state.)
        last = -1  # the step that last changed something
        while True:
            # 0. Prefetches and lane ops are issued, and their buffers allocated, when the compute stream
            # reaches them, in plan order, and while the budget has room.
            changed = False
            while next_alloc < n_allocating:
                i = allocating[next_alloc]
                if not on_lane[i] or i >= reach or (budget is not None and usage + alloc[i] > budget):
                    break
                allocate(i)
                issued[i] = True
                changed = True
            if changed:
                last = 0
            elif last == 0:
                break
            # 1. The compute stream starts its next instruction.
            changed = False
            if compute_running < 0 and compute_pos < n_stream:
                i = compute_stream[compute_pos]
                if is_wait[i]:
                    why = "copy" if finish[wait_for[i]] < 0 else ""
                elif has_lanes and any(finish[d] < 0 for d in lane_deps[i]):
                    why = "copy"
                elif alloc[i] and (allocating[next_alloc] != i or (budget is not None and usage + alloc[i] > budget)):
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
                else:
                    if stall_since is not None:
                        if t > stall_since + _EPS:
                            stalls.append(Stall(stall_cause, stall_since, t, i))
                        stall_since = None
                    compute_pos += 1
                    reach = compute_stream[compute_pos] if compute_pos < n_stream else n
                    changed = True
                    if is_wait[i]:
                        finish[i] = t
                    else:
                        if alloc[i]:
                            allocate(i)
                        target = instrs[i].target
                        duration = cost[target] + issuing[i]
                        compute_running, compute_busy_until = i, t + duration
                        if duration > 0:
                            intervals.append(Interval(COMPUTE, t, t + duration, i, program.ops[target].name))
            if changed:
                last = 1
            elif last == 1:
                break
            # 2. Copy lanes start their next copies.
            changed = False
            for lane in (0, 1):
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
                active[lane] = _Copy(i, t, t + latency[lane], float(copy_bytes[i]))
                changed = True
            if changed:
                last = 2
            elif last == 2:
                break
            # 3. The running compute finishes (one of zero duration at once).
            if compute_running >= 0 and compute_busy_until <= t + _EPS:
                finished(compute_running, t)
                compute_running = -1
                last = 3
            elif last == 3:
                break
            # 4. Copies finish.
            changed = False
            for lane in (0, 1):
                copy = active[lane]
                if copy is not None and copy.latency_end <= t + _EPS and copy.remaining <= _EPS:
                    intervals.append(Interval(lanes[lane], copy.start, t, copy.instr,
                                              instrs[copy.instr].describe(program)))
                    active[lane] = None
                    finished(copy.instr, t)
                    changed = True
            if changed:
                last = 4
            elif last in (4, -1):  # -1: a whole first round without change
                break

        # Next event: the running compute ends, a copy's latency ends, or a copy's data phase ends (both lanes
        # moving data share the link).
        h2d, d2h = active
        moving_h2d = h2d is not None and h2d.latency_end <= t + _EPS
        moving_d2h = d2h is not None and d2h.latency_end <= t + _EPS
        share = hardware.duplex_share if moving_h2d and moving_d2h else 1.0
        nxt = compute_busy_until if compute_running >= 0 else None
        for copy, moving, bw in ((h2d, moving_h2d, bandwidth[0]), (d2h, moving_d2h, bandwidth[1])):
            if copy is not None:
                end = t + copy.remaining / (bw * share) if moving else copy.latency_end
                nxt = end if nxt is None or end < nxt else nxt
        if nxt is None:
            break
        events_left -= 1
        if not t <= nxt < math.inf or events_left < 0:  # also NaN, which compares false
            raise _stuck(program, instrs, hardware, t, nxt, compute_running, active)
        for copy, moving, bw in ((h2d, moving_h2d, bandwidth[0]), (d2h, moving_d2h, bandwidth[1])):
            if moving:
                rate = bw * share
                if t + copy.remaining / rate <= nxt * (1 + 1e-12):
                    copy.remaining = 0.0  # this copy's data phase ends now (no float residue)
                else:
                    copy.remaining -= (nxt - t) * rate
        t = nxt

    unfinished = [i for i in range(n) if finish[i] < 0 and instrs[i].kind is not Kind.RELEASE]
    if unfinished:
        i = unfinished[0]
        raise PlanError(i, f"{instrs[i].describe(program)} can never run: the plan deadlocks "
                           f"(device memory {usage} bytes, budget {budget})")

    step = per_step or plan
    compute_s = float(sum(op_times(step.program, hardware))) if per_step else float(sum(cost))
    step_s = max((iv.end for iv in intervals), default=0.0)
    memory.sort(key=lambda e: e[0])
    measured = _Measured(hardware=hardware, per_step=step, compute_s=compute_s, step_s=step_s, peak_bytes=peak,
                         steady_state=False, counted_from=0)
    return Timeline(intervals=tuple(intervals), memory=tuple(memory), stalls=tuple(stalls), plan=plan,
                    measured=measured)
