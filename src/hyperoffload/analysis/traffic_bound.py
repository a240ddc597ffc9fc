"""The traffic bound: the least copy time of any plan that runs a step's ops in a given order under a budget,
as a linear program.

The window bound (``analysis.window_bound``) and the flow bound (``analysis.flow_bound``) ask when the copies
can run. This one asks only how much has to cross, but at every op of the order: a plan has to keep enough
off the device while each op starts, every storage it keeps off goes out after its last write and comes back
before its next use, and the link moves all of that in the step. On a link that shares both ways
(``Hardware.duplex_share``; NVLink-C2C's 0.5) that copy time, not the schedule, is what sets the step time
at small budgets, and it can be well above what the excess alone needs: parameters that must be off both
at the peak and across the optimizer phase come in twice per step.

**Memory at each op.** While op ``p`` (a compute op) starts, the device holds every storage the unplanned step
holds there (``check_plan(plan_without_offload(...)).live_bytes``) except those that are off, and at most the
budget; so the bytes off are at least ``need(p) = live(p) - budget``. A storage off at ``p`` is not used by
op ``p``, so it lies in one of its segments (``analysis.segments``). ``z_i`` in ``[0, b_i]`` is how much of
segment ``i`` is off; a plan's point sets it to ``b_i`` if the storage is off while any op of the segment
starts, else 0, and at every compute op ``sum of z_i over the segments around it >= need(p)``.

**Copies.** A segment a plan keeps off comes back by a prefetch before the use that ends it, if that use is in
this step and not after the last compute op (there the prefetch may trail the compute this bound counts): at
least ``z_i`` bytes of H2D. It went out after the last write before it: one offload of at least ``y_e`` bytes
for each write epoch ``e`` (the storage, and its last write before the segment) with ``y_e >= z_i`` for every
segment of the epoch; segments of one epoch share the offload, since a copy stays current until the next
write. A storage the step starts with and writes is per step what it is after the step's last write: its
segments before its first write share that epoch's offload (the previous step's, for state kept in remote
memory), as in the link bound (``analysis.link_bound``: the bound is for plans that end the step with every
input where it started, so that they can run step after step; the simulator times those that keep state
remote in steady state). A storage the step never writes needs no offload: its remote copy stays current.
Likewise, a storage the step starts with and uses within its compute is per step off in one stretch from
its last use to its first: its segment after the last use and its segment before the first share one
prefetch (``r_g >= z_i`` for both), which brings it back before its first use in the next step or, for a plan
that does not keep it remote, before this step ends.

**Link.** ``X`` and ``Y`` are the seconds the H2D and D2H bytes take at full speed alone. While both
directions copy each gets ``duplex_share`` of its bandwidth, so, as in the flow bound, the copy time ``L``
satisfies ``share X + (1 - share) Y <= share L`` and ``(1 - share) X + share Y <= share L`` for
``share >= 1/2``, else ``X + Y <= L``. Copy latencies and the program's own lane ops are left out, which
loosens.

The LP minimises ``L``; the bound is ``max(compute_s, L)``. The memory rows are intervals of consecutive
positions, so they are written as a flow along the order (one arc per position, one per segment) and the LP
has a few nonzeros per position and segment; HiGHS's interior point method solves it, faster than its simplex
on full-size steps (solve times: docs/results.md, "Planning results (simulated)"). Its optimum is reduced by a
relative ``1e-7`` so that solver tolerance does not put the bound above a plan that meets it exactly.

It knows nothing of time within the step, so it is often looser than the window or flow bound; it is tighter
where the copies' volume, not their timing, decides, as on a fast link at a small budget, where state kept
remote comes back twice a step (``llama3-8b`` training on ``gh200`` at 10% of the peak: docs/results.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyperoffload.analysis.lp import SOLVER_MARGIN, SparseProgram, link_rows, solved
from hyperoffload.analysis.segments import OrderProfile, Segment, order_profile, segments
from hyperoffload.analysis.uses import Uses, storage_uses
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import state_storages


@dataclass(frozen=True, slots=True, kw_only=True)
class TrafficBound:
    """The traffic bound and what sets it (seconds, bytes)."""

    seconds: float
    """No plan in this order under this budget steps faster (simulator semantics; of the plans that end the
    step with every input where it started): ``max(compute_s, copy_s)``; ``inf`` if the budget cannot be met
    in this order at all (``status == "infeasible"``)."""
    compute_s: float
    copy_s: float
    """The least time the link needs for the copies any plan in the order has to make (0 where it fits)."""
    status: str
    """``"fits"`` (the unplanned step is within the budget: no LP), ``"optimal"`` or ``"infeasible"`` (at some
    op even every storage off would not bring the device under the budget)."""
    h2d_bytes: float = 0.0
    """Bytes the LP's least copy time moves remote -> device (of those, the fewest)."""
    d2h_bytes: float = 0.0
    """Bytes it moves device -> remote."""
    segments: int = 0
    variables: int = 0
    constraints: int = 0
    solve_s: float = 0.0
    """Wall seconds to build and solve the LP (a real CPU timing)."""


