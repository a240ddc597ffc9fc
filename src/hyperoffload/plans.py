"""Plans: a Program's compute ops in an order, with the cache instructions that move data.

A ``Plan`` is what every policy produces and what the simulator and the executors consume. Its
instructions are issued in order, as one host thread would issue them to three streams:

* ``COMPUTE op``   runs ``op`` on the compute stream; its outputs are allocated when it starts.
* ``OFFLOAD s``    copies storage ``s`` device -> remote on the D2H lane, once the op that last
                   wrote ``s`` has finished. The device copy stays until released.
* ``PREFETCH s``   allocates ``s`` on the device and copies it remote -> device on the H2D lane,
                   once the offload that filled remote memory (if still in flight) has landed.
* ``WAIT s``       the compute stream waits until the latest transfer of ``s`` has finished.
* ``RELEASE s``    drops the device copy of ``s``; its memory is returned once the offload of
                   ``s`` and the ops issued before that read it have finished.

Storages not held by the caller (anything but step inputs, outputs and constants) are freed
automatically after their last device use, as the lifetime analysis assumes. ``check_plan``
enforces the rules below statically and reports the first broken one by instruction index;
nothing invalid is ever simulated.

Rules: an op reads only values that are on the device and ready (produced, or prefetched and waited
for); a prefetch needs a copy in remote memory (an offload since the last write, landed or still in
flight: the copy lanes keep that order) and a value not already on the device; a release must not
lose data that is used later or returned (an offload since the last write); an op must not overwrite
a value while its offload may still be reading it; every op runs once, after the ops it depends on;
at the end every held storage is on the device or in remote memory; and, with a budget, the bytes
allocated in instruction order never exceed it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from hyperoffload.instructions import OUTPUTS, RULES, TARGET, Kind
from hyperoffload.ir import Program
from hyperoffload.memo import per_program


class Instr(NamedTuple):
    """One instruction: ``target`` is an op id for COMPUTE, a storage-owner value id otherwise. (A named tuple:
    immutable, and much faster to make than a frozen dataclass; planners make tens of thousands per plan.)"""

    kind: Kind
    target: int

    def describe(self, program: Program) -> str:
        if self.kind is Kind.COMPUTE:
            op = program.ops[self.target]
            return f"compute {op.name} ({op.target})"
        return f"{self.kind.value} {program.values[self.target].name}"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Plan:
    """Instructions over a Program, made by a policy for a budget."""

    program: Program
    instructions: tuple[Instr, ...]
    policy: str = "none"
    budget_bytes: int | None = None
    """Device bytes the plan promises to stay under (None: no limit)."""
    initial_remote: frozenset[int] = frozenset()
    """Storages (step inputs) that start the step in remote memory rather than on the device."""
    layout: Any = None
    """A static layout of the plan's device memory (``hyperoffload.layout.Layout``), or None if the policy
    leaves addresses to the allocator."""

    def compute_order(self) -> list[int]:
        """The op ids the plan computes, in its order (what the order-dependent bounds take)."""
        return [i.target for i in self.instructions if i.kind is Kind.COMPUTE]


class PlanError(ValueError):
    """A plan breaks a rule; ``index`` is the offending instruction (-1 for the plan as a whole)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"instruction #{index}: {message}" if index >= 0 else message)
        self.index = index


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanCheck:
    """What ``check_plan`` derives from a valid plan."""

    live_bytes: tuple[int, ...]
    """Device bytes allocated at each instruction, after its own allocation or release and before the
    automatic frees that follow it (instruction-order accounting; for a compute, its inputs and
    outputs together)."""
    peak_bytes: int
    frees_after: tuple[tuple[int, ...], ...]
    """Storages freed automatically once each instruction has finished (their last device use)."""
    initial_bytes: int
    """Bytes on the device when the step starts (held storages not in remote memory)."""


def plan_without_offload(program: Program, order: Sequence[int] | None = None,
                         budget_bytes: int | None = None) -> Plan:
    """The step as captured (or in ``order``): compute only, nothing leaves the device."""
    order = range(len(program.ops)) if order is None else order
    computes = compute_instructions(program)
    return Plan(program=program, instructions=tuple(computes[i] for i in order), policy="none",
                budget_bytes=budget_bytes)


