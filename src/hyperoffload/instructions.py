"""What each plan instruction kind does to device memory, to its target's copies and to the streams, stated once.

A plan (``plans.Plan``) is a sequence of instructions of five kinds. ``RULES`` says, per kind, which copy of its
target it reads and writes (``Tier``), which device bytes it allocates or frees and when, which stream it occupies,
what it waits for (``WaitsOn``), the cache operator it lowers to and where a baseline emits it among the cache
instructions before one op. The checker (``plans.check_plan``), the simulator (``simulate``), the static layout
(``layout``), the lowering (``lower``), the compile backend, the baselines' emission (``policies.common``), the
executor (``runtime``) and the timeline check (``verify``) read these facts from here rather than each deriving
them anew, so a new kind is described in one place (its validity rules stay in the checker, its timing in the
simulator, its effect on tensors in the executor and the lowering, each a method per kind).

Streams: ``COMPUTE`` (the compute stream), ``H2D`` (remote -> device copy lane), ``D2H`` (device ->
remote copy lane), ``NET`` (the network between ranks), ``HOST`` (the host CPU). A compute of a lane op
(``Op.lane``) runs on that op's lane instead (a copy lane, or the host for a host op), and a compute of a
collective (``Op.collective``) on the network (``Op.stream``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: plans imports this module
    from hyperoffload.ir import Program
    from hyperoffload.plans import Instr, Plan

COMPUTE, H2D, D2H, NET, HOST = "compute", "h2d", "d2h", "net", "host"
STREAMS = (COMPUTE, H2D, D2H, NET, HOST)


class Kind(str, Enum):
    COMPUTE = "compute"
    OFFLOAD = "offload"
    PREFETCH = "prefetch"
    WAIT = "wait"
    RELEASE = "release"

    # The hash of the kind's text (equal kinds and texts compare equal already), computed in C: the checker and
    # the simulator look kinds up in ``RULES`` and in the sets below once per instruction, and ``Enum``'s own
    # hash, a Python function, made that a good part of their time.
    __hash__ = str.__hash__


class Tier(str, Enum):
    """Where a copy of a storage lives: device memory, or remote memory (host DRAM)."""

    DEVICE = "device"
    REMOTE = "remote"

    __hash__ = str.__hash__


class WaitsOn(str, Enum):
    """What an instruction waits for before it starts (``KindRule.waits_on``)."""

    PREVIOUS = "previous"
    """The instructions before it on its stream (a lane op's compute: the ops it depends on)."""
    WRITER = "writer"
    """The op that last wrote its target."""
    FILLER = "filler"
    """The transfer that fills the copy it reads (its ``reads`` tier's), if still in flight."""
    TRANSFER = "transfer"
    """The latest transfer of its target: the compute stream stops until it has landed."""
    NOTHING = "nothing"
    """Nothing (a release: its bytes come back once its target's copy and earlier readers have finished)."""


OUTPUTS, TARGET = "outputs", "target"
"""What an instruction allocates or frees: the storages its op's outputs own, or its target storage."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KindRule:
    """What one instruction kind does (``RULES``)."""

    kind: Kind
    stream: str | None
    """The stream it occupies (``COMPUTE``, ``H2D``, ``D2H``; a lane op's compute: its ``Op.lane``), or None
    for one that occupies none (a release only gives memory back)."""
    reads: Tier | None
    """The tier whose copy it reads: of its target (a copy), of its op's inputs (a compute); None: none."""
    writes: Tier | None
    """The tier whose copy it writes: of its target (a copy), of its op's outputs and mutated inputs (a compute)."""
    allocates: str | None
    """Whose device bytes it allocates when the compute stream reaches it (``OUTPUTS``, ``TARGET``, None)."""
    ready_at_issue: bool
    """Whether what it allocates is usable by the next instruction (an op's outputs), or only once a WAIT
    for it has come (a prefetch's copy)."""
    frees: str | None
    """Whose device bytes it gives back (``TARGET``, None); they come back once its target's latest copy and
    the ops issued before it that read the target have finished."""
    waits_on: WaitsOn
    """What it waits for before it starts."""
    operator: str | None
    """The ``torch.library`` operator it lowers to (``namespace::name[.overload]``, resolved by ``cache_ops``), or
    None for a compute, which runs its op's own fx node."""
    emit_rank: int | None
    """Where a baseline emits it among the cache instructions placed before one op (smaller first); None for a
    compute, which is the op itself."""

    @property
    def copies(self) -> bool:
        """Whether it moves its target's ``alloc_bytes`` over its copy lane: it reads one tier's copy and writes
        the other's."""
        return self.reads is not None and self.writes is not None and self.reads is not self.writes

    @property
    def on_device_after(self) -> bool | None:
        """Where its target is once it is issued: True on the device (it allocates it), False off it (it frees
        it), None unchanged."""
        return True if self.allocates == TARGET else False if self.frees == TARGET else None


RULES: dict[Kind, KindRule] = {rule.kind: rule for rule in (
    # Emit ranks: copies out first (they read what the previous op wrote), then releases (memory back before
    # anything new is allocated), then prefetches, then the waits right before the op.
    KindRule(kind=Kind.COMPUTE, stream=COMPUTE, reads=Tier.DEVICE, writes=Tier.DEVICE, allocates=OUTPUTS,
             ready_at_issue=True, frees=None, waits_on=WaitsOn.PREVIOUS, operator=None, emit_rank=None),
    KindRule(kind=Kind.OFFLOAD, stream=D2H, reads=Tier.DEVICE, writes=Tier.REMOTE, allocates=None,
             ready_at_issue=False, frees=None, waits_on=WaitsOn.WRITER, operator="hyperoffload::offload", emit_rank=0),
    KindRule(kind=Kind.PREFETCH, stream=H2D, reads=Tier.REMOTE, writes=Tier.DEVICE, allocates=TARGET,
             ready_at_issue=False, frees=None, waits_on=WaitsOn.FILLER, operator="hyperoffload::prefetch",
             emit_rank=2),
    KindRule(kind=Kind.WAIT, stream=COMPUTE, reads=None, writes=None, allocates=None, ready_at_issue=False,
             frees=None, waits_on=WaitsOn.TRANSFER, operator="hyperoffload::wait", emit_rank=3),
    KindRule(kind=Kind.RELEASE, stream=None, reads=None, writes=None, allocates=None, ready_at_issue=False,
             frees=TARGET, waits_on=WaitsOn.NOTHING, operator="hyperoffload::release", emit_rank=1),
)}

ALLOCATES_OUTPUTS = frozenset(k for k, rule in RULES.items() if rule.allocates == OUTPUTS)
ALLOCATES_TARGET = frozenset(k for k, rule in RULES.items() if rule.allocates == TARGET)
FREES_TARGET = frozenset(k for k, rule in RULES.items() if rule.frees == TARGET)
COPIES = frozenset(k for k, rule in RULES.items() if rule.copies)
COPIES_OUT = frozenset(k for k in COPIES if RULES[k].writes is Tier.REMOTE)
"""Copies from the device to remote memory: they read the device copy, which stays until released."""
COPIES_IN = frozenset(k for k in COPIES if RULES[k].writes is Tier.DEVICE)
"""Copies from remote memory to the device: the device copy is readable once waited for."""
MOVES_TIER = frozenset(k for k, rule in RULES.items() if rule.on_device_after is not None)


def stream_of(program: Program, ins: Instr) -> str | None:
    """The stream ``ins`` occupies in ``program`` (a lane op's compute: its copy lane; a collective's: the network)."""
    if ins.kind is Kind.COMPUTE:
        return program.ops[ins.target].stream
    return RULES[ins.kind].stream


def allocated_storages(ins: Instr, owned: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The storages ``ins`` allocates on the device; ``owned``: per op id, the outputs that own their storage
    (``plans.owned_outputs``)."""
    allocates = RULES[ins.kind].allocates
    if allocates == OUTPUTS:
        return owned[ins.target]
    return (ins.target,) if allocates == TARGET else ()


def alloc_bytes(program: Program, instructions: Sequence[Instr], op_alloc: Sequence[int]) -> list[int]:
    """Device bytes each instruction allocates (``op_alloc``: per op id, the bytes of the storages its outputs
    own), in the plan's instruction-order accounting."""
    values = program.values
    return [op_alloc[t] if k in ALLOCATES_OUTPUTS else values[t].alloc_bytes if k in ALLOCATES_TARGET else 0
            for k, t in instructions]


def copy_traffic(plan: Plan) -> tuple[int, int]:
    """Bytes the plan's copies (offloads and prefetches) move per step: (remote -> device, device -> remote)."""
    values = plan.program.values
    moved = {H2D: 0, D2H: 0}
    for kind, target in plan.instructions:
        if kind in COPIES:
            moved[RULES[kind].stream] += values[target].alloc_bytes
    return moved[H2D], moved[D2H]


def inputs_end_on_device(plan: Plan) -> dict[int, bool]:
    """Per storage of a step input, whether it ends the step on the device (it starts there unless in
    ``plan.initial_remote``; prefetches bring it back, releases take it off)."""
    values = plan.program.values
    on_device = {values[v].storage: values[v].storage not in plan.initial_remote for v in plan.program.inputs}
    for ins in plan.instructions:
        if ins.target in on_device and ins.kind in MOVES_TIER:
            on_device[ins.target] = RULES[ins.kind].on_device_after
    return on_device


__all__ = ["ALLOCATES_OUTPUTS", "ALLOCATES_TARGET", "COMPUTE", "COPIES", "COPIES_IN", "COPIES_OUT", "D2H",
           "FREES_TARGET", "H2D", "Kind", "KindRule", "MOVES_TIER", "NET", "OUTPUTS", "RULES", "STREAMS", "TARGET", "Tier",
           "WaitsOn", "alloc_bytes", "allocated_storages", "copy_traffic", "inputs_end_on_device", "stream_of"]
