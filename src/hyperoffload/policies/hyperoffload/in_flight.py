"""Device bytes a collective still holds after its position in the order.

A plan's live bytes count a storage as freed right after its last use in the order (``plans.check_plan``). Where
that last use is a collective, the simulator frees it only once the collective has finished on the network lane:
a reduce-scatter's input (FSDP2's ``chunk_cat`` of a layer's gradients) stays on the device for its ring time while
the compute stream runs on, and an op there that allocates waits for it. ``held_by_collectives`` says how many bytes
are held so at each position, given when each op starts; a pass that fills free room (``passes.prefetch_early``)
counts them as live, so that it does not fill room that is not there yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hyperoffload.cost import collective_op_time
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.memo import per_program
from hyperoffload.plans import check_plan, plan_without_offload


def held_by_collectives(program: Program, hardware: Hardware, order: Sequence[int], start: np.ndarray) -> np.ndarray:
    """Per position of ``order``: bytes of storages whose last use is a collective at an earlier position that has
    not finished by the time the op there starts (``start``, seconds per position). Collectives run one at a time
    on the network lane, each from when the compute stream reaches it or the one before has finished, for its
    ring time (``cost.collective_op_time``), as the simulator runs them."""
    held = np.zeros(len(order))
    lane_free = 0.0
    for position, nbytes in _collectives_in(program, tuple(order)):
        lane_free = max(lane_free, float(start[position])) + collective_op_time(program.ops[order[position]], hardware)
        if nbytes:
            until = int(np.searchsorted(start, lane_free, side="left"))
            held[position + 1:until] += nbytes
    return held


@per_program
def _collectives_in(program: Program, order: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Each collective of ``order``: its position and the bytes of the storages freed once it has finished (those it
    is the last use of)."""
    ops = program.ops
    positions = [p for p, op_id in enumerate(order) if ops[op_id].collective is not None]
    if not positions:
        return ()
    frees = check_plan(plan_without_offload(program, order)).frees_after
    values = program.values
    return tuple((p, sum(values[s].alloc_bytes for s in frees[p])) for p in positions)


__all__ = ["held_by_collectives"]
