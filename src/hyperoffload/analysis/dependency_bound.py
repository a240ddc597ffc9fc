"""A lower bound on the step time of any order of a step's ops, from the dependencies of its ops that run beside the
compute stream.

A lane op (``Op.lane``: a decode step's block fetch, a write to a remote cache) runs on a copy lane, a collective
(``Op.collective``: an FSDP all-gather or reduce-scatter) on the network, and the compute stream runs one op at a
time. Call both *side ops*. Take side ops ``F1, ..., Fk`` each of which depends,
directly or not, on the one before. Every op ``F1`` depends on must finish before ``F1`` starts; every op
that depends on ``Fi`` and that ``Fi+1`` depends on must run after ``Fi`` ends and before ``Fi+1`` starts;
every op that depends on ``Fk`` runs after it ends. Those sets of ops are disjoint and each runs on the
one compute stream, so no order of the ops, and no plan, can step faster than

    compute(ancestors of F1) + t(F1) + compute(between F1 and F2) + t(F2) + ... + t(Fk) + compute(descendants of Fk)

where ``t`` is a side op's time alone on its stream (``cost.side_op_time``). The bound is the largest such sum over
chains of side ops (a longest path over the side ops, weighted by the compute between them), and at least the
step's compute. What it leaves out is exactly what can overlap a transfer or a collective: the ops independent of
it. (The network lane's own total, every collective one after another, is a bound of its own:
``simulate.network_time``.) Host ops (``Op.lane`` ``"host"``: an optimizer step on the CPU) are left out of the
chains, which only loosens the bound: the host lane's total is a bound of its own too (``cost.host_time``).
"""

from __future__ import annotations


import numpy as np

from hyperoffload.cost import op_times, side_op_time
from hyperoffload.hardware import Hardware
from hyperoffload.ir import HOST_LANE, Program
from hyperoffload.memo import per_program

@per_program
def _reach(program: Program) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The side op ids (lane ops and collectives), and for each its ancestors and descendants among all ops
    (boolean rows)."""
    deps, dependents = program.dependencies(), program.dependents()
    n = len(program.ops)
    lanes = [op.id for op in program.ops if (op.lane is not None and op.lane != HOST_LANE) or op.collective is not None]
    ancestors = np.zeros((len(lanes), n), dtype=bool)
    descendants = np.zeros((len(lanes), n), dtype=bool)
    for row, lane in enumerate(lanes):
        for edges, seen in ((deps, ancestors[row]), (dependents, descendants[row])):
            stack = list(edges[lane])
            while stack:
                op_id = stack.pop()
                if not seen[op_id]:
                    seen[op_id] = True
                    stack.extend(edges[op_id])
    return lanes, ancestors, descendants


def dependency_bound(program: Program, hardware: Hardware, compute_s: float | None = None) -> float:
    """Seconds no order of ``program``'s ops can beat on ``hardware`` (module docstring); the step's compute
    time for a step without side ops (``compute_s`` if the caller has it: nothing else is needed then)."""
    if compute_s is not None and not program.has_side_ops():
        return compute_s
    compute = np.asarray(op_times(program, hardware), dtype=np.float64)
    total = float(compute.sum())
    if not program.has_side_ops():
        return total
    lanes, ancestors, descendants = _reach(program)
    transfer = [side_op_time(program.ops[i], hardware) for i in lanes]
    best = np.empty(len(lanes))  # longest chain ending with side op k, from the step's start to its end
    for k in range(len(lanes)):  # side ops in id order: a chain's earlier ops have smaller ids
        start = float(compute[ancestors[k]].sum())
        for j in range(k):
            if descendants[j, lanes[k]]:
                start = max(start, best[j] + float(compute[descendants[j] & ancestors[k]].sum()))
        best[k] = start + transfer[k]
    ends = [best[k] + float(compute[descendants[k]].sum()) for k in range(len(lanes))]
    return max([total, *ends])  # (no chains where the step's only side ops are host ops)
