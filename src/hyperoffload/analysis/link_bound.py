"""A lower bound on the step time of every plan, in every execution order, under a budget.

``bound_s`` (BENCHMARKS.md) lets the excess cross the link once each way at full speed with both
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
  order that updates during the backward pass frees them early: at 70% of the peak on ``h200`` the
  bound was 0.98 x ``bound_s`` at that op and is 1.09 at the backward pass's first.
* **Those bytes cross the link both ways.** A storage off the device at that op was sent out
  after it was last written, in this step or, for state kept remote, the previous one (a storage the
  step never writes needs no offload: its remote copy stays current), and comes back if anything
  after that op reads it. Per step, that is: the bound is for plans that end the step with every
  input where it started, so that they can run step after step (every policy's plans do, and the
  simulator times those that keep state remote in steady state); a plan that starts state remote and
  leaves it on the device has sent it out in no step at all. While both directions copy, each gets
  ``duplex_share`` of its bandwidth (``Hardware.duplex_share``), so moving ``d`` seconds of D2H and
  ``h`` seconds of H2D (each at full speed alone) takes at least ``min(d, h) / share + |d - h|``
  seconds, or ``d + h`` where the share is at most one half and copying one direction at a time is
  faster.

The bound is the larger of the step's compute time and that copy time. It holds for every plan of
the program (every op on the device, each storage moved whole) because it depends on neither the
order nor the schedule; the window bound (``window_bound``) is usually tighter for one order, since it
also knows when the copies can run. It is what rules out ``step_s <= 1.05 x bound_s`` on a link-bound
step wherever the link shares both ways: where the forced bytes are the whole peak and all of them
cross both ways, it is ``bound_s / duplex_share``.
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

from hyperoffload.analysis.lifetimes import memory_profile
from hyperoffload.cost import op_times
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.ir import Program
from hyperoffload.plans import op_storages


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
    """Of the excess, bytes that must have been sent out (less storages the step never writes)."""
    h2d_bytes: int
    """Of the excess, bytes that must come back (less storages nothing reads after ``peak_op``)."""


@dataclass(frozen=True, slots=True)
class _Forced:
    peak_op: int
    forced: int
    never_written: int
    """Bytes of forced storages away from the peak op that the step never writes (they need no offload)."""
    not_read_after: int
    """Bytes of forced storages away from the peak op that no op after it reads (they need not come back)."""


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


def _forced(program: Program) -> tuple[_Forced, ...]:
    """What the bound needs of ``program`` whatever the budget and hardware, at each op it is taken at (see
    ``link_bound``), computed once per program."""
    cached = _FORCED.get(program)
    if cached is None:
        cached = _FORCED[program] = _forced_at_candidates(program)
    return cached


def _forced_at_candidates(program: Program) -> tuple[_Forced, ...]:
    """``_forced_of`` at the op where the captured step peaks and, in each phase, at the op of most live bytes
    in the captured order (the captured peak op first)."""
    profile = memory_profile(program)
    if profile.peak_position < 0:
        values = program.values
        return (_Forced(-1, sum(values[v].alloc_bytes for v in {values[v].storage for v in (
            *program.inputs, *program.constants)}), 0, 0),)
    fullest: dict[object, int] = {}  # phase -> position of most live bytes (the first such)
    for position, op_id in enumerate(profile.order):
        phase = program.ops[op_id].phase
        if phase not in fullest or profile.live_bytes[position] > profile.live_bytes[fullest[phase]]:
            fullest[phase] = position
    ops = dict.fromkeys([profile.order[profile.peak_position], *(profile.order[p] for p in fullest.values())])
    return tuple(_forced_of(program, op_id) for op_id in ops)


def _forced_of(program: Program, peak_op: int) -> _Forced:
    values = program.values
    # Inputs and constants are held by the caller for the whole step; outputs only once they are made.
    state = {values[v].storage for v in (*program.inputs, *program.constants)}
    outputs = {values[v].storage for v in program.outputs}
    before = _closure(peak_op, program.dependencies())
    after = _closure(peak_op, program.dependents())
    touched, read, written = op_storages(program)
    made_before = {o for op_id in (*before, peak_op) for o in program.ops[op_id].outputs if values[o].owns_storage}
    used_from_peak = set(touched[peak_op]).union(*(touched[a] for a in after))
    forced = state | (made_before & (used_from_peak | outputs))
    # What the peak op itself touches must be on the device while it runs: the excess is made of the rest.
    movable = forced - touched[peak_op]
    read_after = set().union(*(read[a] for a in after))
    ever_written = set().union(*written) | made_before  # made: written as it is made
    return _Forced(peak_op=peak_op, forced=sum(values[s].alloc_bytes for s in forced),
                   never_written=sum(values[s].alloc_bytes for s in movable if s not in ever_written),
                   not_read_after=sum(values[s].alloc_bytes for s in movable if s not in read_after))


_FORCED: WeakKeyDictionary[Program, tuple[_Forced, ...]] = WeakKeyDictionary()


def both_ways_s(d2h_s: float, h2d_s: float, duplex_share: float) -> float:
    """Least seconds to copy ``d2h_s`` and ``h2d_s`` seconds' worth (each at full speed alone) when both
    directions at once get ``duplex_share`` of their bandwidth each: together for the shorter, then the
    rest alone; or one after the other where sharing gains nothing (a share of one half or less)."""
    if duplex_share <= 0.5:
        return d2h_s + h2d_s
    return min(d2h_s, h2d_s) / duplex_share + abs(d2h_s - h2d_s)


def link_bound(program: Program, hardware: Hardware | str, budget_bytes: int) -> LinkBound:
    """The link bound of ``program`` under ``budget_bytes`` on ``hardware`` (see the module docstring)."""
    hardware = as_hardware(hardware)
    compute_s = float(sum(op_times(program, hardware)))
    best: LinkBound | None = None
    for f in _forced(program):  # the argument holds at every op: the bound is the largest
        excess = max(0, f.forced - budget_bytes)
        # Bytes that need no copy one way can make up the excess only as far as they go.
        d2h = max(0, excess - f.never_written)
        h2d = max(0, excess - f.not_read_after)
        copies = both_ways_s(d2h / hardware.d2h_bw, h2d / hardware.h2d_bw, hardware.duplex_share)
        bound = LinkBound(seconds=max(compute_s, copies), compute_s=compute_s, peak_op=f.peak_op,
                          forced_bytes=f.forced, excess_bytes=excess, d2h_bytes=d2h, h2d_bytes=h2d)
        if best is None or bound.seconds > best.seconds:
            best = bound
    return best
