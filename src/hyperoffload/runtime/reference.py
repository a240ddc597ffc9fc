"""A plain reference executor: run a Program's graph on real tensors and count live bytes.

It runs the ops of an execution order one by one, keeps every tensor in an
environment, drops each tensor right after its last reader, and after each op
sums the bytes of the distinct storages still referenced. That count is measured
from the tensors themselves (``untyped_storage()``), independent of the IR's
alias bookkeeping, so comparing it with ``memory_profile`` checks the analysis
against reality.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from hyperoffload.analysis.lifetimes import live_ranges
from hyperoffload.ir import Program


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    """Result of ``run_reference``."""

    outputs: tuple[torch.Tensor, ...]
    """The step's outputs, in ``program.outputs`` order."""
    live_bytes: tuple[int, ...]
    """Bytes of distinct storages referenced while the op at each position ran."""
    peak_bytes: int


def op_arguments(node: torch.fx.Node, lookup) -> tuple[tuple, dict]:
    """The positional and keyword arguments of ``node``'s call, each fx node replaced by ``lookup(node)``."""
    return torch.fx.node.map_arg(node.args, lookup), torch.fx.node.map_arg(node.kwargs, lookup)


def graph_object(program: Program, node: torch.fx.Node) -> object:
    """What the graph itself holds at ``node`` where it is no tensor of the Program: a collective's process group
    (an fx ``get_attr`` of a TorchScript object), which the op that takes it needs as is. A ``KeyError`` for any
    other node, as for a value the step does not hold."""
    if node.op != "get_attr" or node.name in program.node_values:
        raise KeyError(node.name)
    return getattr(program.graph, node.target)


def run_op(program: Program, op, node: torch.fx.Node, lookup, works: list | None = None) -> list[torch.Tensor]:
    """Run one captured op on real tensors (``lookup`` maps an fx node to its tensor); return the
    tensors it produced, in the order of ``op.outputs``. Shared by every executor of captured graphs.

    Outputs are matched to the capture's by their position in the op's result, as the capture recorded them
    (``program_from_graph``): an output the trace had as None and the kernel returns is dropped, and an empty
    one the trace had and the kernel leaves out (None) is an empty tensor of the recorded shape and dtype.

    A collective (``op.collective``) on a real process group returns the tensor it writes and its ``Work``, and
    the backend may still be writing it: the op waits for the work, so the ops after it read what it wrote; or,
    given ``works``, appends the work there for the caller to wait for before the first op that reads the result
    (the interpreter overlaps a collective with the ops that do not, as FSDP2 does on a device)."""
    args, kwargs = op_arguments(node, lookup)
    result = node.target(*args, **kwargs)
    if op.collective is not None:
        if works is None:
            wait_for_work(result)
        else:
            works.extend(_unboxed(work) for work in _works(result))
    # Most ops return one tensor: skip matching positions (a few microseconds an op, which the executor pays on
    # every op of every step).
    if isinstance(result, torch.Tensor):
        produced = [result]
    else:
        recorded = node.meta.get("val")
        if isinstance(recorded, (tuple, list)) and isinstance(result, (tuple, list)) and len(result) == len(recorded):
            produced = [_output_at(op, node, i, result[i], item, result)
                        for i, item in enumerate(recorded) if isinstance(item, torch.Tensor)]
        else:
            produced = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
    if len(produced) != len(op.outputs):
        raise RuntimeError(f"{op.name} produced {len(produced)} tensors, the capture recorded {len(op.outputs)}")
    return produced


def _unboxed(work):
    """A c10d ``Work`` as Python's ``torch.distributed`` gives it (``is_completed``, ``wait``): an op called through
    the dispatcher returns it boxed as a TorchScript object, which has ``wait`` only."""
    from torch._C._distributed_c10d import Work

    return work if isinstance(work, Work) else Work.unbox(work)


def _works(result) -> list:
    """Each ``Work`` (a c10d collective's handle: anything with ``wait`` that is no tensor) in an op's ``result``."""
    return [item for item in (result if isinstance(result, (tuple, list)) else (result,))
            if not isinstance(item, torch.Tensor) and callable(getattr(item, "wait", None))]


def wait_for_work(result) -> None:
    """Wait for each ``Work`` in an op's ``result``."""
    for work in _works(result):
        work.wait()


def _output_at(op, node: torch.fx.Node, position: int, got, recorded: torch.Tensor, result) -> torch.Tensor:
    """The kernel's output at ``position`` of its result, where the capture recorded the tensor ``recorded``. An
    output left out (None) stands as an empty tensor only where the capture recorded it empty and no op reads it:
    an op handed an empty tensor for one it needs might read past it."""
    if isinstance(got, torch.Tensor):
        return got
    read = any(user.target is operator.getitem and user.args[1] == position and user.users for user in node.users)
    if got is None and recorded.numel() == 0 and not read:
        device = next((t.device for t in result if isinstance(t, torch.Tensor)), recorded.device)
        return torch.empty(recorded.shape, dtype=recorded.dtype, device=device)
    raise RuntimeError(f"{op.name} returned {type(got).__name__} at output {position}, where the capture recorded "
                       f"a {recorded.dtype} tensor of shape {tuple(recorded.shape)}"
                       + (" that later ops read" if read else ""))


