"""Convert a traced ``torch.fx`` graph (from ``make_fx`` in fake mode) into a Program.

Storage identity comes from the fake tensors the trace left in ``node.meta["val"]``:
two values alias when their tensors share a storage. This follows what the
kernels really do (a view, an in-place result, an ``_unsafe_view`` of a fresh
tensor) rather than what a schema claims, which is what makes the lifetime
analysis agree with a real run byte for byte.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.fx

from hyperoffload.block_ops import LANE_OP_RULES
from hyperoffload.capture.collective_ops import collective_of, undeclared_collective_writes
from hyperoffload.capture.tags import KIND_KEY, PHASE_KEY
from hyperoffload.ir import Op, Phase, Program, Value, ValueKind
from hyperoffload.op_rules import OpCall, count_bytes, count_flops, undeclared_writes


class CaptureError(ValueError):
    """A step could not be captured or converted; the message names the cause and the fix."""


class DataDependentValue(CaptureError):
    """The step reads a tensor's value as a Python number (``.item()``, ``int(tensor)``) and hands it to an op:
    the captured graph would hold that one value, so the step cannot be captured as a Program."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_nodes(args: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found


@dataclass
class _Builder:
    """Mutable scratch state of one conversion; the result is immutable."""

    records: list[dict] = field(default_factory=list)
    storage_owner: dict[int, int] = field(default_factory=dict)
    node_values: dict[str, int] = field(default_factory=dict)
    tuple_values: dict[str, dict[int, int]] = field(default_factory=dict)
    opaque: dict[str, Any] = field(default_factory=dict)
    """Nodes that hold no tensor an op reads (a collective's process group, its ``Work`` handle), by name."""
    fetch_fraction: float = 1.0

    def add(self, name: str, tensor: torch.Tensor, kind: ValueKind | None, tag: ValueKind | None = None,
            remote: bool = False) -> int:
        vid = len(self.records)
        storage = tensor.untyped_storage()
        key = storage._cdata
        owner = self.storage_owner.setdefault(key, vid)
        remote = remote or (owner != vid and self.records[owner]["remote"])  # views of remote memory stay remote
        allocated = int(storage.nbytes())
        if allocated == 0 and owner == vid:
            # A storage resized to 0 after it was traced (FSDP2 frees the parameters it gathered so) held what
            # its first tensor spans while it was in use.
            allocated = (tensor.storage_offset() + tensor.numel()) * tensor.element_size() if tensor.numel() else 0
        self.records.append(dict(
            id=vid, name=name, shape=tuple(int(s) for s in tensor.shape), dtype=_dtype_name(tensor.dtype),
            nbytes=tensor.numel() * tensor.element_size(), storage=owner,
            alloc_bytes=allocated if owner == vid and not remote else 0, kind=kind, tag=tag,
            remote=remote))
        return vid

    def value_of(self, node: torch.fx.Node, user: torch.fx.Node) -> int:
        vid = self.node_values.get(node.name)
        if vid is None:
            if "_local_scalar_dense" in str(node.target):
                raise DataDependentValue(f"{user.name} ({user.target}) takes {node.name}, a tensor's value read as a "
                                         f"Python number (.item(), int(tensor)), which the captured step would hold "
                                         f"fixed; steps must pass tensors between ops")
            raise CaptureError(f"{user.name} ({user.target}) takes {node.name}, which is not a tensor the "
                               f"capture tracks; steps must pass tensors between ops")
        return vid


