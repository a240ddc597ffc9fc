"""What the operators of a sharded step (torch.distributed's ``c10d`` collectives, FSDP2's ``fsdp`` copy ops) do
to memory and to the network, for the capture.

FSDP2 runs each collective as an in-place c10d call into a buffer it allocated (``c10d._allgather_base_`` writes
its ``output_tensor``), and its copy ops write ``out=`` tensors; the c10d schemas do not mark the written
argument, so the capture is told here. A collective's process group and reduce operation are TorchScript
objects, not tensors: the capture skips them. Collectives and FSDP's copies move data and do no arithmetic
worth counting, so they count 0 FLOPs (``op_rules``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperoffload.ir import Collective, CollectiveKind
from hyperoffload.op_rules import OpCall, register_flop_rule


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveRule:
    """How to read one c10d collective: its kind, the argument it writes, and the argument holding the whole
    (unsharded) tensor."""

    kind: CollectiveKind
    written: tuple[str, ...]
    """Arguments written in place (the schema does not say so)."""
    whole: str
    """The argument whose bytes are the whole tensor (``Collective.full_bytes``)."""
    shard: str | None = None
    """The argument holding one rank's shard, whose size against ``whole``'s gives the group size; None where
    every rank holds the whole tensor (an all-reduce: the group size is read from the process group)."""


COLLECTIVE_RULES: dict[str, CollectiveRule] = {
    "c10d._allgather_base_": CollectiveRule(kind=CollectiveKind.ALL_GATHER, written=("output_tensor",),
                                            whole="output_tensor", shard="input_tensor"),
    "c10d._reduce_scatter_base_": CollectiveRule(kind=CollectiveKind.REDUCE_SCATTER, written=("output_tensor",),
                                                 whole="input_tensor", shard="output_tensor"),
    "c10d.allreduce_": CollectiveRule(kind=CollectiveKind.ALL_REDUCE, written=("tensors",), whole="tensors"),
}
"""Overload packet -> how to read it; a c10d op missing here is refused by the capture."""

UNDECLARED_COPY_WRITES: dict[str, tuple[str, ...]] = {
    "fsdp.all_gather_copy_in": ("all_gather_output",),  # copies this rank's shards into the gather's input
}
"""FSDP copy ops that write an argument their schema does not mark written."""

register_flop_rule(*COLLECTIVE_RULES, "fsdp.all_gather_copy_in", "fsdp.split_with_sizes_copy",
                   "fsdp.chunk_cat")(lambda call: 0)


def undeclared_collective_writes(target: str) -> tuple[str, ...]:
    """Arguments the c10d or fsdp op ``target`` (an overload packet) writes although its schema does not say so."""
    rule = COLLECTIVE_RULES.get(target)
    return rule.written if rule is not None else UNDECLARED_COPY_WRITES.get(target, ())


def _nbytes(value) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors)


def collective_of(call: OpCall, group_size: int | None) -> Collective | None:
    """The communication of ``call``, or None for an op that does none; ``group_size`` is the size of the process
    group the op was given, where the capture can read it (needed for an all-reduce)."""
    rule = COLLECTIVE_RULES.get(call.target)
    if rule is None:
        return None
    whole = _nbytes(call.argument(rule.whole))
    if rule.shard is not None:
        shard = _nbytes(call.argument(rule.shard))
        group_size = whole // shard if shard else 1
    return Collective(kind=rule.kind, full_bytes=whole, group_size=group_size or 1)


__all__ = ["COLLECTIVE_RULES", "CollectiveRule", "UNDECLARED_COPY_WRITES", "collective_of",
           "undeclared_collective_writes"]
