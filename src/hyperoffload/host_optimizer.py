"""The host-optimizer form of a sharded training step: parameter shards and optimizer state in host memory, the
optimizer step on the host CPU.

FSDP2 with ``CPUOffloadPolicy`` and DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` keep a rank's
parameter shards and optimizer state in host memory and run the optimizer step there: FSDP2 copies each shard
host-to-device before the all-gather that needs it (``FSDPParam.all_gather_inputs``: ``sharded_param_data.to(device,
non_blocking=True)``), each sharded gradient device-to-host right after its reduce-scatter
(``foreach_reduce``: ``new_sharded_grad.to("cpu", non_blocking=True)``), and the optimizer then steps on the CPU
over CPU state. ``host_optimizer_form(program)`` rewrites a captured sharded training step
(``capture_workload(..., world=N)``) into that form, in the IR:

* the step's state that the optimizer phase updates (the parameter shards, the optimizer state) becomes remote
  (``Value.remote``): it takes no device memory; so do the views of it;
* before each device op that reads such state (the all-gather copy-in of every FSDP unit, in the forward and again in
  the backward), an h2d lane op fetches it: a device copy of the bytes read, which the op reads in its place, freed
  after it (``Fetch``);
* right after the op that makes each device value the optimizer phase reads (a gradient's view of its reduce-scatter
  output), a d2h lane op sends it to the host, and the optimizer reads the host copy; the device copy is freed once
  sent;
* every optimizer-phase op becomes a host op (``Op.lane`` ``"host"``, ``cost.host_op_time``) over host values: its
  results are host memory.

Ops keep their captured order, the new ones next to the op they serve; values keep their ids, the new ones after.
The form has no fx graph: it is simulated, never run (``refuse_host_ops``). It is made once per step
(``per_program``), as ``fsdp-cpu-offload`` and ``zero-infinity`` plan the same form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

from hyperoffload.cost import missing_host_bandwidth
from hyperoffload.hardware import Hardware
from hyperoffload.ir import HOST_LANE, Op, Phase, Program, Value
from hyperoffload.memo import per_program
from hyperoffload.plans import Plan, op_writes

COPY_TARGET = "aten._to_copy.default"
"""The target of the form's fetches and sends: what ``Tensor.to(device, non_blocking=True)`` runs."""