def program_from_graph(gm: torch.fx.GraphModule, input_kinds: Sequence[ValueKind], *, name: str, mode: str,
                       input_names: Sequence[str] | None = None, meta: Mapping[str, Any] | None = None,
                       remote_inputs: Collection[int] = (), fetch_fraction: float = 1.0) -> Program:
    """Build a Program from ``gm``; ``input_kinds`` gives the kind of each placeholder in order and
    ``input_names`` readable names for them (default: the placeholder names).

    ``remote_inputs``: indices of placeholders that live in remote memory (``Value.remote``). Calls of the
    operators in ``block_ops.LANE_OPS`` become lane ops; a pooled block fetch, or the fetch completing a
    speculative prefetch, moves its output's bytes times ``fetch_fraction`` (the stated share of selected blocks
    not already in the pool or the speculation; 1 when there is no pool)."""
    b = _Builder()
    if not 0.0 <= fetch_fraction <= 1.0:
        raise ValueError(f"fetch_fraction is a share of the selected blocks, between 0 and 1; got {fetch_fraction}")
    b.fetch_fraction = float(fetch_fraction)
    inputs: list[int] = []
    constants: list[int] = []
    ops: list[Op] = []
    outputs: list[int] = []
    reads: dict[int, set[Phase]] = {}
    phase = Phase.FORWARD
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(input_kinds):
        raise CaptureError(f"graph has {len(placeholders)} inputs but {len(input_kinds)} kinds were given")
    if input_names is not None and len(input_names) != len(input_kinds):
        raise CaptureError(f"{len(input_names)} input names given for {len(input_kinds)} inputs")
    kinds = iter(input_kinds)
    names = iter(input_names or [n.name for n in placeholders])
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            kind = next(kinds)
            if not isinstance(val, torch.Tensor):
                raise CaptureError(f"step input {node.name} is {type(val).__name__}; only tensors can be inputs")
            vid = b.add(next(names), val, kind, remote=len(inputs) in remote_inputs)
            b.node_values[node.name] = vid
            inputs.append(vid)
        elif node.op == "get_attr":
            tensor = getattr(gm, node.target)
            if isinstance(tensor, torch.Tensor):
                vid = b.add(node.name, val if isinstance(val, torch.Tensor) else tensor, ValueKind.INPUT)
                b.node_values[node.name] = vid
                constants.append(vid)
            else:
                b.opaque[node.name] = tensor
        elif node.op == "call_function" and node.target is operator.getitem:
            parent, index = node.args
            vid = b.tuple_values.get(parent.name, {}).get(index)
            if vid is not None:
                b.node_values[node.name] = vid
            elif not isinstance(val, torch.Tensor):
                b.opaque[node.name] = val
        elif node.op == "call_function":
            ops.append(_convert_op(b, node, len(ops), phase, reads))
        elif node.op == "output":
            for n in _tensor_nodes(node.args):
                outputs.append(b.value_of(n, node))
        else:
            raise CaptureError(f"unsupported fx node {node.name} ({node.op}); capture expects a flat aten graph")
        if PHASE_KEY in node.meta:
            phase = node.meta[PHASE_KEY]
    values = _finalise_kinds(b.records, reads)
    return Program(name=name, mode=mode, values=values, ops=tuple(ops), inputs=tuple(inputs),
                   outputs=tuple(dict.fromkeys(outputs)), constants=tuple(constants), graph=gm,
                   node_values=MappingProxyType(dict(b.node_values)), meta=MappingProxyType(dict(meta or {})))


def _convert_op(b: _Builder, node: torch.fx.Node, op_id: int, phase: Phase, reads: dict[int, set[Phase]]) -> Op:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        raise CaptureError(f"op {node.name} calls {target!r}, which is not an aten operator; "
                           f"capture supports graphs of aten operators only")
    if target.namespace == "_c10d_functional":
        raise CaptureError(f"op {node.name} calls {target}, a functional collective; capture takes the collectives "
                           f"FSDP2 runs (c10d's in-place ones), not those of torch.distributed._functional_collectives")
    read_nodes = [n for n in dict.fromkeys(_tensor_nodes((node.args, node.kwargs))) if n.name not in b.opaque]
    input_ids = list(dict.fromkeys(b.value_of(n, node) for n in read_nodes))
    for v in input_ids:
        reads.setdefault(b.records[v]["storage"], set()).add(phase)
    schema = target._schema

    val = node.meta.get("val")
    out_tensors: list[torch.Tensor] = []
    if isinstance(val, torch.Tensor):
        vid = b.add(node.name, val, None, node.meta.get(KIND_KEY))
        b.node_values[node.name] = vid
        output_ids = [vid]
        out_tensors = [val]
    else:
        output_ids = []
        if isinstance(val, (tuple, list)):
            slots: dict[int, int] = {}
            for i, item in enumerate(val):
                if isinstance(item, torch.Tensor):
                    slots[i] = b.add(f"{node.name}.{i}", item, None)
                    output_ids.append(slots[i])
                    out_tensors.append(item)
            b.tuple_values[node.name] = slots
    for v in output_ids:
        b.records[v]["phase"] = phase

    input_storages = {b.records[v]["storage"] for v in input_ids}
    only_aliases = all(b.records[v]["storage"] in input_storages for v in output_ids)
    example = lambda n: n.meta.get("val")  # noqa: E731
    call = OpCall(
        target=f"{target.namespace}.{target._opname}",
        args=tuple(torch.fx.node.map_arg(node.args, example)),
        kwargs=dict(torch.fx.node.map_arg(node.kwargs, example)),
        inputs=tuple(example(n) for n in read_nodes),
        outputs=tuple(out_tensors),
        argument_names=tuple(a.name for a in schema.arguments),
        result=val,
    )
    # Written in place: what the schema declares, and what the kernel writes without declaring it (op_rules).
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    written.update(undeclared_writes(call))
    written.update(undeclared_collective_writes(call.target))
    mutated: list[int] = []
    for index, argument in enumerate(schema.arguments):
        if argument.name not in written:
            continue
        arg = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
        mutated.extend(b.value_of(n, node) for n in _tensor_nodes(arg) if n.name not in b.opaque)
    if only_aliases and not mutated:
        flops = bytes_read = bytes_written = 0
    else:
        flops = count_flops(call)
        bytes_read, bytes_written = count_bytes(call)
    rule = LANE_OP_RULES.get(str(target))  # a block operator's lane and byte count (``block_ops``)
    lane = None if rule is None else rule.lane
    transfer = 0
    if lane == "h2d":
        transfer = sum(b.records[v]["nbytes"] for v in output_ids)
        if rule.scales_with_fetch_fraction:
            transfer = round(transfer * b.fetch_fraction)
    elif lane == "d2h":  # the rows written: every input that is neither remote nor an index
        transfer = sum(b.records[v]["nbytes"] for v in input_ids
                       if not b.records[v]["remote"] and b.records[v]["dtype"] not in ("int64", "int32"))
    collective = collective_of(call, _group_size(b, node))
    if collective is None and target.namespace == "c10d":
        raise CaptureError(f"op {node.name} calls {target}, a collective the capture does not know (it knows "
                           f"FSDP2's all-gather, reduce-scatter and all-reduce); shard the model with fully_shard only")
    return Op(id=op_id, name=node.name, target=str(target), inputs=tuple(input_ids), outputs=tuple(output_ids),
              mutates=tuple(dict.fromkeys(mutated)), phase=phase, flops=int(flops), bytes_read=bytes_read,
              bytes_written=bytes_written, lane=lane, transfer_bytes=transfer, collective=collective,
              random=_draws_random(call))


