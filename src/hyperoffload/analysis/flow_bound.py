"""The flow bound: a per-storage lower bound on the step time of any plan that runs a step's ops in a
given order under a budget, as a linear program.

The window bound (``analysis.window_bound``) looks at the unplanned peak alone. This one looks at every
stretch of the step where the unplanned step is over the budget, and at what each storage can do there.
It is the optimum of a linear-programming relaxation of every plan in the order: any plan's simulated
step maps onto a feasible point of the LP whose objective is at most the plan's ``step_s``, so the LP's
minimum is at most every plan's step time.

**Time.** The op order is cut into ``K`` bins of consecutive ops, each starting with a compute-stream op
(lane ops run on the copy lanes and collectives on the network lane: neither takes compute time). In each bin
one *instant* is chosen: the start of its compute op of most unplanned live bytes, ``p*``. The instant splits
the bin into two *slots*: from the bin's first op to ``p*`` and from ``p*`` to the next bin. In a plan's
simulated step, a slot's duration is the time from the start of its first op to the start of the next slot's
first op (the first slot from the step's start, or, for a plan timed in steady state, from the end of the
previous step's compute; the last slot to the end of the step's compute), so durations add up to at most
``step_s``, and each is at least the compute time of the slot's ops (ops run one at a time on the compute
stream; stalls and per-instruction issue time only add). The LP's duration variables ``d_j >= c_j`` are these.

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

from hyperoffload.analysis.lp import SOLVER_MARGIN, SparseProgram, link_rows, solved
from hyperoffload.analysis.segments import OrderProfile, Segment, order_profile, segments
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
    started = time.perf_counter()
    profile = order_profile(program, hardware, order)
    compute = float(profile.times.sum())
    compute_positions = np.flatnonzero(profile.computing)
    if compute_positions.size == 0 or int(profile.live[compute_positions].max()) <= budget_bytes:
        return FlowBound(seconds=compute, compute_s=compute, status="fits", bins=0,
                         solve_s=time.perf_counter() - started)
    slots = _cut_into_slots(profile, compute_positions, bins, budget_bytes)
    free, charged = _charged_segments(program, profile.order, slots)
    blocks = _blocks(charged, slots)
    scale = _scale(hardware, compute, slots.count)
    lp = _build_program(blocks, slots, free, scale, hardware.duplex_share)
    result = lp.solve()
    solve_s = time.perf_counter() - started
    common = {"compute_s": compute, "bins": slots.bins, "instants": tuple(int(p) for p in slots.instants),
              "need_bytes": tuple(int(x) for x in slots.need), "segments": len(charged), "blocks": len(blocks),
              "variables": lp.program.variables, "constraints": lp.program.constraints}
    if solved(result, "flow bound") is None:
        return FlowBound(seconds=float("inf"), status="infeasible", solve_s=solve_s, **common)
    return _optimal(result, lp, slots, scale, compute, solve_s, common)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Slots:
    """The order cut into bins of consecutive compute ops, each split into two slots at its instant (positions in
    the order, seconds, bytes)."""

    compute_positions: np.ndarray
    """Positions of the compute ops, ascending."""
    computing: np.ndarray
    """Per position: whether the op runs on the compute stream."""
    instants: np.ndarray
    """Per bin: position of its instant (its compute op of most unplanned live bytes)."""
    slot_start: np.ndarray
    """Per slot ``j``: its first position (slot ``2k``: bin ``k``'s first op, or 0; slot ``2k + 1``: the instant)."""
    slot_of: np.ndarray
    """Per position: the slot it lies in."""
    slot_compute: np.ndarray
    """Per slot: compute seconds of its ops."""
    need: np.ndarray
    """Per bin: bytes that must be off at its instant (``live - budget``, at least 0)."""

    @property
    def bins(self) -> int:
        """Bins: at most as many as asked for, and no more than compute ops."""
        return int(self.instants.size)

    @property
    def count(self) -> int:
        """Slots: two per bin."""
        return int(self.slot_start.size)

    def d2h_from(self, position: int) -> int:
        """First slot an offload started after op ``position`` finished may move data in (a lane op's write
        ends after the compute op before it started)."""
        anchor = position if self.computing[position] else _previous(self.compute_positions, position)
        return 0 if anchor < 0 else int(self.slot_of[anchor])

    def h2d_until(self, position: int) -> int:
        """Last slot a prefetch landing before the op at ``position`` starts may move data in."""
        # The next compute op at or after ``position``: there is one, as a segment whose use comes after the
        # last compute op charges no H2D (``_charged_segments``).
        i = int(np.searchsorted(self.compute_positions, position))
        anchor = int(self.compute_positions[i])
        j = int(self.slot_of[anchor])
        # A slot's time begins when its first op starts (the first slot begins with the step).
        return j - 1 if j > 0 and self.slot_start[j] == anchor else j


def _cut_into_slots(profile: OrderProfile, compute_positions: np.ndarray, bins: int, budget_bytes: int) -> _Slots:
    """Bins of consecutive compute ops (``bins``, fewer if there are fewer compute ops; lane ops ride in the bin
    of the compute op before them, those ahead of every compute op in the first bin), split into two slots at
    the bin's instant."""
    live, n = profile.live, len(profile.order)
    k_bins = min(bins, compute_positions.size)
    groups = np.array_split(compute_positions, k_bins)
    first_of_bin = np.array([g[0] for g in groups])
    instants = np.array([g[int(np.argmax(live[g]))] for g in groups])
    slot_start = np.empty(2 * k_bins, dtype=np.int64)
    slot_start[0::2] = first_of_bin
    slot_start[0] = 0
    slot_start[1::2] = instants
    slots = 2 * k_bins
    slot_of = np.searchsorted(slot_start, np.arange(n), side="right") - 1  # slot of each position
    slot_compute = np.bincount(slot_of, weights=profile.times, minlength=slots) if n else np.zeros(slots)
    return _Slots(compute_positions=compute_positions, computing=profile.computing, instants=instants,
                  slot_start=slot_start, slot_of=slot_of, slot_compute=slot_compute,
                  need=np.maximum(live[instants] - budget_bytes, 0))


def _charged_segments(program: Program, order: list[int], slots: _Slots
                      ) -> tuple[np.ndarray, list[tuple[Segment, np.ndarray]]]:
    """Each segment's instants where bytes must be off; segments that charge nothing are free capacity. Returns
    the free bytes per bin and the charged segments, each with its instants."""
    instants, need = slots.instants, slots.need
    free = np.zeros(slots.bins, dtype=np.float64)
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
        if seg.returns and seg.hi > slots.compute_positions[-1]:
            # A use after the last compute op may wait for its prefetch past the end of the compute this
            # bound counts: charge no H2D for it (looser).
            seg = Segment(seg.storage, seg.lo, seg.hi, seg.nbytes, seg.epoch, False)
        if seg.epoch is None and not seg.returns:
            free[ks] += seg.nbytes
        else:
            charged.append((seg, ks))
    return free, charged


def _blocks(charged: list[tuple[Segment, np.ndarray]], slots: _Slots) -> dict[tuple, int]:
    """Blocks: a write epoch with the segments it serves (or one segment the step charges no D2H for). Blocks
    alike in every slot and instant differ only in bytes, and every constraint of a block scales with its
    bytes, so alike blocks are merged into one of their summed size: the same LP, much smaller.

    Keyed by shape: the first slot the epoch's offload may move data in (None: no D2H charged), and per
    segment its instants and the last slot its prefetch may move data in (-1: no H2D charged); the value is
    the block's bytes."""
    groups: dict[tuple, list[tuple[Segment, np.ndarray]]] = {}
    for seg, ks in charged:
        key = (seg.storage, seg.epoch) if seg.epoch is not None else (seg.storage, seg.lo, None)
        groups.setdefault(key, []).append((seg, ks))
    blocks: dict[tuple, int] = {}
    for members in groups.values():
        head = members[0][0]
        shape = (None if head.epoch is None else slots.d2h_from(head.epoch),
                 tuple(sorted((tuple(int(k) for k in ks), slots.h2d_until(seg.hi) if seg.returns else -1)
                              for seg, ks in members)))
        blocks[shape] = blocks.get(shape, 0) + head.nbytes
    return blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class _Scale:
    """Units that keep the LP's coefficients near 1: time in mean slot compute (``tau``, seconds), bytes in what
    the slower lane moves in that time (``unit``)."""

    tau: float
    unit: float
    x_d2h: float
    """Slot-durations one unit of D2H bytes takes alone."""
    x_h2d: float
    """Slot-durations one unit of H2D bytes takes alone."""


def _scale(hardware: Hardware, compute: float, slots: int) -> _Scale:
    tau = compute / slots if compute > 0 else 1.0
    unit = min(hardware.h2d_bw, hardware.d2h_bw) * tau
    return _Scale(tau=tau, unit=unit, x_d2h=unit / (hardware.d2h_bw * tau), x_h2d=unit / (hardware.h2d_bw * tau))


class _FlowProgram:
    """The flow bound's LP as it is built. Variables: the slots' durations ``d_j`` (in ``tau``), then per block
    its D2H flows ``F_j`` and per segment its amounts off ``o_k`` and H2D flows ``R_j`` (in ``unit``). Each
    slot's link rows and each instant's memory row collect their entries as the blocks come in."""

    __slots__ = ("program", "slots", "link_d2h", "link_h2d", "memory", "d2h_last", "h2d_first")

    def __init__(self, slots: _Slots, scale: _Scale) -> None:
        self.program = SparseProgram()
        self.slots = slots.count
        self.program.add_variables(slots.count, lower=slots.slot_compute / scale.tau, upper=np.inf)
        self.link_d2h: list[list[tuple[int, float]]] = [[] for _ in range(slots.count)]  # (variable, coeff) of X_j
        self.link_h2d: list[list[tuple[int, float]]] = [[] for _ in range(slots.count)]
        self.memory: list[list[int]] = [[] for _ in range(slots.bins)]
        self.d2h_last: list[int] = []  # each epoch's cumulative flow at its last slot (the bytes it moved)
        self.h2d_first: list[int] = []

    def add_offload(self, first: int, last: int, size: float, x_d2h: float) -> int:
        """``F_j``: bytes of the epoch's offload moved up to slot ``j``, from the write's slot ``first`` to the
        last instant's slot ``last``. Returns ``F_first``'s index."""
        f_base = self.program.add_variables(last - first + 1, upper=size)
        for j in range(first, last + 1):
            v = f_base + j - first
            self.link_d2h[j].append((v, x_d2h))
            if j > first:
                self.link_d2h[j].append((v - 1, -x_d2h))
                self.program.add_row([(v - 1, 1.0), (v, -1.0)], 0.0)  # the flow in slot j is not negative
        self.d2h_last.append(f_base + last - first)
        return f_base

    def add_off(self, ks: tuple[int, ...], size: float, offload: tuple[int, int] | None) -> int:
        """``o_k``: bytes of a segment off at each of its instants ``ks``, at most what its epoch's offload
        ``(F_first's index, first)`` has moved by then, where it is charged one. Returns ``o``'s index."""
        off = self.program.add_variables(len(ks), upper=size)
        for i, k in enumerate(ks):
            self.memory[k].append(off + i)
            if offload is not None:
                f_base, d2h_first = offload
                self.program.add_row([(off + i, 1.0), (f_base + 2 * k - d2h_first, -1.0)], 0.0)
        return off

    def add_prefetch(self, ks: tuple[int, ...], last: int, size: float, off: int, x_h2d: float) -> None:
        """``R_j``: bytes of the returning prefetch moved from slot ``j`` on, from the first instant's second slot
        to the slot ``last`` the use starts in; each ``o_k`` is at most what moves after its instant."""
        first = 2 * ks[0] + 1
        r_base = self.program.add_variables(last - first + 1, upper=size)
        for j in range(first, last + 1):
            v = r_base + j - first
            self.link_h2d[j].append((v, x_h2d))
            if j < last:
                self.link_h2d[j].append((v + 1, -x_h2d))
                self.program.add_row([(v + 1, 1.0), (v, -1.0)], 0.0)  # the flow in slot j is not negative
        self.h2d_first.append(r_base)
        for i, k in enumerate(ks):
            self.program.add_row([(off + i, 1.0), (r_base + 2 * k + 1 - first, -1.0)], 0.0)

    def add_memory_rows(self, need: np.ndarray, free: np.ndarray, unit: float) -> None:
        """At each instant that needs bytes off: ``sum_i o_ik >= live(p*) - budget``, less the free capacity."""
        for k, entries in enumerate(self.memory):
            if need[k] > 0:
                self.program.add_row([(v, -1.0) for v in entries], -float(need[k] - free[k]) / unit)

    def add_link_rows(self, duplex_share: float) -> None:
        """In each slot that copies, the link's rows over its ``X_j``, ``Y_j`` and duration ``d_j``."""
        for j in range(self.slots):
            if not self.link_d2h[j] and not self.link_h2d[j]:
                continue
            for a, b, c in link_rows(duplex_share):  # (d2h weight, h2d weight, duration weight)
                entries = ([(v, a * x) for v, x in self.link_d2h[j] if a]
                           + [(v, b * x) for v, x in self.link_h2d[j] if b])
                self.program.add_row(entries + [(j, -c)], 0.0)

    def solve(self):
        """Least total duration (``scipy.optimize.linprog``'s result)."""
        objective = np.zeros(self.program.variables)
        objective[:self.slots] = 1.0
        return self.program.solve(objective)


def _build_program(blocks: dict[tuple, int], slots: _Slots, free: np.ndarray, scale: _Scale,
                   duplex_share: float) -> _FlowProgram:
    """The flow bound's LP: each block's flows and amounts off, then the memory rows, then the link rows."""
    lp = _FlowProgram(slots, scale)
    for (d2h_first, members), nbytes in blocks.items():
        size = nbytes / scale.unit
        offload = None
        if d2h_first is not None:
            last = max(2 * ks[-1] for ks, _ in members)
            offload = (lp.add_offload(d2h_first, last, size, scale.x_d2h), d2h_first)
        for ks, h2d_last in members:
            off = lp.add_off(ks, size, offload)
            if h2d_last >= 0:
                lp.add_prefetch(ks, h2d_last, size, off, scale.x_h2d)
    lp.add_memory_rows(slots.need, free, scale.unit)
    lp.add_link_rows(duplex_share)
    return lp


def _optimal(result, lp: _FlowProgram, slots: _Slots, scale: _Scale, compute: float, solve_s: float,
             common: dict) -> FlowBound:
    """The bound the LP's optimum gives: compute plus the stall it finds, less the solver margin."""
    durations = result.x[:slots.count] * scale.tau
    stall = np.maximum(durations - slots.slot_compute, 0.0)
    total_stall = max(0.0, float(result.fun) * scale.tau - compute)
    return FlowBound(seconds=compute + total_stall * (1.0 - SOLVER_MARGIN), status="optimal", solve_s=solve_s,
                     stall_s=tuple(float(x) for x in stall[0::2] + stall[1::2]),
                     d2h_bytes=float(result.x[lp.d2h_last].sum()) * scale.unit if lp.d2h_last else 0.0,
                     h2d_bytes=float(result.x[lp.h2d_first].sum()) * scale.unit if lp.h2d_first else 0.0, **common)


def _previous(positions: np.ndarray, position: int) -> int:
    """The largest of ``positions`` (sorted) below ``position``, or -1."""
    i = int(np.searchsorted(positions, position)) - 1
    return int(positions[i]) if i >= 0 else -1


__all__ = ["FlowBound", "flow_bound"]