class NotShardedTraining(ValueError):
    """The step is not a sharded training step, so it has no host-optimizer form."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fetch:
    """One h2d lane op of the form: state brought to the device for one op."""

    op: int
    """The fetch's op id in the form."""
    reader: int
    """The op id in the form of the device op that reads what it fetched."""
    nbytes: int
    """Bytes it moves (the bytes of the state's view the reader reads)."""
    elements: int
    """Elements it moves (the unit DeepSpeed's prefetch limits are stated in)."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class HostOptimizerForm:
    """A sharded training step with its state in host memory and its optimizer step on the host."""

    program: Program
    """The form (``Program.meta["host_optimizer"]`` is True). (It keeps no reference to the captured step, which
    ``per_program`` keys it by: the step can go when its callers let it.)"""
    fetches: tuple[Fetch, ...]
    """Its h2d lane ops, in op order."""
    host_state_bytes: int
    """Device bytes of the state moved to the host (the captured step's bytes of the storages made remote)."""


def is_sharded_training(program: Program) -> bool:
    """Whether ``program`` is a sharded training step: a world of more than one rank (``meta["world"]``), mode
    ``"train"``, with collectives and an optimizer phase."""
    return (program.meta.get("world", 1) > 1 and program.mode == "train"
            and any(op.collective is not None for op in program.ops)
            and any(op.phase is Phase.OPTIMIZER for op in program.ops))


def refuse_unsharded(program: Program, policy: str) -> None:
    """Raise ``NotShardedTraining`` naming ``policy`` unless ``program`` is a sharded training step."""
    if is_sharded_training(program):
        return
    world = program.meta.get("world", 1)
    raise NotShardedTraining(
        f"{policy} models a sharded training step, whose parameter shards and optimizer state it keeps in host "
        f"memory and whose optimizer step it runs on the host CPU; {program.name} {program.mode} is "
        + (f"a step of {world} rank" if world == 1 else f"a {program.mode} step of {world} ranks")
        + ": capture a training step of several ranks, e.g. --mode train --world 8")


@per_program
def host_optimizer_form(program: Program) -> HostOptimizerForm:
    """``program``'s host-optimizer form (module docstring); ``NotShardedTraining`` if it is not a sharded training
    step, ``ValueError`` naming the op if its optimizer phase cannot run on the host."""
    refuse_unsharded(program, "the host-optimizer form")
    return _Rewrite(program).form()


def host_form_for(program: Program, hardware: Hardware, policy: str) -> HostOptimizerForm:
    """``program``'s host-optimizer form for ``policy`` to plan on ``hardware``: ``NotShardedTraining`` naming the
    policy for a step that is not a sharded training step, ``cost.HostBandwidthMissing`` for a profile that states
    no host memory bandwidth (its host ops could not be timed)."""
    refuse_unsharded(program, policy)
    if not hardware.host_mem_bw:
        raise missing_host_bandwidth(hardware, f"{policy} runs the optimizer step on the host CPU, which")
    return host_optimizer_form(program)


def refuse_host_ops(plan: Plan) -> None:
    """Raise ``ValueError`` if ``plan``'s step has host ops: the runtime has no host lane, so such a plan (of
    ``fsdp-cpu-offload``, or of ``zero-infinity`` on a sharded step) is simulated only."""
    if plan.program.has_host_ops():
        raise ValueError(
            f"the plan of policy {plan.policy!r} runs its optimizer step on the host CPU (the step's host-optimizer "
            f"form, ops on the host lane), which the runtime cannot execute: it has no host lane. The policy is "
            f"simulated only: compare, sweep and plan show it; run another policy to execute the step")


class _Rewrite:
    """The rewrite of one step into its host-optimizer form (``host_optimizer_form``)."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.values: list[Value] = list(program.values)
        optimizer = [op for op in program.ops if op.phase is Phase.OPTIMIZER]
        held = {v.storage for v in (program.values[i] for i in (*program.inputs, *program.constants))}
        writes = op_writes(program)
        # The step's state the optimizer phase updates goes to the host, with every view of it.
        self.host_storages = frozenset(s for op in optimizer for s in writes[op.id] if s in held)
        if not self.host_storages:
            raise NotShardedTraining(f"{program.name} {program.mode}: its optimizer phase updates none of the step's "
                                     f"state, so there is nothing to keep in host memory")
        for v in self.values:
            if v.storage in self.host_storages:
                self.values[v.id] = dataclasses.replace(v, remote=True, alloc_bytes=0)
        # The optimizer phase's ops that read or write data run on the host; its views (which read none) stay views.
        self.on_host = frozenset(op.id for op in optimizer if not op.is_view)
        values = program.values
        self.made_on_host = frozenset(values[o].storage for op in optimizer if op.id in self.on_host
                                      for o in op.outputs if values[o].owns_storage)
        self.sent: dict[int, int] = {}  # device value -> its host copy

    def form(self) -> HostOptimizerForm:
        program = self.program
        senders = self._senders()
        ops: list[Op] = []
        fetches: list[tuple[int, int]] = []  # (fetch position, reader position)
        for op in program.ops:
            for v in senders.before.get(op.id, ()):
                ops.append(self._send(v, op.phase))
            if op.id in self.on_host:
                ops.append(self._on_host(op))
            elif op.phase is Phase.OPTIMIZER:
                ops.append(self._view_in_optimizer(op))
            else:
                reader, fetched = self._fetched_for(op)
                first = len(ops)
                fetches += [(first + k, first + len(fetched)) for k in range(len(fetched))]
                ops += [*fetched, reader]
            for v in senders.after.get(op.id, ()):
                ops.append(self._send(v, op.phase))
        ops = [dataclasses.replace(o, id=i) for i, o in enumerate(ops)]
        self._views_of_host_memory()
        meta = MappingProxyType({**program.meta, "host_optimizer": True})
        form = Program(name=program.name, mode=program.mode, values=tuple(self.values), ops=tuple(ops),
                       inputs=program.inputs, outputs=program.outputs, constants=program.constants, meta=meta)
        values = form.values
        recorded = tuple(Fetch(op=f, reader=r, nbytes=ops[f].transfer_bytes,
                               elements=_elements(values[ops[f].outputs[0]])) for f, r in fetches)
        state = sum(program.values[s].alloc_bytes for s in self.host_storages)
        return HostOptimizerForm(program=form, fetches=recorded, host_state_bytes=state)

    # --- what goes where --------------------------------------------------------------------------------------
    def _senders(self) -> _Senders:
        """The device values the host ops read, each to be sent to the host right after the op that makes it (or,
        for one the step starts with, right before the first host op that reads it)."""
        program, values = self.program, self.values
        producer = program.producers()
        after: dict[int, list[int]] = {}
        before: dict[int, list[int]] = {}
        host = self.host_storages | self.made_on_host
        seen: set[int] = set()
        for op in program.ops:
            if op.id not in self.on_host:
                continue
            for v in op.inputs:
                if values[v].storage in host or v in seen:
                    continue
                seen.add(v)
                if producer[v] >= 0:
                    after.setdefault(producer[v], []).append(v)
                else:
                    before.setdefault(op.id, []).append(v)
        return _Senders(after=after, before=before)

    def _new_value(self, like: Value, name: str, *, remote: bool) -> int:
        vid = len(self.values)
        self.values.append(Value(id=vid, name=name, shape=like.shape, dtype=like.dtype, nbytes=like.nbytes,
                                 kind=self.values[like.storage].kind, storage=vid,
                                 alloc_bytes=0 if remote else like.nbytes, remote=remote))
        return vid

    def _send(self, v: int, phase: Phase) -> Op:
        """A d2h lane op copying device value ``v`` to a new host value (its host copy, ``self.sent[v]``)."""
        value = self.values[v]
        host = self._new_value(value, f"{value.name}_on_host", remote=True)
        self.sent[v] = host
        return Op(id=-1, name=f"send_{value.name}", target=COPY_TARGET, inputs=(v,), outputs=(host,), phase=phase,
                  bytes_read=value.nbytes, bytes_written=value.nbytes, lane="d2h", transfer_bytes=value.nbytes)

    def _fetched_for(self, op: Op) -> tuple[Op, list[Op]]:
        """``op`` reading device copies of the host state it reads (unless it is a view, which reads no data), and
        the h2d lane ops that fetch them."""
        values = self.values
        if op.is_view or not any(values[v].remote for v in op.inputs):
            return op, []
        written = [values[v].name for v in op.mutates if values[v].remote]
        if written:
            raise ValueError(f"{op.name} ({op.target}) writes {written[0]} on the device outside the optimizer "
                             f"phase: the host-optimizer form keeps that state in host memory and cannot")
        fetches: list[Op] = []
        inputs = list(op.inputs)
        for k, v in enumerate(inputs):
            value = values[v]
            if not value.remote:
                continue
            copy = self._new_value(value, f"{value.name}_fetched_for_{op.name}", remote=False)
            fetches.append(Op(id=-1, name=f"fetch_{value.name}_for_{op.name}", target=COPY_TARGET, inputs=(v,),
                              outputs=(copy,), phase=op.phase, bytes_read=value.nbytes, bytes_written=value.nbytes,
                              lane="h2d", transfer_bytes=value.nbytes))
            inputs[k] = copy
        return dataclasses.replace(op, inputs=tuple(inputs)), fetches

    def _on_host(self, op: Op) -> Op:
        """Optimizer op ``op`` as a host op: it reads the host copies of device values, and its results are host
        memory (a new tensor a host temporary; an alias of a device tensor an alias of that tensor's host copy)."""
        inputs = self._aliasing(op)
        for o in op.outputs:
            value = self.values[o]
            if value.owns_storage and not value.remote:
                self.values[o] = dataclasses.replace(value, remote=True, alloc_bytes=0)
            elif not self.values[self.values[o].storage].remote:
                raise ValueError(f"{op.name} ({op.target}) in the optimizer phase makes {value.name}, a view of device "
                                 f"memory no host copy stands for: the host-optimizer form cannot run it on the host")
        mutates = tuple(self.sent.get(v, v) for v in op.mutates)
        return dataclasses.replace(op, inputs=inputs, mutates=mutates, lane=HOST_LANE)

    def _view_in_optimizer(self, op: Op) -> Op:
        """A view in the optimizer phase: it stays a view (on the device, or of host memory), of what its input has
        become (a tensor sent to the host is viewed there)."""
        return dataclasses.replace(op, inputs=self._aliasing(op))

    def _aliasing(self, op: Op) -> tuple[int, ...]:
        """``op``'s inputs with host copies for the device values sent to the host; its outputs that alias an input
        then alias what that input has become (the host copy's storage)."""
        captured = self.program.values
        inputs = tuple(self.sent.get(v, v) for v in op.inputs)
        for o in op.outputs:
            value = self.values[o]
            if value.owns_storage:
                continue
            now = next((self.values[h].storage for v, h in zip(op.inputs, inputs)
                        if captured[v].storage == value.storage), value.storage)
            self.values[o] = dataclasses.replace(value, storage=now, remote=self.values[now].remote)
        return inputs

    def _views_of_host_memory(self) -> None:
        """Mark remote every view of a storage that is now in host memory (a host temporary's views)."""
        for v in self.values:
            if not v.remote and self.values[v.storage].remote:
                self.values[v.id] = dataclasses.replace(v, remote=True)


@dataclass(frozen=True, slots=True)
class _Senders:
    """Where the sends of device values the optimizer reads go: after the op making each, or before an op."""

    after: dict[int, list[int]]
    before: dict[int, list[int]]


def _elements(value: Value) -> int:
    n = 1
    for d in value.shape:
        n *= d
    return n


__all__ = ["COPY_TARGET", "Fetch", "HostOptimizerForm", "NotShardedTraining", "host_form_for", "host_optimizer_form",
           "is_sharded_training", "refuse_host_ops", "refuse_unsharded"]
