"""A lower bound on the step time of every plan, in every execution order, under a budget.

``bound_s`` (docs/figures.md) lets the excess cross the link once each way at full speed with both
directions running at once. Two facts make every real plan slower than that, whatever its schedule
and whatever order it runs the ops in:

* **Some bytes are live at an op in every order.** Take an op. Every order runs the ops it depends on
  before it and the ops that depend on it after it, so a storage made by one of the first and used by
  one of the second (or by the op itself), a step output made by one of the first, and every input and
  constant (the caller holds them across the step), is live while it runs. Of those *forced* bytes,
  all above the budget must be off the device there (and none of what the op itself touches). That holds
  at every op; the bound takes it at the op where the captured step peaks and, in each phase, at the op of
  most live bytes in the captured order, and keeps the largest. In training the backward pass's fullest op
  (its first) forces every saved activation and all the state; where the captured step peaks in the
  optimizer (``llama3-70b``, with every gradient live), the gradients are not forced there, since an
  order that updates during the backward pass frees them early, so the bound at the backward pass's first
  op is the higher (docs/results.md, "Planning results (simulated)", has the figures).
* **Those bytes cross the link both ways.** A storage off the device at that op was sent out
  after it was last written, in this step or, for state kept remote, the previous one (a storage the
  step never writes needs no offload: its remote copy stays current), and comes back if anything
  after that op reads it, or, for state the step reads, for the next step's read. Per step, that is: the
  bound is for plans that end the step with every input where it started, so that they can run step after
  step (every policy's plans do, and the simulator times those that keep state remote in steady state); a
  plan that starts state remote and leaves it on the device has sent it out in no step at all. While both
  directions copy, each gets ``duplex_share`` of its bandwidth (``Hardware.duplex_share``), so moving ``d``
  seconds of D2H and ``h`` seconds of H2D (each at full speed alone) takes at least
  ``min(d, h) / share + |d - h|`` seconds, or ``d + h`` where the share is at most one half and copying one
  direction at a time is faster.
* **Some of them cross one way before the op and the other way after it.** The step's time splits at the op's
  start: the first phase runs from the step's start (the end of the last step's compute) to there, the
  second from there to the end of the step's compute. A storage the step makes (a saved activation), or
  writes before the op in every order, goes out after that write and has landed before the op starts, so
  its offload runs in the first phase; one that an op after it reads comes back by a prefetch issued after
  the op starts (one issued before would hold its memory there), in the second. Only the other copies
  (state written or read only elsewhere in the step, whose copy may run in the previous or next step) may
  fall in either, and the first phase runs at least the ops every order runs before the op, the second the
  op and those after it. So the saved activations a training step must keep off at the start of its
  backward pass go out during the forward pass and come back during the backward pass, one direction at a
  time, whatever the link shares: the least time over how the excess splits into what can go and how the
  copies split between the phases is a small LP (one variable per phase and kind of copy).

**Two ops.** Take also a second op ``Y`` that every order runs after the first, ``X`` (the op of most forced
bytes among those above, and each of the few ops after it that touch the most bytes: in training, the large
updates of the optimizer phase). Enough must be off at each. A storage off at either costs a step one offload
if the step writes it (one per step serves both: the step writes it once, or the cost is only higher), and a
prefetch for each off stretch that has to come back: one that is off at ``X`` comes back if an op after ``X``
reads it, or, for state the step reads, for the next step's read; likewise at ``Y``. Off at both, the two are
one stretch unless the storage is read both between them (by an op after ``X`` and before ``Y`` in every order)
and between ``Y`` and the next step's ``X`` (by an op after ``Y``, or, for state, which lives on into the next
step, before ``X``); then it comes in twice a step. A parameter off at the peak and again during the optimizer
phase is read in the backward pass between them and in the forward pass after: where one large update
needs much of the budget (``llama3-8b`` training on a fast link at its smallest budgets, the embedding's
update), those second prefetches raise the bound above the one at the peak alone (docs/results.md,
"Planning results (simulated)"). The least copy time over how much of each storage is off at each op is a
small linear program (one row per storage and rule, solved with HiGHS). It lets every copy share the link,
without the phases of the one-op bound: looser there, and kept for the parameters it counts twice.

The bound is the largest of the step's compute time, that copy time and the time its collectives take on the
network one after another (``cost.network_time``: every plan runs each collective, and the network lane runs one at
a time). Compute, copies and collectives run on separate streams, each of which runs all of its share of every step
one thing at a time, so each alone bounds the step, also in steady state (a step's period), and so does their
largest. (A chain of collectives and the compute between them, ``dependency_bound``, bounds one step's makespan but
not a period: consecutive steps may overlap one's tail with the next one's head.) It holds for every plan of
the program (every op on the device, each storage moved whole) because it depends on neither the
order nor the schedule; the window bound (``window_bound``) is usually tighter for one order, since it
also knows when the copies can run. It is what rules out ``step_s <= 1.05 x bound_s`` on a link-bound
step: where the forced bytes are the whole peak and all of them are state that crosses both ways, it is
``bound_s / duplex_share``; where saved activations must be among them, more, since they cross one
direction at a time (the figures with and without the phases: docs/results.md, "Planning results
(simulated)").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperoffload.analysis.lifetimes import memory_profile
from hyperoffload.analysis.lp import SOLVER_MARGIN, link_rows, solved
from hyperoffload.cost import network_time, op_times
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.ir import Program
from hyperoffload.memo import per_program
from hyperoffload.plans import op_storages, state_storages


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkBound:
    """The bound and what sets it (seconds, bytes)."""

    seconds: float
    """No plan of the program, in any order, steps faster under the budget (simulator semantics), of those that
    end the step with every input where it started (every policy's plans; see the module docstring). A
    decode step's remote-KV form (``variants``) is another program, with a bound of its own."""
    compute_s: float
    peak_op: int
    """Id of the op the forced bytes are live at (of those the bound is taken at, the one that gives the largest
    bound; -1: no ops)."""
    forced_bytes: int
    """Bytes live while ``peak_op`` runs in every order (the captured peak may be higher)."""
    excess_bytes: int
    """``max(0, forced_bytes - budget)``: what every plan has off the device at ``peak_op``."""
    d2h_bytes: int
    """Bytes the bound's least-time split of the excess sends out (storages the step never writes need no
    offload)."""
    h2d_bytes: int
    """Bytes it brings back (storages nothing reads after ``peak_op``, and state the step does not read, need
    not come back)."""
    second_op: int = -1
    """Where the bound is taken at two ops (see the module docstring), the second (after ``peak_op`` in every
    order; ``d2h_bytes`` and ``h2d_bytes`` are then the least a step moves for both); -1 where one op sets it."""
    network_s: float = 0.0
    """The step's collectives one after another on the network (0 for a step of one rank)."""


@dataclass(frozen=True, slots=True)
class _Forced:
    peak_op: int
    forced: int
    classes: tuple[tuple[str, str, int], ...] = ()
    """The forced storages that may be off at the peak op, by when their copies can run (see ``_phases``):
    ``(offload, prefetch, bytes)``, the offload ``"before"`` the op, ``"any"`` time of the step or ``"none"``,
    the prefetch ``"after"`` it, ``"any"`` or ``"none"``."""
    before: tuple[int, ...] = ()
    """Ops every order runs before the peak op; ``after``: the peak op and those every order runs after it."""
    after: tuple[int, ...] = ()


def _closure(start: int, edges) -> set[int]:
    """Ops reachable from ``start`` along ``edges`` (``start`` itself excluded)."""
    seen: set[int] = set()
    stack = [start]
    while stack:
        for nxt in edges[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


@per_program
def _forced(program: Program) -> tuple[_Forced, ...]:
    """What the bound needs of ``program`` whatever the budget and hardware, at each op it is taken at (see
    ``link_bound``), computed once per program."""
    return _forced_at_candidates(program)


def _forced_at_candidates(program: Program) -> tuple[_Forced, ...]:
    """``_forced_of`` at the op where the captured step peaks and, in each phase, at the op of most live bytes
    in the captured order (the captured peak op first)."""
    profile = memory_profile(program)
    if profile.peak_position < 0:
        return (_Forced(-1, sum(program.values[s].alloc_bytes for s in state_storages(program))),)
    fullest: dict[object, int] = {}  # phase -> position of most live bytes (the first such)
    for position, op_id in enumerate(profile.order):
        phase = program.ops[op_id].phase
        if phase not in fullest or profile.live_bytes[position] > profile.live_bytes[fullest[phase]]:
            fullest[phase] = position
    ops = dict.fromkeys([profile.order[profile.peak_position], *(profile.order[p] for p in fullest.values())])
    return tuple(_forced_of(program, op_id) for op_id in ops)


def _forced_of(program: Program, peak_op: int) -> _Forced:
    values = program.values
    before, after, forced = _forced_set(program, peak_op)
    touched, read, written = op_storages(program)
    # What the peak op itself touches must be on the device while it runs: the excess is made of the rest.
    movable = forced - touched[peak_op]
    state = state_storages(program)
    made, ever_written, read_in_step = _written_and_read(program)
    written_before = set().union(*(written[b] for b in before)) | made  # a storage made here is made before it
    read_after = set().union(*(read[a] for a in after))
    classes: dict[tuple[str, str], int] = {}
    for s in movable:
        offload = "none" if s not in ever_written else "before" if s in written_before else "any"
        prefetch = "after" if s in read_after else "any" if s in state and s in read_in_step else "none"
        classes[(offload, prefetch)] = classes.get((offload, prefetch), 0) + values[s].alloc_bytes
    return _Forced(peak_op=peak_op, forced=sum(values[s].alloc_bytes for s in forced),
                   classes=tuple((o, h, b) for (o, h), b in sorted(classes.items())),
                   before=tuple(sorted(before)), after=tuple(sorted({peak_op, *after})))


def _phases(forced: _Forced, hardware: Hardware, budget_bytes: int, times: tuple[float, ...]
            ) -> tuple[float, float, float] | None:
    """Least seconds, D2H bytes and H2D bytes of a step with the excess off the device at ``forced.peak_op``,
    or None where that cannot be (an LP; see the module docstring), in two phases: from the step's start
    (the end of the last step's compute) to the op's start, and from there to the end of the step's compute.
    The first runs at least the ops every order runs before the op, the second the op and those after it.
    A storage the step makes, or writes before the op in every order, goes out in the first phase; one read
    after the op comes back in the second; other copies (state written or read only elsewhere in the step,
    whose copy may come from or go to the previous or next step) may run in either. In each phase the link
    moves at most what its rows allow in the phase's time."""
    from scipy.optimize import linprog

    excess = forced.forced - budget_bytes
    if excess <= 0:
        return 0.0, 0.0, 0.0
    if not forced.classes:
        return None
    unit = float(excess)  # bytes, and time in what the H2D lane moves that in
    tau = unit / hardware.h2d_bw
    t_d2h = hardware.h2d_bw / hardware.d2h_bw  # a unit's D2H seconds, in units of tau
    # Variables: T1, T2, then per class: bytes off (x), offloaded in each phase (o1, o2), prefetched in each (q1, q2).
    k = len(forced.classes)
    n_vars = 2 + 5 * k
    x = lambda c: 2 + 5 * c  # noqa: E731
    eq_rows, eq_rhs, ub_rows, ub_rhs = [], [], [], []
    upper = [np.inf, np.inf]
    lower = [sum(times[o] for o in forced.before) / tau, sum(times[o] for o in forced.after) / tau]
    for c, (offload, prefetch, nbytes) in enumerate(forced.classes):
        # o2 only for an offload that may run in either phase; q1 likewise (one "after" runs in the second)
        upper += [nbytes / unit, np.inf, 0.0 if offload != "any" else np.inf, 0.0 if prefetch != "any" else np.inf,
                  np.inf]
        lower += [0.0] * 5
        row = np.zeros(n_vars)  # offloaded in the two phases = off, unless it needs no offload
        row[[x(c) + 1, x(c) + 2]] = 1.0
        if offload != "none":
            row[x(c)] = -1.0
        eq_rows.append(row)
        eq_rhs.append(0.0)
        row = np.zeros(n_vars)
        row[[x(c) + 3, x(c) + 4]] = 1.0
        if prefetch != "none":
            row[x(c)] = -1.0
        eq_rows.append(row)
        eq_rhs.append(0.0)
    row = np.zeros(n_vars)  # enough off
    for c in range(k):
        row[x(c)] = -1.0
    ub_rows.append(row)
    ub_rhs.append(-1.0)
    for phase in (0, 1):
        for a_h2d, b_d2h, coeff in link_rows(hardware.duplex_share):
            row = np.zeros(n_vars)
            for c in range(k):
                row[x(c) + 1 + phase] = b_d2h * t_d2h
                row[x(c) + 3 + phase] = a_h2d
            row[phase] = -coeff
            ub_rows.append(row)
            ub_rhs.append(0.0)
    objective = np.zeros(n_vars)
    objective[:2] = 1.0
    result = linprog(objective, A_ub=np.array(ub_rows), b_ub=np.array(ub_rhs), A_eq=np.array(eq_rows),
                     b_eq=np.array(eq_rhs), bounds=np.column_stack([lower, upper]), method="highs")
    if solved(result, "link bound (phases)") is None:
        return None
    sol = result.x
    d2h = sum(sol[x(c) + 1] + sol[x(c) + 2] for c in range(k)) * unit
    h2d = sum(sol[x(c) + 3] + sol[x(c) + 4] for c in range(k)) * unit
    return float(result.fun) * tau * (1.0 - SOLVER_MARGIN), d2h, h2d


def _written_and_read(program: Program) -> tuple[set[int], set[int], set[int]]:
    """(storages the step makes, those it writes, counting what it makes as written as it is made, those it
    reads)."""
    values = program.values
    _, read, written = op_storages(program)
    made = {o for op in program.ops for o in op.outputs if values[o].owns_storage}
    return made, set().union(*written) | made, set().union(*read)


@dataclass(frozen=True, slots=True)
class _Pair:
    """Two ops, ``first`` and ``second`` (after it in every order), and per storage that may be off the device
    at either: its bytes and what being off there costs a step (see the module docstring)."""

    first: int
    second: int
    forced_first: int
    """Bytes forced at ``first`` (live there in every order); ``forced_second`` likewise."""
    forced_second: int
    nbytes: np.ndarray
    away_first: np.ndarray
    """Whether the storage may be off at ``first`` (forced there, not touched by it); ``away_second`` likewise."""
    away_second: np.ndarray
    written: np.ndarray
    """Whether the step writes it (so being off anywhere costs an offload a step)."""
    back_first: np.ndarray
    """Whether being off at ``first`` costs a prefetch (read later in the step, or state read in the next)."""
    back_second: np.ndarray
    twice: np.ndarray
    """Whether being off at both costs two prefetches: read both between the two ops and between the second
    and the next step's first, in every order."""


@per_program
def _pairs(program: Program) -> tuple[_Pair, ...]:
    """``_Pair`` of the op of most forced bytes among those the bound is taken at, with each of the
    ``_SECONDS`` ops after it (in every order) that touch the most bytes; computed once per program."""
    singles = [f for f in _forced(program) if f.peak_op >= 0]
    if not singles:
        return ()
    first = max(singles, key=lambda f: f.forced).peak_op
    touched = op_storages(program)[0]
    values = program.values
    after = _closure(first, program.dependents())
    seconds = sorted(after, key=lambda o: (-sum(values[s].alloc_bytes for s in touched[o]), o))[:_SECONDS]
    return tuple(_pair_of(program, first, second) for second in seconds)


_SECONDS = 3


def _forced_set(program: Program, op: int) -> tuple[set[int], set[int], set[int]]:
    """(ops before ``op`` in every order, ops after it, storages live at it in every order)."""
    values = program.values
    state = state_storages(program)
    outputs = {values[v].storage for v in program.outputs}
    before = _closure(op, program.dependencies())
    after = _closure(op, program.dependents())
    touched = op_storages(program)[0]
    made_before = {o for op_id in (*before, op) for o in program.ops[op_id].outputs if values[o].owns_storage}
    used_from = set(touched[op]).union(*(touched[a] for a in after))
    return before, after, state | (made_before & (used_from | outputs))


def _pair_of(program: Program, first: int, second: int) -> _Pair:
    values = program.values
    touched, read, _ = op_storages(program)
    before_1, after_1, forced_1 = _forced_set(program, first)
    before_2, after_2, forced_2 = _forced_set(program, second)
    state = state_storages(program)
    _, ever_written, read_in_step = _written_and_read(program)
    read_after_1 = set().union(*(read[a] for a in after_1))
    read_after_2 = set().union(*(read[a] for a in after_2))
    read_between = set().union(*(read[o] for o in after_1 & before_2))
    # From the second op round to the next step's first: after the second, or, for state (it lives on into the
    # next step), before the first.
    read_across = set().union(*(read[o] for o in after_2)) | (state & set().union(*(read[o] for o in before_1)))
    away_1, away_2 = forced_1 - touched[first], forced_2 - touched[second]
    storages = sorted(away_1 | away_2)
    flag = lambda group: np.fromiter((s in group for s in storages), dtype=bool, count=len(storages))  # noqa: E731
    comes_back = state & read_in_step  # state kept off comes back for the next step's first read
    return _Pair(first=first, second=second,
                 forced_first=sum(values[s].alloc_bytes for s in forced_1),
                 forced_second=sum(values[s].alloc_bytes for s in forced_2),
                 nbytes=np.fromiter((values[s].alloc_bytes for s in storages), dtype=np.float64, count=len(storages)),
                 away_first=flag(away_1), away_second=flag(away_2), written=flag(ever_written),
                 back_first=flag(read_after_1 | comes_back), back_second=flag(read_after_2 | comes_back),
                 twice=flag(read_between & read_across))


def _pair_copies(pair: _Pair, hardware: Hardware, budget_bytes: int) -> tuple[float, float, float] | None:
    """Least copy seconds, D2H bytes and H2D bytes a step needs to be within ``budget_bytes`` at both of the
    pair's ops (an LP; see the module docstring), or None where that is not possible at all."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    need_1, need_2 = pair.forced_first - budget_bytes, pair.forced_second - budget_bytes
    if need_1 <= 0 or need_2 <= 0:
        return 0.0, 0.0, 0.0  # one op alone says as much
    unit = float(max(need_1, need_2))
    size = pair.nbytes / unit
    k = size.size
    # Variables, per storage: bytes off at the first op (x), at the second (y), offloaded (d), prefetched (h);
    # then the copy time L (in what the H2D lane moves a unit in).
    x, y, d, h, copy = 0, k, 2 * k, 3 * k, 4 * k
    ids = np.arange(k)
    rows, cols, vals = [], [], []
    r = 0

    def pairwise(mask, a, b):
        """Rows a_i - b_i <= 0 for the storages in ``mask``."""
        nonlocal r
        chosen = ids[mask]
        n = chosen.size
        rows.extend([np.arange(r, r + n)] * 2)
        cols.extend([a + chosen, b + chosen])
        vals.extend([np.ones(n), -np.ones(n)])
        r += n

    pairwise(pair.written, x, d)  # d >= x, d >= y
    pairwise(pair.written, y, d)
    pairwise(pair.back_first & ~pair.twice, x, h)  # h >= x, h >= y
    pairwise(pair.back_second & ~pair.twice, y, h)
    twice = ids[pair.twice]  # h >= x + y
    rows.extend([np.arange(r, r + twice.size)] * 3)
    cols.extend([x + twice, y + twice, h + twice])
    vals.extend([np.ones(twice.size), np.ones(twice.size), -np.ones(twice.size)])
    r += twice.size
    rhs = [np.zeros(r)]
    for start, need in ((x, need_1), (y, need_2)):  # enough off at each op
        rows.append(np.full(k, r))
        cols.append(start + ids)
        vals.append(-np.ones(k))
        rhs.append(np.array([-need / unit]))
        r += 1
    t_d2h = hardware.h2d_bw / hardware.d2h_bw  # a unit's D2H seconds, in H2D seconds of a unit
    for a_h2d, b_d2h, c in link_rows(hardware.duplex_share):
        rows.append(np.full(2 * k + 1, r))
        cols.append(np.concatenate([h + ids, d + ids, [copy]]))
        vals.append(np.concatenate([np.full(k, a_h2d), np.full(k, b_d2h * t_d2h), [-c]]))
        rhs.append(np.zeros(1))
        r += 1
    matrix = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r, 4 * k + 1))
    upper = np.concatenate([np.where(pair.away_first, size, 0.0), np.where(pair.away_second, size, 0.0),
                            np.where(pair.written, size, 0.0), 2 * size, [np.inf]])
    objective = np.zeros(4 * k + 1)
    objective[copy] = 1.0
    result = linprog(objective, A_ub=matrix.tocsr(), b_ub=np.concatenate(rhs),
                     bounds=np.column_stack([np.zeros(4 * k + 1), upper]), method="highs")
    if solved(result, "link bound") is None:
        return None
    seconds = float(result.x[copy]) * unit / hardware.h2d_bw * (1.0 - SOLVER_MARGIN)
    return seconds, float(result.x[d:h].sum()) * unit, float(result.x[h:copy].sum()) * unit


def least_off_device(program: Program, budget_bytes: int) -> tuple[int, int]:
    """``(bytes, op id)``: the most bytes that every plan of ``program`` under ``budget_bytes``, in every order, has
    off the device while that op runs (its forced bytes above the budget; module docstring, first point). Live data
    off the device is in remote memory, so no plan keeps fewer bytes there. (0, -1) where nothing must leave."""
    fullest = max(_forced(program), key=lambda f: f.forced)
    excess = fullest.forced - budget_bytes
    return (excess, fullest.peak_op) if excess > 0 else (0, -1)


def link_bound(program: Program, hardware: Hardware | str, budget_bytes: int) -> LinkBound:
    """The link bound of ``program`` under ``budget_bytes`` on ``hardware`` (see the module docstring)."""
    hardware = as_hardware(hardware)
    compute_s = float(sum(op_times(program, hardware)))
    network_s = network_time(program, hardware)
    floor = max(compute_s, network_s)  # each stream alone
    streams = {"compute_s": compute_s, "network_s": network_s}
    best: LinkBound | None = None
    times = op_times(program, hardware)
    for f in _forced(program):  # the argument holds at every op: the bound is the largest
        excess = max(0, f.forced - budget_bytes)
        phased = _phases(f, hardware, budget_bytes, times)
        if phased is None:  # even every storage that may leave would not do: no plan meets the budget
            phased = (float("inf"), 0.0, 0.0)
        copies, d2h, h2d = phased
        bound = LinkBound(seconds=max(floor, copies), peak_op=f.peak_op, forced_bytes=f.forced, excess_bytes=excess,
                          d2h_bytes=round(d2h), h2d_bytes=round(h2d), **streams)
        if best is None or bound.seconds > best.seconds:
            best = bound
    for pair in _pairs(program):
        copies = _pair_copies(pair, hardware, budget_bytes)
        if copies is not None and copies[0] > best.seconds:
            best = LinkBound(seconds=copies[0], peak_op=pair.first, second_op=pair.second,
                             forced_bytes=pair.forced_first, excess_bytes=max(0, pair.forced_first - budget_bytes),
                             d2h_bytes=int(copies[1]), h2d_bytes=int(copies[2]), **streams)
    return best
