"""Consecutive steps of a plan, for the steady state of plans that keep state in remote memory.

A plan whose storages start the step in remote memory (``Plan.initial_remote``) sends them back out
at the end of the step, and in a training loop those copies overlap the next step's start. One
simulated step would count them as exposed and would start on idle lanes; simulating two steps back
to back and timing the second gives the period a training loop actually sees.
"""

from __future__ import annotations

from dataclasses import replace

from hyperoffload.instructions import ALLOCATES_TARGET, FREES_TARGET
from hyperoffload.ir import Op, Program, Value
from hyperoffload.memo import per_program
from hyperoffload.plans import Instr, Kind, Plan, compute_instructions, op_storages


def repeat_plan(plan: Plan, times: int) -> tuple[Plan, tuple[int, ...]]:
    """``plan`` run ``times`` times in a row as one plan, and the index of each step's first instruction.

    Step inputs and constants are shared by all steps (the state they hold carries over); every other
    value is new in each step. An offload left in flight at the end of one step is ordered before the
    next step's prefetch of the same storage by the copy lanes, not by the compute stream.
    """
    program = plan.program
    repeated, maps = _repeated(program, times)
    computes = compute_instructions(repeated)
    instructions: list[Instr] = []
    starts: list[int] = []
    n_ops = len(program.ops)
    # An earlier step's outputs are not held through later steps, so one released after its last device
    # use has already been freed there (by the automatic free after that use, to the same effect).
    shared = set(program.inputs) | set(program.constants)
    returned = {program.values[v].storage for v in program.outputs} - shared
    freed_anyway = _releases_after_last_use(plan, returned)
    for k, mapping in enumerate(maps):
        starts.append(len(instructions))
        offset = k * n_ops
        for i, ins in enumerate(plan.instructions):
            if ins.kind is Kind.COMPUTE:
                instructions.append(computes[ins.target + offset])
            elif i in freed_anyway and k < len(maps) - 1:
                continue
            else:
                instructions.append(ins if k == 0 else Instr(ins.kind, mapping[ins.target]))
    return (Plan(program=repeated, instructions=tuple(instructions), policy=plan.policy,
                 budget_bytes=plan.budget_bytes, initial_remote=plan.initial_remote), tuple(starts))


def _releases_after_last_use(plan: Plan, storages: set[int]) -> set[int]:
    """Indices of instructions freeing one of ``storages`` (``FREES_TARGET``: releases) that nothing putting the
    same storage on the device again follows: no compute touching it, no instruction allocating it
    (``ALLOCATES_TARGET``: prefetches)."""
    touched = op_storages(plan.program)[0]
    result: set[int] = set()
    used_later: set[int] = set()
    for i in range(len(plan.instructions) - 1, -1, -1):
        ins = plan.instructions[i]
        if ins.kind is Kind.COMPUTE:
            used_later.update(touched[ins.target])
        elif ins.kind in ALLOCATES_TARGET:
            used_later.add(ins.target)
        elif ins.kind in FREES_TARGET and ins.target in storages and ins.target not in used_later:
            result.add(i)
    return result


@per_program
def _repeated(program: Program, times: int) -> tuple[Program, list[dict[int, int]]]:
    """``program`` ``times`` times in a row, and each step's value-id mapping; built once per program and
    count (every plan of a program repeats the same ops, and planners simulate many plans)."""
    shared = set(program.inputs) | set(program.constants)
    values: list[Value] = list(program.values)
    ops: list[Op] = list(program.ops)
    maps: list[dict[int, int]] = [{v.id: v.id for v in program.values}]
    for k in range(1, times):
        mapping: dict[int, int] = {}
        for v in program.values:
            if v.id in shared:
                mapping[v.id] = v.id
                continue
            mapping[v.id] = len(values)
            values.append(replace(v, id=len(values), name=f"{v.name}#{k + 1}", storage=mapping[v.storage]))
        for op in program.ops:
            ops.append(replace(op, id=len(ops), name=f"{op.name}#{k + 1}",
                               inputs=tuple(mapping[v] for v in op.inputs),
                               outputs=tuple(mapping[v] for v in op.outputs),
                               mutates=tuple(mapping[v] for v in op.mutates)))
        maps.append(mapping)
    # Earlier steps' outputs are handed to the caller when their step ends, not held through later steps.
    outputs = tuple(maps[-1][v] for v in program.outputs)
    repeated = Program(name=program.name, mode=program.mode, values=tuple(values), ops=tuple(ops),
                       inputs=program.inputs, outputs=outputs, constants=program.constants, meta=program.meta)
    return repeated, maps