def traffic_bound(program: Program, hardware: Hardware, budget_bytes: int,
                  order: Sequence[int] | None = None) -> TrafficBound:
    """The traffic bound of ``program`` run in ``order`` (default: as captured) under ``budget_bytes``."""
    started = time.perf_counter()
    profile = order_profile(program, hardware, order)
    compute = float(profile.times.sum())
    need = _need(profile, budget_bytes)
    if not need.any():
        return TrafficBound(seconds=compute, compute_s=compute, copy_s=0.0, status="fits",
                            solve_s=time.perf_counter() - started)
    uses = storage_uses(program, profile.order)
    found = segments(program, profile.order, uses)
    copies = _copies(program, profile, found, uses)
    scale = _scale(hardware, need)
    lp, columns, a_eq, b_eq = _build_program(program, found, copies, need, scale, hardware.duplex_share)
    constraints = a_eq.shape[0] + lp.constraints
    bounds = lp.bounds()
    if (bounds[:, 1] < bounds[:, 0] - 1e-12).any():
        return _infeasible(compute, len(found), lp.variables, constraints, started)
    result = lp.solve(_objective(columns, lp.variables), a_eq=a_eq, b_eq=b_eq)
    solve_s = time.perf_counter() - started
    if solved(result, "traffic bound") is None:
        return _infeasible(compute, len(found), lp.variables, constraints, started)
    copy_s = float(result.x[columns.copy_time]) * scale.t_h2d * (1.0 - SOLVER_MARGIN)
    return TrafficBound(seconds=max(compute, copy_s), compute_s=compute, copy_s=copy_s, status="optimal",
                        h2d_bytes=float(result.x[columns.prefetches:columns.copy_time].sum()) * scale.unit,
                        d2h_bytes=float(result.x[columns.offloads:columns.prefetches].sum()) * scale.unit,
                        segments=len(found), variables=lp.variables, constraints=constraints, solve_s=solve_s)


def _build_program(program: Program, found: list[Segment], copies: _Copies, need: np.ndarray, scale: _Scale,
                   duplex_share: float):
    """The traffic bound's LP: its variables with their bounds and inequality rows, and its equality rows
    ``(A_eq, b_eq)``, returned as ``(program, columns, A_eq, b_eq)``."""
    lp, columns = _variables(program, found, copies, need, scale)
    a_eq, b_eq = _flow_rows(found, need.size, columns, lp.variables)
    _add_cover_rows(lp, copies, columns)
    _add_link_rows(lp, copies, columns, scale, duplex_share)
    return lp, columns, a_eq, b_eq


