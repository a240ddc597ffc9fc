"""Trace a user's whole training step (forward, loss, backward and their own ``torch.optim`` update) into one graph.

``trace_whole_step`` builds a step function over a flat list of tensors (``StepInputs`` says which is
which), traces it with ``make_fx`` in fake mode and returns the graph: the forward and ``loss_fn`` as
written, the backward as ``torch.autograd.grad`` traces it, and the user's ``optimizer.step()`` run on
the traced parameters and state (``hyperoffload.compile.optimizers`` says how), updating them in
place. Every node carries the phase it belongs to in ``node.meta["custom"]``, the part of a node's
metadata that aot_autograd and Inductor carry over to the nodes they derive from it, so the phases
survive the graph Inductor is handed (``mark_phases``).

Two passes prepare that graph (aot_autograd's functional form, in which each input updated in place
is written back by a ``copy_`` at the end) for planning:

* ``write_back_early``: each write-back moves to just after the new value is computed and the old one
  last read, so the new and old values of a parameter or of its optimizer state live together only
  for that parameter's update, not until the end of the step;
* ``mark_phases``: the phases come back as the markers ``program_from_graph`` reads, and a value
  made in the backward and read by the optimizer is a gradient.
"""

from __future__ import annotations

import copy
import operator
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from hyperoffload.capture.graph_to_program import CaptureError
from hyperoffload.capture.steps import recurrent_layers_without_onednn
from hyperoffload.capture.tags import KIND_KEY, PHASE_KEY, mark_phase
from hyperoffload.compile.optimizers import OptimizerRule, UnsupportedOptimizer, rule_for
from hyperoffload.ir import Phase, ValueKind

PHASE_META = "hyperoffload_phase"
"""Key of a node's phase (``Phase.value``) in ``node.meta["custom"]``."""

Leaf = tuple[tuple[int, ...], torch.dtype, str]
"""A batch tensor's shape, dtype and device type: what the compiled step was traced for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInputs:
    """How the flat inputs of a whole training step map onto the model, the optimizer and the batch.

    In order: the trained parameters (those the optimizer holds), the model's other parameters, its
    buffers, every optimizer state tensor (per trained parameter in order, its keys sorted), one
    learning rate per parameter group (a 0-d float64 tensor), and the batch's tensors.
    """

    trained: tuple[tuple[str, nn.Parameter], ...]
    frozen: tuple[tuple[str, nn.Parameter], ...]
    buffers: tuple[tuple[str, torch.Tensor], ...]
    state_keys: tuple[tuple[int, str], ...]
    """``(index into trained, key)`` of each optimizer state tensor."""
    groups: tuple[tuple[int, ...], ...]
    """The indices into ``trained`` of each parameter group's parameters, in the group's order."""
    batch_spec: TreeSpec
    batch_leaves: tuple[Any, ...]
    """The batch's leaves, with its tensors as ``Leaf`` descriptions (other leaves as they are)."""

    @property
    def names(self) -> tuple[str, ...]:
        """Readable names of the flat inputs."""
        trained = [n for n, _ in self.trained]
        state = [f"{key}:{trained[i]}" for i, key in self.state_keys]
        lrs = [f"lr:group{g}" for g in range(len(self.groups))]
        batch = [f"batch.{i}" for i in range(self.batch_tensors)]
        return (*trained, *(n for n, _ in self.frozen), *(n for n, _ in self.buffers), *state, *lrs, *batch)

    @property
    def kinds(self) -> tuple[ValueKind, ...]:
        state_count = len(self.trained) + len(self.frozen) + len(self.buffers)
        return ((ValueKind.PARAMETER,) * state_count + (ValueKind.OPTIMIZER_STATE,) * len(self.state_keys)
                + (ValueKind.INPUT,) * (len(self.groups) + self.batch_tensors))

    @property
    def state_tensors(self) -> int:
        """How many of the flat inputs, from the first, are the model's and the optimizer's state (what a step may
        write); the learning rates and the batch follow."""
        return len(self.trained) + len(self.frozen) + len(self.buffers) + len(self.state_keys)

    @property
    def batch_tensors(self) -> int:
        return sum(map(is_tensor_leaf, self.batch_leaves))

    def flat(self, optimizer: torch.optim.Optimizer, lrs: Sequence[torch.Tensor],
             batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The flat inputs for one call: the model's and optimizer's own tensors (updated in place), ``lrs``
        and the batch's tensors."""
        params = [p.detach() for _, p in self.trained]
        state = [optimizer.state[self.trained[i][1]][key] for i, key in self.state_keys]
        return [*params, *(p.detach() for _, p in self.frozen), *(b for _, b in self.buffers), *state, *lrs, *batch]


def is_tensor_leaf(x: Any) -> bool:
    """Whether a batch leaf of ``StepInputs.batch_leaves`` stands for a tensor (a ``Leaf``)."""
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[1], torch.dtype)


