"""``zero-infinity``: DeepSpeed ZeRO-3 with parameter and optimizer offload (ZeRO-Infinity), one device.

What DeepSpeed does (``docs/references.md``): parameters live in CPU (or NVMe) memory and are
gathered to the device before the module that uses them runs, ahead of time from a recorded trace of
the module order: the prefetcher keeps fetching the next parameters in the trace while fewer than
``prefetch_bucket_elements`` (5e7) are in flight, and while fewer than ``max_live_elements`` (1e9)
are on the device; parameters under ``persistence_threshold`` elements (1e5) stay on the device. A
parameter is released after its module ran unless the trace says it is used again within
``max_reuse_distance`` elements (1e9) of other parameters' fetches. Optimizer state (and the
optimizer step) live off the device; gradients are moved off the device as the backward pass
produces them.

How faithful: on one device the optimizer step runs on the device here (a step of one rank has no
host-optimizer form; a sharded step's is below): each moment and gradient is fetched before its
update and the moments are sent back after it. DeepSpeed
runs the step on the CPU and moves only gradients out and updated parameters in, so this model moves
more bytes than the real system in the optimizer phase. A "module visit" is a run of uses of a
storage within one phase (forward, backward, optimizer): that is when DeepSpeed gathers a parameter
(module forward, module backward, optimizer step). The trace is the order of those visits in the
captured step. Activations stay on the device (no activation offload or checkpointing).
Parameters and optimizer state start the step in remote memory and are back there at its end, so
the plan is timed in steady state.

Budget: DeepSpeed has no device budget, only these limits. If the plan's peak is over the budget it
is returned without one, and its peak is what the policy needs.

On a sharded training step (``host_optimizer.is_sharded_training``: a rank's step of ZeRO-3 across several devices)
the model is DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer``: the rank's parameter partitions and
optimizer state live in host memory and CPU Adam steps there. The plan is the step's host-optimizer form (the one
``fsdp-cpu-offload`` plans: the optimizer step on the host lane, each gradient sent to the host after its
reduce-scatter) with each partition's fetch moved ahead by the prefetcher: after each op, the next fetches in trace
order are issued while fewer than ``prefetch_bucket_elements`` fetched ahead are not yet used (``_prefetched_order``).
The other limits (``max_live_elements``, ``max_reuse_distance``, ``persistence_threshold``) are not modelled there:
every partition is fetched for each gather that reads it. It refuses a profile with no host memory bandwidth.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from hyperoffload.hardware import Hardware
from hyperoffload.host_optimizer import HostOptimizerForm, host_form_for, is_sharded_training
from hyperoffload.ir import Program, ValueKind
from hyperoffload.plans import Instr, Kind, Plan
from hyperoffload.policies.common import Placed, elements, emit_plan, fit_budget, written_between
from hyperoffload.policies.spans import storage_uses

POLICY = "zero-infinity"


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroInfinityConfig:
    """DeepSpeed's defaults (``stage3_*`` settings), in tensor elements."""

    prefetch_bucket_elements: int = 50_000_000
    """Fetching ahead continues while fewer elements than this are in flight."""
    max_live_elements: int = 1_000_000_000
    """... and while fewer elements than this are on the device."""
    max_reuse_distance: int = 1_000_000_000
    """A parameter used again within this many fetched elements is not released in between."""
    persistence_threshold: int = 100_000
    """Tensors with fewer elements stay on the device."""


_OFFLOADED = (ValueKind.PARAMETER, ValueKind.OPTIMIZER_STATE, ValueKind.GRADIENT)


def plan_zero_infinity(program: Program, hardware: Hardware, budget_bytes: int,
                       config: ZeroInfinityConfig = ZeroInfinityConfig()) -> Plan:
    """Parameters, optimizer state and gradients off the device between visits, fetched ahead by trace; on a sharded
    training step, the host-optimizer form with its fetches ahead (module docstring)."""
    if is_sharded_training(program):
        form = host_form_for(program, hardware, POLICY)
        order = _prefetched_order(form, config.prefetch_bucket_elements)
        plan = Plan(program=form.program, instructions=tuple(Instr(Kind.COMPUTE, i) for i in order), policy=POLICY)
        return fit_budget(plan, budget_bytes)
    values = program.values
    inputs = {values[v].storage for v in program.inputs} - {values[v].storage for v in program.constants}
    managed = {s for s in range(len(values)) if values[s].owns_storage and values[s].kind in _OFFLOADED
               and elements(values[s]) >= config.persistence_threshold
               and (s in inputs or values[s].kind is ValueKind.GRADIENT)}
    uses = storage_uses(program, list(range(len(program.ops))))
    visits = {s: _visits(program, uses.positions.get(s, ())) for s in managed}
    kept = _kept_between_visits(program, visits, config)
    placed: list[Placed] = []
    # (first position of the visit, storage, elements, first position its device copy is gone), trace order
    fetches: list[tuple[int, int, int, int]] = []
    leaves: dict[int, list[int]] = {}  # position -> storages whose device copy goes there
    for s, runs in visits.items():
        around = _around_visits(s, runs, kept, s in inputs, uses.writes.get(s, []), elements(values[s]))
        placed += around.placed
        fetches += around.fetches
        for p in around.gone_at:
            leaves.setdefault(p, []).append(s)
    fetches.sort()
    placed += _schedule_fetches(fetches, leaves, len(program.ops), config)
    remote = frozenset(s for s in managed if s in inputs)
    return emit_plan(program, placed, policy=POLICY, budget_bytes=budget_bytes, initial_remote=remote)


