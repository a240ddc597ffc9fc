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

from hyperoffload.instructions import COPIES_OUT, OUTPUTS, RULES, TARGET, Kind
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
    """Check every rule of a plan (see the module docstring); raise ``PlanError`` on the first broken one.

    The steps: check every target names what the program has and find each storage's last uses
    (``_last_uses``); put the step's inputs where the plan starts them; then, instruction by instruction, check
    its kind's rules (``_Checker``, one method per kind), apply what it does to device memory
    (``instructions.RULES``) against the budget and free what it was the last use of; finally check that every op
    ran and no held storage is lost."""
    program = plan.program
    values = program.values
    if not plan.initial_remote <= {values[v].storage for v in program.inputs}:
        raise PlanError(-1, "initial_remote may only name storages of step inputs")
    checker = _Checker(plan)
    check, apply = checker.check, _memory_effects(checker)
    for i, ins in enumerate(plan.instructions):
        check[ins.kind](i, ins)
        apply(i, ins)
    return checker.finish()


def _memory_effects(checker: _Checker):
    """``apply(i, ins)``: what instruction ``i`` does to device memory (``instructions.RULES``), once its rules
    hold: what it allocates or frees, against the budget, then the automatic frees of the storages the caller does
    not hold after their last device use (in the order the op touches them, which the static layout's free list
    follows). (A closure over the checker's tables: it runs once per instruction of every plan a planner checks.)"""
    on_device, ready, values, owned = checker.on_device, checker.ready, checker.values, checker.owned
    live, frees_after, last_of, touched = checker.live, checker.frees_after, checker.last_of, checker.touched
    budget, program = checker.plan.budget_bytes, checker.program
    allocated = checker.initial

    def apply(i: int, ins: Instr) -> None:
        nonlocal allocated
        s, rule = ins.target, RULES[ins.kind]
        if rule.allocates is not None:
            ready_at_issue = rule.ready_at_issue
            for o in owned[s] if rule.allocates is OUTPUTS else (s,):
                on_device[o], ready[o] = True, ready_at_issue
                allocated += values[o].alloc_bytes
        elif rule.frees is TARGET:
            on_device[s] = ready[s] = False
            allocated -= values[s].alloc_bytes
        if budget is not None and allocated > budget:
            raise PlanError(i, f"{ins.describe(program)} brings the device to {allocated} bytes, over the budget "
                               f"of {budget}")
        live.append(allocated)
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

    return apply


def _last_uses(plan: Plan, touched: Sequence[frozenset[int]]) -> tuple[dict[int, int], dict[int, set[int]]]:
    """Each storage's last compute use (read or write), for knowing whether a released value is needed again,
    and, per instruction, the storages the caller does not hold whose last device use (a compute, or an offload)
    it is, to be freed automatically after it. (Indices only: the instruction that uses a storage next is looked
    up when a release is found to lose data, on the error path.) Raises ``PlanError`` for a target the program
    does not have."""
    program, values = plan.program, plan.program.values
    n_ops = len(program.ops)
    last_compute: dict[int, int] = {}
    last_offload: dict[int, int] = {}
    for i, ins in enumerate(plan.instructions):
        if ins.kind is Kind.COMPUTE:
            if not 0 <= ins.target < n_ops:
                raise PlanError(i, f"compute of op id {ins.target}, which the program does not have")
            for s in touched[ins.target]:
                last_compute[s] = i
        else:
            if not 0 <= ins.target < len(values) or values[ins.target].storage != ins.target:
                raise PlanError(i, f"{ins.kind.value} of value id {ins.target}, which is not a storage owner")
            if values[ins.target].remote:
                raise PlanError(i, f"{ins.kind.value} of {values[ins.target].name}: it lives in remote memory for the "
                                   f"whole step; only the step's lane ops move its data")
            if ins.kind in COPIES_OUT:
                last_offload[ins.target] = i
    last_use = dict(last_compute)
    for s, i in last_offload.items():
        if i > last_use.get(s, -1):
            last_use[s] = i
    held = held_storages(program)
    last_of: dict[int, set[int]] = {}
    for s, i in last_use.items():
        if s not in held:
            last_of.setdefault(i, set()).add(s)
    return last_compute, last_of