def _group_size(b: _Builder, node: torch.fx.Node) -> int | None:
    """The size of the process group ``node`` (a c10d call) was given, where one of its arguments is a group."""
    for arg in _tensor_nodes((node.args, node.kwargs)):
        group = b.opaque.get(arg.name)
        size = getattr(group, "size", None)
        if callable(size):
            try:
                return int(size())
            except (RuntimeError, TypeError, ValueError):  # a ReduceOp, a Work handle: not a group
                continue
    return None


# aten ops that draw from the global random generator (names without the overload), and the attention
# kernels that do when given a dropout probability (their backward replays the mask it drew).
_RANDOM_OPS = ("bernoulli", "rand", "normal", "uniform", "native_dropout", "_fused_dropout", "multinomial",
               "exponential", "geometric", "cauchy", "log_normal", "random_", "poisson", "rrelu_with_noise")
_ATTENTION_OPS = ("_scaled_dot_product", "_efficient_attention", "_flash_attention")


def _draws_random(call: OpCall) -> bool:
    namespace, _, name = call.target.partition(".")
    if namespace != "aten" or name.endswith("_backward"):
        return False
    if name.startswith(_RANDOM_OPS):
        return True
    if name.startswith(_ATTENTION_OPS) and "dropout_p" in call.argument_names:
        k = call.argument_names.index("dropout_p")
        dropout = call.args[k] if k < len(call.args) else call.kwargs.get("dropout_p", 0.0)
        return isinstance(dropout, (int, float)) and dropout > 0
    return False


def _finalise_kinds(records: list[dict], reads: dict[int, set[Phase]]) -> tuple[Value, ...]:
    """Give each produced storage its kind; aliases take their storage's kind."""
    tagged = {r["storage"]: r["tag"] for r in records if r.get("tag") is not None}
    owner_kind: dict[int, ValueKind] = {}
    for r in records:
        if r["id"] != r["storage"]:
            continue
        if r["kind"] is not None:
            owner_kind[r["id"]] = r["kind"]
        elif r["id"] in tagged:
            owner_kind[r["id"]] = tagged[r["id"]]
        elif r.get("phase") == Phase.FORWARD and Phase.BACKWARD in reads.get(r["id"], ()):
            owner_kind[r["id"]] = ValueKind.ACTIVATION
        else:
            owner_kind[r["id"]] = ValueKind.TEMPORARY
    return tuple(
        Value(id=r["id"], name=r["name"], shape=r["shape"], dtype=r["dtype"], nbytes=r["nbytes"],
              kind=owner_kind[r["storage"]], storage=r["storage"], alloc_bytes=r["alloc_bytes"], remote=r["remote"])
        for r in records)