def _prefetched_order(form: HostOptimizerForm, bucket_elements: int) -> list[int]:
    """The form's ops in captured order with its fetches moved ahead: after each op, the next fetches in op order
    (the trace) whose inputs are made are issued while fewer than ``bucket_elements`` fetched ahead are not yet
    used; a fetch not issued ahead runs where the form has it, right before its reader."""
    program = form.program
    deps = program.dependencies()
    fetches = form.fetches
    is_fetch = {f.op for f in fetches}
    done = [False] * len(program.ops)
    order: list[int] = []
    ahead: dict[int, int] = {}  # reader -> elements fetched ahead for it
    flying = 0
    k = 0  # the next fetch in op order not yet placed
    for op in program.ops:
        if done[op.id]:
            continue
        order.append(op.id)
        done[op.id] = True
        if op.id in is_fetch:
            continue
        flying -= ahead.pop(op.id, 0)
        while k < len(fetches) and done[fetches[k].op]:
            k += 1
        while k < len(fetches) and flying < bucket_elements:
            fetch = fetches[k]
            if not all(done[d] for d in deps[fetch.op]):
                break
            order.append(fetch.op)
            done[fetch.op] = True
            flying += fetch.elements
            ahead[fetch.reader] = ahead.get(fetch.reader, 0) + fetch.elements
            k += 1
    return order


def _visits(program: Program, positions: Sequence[int]) -> list[list[int]]:
    """A storage's visits: runs of its uses (``positions``) within one phase, [first, last] positions."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and program.ops[runs[-1][1]].phase is program.ops[p].phase:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return runs


@dataclass(frozen=True, slots=True)
class _AroundVisits:
    """What one managed storage's visits need: its fetches (first position of the visit, storage, elements, first
    position its device copy is gone), its offloads and releases, and the positions its device copy goes."""

    fetches: list[tuple[int, int, int, int]]
    placed: list[Placed]
    gone_at: list[int]


def _around_visits(s: int, runs: list[list[int]], kept: set[tuple[int, int]], is_input: bool, writes: list[int],
                   nelem: int) -> _AroundVisits:
    """Storage ``s`` fetched before each visit not ``kept`` from the one before (a step input also before its first),
    sent out after a visit that wrote it (a gradient is made on the device, an input starts with a current remote
    copy) and released after each visit not followed by a kept one; a storage the step makes is freed after its last
    use instead."""
    fetches: list[tuple[int, int, int, int]] = []
    placed: list[Placed] = []
    gone_at: list[int] = []
    stale = not is_input
    gone = 0
    for k, (a, b) in enumerate(runs):
        if (k == 0 and is_input) or (k > 0 and (s, k) not in kept):
            fetches.append((a, s, nelem, gone))
        gone = b + 1
        stale = stale or written_between(writes, a, b)
        last = k == len(runs) - 1
        if last and not is_input:
            gone_at.append(b + 1)  # freed after its last use
            continue
        if not last and (s, k + 1) in kept:
            continue
        if stale:
            placed.append(Placed(b + 1, Kind.OFFLOAD, s))
            stale = False
        placed.append(Placed(b + 1, Kind.RELEASE, s))
        gone_at.append(b + 1)
    return _AroundVisits(fetches, placed, gone_at)


def _kept_between_visits(program: Program, visits: dict[int, list[list[int]]],
                         config: ZeroInfinityConfig) -> set[tuple[int, int]]:
    """(storage, visit index) of parameter visits that need no fetch: the previous visit was within
    ``max_reuse_distance`` elements of other parameters' visits, so the parameter stayed on the device."""
    values = program.values
    params = sorted((a, elements(values[s])) for s, runs in visits.items()
                    if values[s].kind is ValueKind.PARAMETER for a, _ in runs)
    starts = [a for a, _ in params]
    before = [0]
    for _, nelem in params:
        before.append(before[-1] + nelem)
    kept = set()
    for s, runs in visits.items():
        if values[s].kind is not ValueKind.PARAMETER:
            continue
        for k in range(1, len(runs)):
            lo = bisect.bisect_right(starts, runs[k - 1][1])
            hi = bisect.bisect_left(starts, runs[k][0])
            if before[hi] - before[lo] <= config.max_reuse_distance:
                kept.add((s, k))
    return kept


def _schedule_fetches(fetches: list[tuple[int, int, int, int]], leaves: dict[int, list[int]], n: int,
                      config: ZeroInfinityConfig) -> list[Placed]:
    """Prefetches in trace order: each no later than its visit, and ahead of it while fewer than the
    bucket's elements are in flight and fewer than the live limit are on the device; a wait before use."""
    placed: list[Placed] = []
    size = {s: nelem for _, s, nelem, _ in fetches}
    on_device: set[int] = set()
    in_flight: dict[int, int] = {}  # position of the visit -> elements fetched for it, not yet used
    flying = live = 0
    k = 0
    for p in range(n):
        for s in leaves.get(p, ()):
            if s in on_device:
                on_device.discard(s)
                live -= size[s]
        flying -= in_flight.pop(p, 0)  # fetched ahead for visits starting here: now in use
        while k < len(fetches):
            first, s, nelem, gone = fetches[k]
            due = first <= p
            if not due and (p < gone or flying >= config.prefetch_bucket_elements
                            or live >= config.max_live_elements):
                break
            placed += [Placed(p, Kind.PREFETCH, s, order=first), Placed(first, Kind.WAIT, s)]
            on_device.add(s)
            live += nelem
            if first > p:
                flying += nelem
                in_flight[first] = in_flight.get(first, 0) + nelem
            k += 1
    return placed
