"""Run a Plan on real CPU tensors with synchronous copies: the reference for planned steps.

There are two tiers. The *device* tier is an environment of live tensors, as in
``run_reference``; the *remote* tier maps a storage id to a copy of that storage's bytes in a
separate CPU buffer. Instructions act on them in plan order:

* ``COMPUTE op`` runs the op's fx node. Storages are freed after their last device use exactly
  as ``check_plan(plan).frees_after`` says, by dropping every value aliasing them at once.
* ``OFFLOAD s`` copies the whole untyped storage of ``s`` into a new remote buffer, so any view
  into it can be rebuilt.
* ``RELEASE s`` drops every value aliasing ``s`` from the device tier and remembers the view
  metadata of those read again later or returned.
* ``PREFETCH s`` allocates a new device storage from the remote copy and rebuilds the remembered
  views into it, so later ops read exactly the bytes that were offloaded.
* ``WAIT s`` has nothing to wait for (copies are synchronous); it checks that the transfer it
  waits for was issued.

Device bytes are measured from the tensors themselves (distinct storages referenced by the
device tier) after each instruction, like ``run_reference``, so they check ``check_plan``'s
accounting against reality. The caller's own references to its input tensors are not part of
the device tier: once the plan releases an input's storage, that memory counts as remote.

Caller tensors (step inputs and graph constants) whose storage the plan released are no longer
the tensors the step updates: the step continues on a rebuilt storage. So that in-place updates
(optimizer state, parameters, KV cache) land in the caller's tensors as in the unplanned step,
the final bytes of every replaced storage are copied back into the caller's storage at the end,
from the device tier or, if the plan leaves it in remote memory, from the remote copy; returned
values aliasing such a storage are returned as views of the caller's storage. This copy-back
emulates the caller's tensors living wherever the plan left them and is not counted as a
transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from hyperoffload.plans import Kind, Plan, check_plan
from hyperoffload.runtime.reference import live_storage_bytes, run_op


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRun:
    """Result of ``run_plan``."""

    outputs: tuple[torch.Tensor, ...]
    """The step's outputs, in ``program.outputs`` order."""
    live_bytes: tuple[int, ...]
    """Device-tier bytes of distinct storages referenced after each instruction (before its automatic frees)."""
    peak_bytes: int
    """Largest entry of ``live_bytes`` (the inputs' device bytes for a plan with no instructions)."""
    h2d_bytes: int
    """Bytes copied remote -> device by PREFETCH instructions."""
    d2h_bytes: int
    """Bytes copied device -> remote by OFFLOAD instructions."""


