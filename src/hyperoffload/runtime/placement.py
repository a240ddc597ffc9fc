"""Where a step's state starts: placing a step's inputs in the tiers the plan starts them in.

``place_state`` copies a step's inputs to where a plan starts them (remote buffers of the backend, device
storages, or their start slots of one new arena), to donate to its first step; ``move_order`` orders the moves
of state storages within one arena to their start slots, which a donated step does when it reuses the
previous step's arena.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyperoffload.layout import Layout
from hyperoffload.plans import Plan
from hyperoffload.runtime.arena import ArenaOverlap, _check_arena_budget, with_arena
from hyperoffload.runtime.prepared_plan import PreparedPlan, prepare_plan
from hyperoffload.runtime.transfers import Transfers
from hyperoffload.runtime.views import _ViewMeta


def place_state(plan: Plan | PreparedPlan, inputs: Sequence[torch.Tensor], transfers: Transfers, *,
                arena: bool | Layout = False) -> tuple[list[torch.Tensor], torch.UntypedStorage | None]:
    """Copies of a step's ``inputs`` where ``plan`` starts them, to donate to its first step: inputs that start
    in remote memory (``plan.initial_remote``) and those that live there for the whole step (a remote KV cache,
    which only lane ops touch) in the backend's remote buffers (``Transfers.input_storage``: pinned host memory
    on CUDA), the others in device storages of the backend, or, with ``arena`` (as ``execute_plan``'s), each in
    its start slot of one new arena (an empty input, which has none, in a device storage of its own). Returns
    the copies and the arena (None without one). Inputs that share a storage share its copy; the caller's
    tensors are left as they are.

    Why the arena: a donated step that finds its state outside an arena copies it into a new one, so the
    device holds the state twice while it does (the arena and the caller's copies). Placed here, the state
    is already in its slots, and a step given this arena (``kept_arena``) moves nothing."""
    prepared = plan if isinstance(plan, PreparedPlan) else prepare_plan(plan)
    plan, program = prepared.plan, prepared.plan.program
    if len(inputs) != len(program.inputs):
        raise ValueError(f"program {program.name} takes {len(program.inputs)} inputs, got {len(inputs)}")
    slots = None
    buffer = None
    if arena is not False and arena is not None:
        prepared = with_arena(prepared, arena)
        _check_arena_budget(plan, prepared.arena.layout)
        slots = prepared.arena.slots
        resident = [t for v, t in zip(program.inputs, inputs) if _starts_on_device(plan, prepared.storage_of[v])]
        like = (resident or list(inputs) or [torch.empty(0)])[0].untyped_storage()
        allocate = getattr(transfers, "arena_storage", None) or transfers.device_storage
        buffer = allocate(prepared.arena.layout.arena_bytes, like)
    copies: dict[int, torch.UntypedStorage] = {}
    placed = []
    for vid, tensor in zip(program.inputs, inputs):
        s = prepared.storage_of[vid]
        copy = copies.get(s)
        if copy is None:
            source = tensor.detach().untyped_storage()
            if not _starts_on_device(plan, s):
                allocate = getattr(transfers, "input_storage", None) or _input_storage
                copy = allocate(source.nbytes(), source)
            elif buffer is not None and (s, -1) in slots:
                offset, nbytes = slots[(s, -1)]
                if nbytes != source.nbytes():
                    raise ArenaOverlap(f"input {program.values[vid].name} has {source.nbytes()} bytes but its slot "
                                       f"in the layout {nbytes}; the program's sizes do not match the tensors "
                                       f"(capture the step again)")
                copy = buffer[offset:offset + nbytes]
            else:
                copy = transfers.device_storage(source.nbytes(), source)
            copy.copy_(source)
            copies[s] = copy
        placed.append(_ViewMeta.of(tensor).view_into(copy))
    return placed, buffer


def _starts_on_device(plan: Plan, s: int) -> bool:
    """Whether storage ``s`` is on the device tier when a step of ``plan`` starts: not an input that starts in
    remote memory (``initial_remote``) nor one that stays there for the whole step (a remote KV cache)."""
    return s not in plan.initial_remote and not plan.program.values[s].remote


def _input_storage(nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
    """A remote buffer for an input that starts a step in remote memory, where the backend has no
    ``input_storage`` of its own: a new storage on ``like``'s device (the reference backends keep both tiers
    there)."""
    return torch.UntypedStorage(nbytes, device=like.device)


def move_order(moves: dict[Any, tuple[int, int, int]]) -> list[tuple[str, Any]]:
    """An order for moving byte ranges within one buffer so that no range is overwritten before it is read.

    ``moves`` maps a key to ``(source, destination, nbytes)`` (offsets; sources are pairwise disjoint, and so
    are destinations). Returns steps ``("copy", key)`` (copy that move's bytes from its current source to its
    destination) and ``("spill", key)`` (first copy its source out of the buffer, to a temporary, which is its
    source from then on): a cycle of moves, each writing where another still has to read, needs one spill, and
    so does a move whose destination overlaps its own source."""
    pending = {key: (src, dst, n) for key, (src, dst, n) in moves.items() if src != dst}
    spilled: set[Any] = set()
    steps: list[tuple[str, Any]] = []

    def reads(key) -> tuple[int, int] | None:
        src, _, n = pending[key]
        return None if key in spilled else (src, src + n)

    def blocked_by(key):
        """A pending move that still reads from the buffer where ``key`` writes (spilled sources are read from
        elsewhere), or None; one exists for every move whenever no move is ready."""
        _, dst, n = pending[key]
        return next((other for other in pending if other != key and (span := reads(other)) is not None
                     and span[0] < dst + n and dst < span[1]), None)

    while pending:
        ready = [key for key in pending if blocked_by(key) is None]
        if not ready:  # every pending move writes where another reads: take one source out of the buffer,
            # one on a cycle of such waits (a move outside every cycle would still wait after the spill). Following
            # each move to one it waits for must come back to a move seen before: that one is on a cycle.
            seen: list[Any] = []
            key = next(iter(pending))
            while key not in seen:
                seen.append(key)
                key = blocked_by(key)
            steps.append(("spill", key))
            spilled.add(key)
            continue
        for key in ready:
            src, dst, n = pending.pop(key)
            if key not in spilled and src < dst + n and dst < src + n:  # shifted onto itself
                steps.append(("spill", key))
            steps.append(("copy", key))
    return steps
