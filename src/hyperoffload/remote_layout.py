"""Where a plan's remote copies live in host memory: ``remote_copies``, ``remote_layout``, ``remote_bytes``.

An OFFLOAD makes a remote copy of its storage (one that starts the step remote, ``plan.initial_remote``, is its own
copy: the caller's storage, which its offloads write). The copy is read by the storage's prefetches until the next
offload makes a newer one, and is needed until the last of those has landed, at the WAIT that follows it; the
newest copy of a storage the caller keeps (a step input, constant or output) is needed past the step, since the
step hands it back from there. A copy is therefore live over instructions ``[offload, wait + 1)``; one needed past
the step is live over the whole step, since the next step's copies are made before it is read.

``remote_layout`` places every copy at an offset of one host buffer, as ``layout`` places device storages in the
device arena (the same packing, ``layout.pack_blocks``), so that copies never live at once share bytes: a training
step's gradients, sent out in the backward pass, land where its activations were, once those have come back. What
a plan keeps in host memory (``remote_bytes``) is that buffer, the storages that start the step remote and what the
step keeps remote itself. The interpreter runs a step's offloads into that buffer (``Transfers.remote_arena``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperoffload.instructions import COPIES_OUT
from hyperoffload.layout import Residency, pack_aligned
from hyperoffload.plans import Kind, Plan


HOST_ALIGNMENT = 8
"""Bytes every copy's offset in the host buffer is a multiple of: a double's, so a copy can be viewed as any dtype;
copies are moved as bytes, so a larger alignment would only make host memory look fuller than it is."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteLayout:
    """Each remote copy's offset (bytes) in one host buffer of ``arena_bytes``: ``offset_of[offload instruction]``.
    A copy is a ``layout.Residency`` of host memory from its offload (``start``) to ``end``."""

    copies: tuple[Residency, ...]
    offset_of: dict[int, int]
    arena_bytes: int


def remote_copies(plan: Plan) -> tuple[Residency, ...]:
    """Every remote copy ``plan``'s offloads make, in offload order (see the module docstring)."""
    program, instrs = plan.program, plan.instructions
    values = program.values
    n = len(instrs)
    kept = {values[v].storage for v in (*program.inputs, *program.constants, *program.outputs)}
    current: dict[int, list[int]] = {}  # storage -> [offload index, end so far, whether a prefetch is unwaited]
    found: list[Residency] = []

    def close(s: int, past_the_step: bool) -> None:
        start, end, unwaited = current.pop(s)
        found.append(Residency(s, start, n if past_the_step or unwaited else end, values[s].alloc_bytes))

    for i, ins in enumerate(instrs):
        kind, s = ins.kind, ins.target
        if kind is Kind.COMPUTE or s in plan.initial_remote:
            continue
        if kind in COPIES_OUT:
            if s in current:
                close(s, past_the_step=False)
            current[s] = [i, i + 1, 0]
        elif s in current:
            copy = current[s]
            if kind is Kind.PREFETCH:
                copy[2] = 1
            elif kind is Kind.WAIT:
                copy[1], copy[2] = i + 1, 0
    for s in list(current):
        close(s, past_the_step=s in kept)
    found.sort(key=lambda c: c.start)
    return tuple(found)


def remote_layout(plan: Plan) -> RemoteLayout:
    """An offset in one host buffer for each of ``plan``'s remote copies, copies live at once never sharing a byte,
    the buffer as small as ``pack_blocks`` gets it (each copy's bytes rounded up to ``HOST_ALIGNMENT``)."""
    n = len(plan.instructions)
    copies = remote_copies(plan)
    if not copies:
        return RemoteLayout(copies=(), offset_of={}, arena_bytes=0)
    # A copy needed past the step is held over the whole of it: the next step's copies are made before it is read.
    offsets, arena_bytes = pack_aligned([-1 if c.end == n else c.start for c in copies], [c.end for c in copies],
                                        [c.nbytes for c in copies], HOST_ALIGNMENT)
    return RemoteLayout(copies=copies, offset_of={c.start: o for c, o in zip(copies, offsets)},
                        arena_bytes=arena_bytes)


def remote_bytes(plan: Plan) -> int:
    """Bytes of remote memory (host DRAM) the plan keeps: the buffer of its copies (``remote_layout``), every
    storage that starts the step remote, and what the step holds in remote memory itself (a remote KV cache, host
    state, the host copies its lane ops send there); not the temporaries its host ops make, which the host frees as
    it goes."""
    program = plan.program
    values = program.values
    host_made = ({o for op in program.ops if op.lane == "host" for o in op.outputs} if program.has_host_ops()
                 else set())
    held = sum(v.nbytes for v in values if v.remote and v.owns_storage and v.id not in host_made)
    return remote_layout(plan).arena_bytes + sum(values[s].alloc_bytes for s in plan.initial_remote) + held


__all__ = ["HOST_ALIGNMENT", "RemoteLayout", "remote_bytes", "remote_copies", "remote_layout"]
