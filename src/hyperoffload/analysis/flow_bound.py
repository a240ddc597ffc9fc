"""The flow bound: a per-storage lower bound on the step time of any plan that runs a step's ops in a
given order under a budget, as a linear program.

The window bound (``analysis.window_bound``) looks at the unplanned peak alone. This one looks at every
stretch of the step where the unplanned step is over the budget, and at what each storage can do there.
It is the optimum of a linear-programming relaxation of every plan in the order: any plan's simulated
step maps onto a feasible point of the LP whose objective is at most the plan's ``step_s``, so the LP's
minimum is at most every plan's step time.

**Time.** The op order is cut into ``K`` bins of consecutive ops, each starting with a compute-stream op
(lane ops run on the copy lanes and take no compute time). In each bin one *instant* is chosen: the start
of its compute op of most unplanned live bytes, ``p*``. The instant splits the bin into two *slots*: from
the bin's first op to ``p*`` and from ``p*`` to the next bin. In a plan's simulated step, a slot's duration
is the time from the start of its first op to the start of the next slot's first op (the first slot from
the step's start, or, for a plan timed in steady state, from the end of the previous step's compute; the
last slot to the end of the step's compute), so durations add up to at most ``step_s``, and each is at
least the compute time of the slot's ops (ops run one at a time on the compute stream; stalls and
per-instruction issue time only add). The LP's duration variables ``d_j >= c_j`` are these.

**Memory at an instant.** While op ``p*`` starts, the device holds every storage the unplanned step holds
there (``check_plan(plan_without_offload(...)).live_bytes``), except those that are *off*: released (their
memory returned, which the simulator does once their offload has landed) and not yet allocated again (a
prefetch allocates when the compute stream reaches it). Automatic frees in a plan never come earlier than
in the unplanned step (a storage's last use is its last compute use or a later offload), and prefetched
buffers only add. The device holds at most the budget, so the bytes off at the instant are at least
``live(p*) - budget``. A storage off at ``p*`` is not used by op ``p*`` (its inputs are ready, its outputs
just allocated), so it lies in one of its *segments*: between two of its uses (``policies.spans``), before
its first use (a step input or constant), or after its last use (a storage the caller holds).

**Flows.** For segment ``i`` (``b_i`` bytes) and instant ``k`` inside it, ``o_ik`` in ``[0, b_i]`` is the
amount off. A plan's point sets it to ``b_i`` if the storage is off at the instant, else 0. Then:

* *D2H*: the storage's memory came back only after an offload landed, and that offload started after the
  op that last wrote it before the segment. So ``o_ik`` is at most the cumulative D2H flow ``F`` of the
  segment's *write epoch* (the stretch from that write) through the slot that ends at the instant. Spans of
  a storage in the same epoch share one ``F``: one offload serves every release until the next write
  (a storage that is not written again needs no second copy). A segment with no write before it in the
  step (state written only later, or never: a step input whose remote copy may come from the previous
  step or was there from the start) needs no D2H in this step at all; it is left free, which only loosens.
  ``F`` is capped at ``b_i`` (a plan's point counts the first offload that landed in the epoch).
* *H2D*: a storage off at the instant comes back, if the segment ends at a use in this step, by a prefetch
  that starts after the instant (it allocates when issued) and lands before that use starts. So ``o_ik`` is
  at most the H2D flow ``R`` of that prefetch from the slot that starts at the instant up to the slot where
  the use starts. A segment after the last use (held storages: the step's outputs, or state sent to
  remote memory between steps) need not come back within the step: no H2D is charged for it.
* *Memory*: at each instant, ``sum_i o_ik >= live(p*) - budget``.

Counting a storage off for a whole slot, letting fractions of it move, and dropping the previous step's
copies (the D2H of state the step never writes, the tail of copies left in flight at the step's start)
only enlarge the feasible set. Dropping any segment would shrink it (and could raise the bound above a
plan), so every storage is kept.

**Link.** In each slot the bytes each lane moves are at most what its bandwidth allows in the slot's
duration; while both lanes move data each gets ``duplex_share`` of its bandwidth (``simulate``), so with
``X``, ``Y`` the seconds each direction would take alone, ``(X, Y) / d`` lies in the convex hull of
``(0, 0), (1, 0), (0, 1), (share, share)``: for ``share >= 1/2`` the two rows ``share X + (1 - share) Y <=
share d`` and ``(1 - share) X + share Y <= share d``, else ``X + Y <= d``. Copy latencies and the program's
own lane ops (``Op.lane``: they also use the lanes) are left out, which loosens.

**Where it rests on the simulator's rules.** The argument above takes a release to return memory only once
its offload has landed and an automatic free to come only after the storage's last use has finished, as
``plans.py`` documents. The LP is solved with HiGHS (interior point: on an 8B training step far faster than simplex); its optimum is reduced by a relative ``1e-7`` of the
stall it finds so that solver tolerance does not put the bound above a plan that meets it exactly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyperoffload.analysis.lp import SOLVER_MARGIN, link_rows, solved
from hyperoffload.analysis.segments import Segment, order_profile, segments
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowBound:
    """The flow bound and what sets it (seconds, bytes, positions in the order)."""

    seconds: float
    """No plan in this order under this budget steps faster (simulator semantics); ``inf`` if the budget
    cannot be met in this order at all (``status == "infeasible"``)."""
    compute_s: float
    status: str
    """``"fits"`` (the unplanned step is within the budget: no LP), ``"optimal"`` or ``"infeasible"``
    (at some instant even every storage off would not bring the device under the budget)."""
    bins: int
    """Bins the order was cut into (each two slots, split at the bin's instant)."""
    instants: tuple[int, ...] = ()
    """Position (in the order) of each bin's instant: its compute op of most unplanned live bytes."""
    need_bytes: tuple[int, ...] = ()
    """Per bin: bytes that must be off at its instant (``live - budget``, at least 0)."""
    stall_s: tuple[float, ...] = ()
    """Per bin: seconds beyond its compute time the LP needs (both slots)."""
    d2h_bytes: float = 0.0
    """Bytes the LP moves device -> remote (the ones it has to charge)."""
    h2d_bytes: float = 0.0
    """Bytes the LP moves remote -> device."""
    segments: int = 0
    """Segments (storage idle stretches) in the LP; smaller storages are counted as free capacity."""
    blocks: int = 0
    """Blocks the segments make in the LP once alike ones are merged (see ``flow_bound``)."""
    variables: int = 0
    constraints: int = 0
    solve_s: float = 0.0
    """Wall seconds to build and solve the LP (a real CPU timing)."""


def flow_bound(program: Program, hardware: Hardware, budget_bytes: int, order: Sequence[int] | None = None,
               *, bins: int = 50) -> FlowBound:
    """The flow bound of ``program`` run in ``order`` (default: as captured) under ``budget_bytes``.

    ``bins``: how many bins to cut the order into (fewer if it has fewer compute ops); more is tighter and
    slower.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    started = time.perf_counter()
    profile = order_profile(program, hardware, order)
    order, times, computing, live = profile.order, profile.times, profile.computing, profile.live
    n = len(order)
    compute = float(times.sum())
    compute_positions = np.flatnonzero(computing)
    if compute_positions.size == 0 or int(live[compute_positions].max()) <= budget_bytes:
        return FlowBound(seconds=compute, compute_s=compute, status="fits", bins=0,
                         solve_s=time.perf_counter() - started)

    # Bins of consecutive compute ops (lane ops ride in the bin of the compute op before them; those ahead
    # of every compute op in the first bin), split into two slots at the bin's instant.
    k_bins = min(bins, compute_positions.size)
    groups = np.array_split(compute_positions, k_bins)
    first_of_bin = np.array([g[0] for g in groups])
    instants = np.array([g[int(np.argmax(live[g]))] for g in groups])
    # slot_start[j]: first position of slot j (slot 2k: the bin's first op, or 0; slot 2k + 1: the instant)
    slot_start = np.empty(2 * k_bins, dtype=np.int64)
    slot_start[0::2] = first_of_bin
    slot_start[0] = 0
    slot_start[1::2] = instants
    slots = 2 * k_bins
    slot_of = np.searchsorted(slot_start, np.arange(n), side="right") - 1  # slot of each position
    slot_compute = np.bincount(slot_of, weights=times, minlength=slots) if n else np.zeros(slots)
    need = np.maximum(live[instants] - budget_bytes, 0)

    def d2h_from(position: int) -> int:
        """First slot an offload started after op ``position`` finished may move data in (a lane op's write
        ends after the compute op before it started)."""
        anchor = position if computing[position] else _previous(compute_positions, position)
        return 0 if anchor < 0 else int(slot_of[anchor])

    def h2d_until(position: int) -> int:
        """Last slot a prefetch landing before the op at ``position`` starts may move data in."""
        # The next compute op at or after ``position``: there is one, as a segment whose use comes after the
        # last compute op charges no H2D (below).
        i = int(np.searchsorted(compute_positions, position))
        anchor = int(compute_positions[i])
        j = int(slot_of[anchor])
        # A slot's time begins when its first op starts (the first slot begins with the step).
        return j - 1 if j > 0 and slot_start[j] == anchor else j

    # Each segment's instants; segments that charge nothing are free capacity.
    free = np.zeros(k_bins, dtype=np.float64)
    charged: list[tuple[Segment, np.ndarray]] = []
    for seg in segments(program, order):
        lo_k = int(np.searchsorted(instants, seg.lo, side="right"))
        hi_k = int(np.searchsorted(instants, seg.hi, side="left"))
        if hi_k <= lo_k:
            continue
        ks = np.arange(lo_k, hi_k)
        ks = ks[need[ks] > 0]
        if ks.size == 0:
            continue
        if seg.returns and seg.hi > compute_positions[-1]:
            # A use after the last compute op may wait for its prefetch past the end of the compute this
            # bound counts: charge no H2D for it (looser).
            seg = Segment(seg.storage, seg.lo, seg.hi, seg.nbytes, seg.epoch, False)
        if seg.epoch is None and not seg.returns:
            free[ks] += seg.nbytes
        else:
            charged.append((seg, ks))
    # Units keep the LP's coefficients near 1: time in mean slot compute, bytes in what the slower lane
    # moves in that time.
    tau = compute / slots if compute > 0 else 1.0
    unit = min(hardware.h2d_bw, hardware.d2h_bw) * tau
    x_d2h = unit / (hardware.d2h_bw * tau)  # slot-durations one unit of D2H bytes takes alone
    x_h2d = unit / (hardware.h2d_bw * tau)

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []
    upper: list[float] = [np.inf] * slots
    lower: list[float] = list(slot_compute / tau)
    link_d2h: list[list[tuple[int, float]]] = [[] for _ in range(slots)]  # (variable, coefficient) of X_j
    link_h2d: list[list[tuple[int, float]]] = [[] for _ in range(slots)]
    memory: list[list[int]] = [[] for _ in range(k_bins)]
    d2h_last: list[int] = []  # each epoch's cumulative flow at its last slot (the bytes it moved)
    h2d_first: list[int] = []

    def new_vars(count: int, cap: float) -> int:
        base = len(upper)
        upper.extend([cap] * count)
        lower.extend([0.0] * count)
        return base

    def row(entries: list[tuple[int, float]], bound: float) -> None:
        r = len(rhs)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        rhs.append(bound)

    # Blocks: a write epoch with the segments it serves (or one segment the step charges no D2H for). Blocks
    # alike in every slot and instant differ only in bytes, and every constraint of a block scales with its
    # bytes, so alike blocks are merged into one of their summed size: the same LP, much smaller.
    groups: dict[tuple, list[tuple[Segment, np.ndarray]]] = {}
    for seg, ks in charged:
        key = (seg.storage, seg.epoch) if seg.epoch is not None else (seg.storage, seg.lo, None)
        groups.setdefault(key, []).append((seg, ks))
    blocks: dict[tuple, int] = {}
    for members in groups.values():
        head = members[0][0]
        shape = (None if head.epoch is None else d2h_from(head.epoch),
                 tuple(sorted((tuple(int(k) for k in ks), h2d_until(seg.hi) if seg.returns else -1)
                              for seg, ks in members)))
        blocks[shape] = blocks.get(shape, 0) + head.nbytes

    for (d2h_first, members), nbytes in blocks.items():
        size = nbytes / unit
        if d2h_first is not None:
            # F_j: bytes of the epoch's offload moved up to slot j, from the write's slot to the last instant.
            last = max(2 * ks[-1] for ks, _ in members)
            f_base = new_vars(last - d2h_first + 1, size)
            for j in range(d2h_first, last + 1):
                v = f_base + j - d2h_first
                link_d2h[j].append((v, x_d2h))
                if j > d2h_first:
                    link_d2h[j].append((v - 1, -x_d2h))
                    row([(v - 1, 1.0), (v, -1.0)], 0.0)  # the flow in slot j is not negative
            d2h_last.append(f_base + last - d2h_first)
        for ks, h2d_last in members:
            off = new_vars(len(ks), size)
            for i, k in enumerate(ks):
                memory[k].append(off + i)
                if d2h_first is not None:
                    row([(off + i, 1.0), (f_base + 2 * k - d2h_first, -1.0)], 0.0)
            if h2d_last < 0:
                continue
            # R_j: bytes of the returning prefetch moved from slot j on, from the first instant's second slot
            # to the slot the use starts in.
            first = 2 * ks[0] + 1
            r_base = new_vars(h2d_last - first + 1, size)
            for j in range(first, h2d_last + 1):
                v = r_base + j - first
                link_h2d[j].append((v, x_h2d))
                if j < h2d_last:
                    link_h2d[j].append((v + 1, -x_h2d))
                    row([(v + 1, 1.0), (v, -1.0)], 0.0)  # the flow in slot j is not negative
            h2d_first.append(r_base)
            for i, k in enumerate(ks):
                row([(off + i, 1.0), (r_base + 2 * k + 1 - first, -1.0)], 0.0)

    for k in range(k_bins):
        if need[k] > 0:
            row([(v, -1.0) for v in memory[k]], -float(need[k] - free[k]) / unit)

    for j in range(slots):
        if not link_d2h[j] and not link_h2d[j]:
            continue
        for a, b, c in link_rows(hardware.duplex_share):  # (d2h weight, h2d weight, duration weight)
            entries = [(v, a * x) for v, x in link_d2h[j] if a] + [(v, b * x) for v, x in link_h2d[j] if b]
            row(entries + [(j, -c)], 0.0)

    n_vars = len(upper)
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(rhs), n_vars)).tocsr()
    objective = np.zeros(n_vars)
    objective[:slots] = 1.0
    result = linprog(objective, A_ub=matrix, b_ub=np.asarray(rhs), bounds=np.column_stack([lower, upper]),
                     method="highs-ipm")
    solve_s = time.perf_counter() - started
    common = {"compute_s": compute, "bins": k_bins, "instants": tuple(int(p) for p in instants),
              "need_bytes": tuple(int(x) for x in need), "segments": len(charged), "blocks": len(blocks),
              "variables": n_vars, "constraints": len(rhs)}
    if solved(result, "flow bound") is None:
        return FlowBound(seconds=float("inf"), status="infeasible", solve_s=solve_s, **common)
    durations = result.x[:slots] * tau
    stall = np.maximum(durations - slot_compute, 0.0)
    total_stall = max(0.0, float(result.fun) * tau - compute)
    return FlowBound(seconds=compute + total_stall * (1.0 - SOLVER_MARGIN), status="optimal", solve_s=solve_s,
                     stall_s=tuple(float(x) for x in stall[0::2] + stall[1::2]),
                     d2h_bytes=float(result.x[d2h_last].sum()) * unit if d2h_last else 0.0,
                     h2d_bytes=float(result.x[h2d_first].sum()) * unit if h2d_first else 0.0, **common)


def _previous(positions: np.ndarray, position: int) -> int:
    """The largest of ``positions`` (sorted) below ``position``, or -1."""
    i = int(np.searchsorted(positions, position)) - 1
    return int(positions[i]) if i >= 0 else -1


__all__ = ["FlowBound", "flow_bound"]
