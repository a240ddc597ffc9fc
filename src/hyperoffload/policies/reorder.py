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

import heapq

from hyperoffload.ir import Phase, Program


def hoist_updates(program: Program) -> tuple[int, ...]:
    """An execution order (op ids) in which each optimizer-phase op runs as soon as the ops it depends
    on have run; other ops keep the captured order. Equal to the captured order when the step has no
    optimizer phase."""
    deps = program.dependencies()
    early = [op.phase is Phase.OPTIMIZER for op in program.ops]
    waiting = [len(d) for d in deps]
    dependents: list[list[int]] = [[] for _ in program.ops]
    for op_id, d in enumerate(deps):
        for before in d:
            dependents[before].append(op_id)
    ready: list[int] = [op_id for op_id, e in enumerate(early) if e and waiting[op_id] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    done = [False] * len(program.ops)

    def run(op_id: int) -> None:
        order.append(op_id)
        done[op_id] = True
        for after in dependents[op_id]:
            waiting[after] -= 1
            if early[after] and waiting[after] == 0:
                heapq.heappush(ready, after)

    def drain() -> None:  # every update whose inputs are ready, in captured order
        while ready:
            run(heapq.heappop(ready))

    drain()
    for op_id in range(len(program.ops)):
        if early[op_id]:
            continue  # placed by drain() once its dependencies have run
        # Every dependency of a later-phase op comes before it in the captured order, so by induction
        # each one has run (or has been drained) by now.
        assert waiting[op_id] == 0, f"op {program.ops[op_id].name} reached before its dependencies"
        run(op_id)
        drain()
    assert all(done), "an optimizer op never became ready"
    return tuple(order)


__all__ = ["hoist_updates"]