def _need(profile: OrderProfile, budget_bytes: int) -> np.ndarray:
    """Per position: bytes that must be off while its op starts (``live - budget`` at a compute op, at least 0;
    0 at a lane op or a collective)."""
    if not profile.order:
        return np.zeros(0, dtype=np.int64)
    return np.where(profile.computing, np.maximum(profile.live - budget_bytes, 0), 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Copies:
    """The copies the segments share (indices into the order's segments)."""

    epochs: dict[tuple[int, int], int]
    """``(storage, write position) -> index`` of each write epoch whose offload some segment needs."""
    epoch_of: list[int]
    """Per segment: the epoch whose offload it needs, or -1: no offload needed."""
    groups: list[list[int]]
    """Per prefetch: the segments it brings back."""


def _copies(program: Program, profile: OrderProfile, found: list[Segment], uses: Uses) -> _Copies:
    """Which offload and which prefetch each segment needs (module docstring, *Copies*)."""
    at_start = state_storages(program)
    epochs: dict[tuple[int, int], int] = {}
    epoch_of: list[int] = []
    for seg in found:
        epoch = seg.epoch
        if epoch is None and seg.storage in at_start and uses.writes.get(seg.storage):
            epoch = uses.writes[seg.storage][-1]  # before the first write: the last step's last write
        epoch_of.append(-1 if epoch is None else epochs.setdefault((seg.storage, epoch), len(epochs)))
    return _Copies(epochs=epochs, epoch_of=epoch_of, groups=_prefetch_groups(profile, found, uses, at_start))


def _prefetch_groups(profile: OrderProfile, found: list[Segment], uses: Uses, at_start: set[int]) -> list[list[int]]:
    """Prefetches: one per segment that returns within the compute, except that a storage the step starts with
    is per step one stretch from its last use to its first (module docstring): its segment after the last use
    and its segment before the first share one prefetch (``r_g >= z_i``), even where the latter charges none."""
    n = len(profile.order)
    last_compute = int(np.flatnonzero(profile.computing)[-1])
    returns: dict[tuple[int, int], list[int]] = {}  # group -> its segments
    for i, seg in enumerate(found):
        if seg.storage in at_start and (seg.lo < 0 or seg.hi >= n):
            if uses.positions.get(seg.storage, [n])[0] <= last_compute:
                returns.setdefault((seg.storage, -1), []).append(i)
        elif seg.returns and seg.hi <= last_compute:
            returns[(seg.storage, seg.lo)] = [i]
    return list(returns.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class _Scale:
    """Units that keep the LP's coefficients near 1: bytes in the largest need (``unit``), time in what the H2D
    lane takes to move that alone (``t_h2d``, seconds; ``t_d2h``: the D2H lane's)."""

    unit: float
    t_h2d: float
    t_d2h: float


def _scale(hardware: Hardware, need: np.ndarray) -> _Scale:
    unit = float(need.max())
    return _Scale(unit=unit, t_h2d=unit / hardware.h2d_bw, t_d2h=unit / hardware.d2h_bw)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Columns:
    """Where each kind of variable starts in the LP. Variables: ``f_p`` from 0 (the flow past position ``p``
    along the order, what is *not* off there: at most ``total - need``), ``z_i`` (bytes of segment ``i`` off),
    ``y_e`` (bytes of epoch ``e``'s offload), ``r_g`` (bytes of prefetch ``g``), then ``L`` (the copy time, in
    units of ``t_h2d``); bytes in ``unit``."""

    segments: int
    offloads: int
    prefetches: int
    copy_time: int
    total: float
    """What the flow carries past every position: every segment's bytes, and one more unit."""


def _variables(program: Program, found: list[Segment], copies: _Copies, need: np.ndarray, scale: _Scale
               ) -> tuple[SparseProgram, _Columns]:
    """The LP's variables, each within its bounds (``_Columns``), and no rows yet."""
    size = np.array([seg.nbytes for seg in found], dtype=np.float64) / scale.unit
    total = float(size.sum()) + 1.0
    epoch_size = np.zeros(len(copies.epochs))
    for (storage, _), e in copies.epochs.items():
        epoch_size[e] = program.values[storage].alloc_bytes / scale.unit
    group_size = np.array([size[members[0]] for members in copies.groups])
    lp = SparseProgram()
    lp.add_variables(need.size, upper=total - need / scale.unit)
    segments_at = lp.add_variables(size.size, upper=size)
    offloads_at = lp.add_variables(epoch_size.size, upper=epoch_size)
    prefetches_at = lp.add_variables(group_size.size, upper=group_size)
    copy_time_at = lp.add_variables(1, upper=np.inf)
    return lp, _Columns(segments=segments_at, offloads=offloads_at, prefetches=prefetches_at,
                        copy_time=copy_time_at, total=total)


def _flow_rows(found: list[Segment], n: int, columns: _Columns, n_vars: int):
    """The memory rows, as a flow along the order (module docstring): equality rows ``(A_eq, b_eq)``.

    Flow conservation at the boundary before each position 1..n-1 (node p: between positions p - 1 and p);
    node 0 supplies ``total``, node n takes it. Position p's arc runs from node p to p + 1, segment i's from
    node lo + 1 to node hi: every position's cut then carries f_p + (segments around p) = total."""
    from scipy.sparse import coo_matrix, vstack

    z0 = columns.segments
    p = np.arange(n)
    lo = np.array([max(seg.lo + 1, 0) for seg in found], dtype=np.int64)
    hi = np.array([min(seg.hi, n) for seg in found], dtype=np.int64)
    spans = hi > lo
    seg_ids = np.flatnonzero(spans)
    rows = [p + 1, p, hi[spans], lo[spans]]
    cols = [p, p, z0 + seg_ids, z0 + seg_ids]
    vals = [np.ones(n), -np.ones(n), np.ones(seg_ids.size), -np.ones(seg_ids.size)]
    eq = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n + 1, n_vars))
    eq = eq.tocsr()[1:n]  # nodes 1..n-1 balance; the source's and the sink's supply is the first cut's row below
    # With f_p + (segments around p) the same at every cut, fixing it at position 0 fixes it everywhere.
    around_first = np.flatnonzero(spans & (lo <= 0) & (hi > 0))
    first_cut_cols = np.concatenate([[0], z0 + around_first])
    first_cut = coo_matrix((np.ones(1 + around_first.size),
                            (np.zeros(1 + around_first.size, dtype=np.int64), first_cut_cols)),
                           shape=(1, n_vars)).tocsr()
    eq = vstack([eq, first_cut]).tocsr()
    eq_rhs = np.zeros(eq.shape[0])
    eq_rhs[-1] = columns.total
    return eq, eq_rhs


