"""Graph passes that turn one rank's traced FSDP2 step into a graph the capture can read as a Program.

FSDP2 manages memory outside what a trace records: it frees a module's gathered (unsharded) parameters after
the module's forward by resizing their storage to 0 bytes, and gathers them again into the same storage before
the module's backward, resized back. A trace sees one storage written twice and read from the forward to the
backward, which would count the whole gathered module as held across the step. ``separate_regathers`` gives
each gather after the first a buffer of its own, so that the forward's gathered parameters die after their
last forward use and the backward's are made where the backward gathers them, as in the real run.

On real ranks FSDP2 gathers a module's parameters on a stream of its own while the compute stream still runs the
module before: its pre-forward hook issues the next gather as soon as the host reaches it, which is well ahead of
the device, and the gather waits only for the module two back to have freed its parameters. A trace records the
gather where the host issued it, right before the module, and a plan's order is the device's: ``issue_gathers_ahead``
puts each forward gather (its copy-in and the collective) right after the previous gather's ``split_with_sizes_copy``,
where the previous module starts, so that two modules' gathered parameters are live at once, as in FSDP2's forward.
The backward needs no such pass: FSDP2 prefetches its next gather itself there, and the trace records it so.

The sharded parameters a rank holds are tensors the trace took as constants (FSDP reads them from its own
state, not from the step's arguments); ``lift_constants`` makes them inputs of the step, so they are planned
like any parameter. ``drop_profiler_calls`` removes the ``record_function`` ranges FSDP2 marks its phases with.
Each pass takes a ``GraphModule`` and returns a new one; the one given is left as it was.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping

import torch
import torch.fx
import torch.utils._pytree as pytree

from hyperoffload.capture.tags import PHASE_KEY

_SPLIT_COPY = "fsdp.split_with_sizes_copy"


def _storage(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.untyped_storage()._cdata if isinstance(val, torch.Tensor) else None


def _packet(node: torch.fx.Node) -> str:
    target = node.target
    return f"{target.namespace}.{target._opname}" if isinstance(target, torch._ops.OpOverload) else ""


def _copied(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, sharing its attributes (the constants); the nodes' ``meta``
    is copied shallowly (``Graph.__deepcopy__``), so the fake tensors, and which storages they share, are the
    same."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)


def drop_profiler_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` without its ``profiler`` calls (``record_function`` ranges mark time, and compute nothing)."""
    result = _copied(gm)
    graph = result.graph
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "profiler":
            if any(_packet(user) != "" and user.target.namespace != "profiler" for user in node.users):
                raise ValueError(f"{node.name} ({node.target}) is read by an op that is not a profiler call")
            if PHASE_KEY in node.meta:  # the phase a step marked here starts after the node before instead
                node.prev.meta[PHASE_KEY] = node.meta[PHASE_KEY]
            graph.erase_node(node)
    graph.lint()
    result.recompile()
    return result


def _recomputed(node: torch.fx.Node) -> object:
    """``node``'s value computed again from its arguments' values (fake tensors: shapes and storages only)."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    fakes = [v for v in pytree.tree_leaves((args, kwargs)) if hasattr(v, "fake_mode")]
    with fakes[0].fake_mode if fakes else contextlib.nullcontext():
        return node.target(*args, **kwargs)


def separate_regathers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every FSDP gather that writes parameters gathered before (``fsdp.split_with_sizes_copy`` into a
    storage an earlier one wrote) writing into a new buffer instead; every later reader of the old storage reads
    the same view of the new one."""
    result = _copied(gm)
    graph = result.graph
    written: set[int] = set()
    for gather in [n for n in graph.nodes if _packet(n) == _SPLIT_COPY]:
        outs = gather.kwargs.get("out", ())
        # In the order of the gather's outputs, not of the storages' addresses: every process rewrites alike.
        storages = list(dict.fromkeys(s for s in map(_storage, outs) if s is not None))
        again = [s for s in storages if s in written]
        written.update(storages)
        nodes = list(graph.nodes)  # the nodes a storage's readers are among; copies go in before ``gather``
        position = {n: i for i, n in enumerate(nodes)}
        for storage in again:
            _move_storage(graph, gather, storage, nodes, position)
    graph.lint()
    result.recompile()
    return result