def state_storages(program: Program) -> frozenset[int]:
    """Storages the step starts with and the caller keeps across steps: its inputs' and constants'."""
    values = program.values
    return frozenset(values[v].storage for v in (*program.inputs, *program.constants))


def held_storages(program: Program) -> frozenset[int]:
    """Storages the caller holds across the step: inputs, constants and outputs."""
    values = program.values
    return state_storages(program) | {values[v].storage for v in program.outputs}


def check_plan(plan: Plan) -> PlanCheck:
    """Check every rule of a plan (see the module docstring); raise ``PlanError`` on the first broken one."""
    program, instrs = plan.program, plan.instructions
    values = program.values
    storage_of = [v.storage for v in values]
    held = held_storages(program)
    name = lambda s: values[s].name  # noqa: E731
    if not plan.initial_remote <= {storage_of[v] for v in program.inputs}:
        raise PlanError(-1, "initial_remote may only name storages of step inputs")

    # Last device use of every storage (compute read/write, or offload), for automatic frees, and its last
    # compute use, for knowing whether a released value is needed again. (Indices only: the instruction
    # that uses it next is looked up when a release is found to lose data, on the error path.)
    touched, read, written = op_storages(program)
    n_ops = len(program.ops)
    last_compute: dict[int, int] = {}
    last_offload: dict[int, int] = {}
    for i, ins in enumerate(instrs):
        if ins.kind is Kind.COMPUTE:
            if not 0 <= ins.target < n_ops:
                raise PlanError(i, f"compute of op id {ins.target}, which the program does not have")
            for s in touched[ins.target]:
                last_compute[s] = i
        else:
            if not 0 <= ins.target < len(values) or storage_of[ins.target] != ins.target:
                raise PlanError(i, f"{ins.kind.value} of value id {ins.target}, which is not a storage owner")
            if values[ins.target].remote:
                raise PlanError(i, f"{ins.kind.value} of {values[ins.target].name}: it lives in remote memory for the "
                                   f"whole step; only the step's lane ops move its data")
            if ins.kind is Kind.OFFLOAD:
                last_offload[ins.target] = i
    last_use = dict(last_compute)
    for s, i in last_offload.items():
        if i > last_use.get(s, -1):
            last_use[s] = i
    # Storages the caller does not hold are freed after their last device use: the candidates per instruction.
    last_of: dict[int, set[int]] = {}
    for s, i in last_use.items():
        if s not in held:
            last_of.setdefault(i, set()).add(s)

    on_device: dict[int, bool] = {}
    ready: dict[int, bool] = {}
    remote: dict[int, str] = {}  # "valid" | "pending" (offload not waited) | absent
    pending: dict[int, tuple[Kind, int]] = {}
    released_at: dict[int, int] = {}
    allocated = 0
    for s in {storage_of[v] for v in (*program.inputs, *program.constants)}:
        if s in plan.initial_remote:
            on_device[s], ready[s], remote[s] = False, False, "valid"
        else:
            on_device[s] = ready[s] = True
            allocated += values[s].alloc_bytes
    initial = allocated
    if plan.budget_bytes is not None and initial > plan.budget_bytes:
        raise PlanError(-1, f"the step's inputs on the device take {initial} bytes, over the budget of "
                            f"{plan.budget_bytes}; start some of them in remote memory")

    deps = program.dependencies()
    owned = owned_outputs(program)
    computed = [False] * len(program.ops)
    live: list[int] = []
    frees_after: list[tuple[int, ...]] = []
    for i, ins in enumerate(instrs):
        s = ins.target
        if ins.kind is Kind.COMPUTE:
            if computed[s]:
                raise PlanError(i, f"{ins.describe(program)} runs a second time")
            for d in deps[s]:
                if not computed[d]:
                    raise PlanError(i, f"{ins.describe(program)} runs before {program.ops[d].name}, which it "
                                       f"depends on")
            for r in read[s]:
                if not ready.get(r, False):
                    if r in released_at and not on_device.get(r):
                        why = f"released by #{released_at[r]}; prefetch it and wait before this op"
                    elif r in pending and pending[r][0] is Kind.PREFETCH:
                        why = f"prefetched by #{pending[r][1]} but not waited for"
                    else:
                        why = "never brought to the device"
                    raise PlanError(i, f"{ins.describe(program)} reads {name(r)}, which is not on the device ({why})")
            for w in written[s]:
                if w in pending and pending[w][0] is Kind.OFFLOAD:
                    raise PlanError(i, f"{ins.describe(program)} overwrites {name(w)} while its offload "
                                       f"#{pending[w][1]} may still be reading it; wait for the offload first")
                remote.pop(w, None)  # the remote copy, if any, is now stale
            computed[s] = True
        elif ins.kind is Kind.OFFLOAD:
            if not ready.get(s, False):
                raise PlanError(i, f"offload of {name(s)}: it is not on the device")
            if s in pending:
                raise PlanError(i, f"offload of {name(s)} while its {pending[s][0].value} #{pending[s][1]} "
                                   f"is still in flight; wait for it first")
            pending[s] = (Kind.OFFLOAD, i)
            remote[s] = "pending"
        elif ins.kind is Kind.PREFETCH:
            if on_device.get(s, False):
                raise PlanError(i, f"prefetch of {name(s)}: it is already on the device")
            if remote.get(s) == "pending":
                # The H2D lane starts this copy once the offload has landed (a stream-to-stream wait, as
                # a runtime records it); the compute stream does not stop for it.
                remote[s] = "valid"
            elif remote.get(s) != "valid":
                raise PlanError(i, f"prefetch of {name(s)}: it has no copy in remote memory; offload it first")
            pending[s] = (Kind.PREFETCH, i)
        elif ins.kind is Kind.WAIT:
            if s not in pending:
                raise PlanError(i, f"wait for {name(s)}: no transfer of it is in flight")
            kind, _ = pending.pop(s)
            if kind is Kind.OFFLOAD:
                remote[s] = "valid"
            else:
                ready[s] = True
        elif ins.kind is Kind.RELEASE:
            if not on_device.get(s, False):
                raise PlanError(i, f"release of {name(s)}: it is not on the device")
            if s in pending and pending[s][0] is Kind.PREFETCH:
                raise PlanError(i, f"release of {name(s)} while its prefetch #{pending[s][1]} is in flight")
            used_later = last_compute.get(s, -1) > i
            if remote.get(s) is None and (used_later or s in held):
                if used_later:
                    at = next(j for j in range(i + 1, len(instrs))
                              if instrs[j].kind is Kind.COMPUTE and s in touched[instrs[j].target])
                    where = f"it is used again by #{at}"
                else:
                    where = "the step returns or keeps it"
                raise PlanError(i, f"release of {name(s)} loses its data: no offload since it was last "
                                   f"written, and {where}")
            released_at[s] = i
        else:  # pragma: no cover - Kind is closed
            raise PlanError(i, f"unknown instruction {ins.kind}")
        # What the instruction does to device memory (``instructions.RULES``), once its rules hold.
        rule = RULES[ins.kind]
        if rule.allocates is not None:
            for o in owned[s] if rule.allocates is OUTPUTS else (s,):
                on_device[o], ready[o] = True, rule.ready_at_issue
                allocated += values[o].alloc_bytes
        elif rule.frees is TARGET:
            on_device[s] = ready[s] = False
            allocated -= values[s].alloc_bytes
        if plan.budget_bytes is not None and allocated > plan.budget_bytes:
            raise PlanError(i, f"{ins.describe(program)} brings the device to {allocated} bytes, over the budget "
                               f"of {plan.budget_bytes}")
        live.append(allocated)
        # Automatic frees: storages the caller does not hold, after their last device use (in the order the
        # op touches them, which the static layout's free list follows).
        ending = last_of.get(i)
        if ending:
            ended = [t for t in touched[s] if t in ending] if ins.kind is Kind.COMPUTE else ending
            frees = [t for t in ended if on_device.get(t, False)]
            for t in frees:
                on_device[t] = ready[t] = False
                allocated -= values[t].alloc_bytes
            frees_after.append(tuple(frees))
        else:
            frees_after.append(())

    if not all(computed):
        missing = next(op.name for op, done in zip(program.ops, computed) if not done)
        raise PlanError(-1, f"the plan never computes {missing}")
    for s in sorted(held):
        if not on_device.get(s, False) and remote.get(s) is None:
            raise PlanError(-1, f"{name(s)} is lost at the end of the step: neither on the device nor in remote memory")
    return PlanCheck(live_bytes=tuple(live), peak_bytes=max(live, default=initial), frees_after=tuple(frees_after),
                     initial_bytes=initial)