def live_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what they hold in memory)."""
    sizes: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def run_reference(program: Program, inputs: Sequence[torch.Tensor], order: Sequence[int] | None = None) -> ReferenceRun:
    """Execute ``program`` (which must carry its fx graph) on ``inputs`` in ``order``.

    Inputs are used as given: in-place updates (optimizer state, parameters, KV cache)
    land in them, as in the captured step. Pass clones to keep the originals.
    """
    if program.graph is None:
        raise ValueError(f"program {program.name} has no fx graph to execute; build it with a capture function")
    if len(inputs) != len(program.inputs):
        raise ValueError(f"program {program.name} takes {len(program.inputs)} inputs, got {len(inputs)}")
    order = tuple(range(len(program.ops))) if order is None else tuple(order)
    ranges = live_ranges(program, order)
    nodes = {n.name: n for n in program.graph.graph.nodes}
    frees: list[list[int]] = [[] for _ in order]
    for vid, r in ranges.items():
        if r.end < len(order) and r.end > 0:
            frees[r.end - 1].append(vid)

    env: dict[int, torch.Tensor] = dict(zip(program.inputs, inputs))
    for vid in program.constants:
        env[vid] = getattr(program.graph, nodes[program.values[vid].name].target)

    def lookup(node: torch.fx.Node) -> torch.Tensor:
        vid = program.node_values.get(node.name)
        return env[vid] if vid is not None else graph_object(program, node)

    live: list[int] = []
    with torch.no_grad():
        for position, op_id in enumerate(order):
            op = program.ops[op_id]
            env.update(zip(op.outputs, run_op(program, op, nodes[op.name], lookup)))
            live.append(live_storage_bytes(env.values()))
            for vid in frees[position]:
                env.pop(vid, None)
    outputs = tuple(env[v] for v in program.outputs)
    return ReferenceRun(outputs=outputs, live_bytes=tuple(live), peak_bytes=max(live, default=0))


@dataclass(frozen=True, slots=True, kw_only=True)
class EagerComparison:
    """A captured step's graph run against its eager run on identical copies of the inputs."""

    identical: bool
    """Outputs and every input after the step (updated in place) are bit-identical."""
    max_abs_diff: float
    """Largest absolute difference over outputs and updated inputs (0.0 when identical)."""
    mismatched: tuple[str, ...]
    """Names of the outputs / inputs that differ."""
    measured_peak_bytes: int
    """Peak of the bytes the executor held, measured from the tensors' storages."""
    analysed_peak_bytes: int
    """Peak the lifetime analysis predicts for the same order."""
    live_bytes_agree: bool
    """Measured and analysed live bytes are equal at every op, not just at the peak."""


def replayed_random_numbers():
    """A ``with`` block after which torch's default random generators (the CPU's, and each CUDA device's once
    CUDA is in use) are back where they were at its start (``torch.random.fork_rng``).

    A step with random ops (dropout in a training step: ``aten.bernoulli_``) draws from them; run the first of
    two runs compared bit for bit inside the block, and the second draws the same masks."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # never start CUDA just for this
    return torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else [])


def compare_with_eager(captured, order: Sequence[int] | None = None) -> EagerComparison:
    """Run ``captured`` (a real, not fake, capture) through ``run_reference`` and eagerly, and compare."""
    from hyperoffload.analysis import memory_profile

    program = captured.program
    graph_inputs = [t.clone() for t in captured.inputs]
    eager_inputs = [t.clone() for t in captured.inputs]
    with replayed_random_numbers():  # both runs draw the same random numbers (dropout masks)
        run = run_reference(program, graph_inputs, order)
    eager = captured.step(*eager_inputs)
    eager = tuple(x for x in tree_flatten(eager)[0] if isinstance(x, torch.Tensor))
    pairs = [(f"output {i}", got, want) for i, (got, want) in enumerate(zip(run.outputs, eager))]
    pairs += [(program.values[v].name, got, want) for v, got, want in zip(program.inputs, graph_inputs, eager_inputs)]
    mismatched, worst = [], 0.0
    for name, got, want in pairs:
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            mismatched.append(name)
            if got.shape == want.shape and got.numel():
                worst = max(worst, (got.double() - want.double()).abs().max().item())
            else:
                worst = float("inf")
    if len(run.outputs) != len(eager):
        mismatched.append("number of outputs")
        worst = float("inf")
    profile = memory_profile(program, order)
    return EagerComparison(identical=not mismatched, max_abs_diff=worst, mismatched=tuple(mismatched),
                           measured_peak_bytes=run.peak_bytes, analysed_peak_bytes=profile.peak_bytes,
                           live_bytes_agree=run.live_bytes == profile.live_bytes)