def describe_leaf(t: torch.Tensor) -> Leaf:
    return (tuple(t.shape), t.dtype, t.device.type)


def flatten_batch(batch: Any) -> tuple[list[torch.Tensor], TreeSpec, list[Any]]:
    """The batch's tensors, its tree structure and its leaves with tensors described (``Leaf``)."""
    leaves, spec = tree_flatten(batch)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        raise CaptureError("the batch holds no tensors; pass the tensors loss_fn(model, batch) reads")
    described = [describe_leaf(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    return tensors, spec, described


def describe_inputs(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> StepInputs:
    """The flat-input layout of ``model``'s step with ``optimizer`` on ``batch`` (state must exist already)."""
    by_id = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    named = list(model.named_parameters())
    in_optimizer: list[int] = []
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        indices = []
        for p in group["params"]:
            if id(p) not in by_id:
                raise UnsupportedOptimizer(f"parameter group {g} of the optimizer holds a tensor of shape "
                                           f"{tuple(p.shape)} that is not a parameter of the model; build the "
                                           f"optimizer from model.parameters()")
            if not p.requires_grad:
                raise UnsupportedOptimizer(f"the optimizer holds {named[by_id[id(p)]][0]}, which has "
                                           f"requires_grad=False; leave frozen parameters out of the optimizer")
            in_optimizer.append(by_id[id(p)])
            indices.append(len(in_optimizer) - 1)
        groups.append(tuple(indices))
    if not in_optimizer:
        raise UnsupportedOptimizer("the optimizer holds no parameters of the model; nothing to train")
    if len(set(in_optimizer)) != len(in_optimizer):
        raise UnsupportedOptimizer("a parameter appears twice in the optimizer's parameter groups")
    trained = tuple(named[i] for i in in_optimizer)
    frozen = tuple(named[i] for i in range(len(named)) if i not in set(in_optimizer))
    state_keys = tuple((i, key) for i, (_, p) in enumerate(trained) for key in sorted(optimizer.state[p])
                       if isinstance(optimizer.state[p][key], torch.Tensor))
    _, spec, leaves = flatten_batch(batch)
    return StepInputs(trained=trained, frozen=frozen, buffers=tuple(model.named_buffers()), state_keys=state_keys,
                      groups=tuple(groups), batch_spec=spec, batch_leaves=tuple(leaves))


def init_optimizer_state(optimizer: torch.optim.Optimizer, rule: OptimizerRule) -> None:
    """Create the state the optimizer's first ``step()`` would (``rule.init_state``) where it has none yet;
    ``UnsupportedOptimizer`` if a group's settings cannot be captured."""
    for g, group in enumerate(optimizer.param_groups):
        missing = any(not optimizer.state.get(p) for p in group["params"])
        reason = rule.refusal(group, missing)
        if reason is not None:
            raise UnsupportedOptimizer(f"{type(optimizer).__name__} parameter group {g}: {reason}")
        for p in group["params"]:
            if not optimizer.state.get(p):
                with torch.no_grad():
                    optimizer.state[p] = rule.init_state(group, p)


class _OptimizerOver:
    """Inside the block, ``optimizer`` updates the traced ``params`` with ``grads``, ``state`` and learning rates
    ``lrs`` (one per group) as its own; its groups and state are restored after."""

    def __init__(self, optimizer: torch.optim.Optimizer, rule: OptimizerRule, inputs: StepInputs,
                 params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                 state: Sequence[torch.Tensor], lrs: Sequence[torch.Tensor]) -> None:
        self.optimizer, self.rule, self.inputs = optimizer, rule, inputs
        self.params, self.grads, self.state, self.lrs = params, grads, state, lrs

    def __enter__(self) -> None:
        opt = self.optimizer
        self.saved_groups = [dict(group) for group in opt.param_groups]
        self.saved_state = opt.state
        states: dict[torch.Tensor, dict[str, torch.Tensor]] = {p: {} for p in self.params}
        for (i, key), t in zip(self.inputs.state_keys, self.state):
            states[self.params[i]][key] = t
        for i, p in enumerate(self.params):
            for key, v in self.saved_state[self.inputs.trained[i][1]].items():
                states[p].setdefault(key, v)  # non-tensor state, as it is
        opt.state = type(self.saved_state)(dict, states) if hasattr(self.saved_state, "default_factory") else states
        for group, indices, lr in zip(opt.param_groups, self.inputs.groups, self.lrs):
            group["params"] = [self.params[i] for i in indices]
            group.update(self.rule.trace_options)
            group["lr"] = lr.detach().requires_grad_() if self.rule.lr_requires_grad else lr
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def __exit__(self, *exc) -> None:
        for p in self.params:
            p.grad = None
        for group, saved in zip(self.optimizer.param_groups, self.saved_groups):
            group.clear()
            group.update(saved)
        self.optimizer.state = self.saved_state


def trace_whole_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[nn.Module, Any], Any],
                     inputs: StepInputs, flat: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """Trace the whole step on the flat inputs ``flat`` (``StepInputs.flat``) into an aten graph that returns the
    loss (detached) and updates parameters and optimizer state in place; every node is tagged with its phase."""
    rule = rule_for(optimizer)
    sizes = [len(inputs.trained), len(inputs.frozen), len(inputs.buffers), len(inputs.state_keys),
             len(inputs.groups), inputs.batch_tensors]
    names = [n for n, _ in (*inputs.trained, *inputs.frozen, *inputs.buffers)]

    def step(*flat_t: torch.Tensor) -> torch.Tensor:
        parts, at = [], 0
        for size in sizes:
            parts.append(list(flat_t[at:at + size]))
            at += size
        params, frozen, buffers, state, lrs, batch_t = parts
        it = iter(batch_t)
        batch = tree_unflatten([next(it) if is_tensor_leaf(x) else x for x in inputs.batch_leaves],
                               inputs.batch_spec)
        leaves = [p.detach().requires_grad_() for p in params]
        with (torch.enable_grad(), _reparametrize_module(model, dict(zip(names, [*leaves, *frozen, *buffers])),
                                                         tie_weights=True, strict=False),
              recurrent_layers_without_onednn(model)):
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise CaptureError(f"loss_fn(model, batch) must return a single-element tensor, got "
                                   f"{type(loss).__name__}" + (f" of shape {tuple(loss.shape)}"
                                                               if isinstance(loss, torch.Tensor) else ""))
            if not loss.requires_grad:
                raise CaptureError("the loss does not depend on any trained parameter (loss_fn detached it, or ran "
                                   "under no_grad)")
            mark_phase(Phase.BACKWARD)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        mark_phase(Phase.OPTIMIZER)
        with torch.no_grad(), torch.compiler._compile_session_context(), \
                _OptimizerOver(optimizer, rule, inputs, params, grads, state, lrs):
            optimizer.step()
        return loss.detach()

    try:
        gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)
    except (CaptureError, UnsupportedOptimizer):
        raise
    except Exception as error:  # tracing runs the user's model, loss and optimizer code
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CaptureError(f"tracing the training step failed{_user_line(error)}: {type(error).__name__}: "
                           f"{first_line}. {_trace_advice(error)}") from error
    _drop_profiler_ranges(gm)
    _tag_phases(gm)
    return gm


def _drop_profiler_ranges(gm: torch.fx.GraphModule) -> None:
    """Remove the profiler's range markers ``optimizer.step()`` records (``record_function``): they compute
    nothing, and pass an opaque object between two ops."""
    exits = gm.graph.find_nodes(op="call_function", target=torch.ops.profiler._record_function_exit._RecordFunction)
    for node in exits:
        gm.graph.erase_node(node)
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.profiler._record_function_enter_new.default):
        if not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _user_line(error: BaseException) -> str:
    """`` at file:line in function`` of the innermost frame of the traceback outside torch and this package (the
    user's model or loss), or nothing."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} in {f.name} ({(f.line or '').strip()})"


def _trace_advice(error: Exception) -> str:
    text = str(error)
    if "data-dependent" in text or "Could not guard" in text or "item()" in text or "_local_scalar_dense" in text:
        return ("The step reads a tensor's value in Python (an if on a tensor, .item(), .tolist()): the whole step is "
                "traced once for every call, so its control flow must not depend on the data; compute the branch "
                "with torch.where, or move it out of the model")
    return "The model and loss_fn must run on the example batch with static shapes and no data-dependent control flow"


def _tag_phases(gm: torch.fx.GraphModule) -> None:
    """Record each node's phase (from ``mark_phase``'s markers) in ``node.meta["custom"]``."""
    phase = Phase.FORWARD
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta.setdefault("custom", {})[PHASE_META] = phase.value
        if PHASE_KEY in node.meta:
            phase = node.meta[PHASE_KEY]


def _copied(gm: torch.fx.GraphModule, order: Sequence[torch.fx.Node]) -> tuple[torch.fx.Graph, dict]:
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in order:
        env[n] = graph.node_copy(n, env.__getitem__)
    return graph, env


def _storage(node: Any) -> StorageWeakRef | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def write_back_early(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` in which each write-back of an updated input (``copy_(input, new)``, after the last
    compute node) comes right after both ``new`` is computed and the last reader of ``input``'s storage (a view
    of it included); nothing else moves."""
    nodes = list(gm.graph.nodes)
    write_backs = _write_backs(nodes)
    moving = set(write_backs)
    position = {n: i for i, n in enumerate(nodes)}
    readers: dict[StorageWeakRef, int] = {}
    for n in nodes:
        if n in moving or n.op != "call_function":
            continue
        for arg in n.all_input_nodes:
            s = _storage(arg)
            if s is not None:
                readers[s] = max(readers.get(s, -1), position[n])
    after: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for w in write_backs:
        dst, src = w.args[0], w.args[1]
        at = max(position[src] if isinstance(src, torch.fx.Node) else -1, readers.get(_storage(dst), -1))
        anchor = nodes[at] if at >= 0 else dst
        after.setdefault(anchor, []).append(w)
    order = []
    for n in nodes:
        if n in moving:
            continue
        order.append(n)
        order.extend(after.get(n, ()))
    graph, _ = _copied(gm, order)
    graph.lint()
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def read_written_back(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` in which a node after a write-back ``copy_(input, new)`` that reads ``new`` reads ``input``
    instead, which holds the same values from the write-back on (an optimizer update reads a moment's new value
    after writing it into the moment). ``new`` then ends at its write-back, and the input's storage is what
    later readers hold: so a plan releases the input after them rather than before, where the values they read
    would have to be stored apart from it; and Inductor, which never stores ``new`` apart when it fuses the
    write-back with those readers, holds what the plan counts. Only a ``new`` of the input's size, stride and
    dtype is replaced, and only while no later write-back writes the input again."""
    graph, _ = _copied(gm, list(gm.graph.nodes))
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}  # replacing inputs moves no node
    write_backs = _write_backs(nodes)
    written_at: dict[torch.fx.Node, list[int]] = {}
    for w in write_backs:
        written_at.setdefault(w.args[0], []).append(position[w])
    for w in write_backs:
        dst, src = w.args[0], w.args[1]
        if not isinstance(src, torch.fx.Node) or not _same_layout(dst, src):
            continue
        until = min((at for at in written_at[dst] if at > position[w]), default=len(nodes))
        for user in list(src.users):
            if position[w] < position[user] < until:
                user.replace_input_with(src, dst)
    graph.lint()
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def _write_backs(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The write-backs among ``nodes``: ``copy_(input, new)`` of a placeholder whose result nothing reads."""
    placeholders = {n for n in nodes if n.op == "placeholder"}
    return [n for n in nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
            and n.args[0] in placeholders and not n.users]


def _same_layout(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    x, y = a.meta.get("val"), b.meta.get("val")
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
            and x.shape == y.shape and x.stride() == y.stride())


def mark_phases(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with the phase markers ``program_from_graph`` reads, from the phases ``trace_whole_step``
    left in each node's ``meta["custom"]`` (a node without one, such as a write-back, is in the phase of the
    node before it), and a value made in the backward and read in the optimizer update tagged a gradient."""
    graph, env = _copied(gm, list(gm.graph.nodes))
    nodes = list(graph.nodes)
    phases: dict[torch.fx.Node, Phase] = {}
    phase = Phase.FORWARD
    for n in nodes:
        if n.op == "call_function":
            tagged = (n.meta.get("custom") or {}).get(PHASE_META)
            phase = Phase(tagged) if tagged is not None else phase
        phases[n] = phase
    for n, following in zip(nodes, nodes[1:]):
        n.meta = dict(n.meta)  # ``node_copy`` shares the meta dict with ``gm``'s node
        n.meta.pop(PHASE_KEY, None)
        if phases[following] is not phases[n]:
            n.meta[PHASE_KEY] = phases[following]
    for n in nodes:
        if (n.op == "call_function" and n.target is not operator.getitem and phases[n] is Phase.BACKWARD
                and any(phases[u] is Phase.OPTIMIZER for u in n.users)):
            n.meta[KIND_KEY] = ValueKind.GRADIENT
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)


__all__ = ["Leaf", "PHASE_META", "StepInputs", "describe_inputs", "describe_leaf", "flatten_batch",
           "init_optimizer_state", "is_tensor_leaf", "mark_phases", "read_written_back", "trace_whole_step",
           "write_back_early"]
