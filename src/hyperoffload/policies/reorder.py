"""Execution-order refinement: run each optimizer update as soon as its gradient is final.

A captured training step runs the whole backward pass and then the whole optimizer update, as
``loss.backward(); optimizer.step()`` does. The update of one parameter depends only on that
parameter's gradient, its own optimizer state and the step's shared scalars (the step count and bias
corrections), so it can run as soon as the backward pass has finished the gradient and read the
parameter for the last time. Running it there (the fused backward-and-optimizer order that PyTorch
recommends with ``register_post_accumulate_grad_hook`` and that DeepSpeed and ZeRO-Offload use):

* frees each gradient right after it is complete, instead of keeping every gradient until the end;
* spreads the optimizer state's traffic over the backward pass: a layer's moments come in and go out
  while later layers' backward compute runs, instead of all crossing the link in the short, memory-
  bound optimizer phase, where almost nothing can hide a copy.

The pass moves only ops of the optimizer phase and only earlier: every other op keeps its captured
relative order, and ``Program.dependencies()`` (data plus in-place hazards) decides how early an
update may run, so the result is always a valid order with bit-identical results.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence

from hyperoffload.ir import Phase, Program
from hyperoffload.simulate import side_waits  # the rule the simulator waits by

BIG_STATE_SHARE = 0.5
"""Default of ``PlannerConfig.big_state_share`` (a share of the step's largest input), which documents it."""

LOOKAHEAD_OPS = 256
"""Default of ``PlannerConfig.lane_lookahead_ops`` (ops), which documents it."""


def hoist_updates(program: Program, *, anchored: bool = True, share: float | None = None,
                  big_state_share: float = BIG_STATE_SHARE) -> tuple[int, ...]:
    """An execution order (op ids) in which each optimizer-phase op runs as soon as the ops it depends
    on have run; other ops keep the captured order. With ``anchored``, an optimizer op that some later op
    depends on then moves down to just before the first of them, so that each update runs as one piece
    where its gradient is final (``_sink``); without, ops that need no gradient run at the
    start of the step. With ``share``, only the updates ``early_updates`` picks with ``big_state_share`` move (see
    there). Equal to the captured order when the step has no optimizer phase."""
    hoisted = [op.phase is Phase.OPTIMIZER for op in program.ops] if share is None else early_updates(
        program, share, big_state_share)
    dependents = program.dependents()
    # An op that no op depends on and that writes nothing in place (the loss detached to be returned) keeps its
    # place at the step's end. Hoisted, it would be the last use of the storage it reads, which, returned, would
    # then stay on the device from there to the end; left at the end, it can leave between its two uses.
    early = [h and bool(dependents[i] or program.ops[i].mutates) for i, h in enumerate(hoisted)]
    order = _early_ones_when_ready(program, early)
    # Run as soon as its inputs are ready, an optimizer op that needs no gradient (AdamW's
    # ``exp_avg_sq.mul_(beta2)``, the bias corrections) would run at the very start of the step, and the state
    # it touches would then be needed on the device there as well as at its update: every second moment would
    # cross the link twice per step. Sunk to its first dependent, it runs with the rest of its update, which
    # the gradient anchors in the backward pass.
    return _sink(order, early, dependents) if anchored else tuple(order)


def _early_ones_when_ready(program: Program, early: Sequence[bool]) -> list[int]:
    """The captured order with each ``early`` op moved to run as soon as the ops it depends on have run (those ready
    at once in captured order); the other ops keep their order."""
    waiting = [len(d) for d in program.dependencies()]
    dependents = program.dependents()
    gate = _collective_gates(program, early)
    held: dict[int, list[int]] = {}  # gate op -> early ops ready once it has run
    ready: list[int] = [op_id for op_id, e in enumerate(early) if e and waiting[op_id] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    done = [False] * len(program.ops)

    def run(op_id: int) -> None:
        order.append(op_id)
        done[op_id] = True
        for later in held.pop(op_id, ()):
            heapq.heappush(ready, later)
        for after in dependents[op_id]:
            waiting[after] -= 1
            if early[after] and waiting[after] == 0:
                if gate[after] >= 0 and not done[gate[after]]:
                    held.setdefault(gate[after], []).append(after)
                else:
                    heapq.heappush(ready, after)

    def drain() -> None:  # every early op whose inputs are ready, in captured order
        while ready:
            run(heapq.heappop(ready))

    def release_held() -> None:  # every op held for a gate, now
        while held:
            for later in held.pop(next(iter(held))):
                heapq.heappush(ready, later)
            drain()

    drain()
    for op_id in range(len(program.ops)):
        if early[op_id]:
            continue  # placed by drain() once its dependencies have run
        if waiting[op_id] and held:  # it needs an op held for a gate it comes before: the gate gives way
            release_held()
        # Every dependency of a later-phase op comes before it in the captured order, so by induction
        # each one has run (or has been drained) by now.
        assert waiting[op_id] == 0, f"op {program.ops[op_id].name} reached before its dependencies"
        run(op_id)
        drain()
    release_held()
    assert all(done), "an early op never became ready"
    return order


def _collective_gates(program: Program, early: Sequence[bool]) -> list[int]:
    """Per op: for an ``early`` op that reads a collective's result (a gradient its reduce-scatter made, directly or
    through views), the next collective after that one in captured order, which it waits for (-1: none). Hoisted
    right after the reduction, an update would wait for it on the compute stream; one module later the reduction
    has landed while that module ran. No collectives, no gates."""
    collectives = [op.id for op in program.ops if op.collective is not None]
    gates = [-1] * len(program.ops)
    if not collectives:
        return gates
    waits = side_waits(program)
    for op_id, e in enumerate(early):
        read = [d for d in waits[op_id] if program.ops[d].collective is not None] if e else ()
        if read:
            after = bisect.bisect_right(collectives, max(read))
            gates[op_id] = collectives[after] if after < len(collectives) else -1
    return gates


def early_updates(program: Program, share: float,
                  big_state_share: float = BIG_STATE_SHARE) -> list[bool]:
    """Which optimizer ops a partly hoisted order moves into the backward pass: the updates whose gradients
    are final within the first ``share`` of the backward pass's ops, and the shared scalars they need (the
    step count, bias corrections), but not an update whose state includes a tensor of more than
    ``big_state_share`` of the step's largest input (``PlannerConfig.big_state_share``).

    Why only some: hoisted, an update needs its parameter's moments on the device where its gradient is
    final. For the layers whose gradients come first, that is the start of the backward pass, right after
    the memory peak, when the moments have just been sent out to make room for it: the update's traffic
    then crowds the link where it is busiest. Hoisting the first few layers' updates fills the link's idle
    direction in the early backward pass with their offloads instead of the next step's forward pass; the
    large ones (an output projection's moments, gigabytes each) are what makes the peak, so they stay.
    Near the peak, planned in this order the step is faster than in the captured one (``docs/design.md``,
    "Tuning the planner")."""
    ops = program.ops
    backward = [op.id for op in ops if op.phase is Phase.BACKWARD]
    if not backward:
        return [False] * len(ops)
    position = {op_id: k for k, op_id in enumerate(backward)}
    cutoff = share * len(backward)
    values = program.values
    inputs = set(program.inputs)
    big = max((values[v].alloc_bytes for v in inputs), default=0) * big_state_share
    deps = program.dependencies()
    ready: dict[int, float] = {}  # optimizer op -> position in the backward pass where its gradient is final
    large: dict[int, bool] = {}  # optimizer op -> whether its update touches a large state tensor
    for op in ops:
        if op.phase is not Phase.OPTIMIZER:
            continue
        before = [position[d] for d in deps[op.id] if d in position]
        before += [ready[d] for d in deps[op.id] if d in ready]
        ready[op.id] = max(before, default=-1.0)
        large[op.id] = any(values[values[v].storage].alloc_bytes > big for v in op.inputs
                           if values[v].storage in inputs) or any(large.get(d, False) for d in deps[op.id])
    # The shared scalars (ready at -1, needing no gradient) come along whatever the share.
    return [op.id in ready and ready[op.id] < cutoff and not large[op.id] for op in ops]


def _sink(order: Sequence[int], movable: Sequence[bool], dependents: Sequence[Sequence[int]],
          allowed: Callable[[int, int], bool] | None = None) -> tuple[int, ...]:
    """``order`` with each ``movable`` op that other ops depend on moved to just before the first of them
    (a chain of such ops moves as one, in the order it had), where ``allowed(op, first dependent)`` (if
    given) says yes. Only ops are moved that some op depends on, and only later, to before a dependent, so
    the order stays valid."""
    position = {op_id: p for p, op_id in enumerate(order)}
    # Sort keys: an op that stays is (position, inf); one moved before dependent d is d's key with
    # (position, inf) in place of d's last element, so it sorts just before d and, among ops moved before
    # the same d, in the order they had.
    stays = float("inf")
    key: dict[int, tuple[float, ...]] = {}
    for op_id in reversed(order):
        after = dependents[op_id]
        first = min(after, key=key.__getitem__) if movable[op_id] and after else None
        if first is not None and (allowed is None or allowed(op_id, first)):
            key[op_id] = key[first][:-1] + (position[op_id], stays)
        else:
            key[op_id] = (position[op_id], stays)
    return tuple(sorted(order, key=key.__getitem__))


def sink_views(program: Program, order: Sequence[int] | None = None) -> tuple[int, ...]:
    """``order`` (default: captured) with each view op (``Op.is_view``: ``detach``, ``t``, ``view``) moved to
    just before the first op that depends on it.

    A view moves no data, but the planner, the simulator and the executor count every op that touches a
    storage as a use that needs it on the device. A captured training step detaches every parameter at its
    very start, so each parameter was "used" there: one kept in remote memory between steps had to be back
    before the step began, and held the device from then on, instead of arriving just before its layer's
    forward matmul. Sunk, a storage's uses are where its data is read. A view allocates nothing, and it moves
    only to just before an op that touches the same storage, so the memory profile is unchanged. (An op that
    costs nothing but owns its output, ``empty``, allocates: it stays.) A parameter kept remote between steps
    then comes back just before its layer, which makes the planned step faster at small budgets
    (``docs/design.md``, "Tuning the planner")."""
    order = tuple(range(len(program.ops))) if order is None else tuple(order)
    values = program.values
    views = [op.is_view and not any(values[v].owns_storage for v in op.outputs) for op in program.ops]
    forward = [op.phase is Phase.FORWARD for op in program.ops]
    # A view stays on its side of the end of the forward pass (``compile.split`` runs the two sides as
    # separate graphs): one whose first dependent is in the backward pass (a saved tensor's detach) stays.
    return _sink(order, views, program.dependents(), lambda op, first: forward[op] == forward[first])


def overlap_lane_ops(program: Program, order: Sequence[int] | None = None,
                     lookahead: int = LOOKAHEAD_OPS) -> tuple[int, ...]:
    """``order`` (default: captured) with the step's lane ops given compute to hide behind.

    A lane op (``Op.lane``: an indexed fetch of KV blocks, a write to a remote cache) runs as soon as
    the ops it depends on have run, but no more than ``lookahead`` positions earlier than ``order`` has
    it (a speculative prefetch, which depends on nothing in the step, would otherwise hold every layer's
    blocks from the start), and an op that reads what a remote -> device lane op produced is put after
    every ready op up to ``lookahead`` positions further in ``order`` that does not (NSA's window branch
    and gates run while the selected blocks arrive). Otherwise ops keep their order;
    ``Program.dependencies()`` keeps the result valid. Equal to ``order`` for a step without lane ops.
    The planner's lookahead is ``PlannerConfig.lane_lookahead_ops``.
    """
    order = tuple(range(len(program.ops))) if order is None else tuple(order)
    if not program.has_lane_ops():
        return order
    position = {op_id: p for p, op_id in enumerate(order)}
    lanes = _LaneQueues(program, position)
    deferred = _reads_a_fetch(program)
    waiting = [len(d) for d in program.dependencies()]
    dependents = program.dependents()
    ready = [(position[i], i) for i in range(len(program.ops)) if waiting[i] == 0]
    heapq.heapify(ready)
    result: list[int] = []
    while ready:
        chosen = _next_within(ready, lookahead, lanes, deferred)
        result.append(chosen)
        for after in dependents[chosen]:
            waiting[after] -= 1
            if waiting[after] == 0:
                heapq.heappush(ready, (position[after], after))
    assert len(result) == len(program.ops), "an op never became ready"
    return tuple(result)


class _LaneQueues:
    """Each lane's ops not issued yet, by deadline (the position of their first reader in the order): a lane's
    copies run in issue order, so a copy needed later must not be issued ahead of one needed sooner."""

    def __init__(self, program: Program, position: dict[int, int]) -> None:
        self.ops = program.ops
        dependents = program.dependents()
        self.unissued: dict[str, list[tuple[int, int]]] = {}
        for i, op in enumerate(self.ops):
            if op.lane:
                deadline = min((position[d] for d in dependents[i]), default=len(position))
                self.unissued.setdefault(op.lane, []).append((deadline, i))
        for queue in self.unissued.values():
            heapq.heapify(queue)
        self.issued = [False] * len(self.ops)

    def most_urgent(self, i: int) -> bool:
        """Whether op i is the lane op its lane needs soonest among those not issued."""
        queue = self.unissued[self.ops[i].lane]
        while queue and self.issued[queue[0][1]]:
            heapq.heappop(queue)
        return queue[0][1] == i

    def issue(self, i: int) -> None:
        self.issued[i] = True


def _reads_a_fetch(program: Program) -> list[bool]:
    """Per op: whether it is compute that reads a storage a remote -> device lane op fills."""
    ops, values = program.ops, program.values
    fetched_storages = {values[v].storage for op in ops if op.lane == "h2d" for v in op.outputs}
    return [op.lane is None and any(values[v].storage in fetched_storages for v in op.inputs) for op in ops]


def _next_within(ready: list[tuple[int, int]], lookahead: int, lanes: _LaneQueues, deferred: list[bool]) -> int:
    """The op to run next, taken off the heap ``ready`` ((position, op id)): of the ready ops within ``lookahead``
    positions of the earliest, the lane op its lane needs soonest (a copy issued early hides best), then the
    earliest op that does not wait for a fetch, then the earliest op."""
    frontier = ready[0][0]
    near: list[tuple[int, int]] = []
    while ready and ready[0][0] < frontier + lookahead:
        near.append(heapq.heappop(ready))
    chosen = next((item for item in near if lanes.ops[item[1]].lane is not None and lanes.most_urgent(item[1])), None) \
        or next((item for item in near if not deferred[item[1]]), None) or near[0]
    lanes.issue(chosen[1])
    for item in near:
        if item is not chosen:
            heapq.heappush(ready, item)
    return chosen[1]


def fetch_on_demand(program: Program, order: Sequence[int] | None = None) -> tuple[int, ...]:
    """``order`` (default: captured) with each remote -> device lane op moved to just before the first op
    that reads its result: a fetch issued when the data is needed, as a runtime that swaps blocks in on a
    miss does."""
    order = list(range(len(program.ops)) if order is None else order)
    ops = program.ops
    fetches = [i for i in order if ops[i].lane == "h2d"]
    if not fetches:
        return tuple(order)
    deps = program.dependencies()
    first_reader: dict[int, int] = {}
    for op_id in order:
        for d in deps[op_id]:
            if ops[d].lane == "h2d":
                first_reader.setdefault(d, op_id)
    before: dict[int, list[int]] = {}
    for f in fetches:
        if f in first_reader:
            before.setdefault(first_reader[f], []).append(f)
    moved = {f for fs in before.values() for f in fs}
    result: list[int] = []
    for op_id in order:
        if op_id in moved:
            continue
        result.extend(before.get(op_id, ()))
        result.append(op_id)
    return tuple(result)


__all__ = ["fetch_on_demand", "hoist_updates", "overlap_lane_ops", "sink_views"]