class _Checker:
    """The state of a plan being checked, instruction by instruction: where each storage is (on the device,
    ready, in remote memory), the transfers in flight, the ops run, the bytes allocated. ``check[kind](i, ins)``
    checks instruction ``i`` against its kind's rules (one method per kind, named as ``Kind``'s values and
    dispatched on it, as ``torch.fx.Interpreter.run_node`` dispatches on a node's op) and updates what they track;
    ``_memory_effects`` then makes its memory effects."""

    __slots__ = ("plan", "program", "instrs", "values", "held", "touched", "read", "written", "last_compute",
                 "last_of", "deps", "owned", "on_device", "ready", "remote", "pending", "released_at",
                 "initial", "computed", "live", "frees_after", "check")

    def __init__(self, plan: Plan) -> None:
        self.plan, self.program, self.instrs = plan, plan.program, plan.instructions
        program = plan.program
        self.values = values = program.values
        self.held = held_storages(program)
        self.touched, self.read, self.written = op_storages(program)
        self.last_compute, self.last_of = _last_uses(plan, self.touched)
        self.on_device: dict[int, bool] = {}
        self.ready: dict[int, bool] = {}
        self.remote: dict[int, str] = {}  # "valid" | "pending" (offload not waited) | absent
        self.pending: dict[int, tuple[Kind, int]] = {}
        self.released_at: dict[int, int] = {}
        allocated = 0
        for s in {values[v].storage for v in (*program.inputs, *program.constants)}:
            if s in plan.initial_remote:
                self.on_device[s], self.ready[s], self.remote[s] = False, False, "valid"
            else:
                self.on_device[s] = self.ready[s] = True
                allocated += values[s].alloc_bytes
        self.initial = allocated
        if plan.budget_bytes is not None and allocated > plan.budget_bytes:
            raise PlanError(-1, f"the step's inputs on the device take {allocated} bytes, over the budget of "
                                f"{plan.budget_bytes}; start some of them in remote memory")
        self.deps = program.dependencies()
        self.owned = owned_outputs(program)
        self.computed = [False] * len(program.ops)
        self.live: list[int] = []
        self.frees_after: list[tuple[int, ...]] = []
        self.check = {kind: getattr(self, kind.value) for kind in Kind}

    def _name(self, s: int) -> str:
        return self.values[s].name

    def compute(self, i: int, ins: Instr) -> None:
        """An op runs once, after the ops it depends on, reads only values on the device and ready, and does not
        overwrite a value its offload may still be reading; its writes make remote copies stale."""
        s, program = ins.target, self.program
        if self.computed[s]:
            raise PlanError(i, f"{ins.describe(program)} runs a second time")
        computed = self.computed
        for d in self.deps[s]:
            if not computed[d]:
                raise PlanError(i, f"{ins.describe(program)} runs before {program.ops[d].name}, which it depends on")
        ready = self.ready
        for r in self.read[s]:
            if not ready.get(r, False):
                raise PlanError(i, f"{ins.describe(program)} reads {self._name(r)}, which is not on the device "
                                   f"({self._why_not_ready(r)})")
        pending, remote = self.pending, self.remote
        for w in self.written[s]:
            if w in pending and pending[w][0] is Kind.OFFLOAD:
                raise PlanError(i, f"{ins.describe(program)} overwrites {self._name(w)} while its offload "
                                   f"#{pending[w][1]} may still be reading it; wait for the offload first")
            remote.pop(w, None)  # the remote copy, if any, is now stale
        computed[s] = True

    def _why_not_ready(self, r: int) -> str:
        if r in self.released_at and not self.on_device.get(r):
            return f"released by #{self.released_at[r]}; prefetch it and wait before this op"
        if r in self.pending and self.pending[r][0] is Kind.PREFETCH:
            return f"prefetched by #{self.pending[r][1]} but not waited for"
        return "never brought to the device"

    def offload(self, i: int, ins: Instr) -> None:
        """An offload copies a value on the device, one transfer of it at a time."""
        s, pending = ins.target, self.pending
        if not self.ready.get(s, False):
            raise PlanError(i, f"offload of {self._name(s)}: it is not on the device")
        if s in pending:
            raise PlanError(i, f"offload of {self._name(s)} while its {pending[s][0].value} #{pending[s][1]} "
                               f"is still in flight; wait for it first")
        pending[s] = (Kind.OFFLOAD, i)
        self.remote[s] = "pending"

    def prefetch(self, i: int, ins: Instr) -> None:
        """A prefetch brings back a value not on the device from its copy in remote memory (landed, or an offload
        still in flight: the H2D lane starts once it has landed, a stream-to-stream wait, as a runtime records
        it; the compute stream does not stop for it)."""
        s, remote = ins.target, self.remote
        if self.on_device.get(s, False):
            raise PlanError(i, f"prefetch of {self._name(s)}: it is already on the device")
        if remote.get(s) == "pending":
            remote[s] = "valid"
        elif remote.get(s) != "valid":
            raise PlanError(i, f"prefetch of {self._name(s)}: it has no copy in remote memory; offload it first")
        self.pending[s] = (Kind.PREFETCH, i)

    def wait(self, i: int, ins: Instr) -> None:
        """A wait needs a transfer in flight; after it, an offload's copy is valid, a prefetched value ready."""
        s = ins.target
        if s not in self.pending:
            raise PlanError(i, f"wait for {self._name(s)}: no transfer of it is in flight")
        kind, _ = self.pending.pop(s)
        if kind is Kind.OFFLOAD:
            self.remote[s] = "valid"
        else:
            self.ready[s] = True

    def release(self, i: int, ins: Instr) -> None:
        """A release drops a value on the device, not while it is being prefetched, and never loses data used
        later or returned (it needs an offload since the last write)."""
        s, pending = ins.target, self.pending
        if not self.on_device.get(s, False):
            raise PlanError(i, f"release of {self._name(s)}: it is not on the device")
        if s in pending and pending[s][0] is Kind.PREFETCH:
            raise PlanError(i, f"release of {self._name(s)} while its prefetch #{pending[s][1]} is in flight")
        used_later = self.last_compute.get(s, -1) > i
        if self.remote.get(s) is None and (used_later or s in self.held):
            if used_later:
                instrs, touched = self.instrs, self.touched
                at = next(j for j in range(i + 1, len(instrs))
                          if instrs[j].kind is Kind.COMPUTE and s in touched[instrs[j].target])
                where = f"it is used again by #{at}"
            else:
                where = "the step returns or keeps it"
            raise PlanError(i, f"release of {self._name(s)} loses its data: no offload since it was last "
                               f"written, and {where}")
        self.released_at[s] = i

    def finish(self) -> PlanCheck:
        """Every op ran, and every held storage ends on the device or in remote memory."""
        computed, program = self.computed, self.program
        if not all(computed):
            missing = next(op.name for op, done in zip(program.ops, computed) if not done)
            raise PlanError(-1, f"the plan never computes {missing}")
        for s in sorted(self.held):
            if not self.on_device.get(s, False) and self.remote.get(s) is None:
                raise PlanError(-1, f"{self._name(s)} is lost at the end of the step: neither on the device nor in "
                                    f"remote memory")
        live = self.live
        return PlanCheck(live_bytes=tuple(live), peak_bytes=max(live, default=self.initial),
                         frees_after=tuple(self.frees_after), initial_bytes=self.initial)


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