def _move_storage(graph: torch.fx.Graph, gather: torch.fx.Node, storage: int, nodes: list[torch.fx.Node],
                  position: dict[torch.fx.Node, int]) -> None:
    """Give ``storage``'s readers from ``gather`` on a new buffer, made just before ``gather``, and the views of it
    they read, rebuilt on the new buffer from the views of the old one. ``nodes`` are the graph's nodes as they
    stood before this gather's storages were moved (``position``: each one's index); what moving another storage
    of the same gather put in before ``gather`` views that storage only, so it is not among this one's readers."""
    at = position[gather]
    base = next(n for n in nodes if _storage(n) == storage)
    if _packet(base) not in ("aten.empty", "aten.empty_strided", "aten.new_empty"):
        raise ValueError(f"FSDP gathers into {base.name} ({base.target}) again; expected a buffer FSDP allocated "
                         f"(aten.empty)")
    with graph.inserting_before(gather):
        new_base = graph.node_copy(base)
    new_base.meta["val"] = _recomputed(new_base)
    rebuilt = {base: new_base}

    def rebuild(node: torch.fx.Node) -> torch.fx.Node:
        """The view ``node`` (of the old storage, made before ``gather``) made again on the new buffer."""
        if node in rebuilt:
            return rebuilt[node]
        parents = [a for a in node.all_input_nodes if _storage(a) == storage]
        if not parents:
            raise ValueError(f"{node.name} ({node.target}) views the gathered parameters but none of its inputs do")
        mapping = {p: rebuild(p) for p in parents}
        with graph.inserting_before(gather):
            copy_ = graph.node_copy(node, lambda a: mapping.get(a, a))
        copy_.meta["val"] = _recomputed(copy_)
        rebuilt[node] = copy_
        return copy_

    moved: set[torch.fx.Node] = set()
    for user in nodes[at:]:
        old = [a for a in user.all_input_nodes if position.get(a, at) < at and _storage(a) == storage]
        mapping = {a: rebuild(a) for a in old}
        if mapping:
            user.args, user.kwargs = torch.fx.node.map_arg((user.args, user.kwargs), lambda a: mapping.get(a, a))
        if user is not gather and _storage(user) == storage and (mapping or moved & set(user.all_input_nodes)):
            user.meta["val"] = _recomputed(user)  # a view (or in-place result) of the new buffer now
            moved.add(user)
    # Views of the old storage made for the gather alone (its ``out=`` tensors) are read by nothing now; left in,
    # they would hold the forward's buffer to the backward.
    for node in sorted(rebuilt, key=position.__getitem__, reverse=True):
        if node is not base and not node.users:
            graph.erase_node(node)


_GATHER = "c10d._allgather_base_"


def issue_gathers_ahead(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with each forward all-gather after the first, and the nodes it depends on that the trace put after the
    previous gather's ``split_with_sizes_copy``, moved to right after that copy (module docstring). A gather that
    depends on anything the previous module computes is left where it is. The forward is the graph up to the first
    phase mark (``capture.tags.PHASE_KEY``), or the whole graph for a step without one."""
    result = _copied(gm)
    graph = result.graph
    nodes = list(graph.nodes)
    end = next((i for i, n in enumerate(nodes) if PHASE_KEY in n.meta), len(nodes))
    forward = nodes[:end + 1]
    gathers = [n for n in forward if _packet(n) == _GATHER]
    for before, gather in zip(gathers, gathers[1:]):
        position = {n: i for i, n in enumerate(graph.nodes)}
        anchor = next((n for n in list(graph.nodes)[position[before]:position[gather]] if _packet(n) == _SPLIT_COPY),
                      None)
        if anchor is None:
            continue
        group = _ancestors_after(gather, position[anchor], position)
        if any(position[a] > position[anchor] and a not in group for node in group for a in node.all_input_nodes):
            continue  # it reads what the previous module made: it cannot go earlier
        for node in sorted(group, key=position.__getitem__):
            anchor.append(node)
            anchor = node
    graph.lint()
    result.recompile()
    return result


def _ancestors_after(node: torch.fx.Node, floor: int, position: dict[torch.fx.Node, int]) -> set[torch.fx.Node]:
    """``node`` and the nodes it depends on, directly or not, that stand after position ``floor``."""
    found: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in found or position[n] <= floor:
            continue
        found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def lift_constants(gm: torch.fx.GraphModule, names: Mapping[int, str]) -> tuple[torch.fx.GraphModule,
                                                                                 list[torch.Tensor], list[str]]:
    """``gm`` with each constant whose tensor ``names`` lists (keyed by ``id(tensor)``) read from a new input
    instead, placed before the graph's own inputs in the order of ``names``; also the lifted tensors and their
    names, in that order. A listed tensor the graph does not hold is left out."""
    result = _copied(gm)
    graph = result.graph
    held = {id(getattr(result, n.target)): n for n in graph.find_nodes(op="get_attr")
            if isinstance(getattr(result, n.target, None), torch.Tensor)}
    first = next(iter(graph.nodes))
    tensors: list[torch.Tensor] = []
    labels: list[str] = []
    for key, name in names.items():
        node = held.get(key)
        if node is None:
            continue
        with graph.inserting_before(first):
            placeholder = graph.placeholder(_identifier(name, len(tensors)))
        placeholder.meta.update(node.meta)
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        tensors.append(getattr(result, node.target))
        labels.append(name)
    graph.lint()
    result.recompile()
    return result, tensors, labels


def _identifier(name: str, index: int) -> str:
    return f"shard_{index}_" + "".join(c if c.isalnum() else "_" for c in name)


__all__ = ["drop_profiler_calls", "issue_gathers_ahead", "lift_constants", "separate_regathers"]
