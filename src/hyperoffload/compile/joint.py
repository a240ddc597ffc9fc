"""Join aot_autograd's forward and backward graphs into one step, so they are planned as one.

aot_autograd partitions a traced training step into a forward graph, which returns the user's
outputs followed by the tensors saved for backward, and a backward graph, which takes those saved
tensors followed by the tangents (the gradients of the user's outputs) and returns a gradient per
forward input. ``join_graphs`` glues them into a single fx graph over the same aten nodes:

* placeholders: the forward's inputs (primals), then the backward-only inputs (tangents), each
  tangent laid out as aot_autograd hands it to the backward (``layouts.compact_tangents``: its own
  storage, not a view of the storage its forward output views);
* the forward's nodes;
* one ``aten.alias`` per tensor the forward returns to the user: a *boundary marker*. It reads the
  output at the end of the forward, where the caller receives it, so a plan keeps it on the device
  there; afterwards the compiled step no longer holds it (the caller does), as in a real run;
* the backward's nodes, reading the forward's nodes directly wherever the backward read a saved
  tensor, so a saved activation is one value produced in the forward and read in the backward:
  the planner can send it to remote memory after its last forward use and bring it back before
  its first backward use;
* the output: the backward's outputs (the gradients).

The last marker carries the phase mark that ``program_from_graph`` reads, so ops after it are
backward ops and values produced before it and read after it are saved activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from hyperoffload.capture.graph_to_program import CaptureError
from hyperoffload.capture.tags import KIND_KEY, PHASE_KEY
from hyperoffload.compile.layouts import compact_tangents
from hyperoffload.ir import Phase, ValueKind

MARKER = torch.ops.aten.alias.default
"""The boundary marker's operator: a view that costs nothing and moves nothing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JointGraph:
    """A forward and a backward graph glued into one step (see the module docstring)."""

    module: torch.fx.GraphModule
    primals: tuple[str, ...]
    """Names of the joint graph's placeholders that are forward inputs, in forward order."""
    backward_inputs: tuple[str, ...]
    """Names of the joint graph's placeholders that only the backward takes (tangents), in backward order."""
    user_outputs: tuple[str | None, ...]
    """For each of the forward's user outputs, the name of its marker node (None: not a tensor)."""
    constant_outputs: tuple[object, ...]
    """For each of the forward's user outputs, the value returned when it is not a graph node."""
    last_forward: str
    """Name of the node after which the backward starts (the last marker)."""


def _is_tensor_node(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _output_args(gm: torch.fx.GraphModule) -> list:
    output = next(iter(gm.graph.find_nodes(op="output")))
    args = output.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


def join_graphs(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_user_outputs: int) -> JointGraph:
    """One graph running ``forward`` then ``backward`` (see the module docstring).

    ``num_user_outputs`` is how many of the forward's outputs go to the user (aot_autograd's
    ``num_fwd_outputs``); the rest are saved for the backward, whose placeholders of the same names
    take them. Raises ``CaptureError`` for graphs with symbolic sizes or non-tensor saved values.
    """
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    forward_outputs = _output_args(forward)
    saved_by_name = {n.name: n for n in forward_outputs[num_user_outputs:] if isinstance(n, torch.fx.Node)}
    for n in forward_outputs[num_user_outputs:]:
        if not _is_tensor_node(n):
            raise CaptureError(f"the forward graph saves {n} for the backward, which is not a tensor (a symbolic "
                               f"size: TorchDynamo compiled with dynamic shapes); the hyperoffload backend plans "
                               f"static shapes: compile with dynamic=False")

    primals = [n for n in forward.graph.nodes if n.op == "placeholder"]
    backward_placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    backward_only = [n for n in backward_placeholders if n.name not in saved_by_name]
    for n in (*primals, *backward_only):
        if not _is_tensor_node(n):
            raise CaptureError(f"graph input {n.name} is not a tensor (a symbolic size?); the hyperoffload backend "
                               f"plans static shapes: compile with dynamic=False")
        env[n] = graph.node_copy(n)

    def copy_nodes(gm: torch.fx.GraphModule, lookup) -> None:
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n.op == "get_attr":
                # Constants of both graphs live on one root; a clash of names gets a fresh one.
                name = n.target if not hasattr(root, n.target) else f"{n.target}_{len(env)}"
                setattr(root, name, getattr(gm, n.target))
                new = graph.get_attr(name)
                new.meta = dict(n.meta)
                env[n] = new
                continue
            env[n] = graph.node_copy(n, lookup)

    copy_nodes(forward, lambda a: env[a])
    markers: list[str | None] = []
    constants: list[object] = []
    last = None
    for out in forward_outputs[:num_user_outputs]:
        if not _is_tensor_node(out):
            markers.append(None)
            constants.append(None if isinstance(out, torch.fx.Node) else out)
            continue
        val = out.meta["val"]
        marker = graph.call_function(MARKER, (env[out],), name=f"to_caller_{out.name}")
        marker.meta["val"] = MARKER(val)  # a fake alias of the same storage
        markers.append(marker.name)
        constants.append(None)
        last = marker
    if last is None:
        raise CaptureError("the forward graph returns no tensor, so there is nothing to differentiate")
    last.meta[PHASE_KEY] = Phase.BACKWARD

    def backward_lookup(a: torch.fx.Node) -> torch.fx.Node:
        if a.op == "placeholder" and a.name in saved_by_name:
            return env[saved_by_name[a.name]]
        return env[a]

    copy_nodes(backward, backward_lookup)
    gradients = [torch.fx.node.map_arg(g, backward_lookup) for g in _output_args(backward)]
    for g in gradients:
        if isinstance(g, torch.fx.Node) and g.op == "call_function":
            g.meta[KIND_KEY] = ValueKind.GRADIENT
    graph.output(tuple(gradients))
    module = torch.fx.GraphModule(root, graph, class_name="JointStep")
    tangents = tuple(env[n].name for n in backward_only)
    compact_tangents(module, tangents)
    return JointGraph(module=module, primals=tuple(env[n].name for n in primals),
                      backward_inputs=tangents, user_outputs=tuple(markers),
                      constant_outputs=tuple(constants), last_forward=last.name)


def input_kinds(joint: JointGraph, static_inputs: Sequence[int]) -> list[ValueKind]:
    """Kinds of the joint graph's placeholders: the forward's static inputs (parameters and buffers,
    aot_autograd's ``static_lifetime_input_indices``) are parameters, everything else a step input."""
    static = set(static_inputs)
    return [ValueKind.PARAMETER if i in static else ValueKind.INPUT for i in range(len(joint.primals))] + [
        ValueKind.INPUT] * len(joint.backward_inputs)


__all__ = ["MARKER", "JointGraph", "input_kinds", "join_graphs"]