def plan_digest(plan: Plan) -> str:
    """A hash of what ``plan`` does, the same in every process that makes the same plan: its instructions (each
    naming the op or value by its fx name, not by an id), the storages it starts remote and its budget.

    Ranks of a sharded step must run the same plan (a rank that issued its collectives in another order than the
    others would wait on them for ever); comparing digests across ranks checks that before a step runs."""
    program = plan.program
    digest = hashlib.sha256(f"{program.name}|{program.mode}|{plan.policy}|{plan.budget_bytes}".encode())
    names = sorted(program.values[s].name for s in plan.initial_remote)
    digest.update(("remote:" + ",".join(names)).encode())
    for instr in plan.instructions:
        name = program.ops[instr.target].name if instr.kind is Kind.COMPUTE else program.values[instr.target].name
        digest.update(f"|{instr.kind.value}:{name}".encode())
    return digest.hexdigest()


def remote_bytes(plan: Plan) -> int:
    """Bytes of remote memory (host DRAM) the plan keeps copies in: every storage it offloads or starts in
    remote memory, counted once (a remote copy is kept to the end of the step, and its buffer is reused by the
    next), plus what the step holds in remote memory itself (a remote KV cache)."""
    values = plan.program.values
    storages = set(plan.initial_remote) | {i.target for i in plan.instructions if i.kind is Kind.OFFLOAD}
    held = sum(v.nbytes for v in values if v.remote and v.owns_storage)
    return sum(values[s].alloc_bytes for s in storages) + held