def _add_cover_rows(lp: SparseProgram, copies: _Copies, columns: _Columns) -> None:
    """Offloads cover their epoch's segments (``z_i <= y_e``), prefetches their group's (``z_i <= r_g``)."""
    for i, e in enumerate(copies.epoch_of):
        if e >= 0:
            lp.add_row([(columns.segments + i, 1.0), (columns.offloads + e, -1.0)], 0.0)
    for g, members in enumerate(copies.groups):
        for i in members:
            lp.add_row([(columns.segments + i, 1.0), (columns.prefetches + g, -1.0)], 0.0)


def _add_link_rows(lp: SparseProgram, copies: _Copies, columns: _Columns, scale: _Scale, duplex_share: float) -> None:
    """The copy time covers the bytes: ``a X + b Y <= c L`` per link row, with ``X``, ``Y`` and ``L`` in units of
    ``t_h2d``."""
    prefetches = range(columns.prefetches, columns.prefetches + len(copies.groups))
    offloads = range(columns.offloads, columns.offloads + len(copies.epochs))
    for a_h2d, b_d2h, c in link_rows(duplex_share):
        d2h = b_d2h * scale.t_d2h / scale.t_h2d
        lp.add_row([*((v, a_h2d) for v in prefetches), *((v, d2h) for v in offloads), (columns.copy_time, -c)], 0.0)


def _objective(columns: _Columns, n_vars: int) -> np.ndarray:
    """Least copy time first; among the least, the fewest bytes (a tie-break far below the solver's tolerance
    on the copy time), so that the bytes reported are what that time needs."""
    objective = np.zeros(n_vars)
    objective[columns.copy_time] = 1.0
    objective[columns.offloads:columns.copy_time] = 1e-9
    return objective


def _infeasible(compute: float, m: int, n_vars: int, constraints: int, started: float) -> TrafficBound:
    return TrafficBound(seconds=float("inf"), compute_s=compute, copy_s=float("inf"), status="infeasible",
                        segments=m, variables=n_vars, constraints=constraints, solve_s=time.perf_counter() - started)


__all__ = ["TrafficBound", "traffic_bound"]
