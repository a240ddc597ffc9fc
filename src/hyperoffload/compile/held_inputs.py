"""Plans for steps whose caller keeps its own tensors: a release of an input frees memory only once the step owns it.

A lowered plan runs on the caller's tensors (a model's parameters, an optimizer's state, the user's
batch): a storage the plan starts on the device *is* the caller's tensor, which the caller holds
across the call. Releasing it frees nothing, whatever the plan's accounting says, so a plan that
offloads such an input and releases it to make room would exceed its budget for real. Once the
storage has been prefetched, its device copy is the step's own, and releasing that frees it.

``start_released_inputs_remote`` turns each such input into one that starts the step in remote
memory (the caller's tensor is then its remote copy, ``Plan.initial_remote``), prefetched at the
start of the step and waited for just before its first use. The device copy then belongs to the step
from the first instruction on, holding the same bytes at every instruction as the original plan
counted, so the peak is unchanged and every release is real; the link carries one more copy of each
such input per step.

``without_current_offloads`` then drops each offload whose storage's remote copy is still current (such an input
before its first write: the caller's tensor already holds those bytes), with its wait.
"""

from __future__ import annotations

import dataclasses

from hyperoffload.plans import Instr, Kind, Plan, op_storages


def start_released_inputs_remote(plan: Plan) -> Plan:
    """``plan`` with every input that starts on the device and is released before any prefetch of it made to
    start in remote memory (see the module docstring); ``plan`` itself when there is none."""
    program = plan.program
    values = program.values
    inputs = {values[v].storage for v in program.inputs} - set(plan.initial_remote)
    touched, _, _ = op_storages(program)
    released: list[int] = []
    prefetched: set[int] = set()
    for ins in plan.instructions:
        if ins.kind is Kind.PREFETCH:
            prefetched.add(ins.target)
        elif ins.kind is Kind.RELEASE and ins.target in inputs and ins.target not in prefetched:
            if ins.target not in released:
                released.append(ins.target)
    if not released:
        return plan
    waiting = set(released)
    instructions = [Instr(Kind.PREFETCH, s) for s in released]
    for ins in plan.instructions:
        used = touched[ins.target] if ins.kind is Kind.COMPUTE else (ins.target,)
        for s in [s for s in used if s in waiting]:
            instructions.append(Instr(Kind.WAIT, s))
            waiting.discard(s)
        instructions.append(ins)
    return dataclasses.replace(plan, instructions=tuple(instructions),
                               initial_remote=plan.initial_remote | frozenset(released))


def without_current_offloads(plan: Plan) -> Plan:
    """``plan`` without the offloads that copy what remote memory already holds: a storage that starts the step there
    (``Plan.initial_remote``) or was offloaded before, with no write since. A wait for a dropped offload goes too.
    ``plan`` itself when there is none."""
    _, _, written = op_storages(plan.program)
    current = set(plan.initial_remote)  # storages whose remote copy holds their data
    unwaited: set[int] = set()  # storages whose dropped offload the next wait of theirs would have waited for
    instructions: list[Instr] = []
    for ins in plan.instructions:
        kind, s = ins.kind, ins.target
        if kind is Kind.COMPUTE:
            current.difference_update(written[s])
        elif kind is Kind.OFFLOAD:
            if s in current:
                unwaited.add(s)
                continue
            current.add(s)
        elif kind is Kind.PREFETCH:
            unwaited.discard(s)  # the next wait of s is this prefetch's
        elif kind is Kind.WAIT and s in unwaited:
            unwaited.discard(s)
            continue
        instructions.append(ins)
    if len(instructions) == len(plan.instructions):
        return plan
    return dataclasses.replace(plan, instructions=tuple(instructions))


HELD_INPUT_PASSES = (start_released_inputs_remote, without_current_offloads)
"""The passes a plan of a step on the caller's own tensors goes through, in order (``hyperoffload.plan``'s
``passes``)."""

__all__ = ["HELD_INPUT_PASSES", "start_released_inputs_remote", "without_current_offloads"]
