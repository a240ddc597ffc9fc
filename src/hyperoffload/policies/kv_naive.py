"""``kv-naive``: the whole KV cache lives in remote memory and is fetched in full, blocking, before each
step uses it. Models the simplest KV offload (``docs/figures.md``: "whole KV cache remote,
fetched in full before use"): every layer's cache tensors are copied to the device when the layer
first reads them, written there (the new token's keys and values), and sent back after the layer's
last use, so each decode step moves the whole cache in and out.

How faithful: a runtime doing this issues the fetch when the layer is reached and waits for it (a
prefetch immediately followed by a wait, at the layer's first use of the tensor), with no lookahead;
the write-back of a cache tensor starts after the op that last wrote it and its device memory is
returned once the copy lands (an offload and a release after its last use). A cache tensor the step
never writes needs no write-back: its remote copy is still current. Nothing else moves. On a step
with no KV cache (training, prefill) the plan is the captured step.

Budget: the rule does not look at the budget. The plan is what it gives; if its peak is over the
budget it is returned without one, and its peak is what the policy needs.
"""

from __future__ import annotations

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program, ValueKind
from hyperoffload.plans import Kind, Plan
from hyperoffload.policies.common import Placed, emit_plan

POLICY = "kv-naive"


def plan_kv_naive(program: Program, hardware: Hardware, budget_bytes: int) -> Plan:
    """Every KV cache storage remote between steps, fetched (blocking) at its first use and sent back after
    its last."""
    values = program.values
    cache = {values[v].storage for v in program.inputs
             if values[values[v].storage].kind is ValueKind.KV_CACHE and values[values[v].storage].alloc_bytes}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    written: set[int] = set()
    for p, op in enumerate(program.ops):
        for s in {values[v].storage for v in (*op.inputs, *op.outputs)} & cache:
            first.setdefault(s, p)
            last[s] = p
        written.update({values[v].storage for v in op.mutates} & cache)
    placed: list[Placed] = []
    for s in first:
        placed += [Placed(first[s], Kind.PREFETCH, s), Placed(first[s], Kind.WAIT, s)]
        if s in written:
            placed.append(Placed(last[s] + 1, Kind.OFFLOAD, s))
        placed.append(Placed(last[s] + 1, Kind.RELEASE, s))
    return emit_plan(program, placed, policy=POLICY, budget_bytes=budget_bytes, initial_remote=frozenset(first))


__all__ = ["POLICY", "plan_kv_naive"]
