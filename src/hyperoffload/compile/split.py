"""Split a planned joint step back into the forward and backward graphs aot_autograd runs.

``lower_plan`` turns the plan of a joint step (``hyperoffload.compile.joint``) into one graph with
the cache operators in plan order. aot_autograd needs it as two graphs again: the forward, which
returns the user's outputs followed by whatever the backward needs, and the backward, which takes
those followed by the tangents. ``split_lowered`` cuts the lowered graph right after the last
boundary marker:

* every node before the cut that a node after the cut reads *crosses* the boundary: the forward
  returns it and the backward takes it as a placeholder of the same name. A saved activation that
  the plan sent to remote memory therefore crosses as its remote buffer (an ``offload`` or
  ``wait`` node), its device copy having been released in the forward, and the backward brings it
  back with ``prefetch`` and ``wait``; one still on the device crosses as itself;
* the user's outputs are what the markers read: the outputs' device tensors at the end of the
  forward (the markers themselves are left out, so callers get the tensors, not aliases).

``keep_backward_inputs_in_backward`` prepares the plan for the cut: tangents exist only once the
backward starts, so a prefetch of one that a plan issued during the forward moves to the start of
the backward (later, so the device holds less in between and the budget still holds).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx

from hyperoffload.compile.joint import JointGraph
from hyperoffload.compile.layouts import propagate_fake_values
from hyperoffload.ir import Phase, Program
from hyperoffload.plans import Instr, Kind, Plan


class SplitError(ValueError):
    """A planned joint step cannot be cut into a forward and a backward graph; the message says why."""


def cut_index(plan: Plan, joint: JointGraph) -> int:
    """Index in ``plan.instructions`` of the compute of the last boundary marker.

    Raises ``SplitError`` if the plan runs a backward op before a forward op (a policy that reorders
    across the boundary), since the forward and backward run at different times.
    """
    program = plan.program
    marker_op = next(op.id for op in program.ops if op.name == joint.last_forward)
    cut = next(i for i, ins in enumerate(plan.instructions) if ins.kind is Kind.COMPUTE and ins.target == marker_op)
    for i, ins in enumerate(plan.instructions):
        if ins.kind is not Kind.COMPUTE:
            continue
        phase = program.ops[ins.target].phase
        if (i <= cut) != (phase is Phase.FORWARD):
            op = program.ops[ins.target]
            raise SplitError(f"policy {plan.policy!r} runs {op.name} ({phase.value}) "
                             f"{'before' if i <= cut else 'after'} the end of the forward; "
                             f"forward and backward run separately, so a plan must keep them apart")
    return cut


def _backward_input_storages(program: Program, joint: JointGraph) -> set[int]:
    return {program.values[program.node_values[name]].storage for name in joint.backward_inputs}


def keep_backward_inputs_in_backward(plan: Plan, joint: JointGraph) -> Plan:
    """``plan`` with every prefetch of a backward-only input (a tangent) issued during the forward moved
    to right after the cut; the plan itself if there is none. Any other instruction on such an input
    before the cut is a ``SplitError``."""
    program = plan.program
    tangents = _backward_input_storages(program, joint)
    cut = cut_index(plan, joint)
    moved: list[Instr] = []
    kept: list[Instr] = []
    for i, ins in enumerate(plan.instructions):
        if i < cut and ins.kind is not Kind.COMPUTE and ins.target in tangents:
            if ins.kind is not Kind.PREFETCH:
                raise SplitError(f"policy {plan.policy!r} issues {ins.describe(program)} during the forward, "
                                 f"before the backward input exists")
            moved.append(ins)
        else:
            kept.append(ins)
    if not moved:
        return plan
    at = cut - len(moved) + 1  # the cut moved up by the prefetches taken out before it
    instructions = (*kept[:at], *moved, *kept[at:])
    return Plan(program=program, instructions=tuple(instructions), policy=plan.policy,
                budget_bytes=plan.budget_bytes, initial_remote=plan.initial_remote)


def _copy_into(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node], env: dict[torch.fx.Node, torch.fx.Node]) -> None:
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])


def split_lowered(lowered: torch.fx.GraphModule, joint: JointGraph) -> tuple[torch.fx.GraphModule,
                                                                                torch.fx.GraphModule]:
    """The forward and backward graphs of ``lowered`` (``lower_plan`` of a plan of ``joint``'s program),
    every node with a fake tensor in ``meta["val"]``."""
    # aot_autograd reads the backward's placeholders' values; the cache operators and the views
    # ``lower_plan`` adds have none yet.
    propagate_fake_values(lowered)
    nodes = list(lowered.graph.nodes)
    by_name = {n.name: n for n in nodes}
    position = {n: i for i, n in enumerate(nodes)}
    cut = position[by_name[joint.last_forward]]
    backward_inputs = {by_name[name] for name in joint.backward_inputs}
    markers = {by_name[name] for name in joint.user_outputs if name is not None}
    output = nodes[-1]
    forward_nodes = [n for n in nodes[:cut + 1] if n not in backward_inputs and n not in markers]
    backward_nodes = [n for n in nodes[cut + 1:] if n is not output]
    for n in forward_nodes:
        early = [u for u in n.all_input_nodes if u in backward_inputs]
        if early:
            raise SplitError(f"{n.name} runs in the forward but reads the backward input {early[0].name}")
    crossing = [n for n in forward_nodes if any(position[u] > cut for u in n.users)]

    forward_graph = torch.fx.Graph()
    forward_env: dict[torch.fx.Node, torch.fx.Node] = {}
    _copy_into(forward_graph, forward_nodes, forward_env)
    user_outputs = [forward_env[by_name[m].args[0]] if m is not None else constant
                    for m, constant in zip(joint.user_outputs, joint.constant_outputs)]
    forward_graph.output((*user_outputs, *(forward_env[n] for n in crossing)))

    backward_graph = torch.fx.Graph()
    backward_env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in crossing:
        placeholder = backward_graph.placeholder(n.name)
        placeholder.meta = dict(n.meta)
        backward_env[n] = placeholder
    _copy_into(backward_graph, [n for n in nodes if n in backward_inputs], backward_env)
    _copy_into(backward_graph, [*backward_nodes, output], backward_env)

    forward_module = torch.fx.GraphModule(lowered, forward_graph, class_name="PlannedForward")
    backward_module = torch.fx.GraphModule(lowered, backward_graph, class_name="PlannedBackward")
    forward_module.graph.lint()
    backward_module.graph.lint()
    return forward_module, backward_module


__all__ = ["SplitError", "cut_index", "keep_backward_inputs_in_backward", "propagate_fake_values", "split_lowered"]