@per_program
def compute_instructions(program: Program) -> tuple[Instr, ...]:
    """``Instr(COMPUTE, op)`` for each op id of ``program``, made once per program: instructions are immutable,
    and planners that make many plans of a 20k-op step spent much of their time making them anew."""
    return tuple(Instr(Kind.COMPUTE, i) for i in range(len(program.ops)))


@per_program
def owned_outputs(program: Program) -> tuple[tuple[int, ...], ...]:
    """Per op id, its outputs that own their storage (what running it allocates); computed once per program."""
    values = program.values
    return tuple(tuple(o for o in op.outputs if values[o].owns_storage) for op in program.ops)


@per_program
def op_writes(program: Program) -> tuple[frozenset[int], ...]:
    """Per op id, the storages it writes: those it mutates and those its outputs own (creates); computed once
    per program (the simulator and every order's storage uses read it)."""
    mutated = op_storages(program)[2]
    return tuple(mutated[i] | frozenset(owned) for i, owned in enumerate(owned_outputs(program)))


@per_program
def op_storages(program: Program) -> tuple[tuple[frozenset[int], ...], tuple[tuple[int, ...], ...],
                                            tuple[frozenset[int], ...]]:
    """Per op id, the storages it touches (reads or writes), those it reads (sorted) and those it mutates;
    computed once per program (every plan of it is checked against the same ops)."""
    storage_of = [v.storage for v in program.values]
    return (tuple(frozenset(storage_of[v] for v in (*op.inputs, *op.outputs)) for op in program.ops),
            tuple(tuple(sorted({storage_of[v] for v in op.inputs})) for op in program.ops),
            tuple(frozenset(storage_of[v] for v in op.mutates) for op in program.ops))