@dataclass(frozen=True, slots=True)
class _ViewMeta:
    """What it takes to rebuild a tensor as a view into a new copy of its storage."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    """In elements of ``dtype``."""

    @staticmethod
    def of(tensor: torch.Tensor) -> _ViewMeta:
        return _ViewMeta(tensor.dtype, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

    def view_into(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.storage_offset, self.size, self.stride)


def run_plan(plan: Plan, inputs: Sequence[torch.Tensor]) -> PlanRun:
    """Execute ``plan`` (whose program must carry its fx graph) on ``inputs``; see the module docstring.

    Raises ``PlanError`` (from ``check_plan``) if the plan is invalid, before anything runs. Inputs
    are used as given, as in ``run_reference``: pass clones to keep the originals.
    """
    program = plan.program
    if program.graph is None:
        raise ValueError(f"program {program.name} has no fx graph to execute; build it with a capture function")
    if len(inputs) != len(program.inputs):
        raise ValueError(f"program {program.name} takes {len(program.inputs)} inputs, got {len(inputs)}")
    checked = check_plan(plan)
    instrs = plan.instructions
    values = program.values
    storage_of = [v.storage for v in values]
    nodes = {n.name: n for n in program.graph.graph.nodes}

    # A released value is rebuilt on prefetch only if an instruction after it reads it or the step returns it.
    last_read = [-1] * len(values)
    for i, ins in enumerate(instrs):
        if ins.kind is Kind.COMPUTE:
            for v in program.ops[ins.target].inputs:
                last_read[v] = i
    returned = set(program.outputs)

    caller: dict[int, torch.Tensor] = dict(zip(program.inputs, inputs))
    for vid in program.constants:
        caller[vid] = getattr(program.graph, nodes[values[vid].name].target)
    caller_storages = {storage_of[v]: t.untyped_storage() for v, t in caller.items()}

    env: dict[int, torch.Tensor] = {}
    aliases: dict[int, set[int]] = {}  # storage id -> ids of the values in env that alias it
    remote: dict[int, torch.UntypedStorage] = {}
    remembered: dict[int, dict[int, _ViewMeta]] = {}  # storage id -> released value id -> its view
    replaced: set[int] = set()  # caller storages the step no longer runs on

    def put(vid: int, tensor: torch.Tensor) -> None:
        env[vid] = tensor
        aliases.setdefault(storage_of[vid], set()).add(vid)

    def drop_storage(s: int) -> dict[int, torch.Tensor]:
        return {v: env.pop(v) for v in aliases.pop(s, ())}

    for vid, tensor in caller.items():
        if storage_of[vid] in plan.initial_remote:
            remote[storage_of[vid]] = tensor.untyped_storage().clone()
            remembered.setdefault(storage_of[vid], {})[vid] = _ViewMeta.of(tensor)
            replaced.add(storage_of[vid])
        else:
            put(vid, tensor)

    def lookup(node: torch.fx.Node) -> torch.Tensor:
        return env[program.node_values[node.name]]

    initial_bytes = live_storage_bytes(env.values())
    pending: dict[int, Kind] = {}
    live: list[int] = []
    h2d = d2h = 0
    with torch.no_grad():
        for i, ins in enumerate(instrs):
            s = ins.target
            if ins.kind is Kind.COMPUTE:
                op = program.ops[s]
                for vid, tensor in zip(op.outputs, run_op(program, op, nodes[op.name], lookup)):
                    put(vid, tensor)
                for w in {storage_of[v] for v in op.mutates}:
                    remote.pop(w, None)  # stale now; check_plan forbids prefetching it
            elif ins.kind is Kind.OFFLOAD:
                copy = _device_storage(env, aliases, s, i).clone()
                remote[s] = copy
                d2h += copy.nbytes()
                pending[s] = Kind.OFFLOAD
            elif ins.kind is Kind.RELEASE:
                storage = _device_storage(env, aliases, s, i)
                dropped = drop_storage(s)
                # The owner is always kept so a prefetched storage stays referenced, hence measured, even
                # if no alias of it is read again.
                remembered[s] = {v: _ViewMeta.of(t) for v, t in dropped.items()
                                 if v == s or last_read[v] > i or v in returned}
                if s in caller_storages:
                    replaced.add(s)
                # The IR's aliasing must match the tensors', or the measured bytes would silently disagree.
                if storage.nbytes() and any(t.untyped_storage().data_ptr() == storage.data_ptr()
                                            for t in env.values()):
                    raise RuntimeError(f"instruction #{i}: {values[s].name} is still referenced after its release "
                                       f"by a value the program does not record as aliasing it")
                del storage, dropped
            elif ins.kind is Kind.PREFETCH:
                source = remote[s]
                storage = torch.UntypedStorage(source.nbytes(), device=source.device)
                storage.copy_(source)
                h2d += storage.nbytes()
                for vid, meta in remembered.pop(s, {}).items():
                    put(vid, meta.view_into(storage))
                pending[s] = Kind.PREFETCH
                del storage
            elif ins.kind is Kind.WAIT:
                kind = pending.pop(s, None)
                done = s in remote if kind is Kind.OFFLOAD else s in aliases
                if kind is None or not done:
                    raise RuntimeError(f"instruction #{i}: wait for {values[s].name}, whose transfer never happened")
            live.append(live_storage_bytes(env.values()))
            for freed in checked.frees_after[i]:
                drop_storage(freed)

    _copy_back(caller_storages, replaced, env, aliases, remote)
    outputs = []
    for vid in program.outputs:
        s = storage_of[vid]
        if s in replaced:
            meta = _ViewMeta.of(env[vid]) if vid in env else remembered[s][vid]
            outputs.append(meta.view_into(caller_storages[s]))
        elif vid in env:
            outputs.append(env[vid])
        else:  # the plan leaves it in remote memory: return it from there
            outputs.append(remembered[s][vid].view_into(remote[s]))
    return PlanRun(outputs=tuple(outputs), live_bytes=tuple(live), peak_bytes=max(live, default=initial_bytes),
                   h2d_bytes=h2d, d2h_bytes=d2h)


def _device_storage(env: dict[int, torch.Tensor], aliases: dict[int, set[int]], s: int,
                    index: int) -> torch.UntypedStorage:
    """The device storage of ``s``, through any value aliasing it."""
    members = aliases.get(s)
    if not members:
        raise RuntimeError(f"instruction #{index}: storage {s} is not on the device")
    return env[next(iter(members))].untyped_storage()


def _copy_back(caller_storages: dict[int, torch.UntypedStorage], replaced: set[int], env: dict[int, torch.Tensor],
               aliases: dict[int, set[int]], remote: dict[int, torch.UntypedStorage]) -> None:
    """Copy the final bytes of every replaced caller storage into the caller's storage."""
    for s in replaced:
        final = _device_storage(env, aliases, s, -1) if aliases.get(s) else remote[s]
        caller_storages[s].copy_(final)
