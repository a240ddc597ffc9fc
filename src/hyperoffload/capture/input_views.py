"""Make the constants of a traced step that are really views of its state read that state.

A sharded step traced on a real process group (``capture.sharded`` with a mesh) holds this rank's parameter shards
as real tensors, and FSDP2 reads each shard through several tensor objects (its flat all-gather input, the
parameter itself): the trace records one constant per object. ``sharded_passes.lift_constants`` makes the
parameter's a step input; the others would stay constants of the graph, still the model's own storage. Run so, the
step would gather and update the model's tensors behind its inputs' back (and a second run would start from the
first one's update), and the Program would count each shard once per constant; where the trace reads a shard only
through other tensors (a prefill step reads them through FSDP2's all-gather inputs alone), the shard would not be
lifted at all.

``constants_as_views``, run before the lifting, gives each shard one node of its own and rewrites every other
constant as a view of the shard it shares its storage with (the shard itself, a ``view``, or a ``slice`` of its
flat elements), so that once lifted all the step's state is in its inputs, as the planner and the executor assume.
The trace gave each such constant a fake tensor with a storage of its own, and so the results of the ops that view
it or update it in place: their fake values are made again from the shard's, so that the Program sees them all as
aliases of it. (On a fake group the trace keeps the shards' shared storage in its fake tensors, so the Program
reads those constants as views of the inputs already, and the step is never run.)
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from hyperoffload.capture.graph_to_program import CaptureError

_aten = torch.ops.aten


def constants_as_views(gm: torch.fx.GraphModule, tensors: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """``gm`` (modified in place and returned) reading each of ``tensors`` (real or fake; a rank's shards and
    buffers, which ``sharded_passes.lift_constants`` makes inputs next) through one ``get_attr`` node of its own,
    right after the graph's placeholders (made if the graph holds none), and every other tensor constant that shares its
    storage with one of them as a view of that node; a ``CaptureError`` for a constant that is no contiguous run
    of a contiguous tensor's elements."""
    graph = gm.graph
    owners = {_storage_key(t): t for t in tensors}
    constants = [(node, getattr(gm, node.target, None)) for node in graph.find_nodes(op="get_attr")]
    constants = [(node, c) for node, c in constants if isinstance(c, torch.Tensor) and _storage_key(c) in owners]
    held: dict[int, torch.fx.Node] = {}  # id(tensor) -> the one node that reads it as it is
    for node, constant in constants:
        if constant is owners[_storage_key(constant)]:
            held.setdefault(id(constant), node)
    first = next(n for n in graph.nodes if n.op != "placeholder")  # the step's own inputs stay first
    for k, tensor in enumerate(t for t in tensors if any(_storage_key(c) == _storage_key(t) for _, c in constants)):
        node = held.get(id(tensor))
        if node is None:  # the graph reads it only through other tensors
            name = f"_state_tensor_{k}"
            gm.register_buffer(name, tensor, persistent=False)
            with graph.inserting_before(first):
                node = graph.get_attr(name)
            node.meta["val"] = _fake_mode(graph).from_tensor(tensor)
            held[id(tensor)] = node
        elif node is not first:
            first.prepend(node)  # before every view made of it below
    replaced: set[str] = set()
    stale: set[int] = set()  # the replaced constants' fake storages
    sources = set(held.values())
    for node, constant in constants:
        if node in sources:
            continue
        tensor = owners[_storage_key(constant)]
        with graph.inserting_before(node):
            view = _view_of(graph, held[id(tensor)], tensor, constant, node.name)
        view.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        stale.update(_storage_key(t) for t in [*_tensors(node.meta.get("val")),
                                               *(r for user in node.users for r in _aliases_of(user, node))])
        node.replace_all_uses_with(view)
        graph.erase_node(node)
        replaced.add(node.target)
    for node in graph.nodes:  # in order: a node's arguments are made again before it
        if node.op == "call_function" and any(_storage_key(t) in stale for t in _tensors(node.meta.get("val"))):
            node.meta["val"] = _recomputed(node)
    graph.lint()
    gm.recompile()
    # The graph reads them no more; kept, they would hold the model's own storage for as long as the step lives.
    for target in replaced - {n.target for n in graph.find_nodes(op="get_attr")}:
        if "." not in target and hasattr(gm, target):
            delattr(gm, target)
    return gm


def _fake_mode(graph: torch.fx.Graph):
    """The fake mode the graph was traced in (that of its nodes' fake values)."""
    for node in graph.nodes:
        for value in _tensors(node.meta.get("val")):
            if hasattr(value, "fake_mode"):
                return value.fake_mode
    raise CaptureError("the traced step holds no fake tensor values to make its state's from")


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _aliases_of(node: torch.fx.Node, argument: torch.fx.Node) -> list[torch.Tensor]:
    """The fake results of ``node`` that its schema says alias ``argument`` (a view of it, or it updated in
    place)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    names: set[str] = set()
    for k, formal in enumerate(schema.arguments):
        given = node.args[k] if k < len(node.args) else node.kwargs.get(formal.name)
        if formal.alias_info is not None and (given is argument or (isinstance(given, (list, tuple))
                                                                   and argument in given)):
            names |= set(formal.alias_info.before_set)
    value = node.meta.get("val")
    results = value if isinstance(value, (list, tuple)) else (value,)
    return [r for r, formal in zip(results, schema.returns) if isinstance(r, torch.Tensor)
            and formal.alias_info is not None and names & set(formal.alias_info.before_set)]


def _recomputed(node: torch.fx.Node) -> object:
    """``node``'s fake value made again from its arguments' fake values."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    fakes = [t for t in _tensors((args, kwargs)) if hasattr(t, "fake_mode")]
    with fakes[0].fake_mode:
        return node.target(*args, **kwargs)


def _view_of(graph: torch.fx.Graph, placeholder: torch.fx.Node, tensor: torch.Tensor, constant: torch.Tensor,
             name: str) -> torch.fx.Node:
    """Nodes that make ``constant`` from ``placeholder`` (standing for ``tensor``, which shares its storage), each
    with its fake value; the last one."""
    start = constant.storage_offset() - tensor.storage_offset()
    if (constant.shape, constant.stride(), start) == (tensor.shape, tensor.stride(), 0):
        return placeholder
    if not (tensor.is_contiguous() and constant.is_contiguous() and 0 <= start
            and start + constant.numel() <= tensor.numel()):
        raise CaptureError(f"the traced step holds {name}, a view of a step input that is no contiguous run of its "
                           f"elements (shape {tuple(constant.shape)}, strides {constant.stride()}); the capture "
                           f"cannot make it from the input")
    node = placeholder
    if start or constant.numel() != tensor.numel():
        node = _call(graph, _aten.view.default, node, [-1])
        node = _call(graph, _aten.slice.Tensor, node, 0, start, start + constant.numel())
    return _call(graph, _aten.view.default, node, list(constant.shape))


def _call(graph: torch.fx.Graph, target, source: torch.fx.Node, *args) -> torch.fx.Node:
    node = graph.call_function(target, (source, *args))
    value = source.meta["val"]
    with value.fake_mode:
        node.meta["val"] = target(value, *args)
    return node


__all__ = ["constants_as_views"]
