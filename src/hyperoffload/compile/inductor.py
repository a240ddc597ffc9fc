"""Compile planned graphs with Inductor: the route ``torch.compile(model)`` takes, with the plan's partition.

``compile_planned`` runs ``torch._inductor.compile_fx.compile_fx`` on a TorchDynamo graph, so the
decompositions, the joint-graph passes, the forward and backward compilers and the inference
compiler are plain Inductor's; only the partition is the backend's (``partition``: Inductor's own
min-cut partition, then planned and lowered, see ``hyperoffload.compile.backend``), handed to
Inductor as its ``custom_partitioner_fn``. An inference graph, which is never partitioned, is
planned by ``inner`` just before Inductor compiles it. The cache operators survive Inductor as
fallback kernels: they are side-effectful (``torch.fx.node.has_side_effect``, which Inductor's
``FallbackKernel`` reads), so nothing drops them; a wait comes before the readers of its transfer's
result because they read its result, and a release after the readers of its storage because
``realize_before_releases`` makes what is computed from the storage an input of the release.

Inductor compiles the planned graphs with ``PLANNED_GRAPH_CONFIG``: the plan already fixes the order
of compute and transfers, so Inductor's reordering passes (for peak memory, for locality) would
undo it, and a copy runs asynchronously on the link's engines while compute goes on, so Inductor
must not reuse a buffer (or write a result into an input's buffer) that a copy may still be reading
or writing. None of this changes what a float32 kernel computes: results equal
``torch.compile(model)``'s with nothing offloaded, bit for bit. (A value computed where the plan
transfers or releases a storage is stored in its dtype there; in a lower-precision model, plain
Inductor may instead keep it in float32 inside a fused kernel.)
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import hashlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from hyperoffload import cache_ops

PLANNED_GRAPH_CONFIG = {
    "reorder_for_peak_memory": False,  # the plan's order is already the memory schedule
    "reorder_for_locality": False,
    "allow_buffer_reuse": False,  # an asynchronous copy may still read or write the buffer
    "inplace_buffers": False,
    "memory_planning": False,  # nor pool buffers in one arena it hands out again
}
"""``torch._inductor.config`` settings every planned graph is compiled with (see the module docstring)."""

class KeepPlanOrder(InductorChoices):
    """Inductor's fusion heuristics, except that two nodes with a ``wait`` between them in the graph's order are never
    fused, nor two with a ``release`` between them unless the fused kernel allocates nothing more before the
    release than the unfused nodes did (``_holds_nothing_more``).

    Inductor fuses nodes that are far apart when they read the same buffer or are independent and alike (a
    parameter's weight decay with the forward's read of it; every Adam step counter of the model, in one kernel
    at the start). A fused kernel runs where its first node was, so it computes values long before the plan does
    and holds them across the releases that were to make room: the plan's memory schedule would not hold. A wait
    is a barrier too: a write of a storage whose offload the plan waits for first must not move above that wait
    (the copy reads the storage until then, and nothing in the graph's data says so). Offloads and prefetches are
    not barriers: a node moved across one changes neither what the copy reads or writes (a node that overwrites
    what an offload reads comes after it, as Inductor orders a mutation after the earlier reads of its buffer; a
    prefetched copy is read only through its wait) nor what the step holds between two releases. Every cache
    operator stays where the plan put it: Inductor's reordering passes are off (``PLANNED_GRAPH_CONFIG``)."""

    BARRIERS = frozenset({"wait", "release"})
    """The cache operators (by ``torch.ops.hyperoffload`` name) fusion is checked across (``can_fuse``)."""

    @staticmethod
    def uuid() -> str:
        """What Inductor's caches key compiled code on (``config.inductor_choices_class``): code fused by other
        rules is never handed back for a planned graph."""
        return hashlib.sha256(b"hyperoffload KeepPlanOrder/3 wait release-holding-more").hexdigest()

    def __init__(self) -> None:
        super().__init__()
        self._positions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """The positions of the barriers among each scheduler's nodes (``_barrier_positions``)."""

    def can_fuse(self, scheduler, node1, node2, shared_data_score: int) -> bool:
        positions = self._positions.get(scheduler)
        if positions is None:  # the cache operators are never fused, so their positions stay
            positions = self._positions[scheduler] = _barrier_positions(scheduler)
        waits, releases = positions
        low, high = min(node1.min_order, node2.min_order), max(node1.max_order, node2.max_order)
        if bisect.bisect_right(waits, low) < bisect.bisect_left(waits, high):
            return False
        first = bisect.bisect_right(releases, low)
        if first < len(releases) and releases[first] < high and not _holds_nothing_more(node1, node2, releases[first]):
            return False
        return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)


def _holds_nothing_more(node1, node2, release: int) -> bool:
    """Whether fusing ``node1`` and ``node2`` across the release at position ``release`` allocates nothing before it
    that the unfused nodes allocated after it: every node of theirs placed after the release (the fused kernel
    runs it before) writes only buffers that exist already (in place) or that only the fused kernel reads (which
    Inductor then never allocates)."""
    nodes = (*node1.get_nodes(), *node2.get_nodes())
    fused = {n.get_name() for n in nodes}
    for n in nodes:
        if n.min_order < release:
            continue
        for buf in n.get_outputs():
            if buf.get_mutations() or buf.get_aliases():
                continue
            if not all(not use.is_weak and getattr(use.node, "get_name", None) is not None
                       and use.node.get_name() in fused for use in buf.users):
                return False
    return True


def _barrier_positions(scheduler) -> tuple[list[int], list[int]]:
    """The positions (``min_order``) of the waits and of the releases among the scheduler's nodes, ascending."""
    waits, releases = [], []
    for n in scheduler.nodes:
        op = getattr(getattr(n, "node", None), "op_overload", None)
        if op is not None and op.namespace == cache_ops.NAMESPACE and op._opname in KeepPlanOrder.BARRIERS:
            (waits if op._opname == "wait" else releases).append(n.min_order)
    return sorted(waits), sorted(releases)


Partition = Callable[..., tuple[torch.fx.GraphModule, torch.fx.GraphModule]]
"""``partition(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices, **kwargs)`` -> the
planned forward and backward (aot_autograd's ``partition_fn`` signature)."""


class PlannedPartition(CustomPartitionerFn):
    """The backend's partition, in the form Inductor's ``custom_partitioner_fn`` takes."""

    def __init__(self, partition: Partition) -> None:
        self.partition = partition

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        kwargs.pop("compiler", None)  # Inductor names itself; the default partition takes no such argument
        return self.partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        return "hyperoffload planned partition"

    def __deepcopy__(self, memo: dict) -> PlannedPartition:
        # Inductor copies its config to key its caches; the partition holds the backend, which stays one.
        return self

    def __reduce__(self):
        # Pickled into Inductor's cache keys as its name: a graph Inductor compiles is keyed by its own code,
        # which is the planned graph's (and aot_autograd's cache, which would skip planning, is off).
        return (str, (self.uuid(),))


def realize_before_releases(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the planned graph ``gm`` whose releases name what must be computed before them.

    Inductor computes a pointwise value inside the kernels that read it rather than where the graph
    defines it, so a value computed from a released storage and read after the release would read the
    storage after its release (a weight released right after an embedding gathers from it, say, while
    the embedding is still read three layers later). Each ``release(x)`` becomes
    ``release.live(x, live)``: ``live`` lists the tensors computed (directly or through other values)
    from ``x`` before the release and read after it. Inductor computes a fallback kernel's inputs
    before it, so later readers read those values, never ``x``. The values are live across the
    release anyway, so no tensor lives longer than in ``gm``. A value an earlier release named ends the
    search: Inductor stores it in a buffer of its own, and what is computed from it later reads that buffer,
    not the released storage (naming those too would make Inductor store more values on their own, in kernels
    that may round differently from the ones it would have fused them into).
    """
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:  # node_copy shares each node's meta (its fake values) with ``gm``'s
        env[n] = graph.node_copy(n, env.__getitem__)
    position = {n: i for i, n in enumerate(graph.nodes)}
    transfers = set(cache_ops.KIND_OPERATORS.values())
    stored: set[torch.fx.Node] = set()  # named by an earlier release: Inductor stores them, later readers read that
    for release in list(graph.find_nodes(op="call_function", target=cache_ops.RELEASE)):
        at = position[release]
        released = release.args[0]
        live, seen, stack = [], {released}, [released]
        while stack:
            for user in stack.pop().users:
                if (user in seen or user in stored or position[user] >= at or user.op != "call_function"
                        or user.target in transfers):
                    continue
                seen.add(user)
                stack.append(user)
                if isinstance(user.meta.get("val"), torch.Tensor) and any(position[u] > at for u in user.users):
                    live.append(user)
        stored.update(live)
        if not live:
            continue
        live.sort(key=position.__getitem__)
        with graph.inserting_before(release):
            new = graph.call_function(cache_ops.RELEASE_LIVE, (released, live))
        new.meta = dict(release.meta)
        position[new] = at
        release.replace_all_uses_with(new)
        graph.erase_node(release)
    graph.lint()
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def compile_planned(gm: torch.fx.GraphModule, example_inputs: Sequence, *, partition: Partition,
                    plan_inference: Callable[[torch.fx.GraphModule], torch.fx.GraphModule],
                    finish: Callable[[torch.fx.GraphModule, Callable], Callable],
                    settings: Mapping[str, Any] = PLANNED_GRAPH_CONFIG,
                    choices: Callable[[torch.fx.GraphModule], InductorChoices] | None = None) -> Callable:
    """Compile TorchDynamo's graph ``gm`` with Inductor, planned.

    ``partition`` plans a training step (aot_autograd's joint graph, after Inductor's joint-graph
    passes) and returns the lowered forward and backward; ``plan_inference(gm)`` plans and lowers an
    inference graph. ``finish(graph, compiled)`` gets each graph Inductor compiled (as lowered) and
    its compiled function (boxed: called with one list of inputs) and returns what runs in its place.
    ``settings``: the ``torch._inductor.config`` the planned graphs are compiled with; ``choices(graph)``: Inductor's
    heuristics for the lowered ``graph`` (``torch._inductor.virtualized.V.choices``; None: Inductor's own).
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: torch.fx.GraphModule, inputs: Sequence, **kwargs: Any):
        if kwargs.get("is_inference"):
            graph = plan_inference(graph)
            inputs = _as_placed(graph, inputs)
        from torch._inductor.virtualized import V

        heuristics, keyed = contextlib.nullcontext(), {}
        if choices is not None:
            # The handler is what Inductor asks; the config entry is what its caches key on (the instance's uuid).
            chosen = choices(graph)
            heuristics, keyed = V.set_choices_handler(chosen), {"inductor_choices_class": lambda: chosen}
        with config.patch({**settings, **keyed}), heuristics:
            compiled = compile_fx_inner(realize_before_releases(graph), inputs, **kwargs)
        return finish(graph, _boxed(compiled))

    # aot_autograd's cache would hand back graphs compiled for another backend (or budget) without planning.
    with config.patch(custom_partitioner_fn=PlannedPartition(partition)), \
            functorch_config.patch(enable_autograd_cache=False), _shape_context(example_inputs) as example_inputs:
        return compile_fx(gm, example_inputs, inner_compile=inner)


@contextlib.contextmanager
def _shape_context(example_inputs: Sequence):
    """A tracing context for a graph handed to Inductor outside TorchDynamo, yielding ``example_inputs`` as fake
    tensors of static shape in its fake mode.

    Inductor's FX graph cache keys on the tracing context's shape environment and bypasses graphs that have none
    (TorchDynamo always sets one up), so without it every process would compile the same step again. The inputs
    are made fake here with static shapes, as aot_autograd would otherwise make them symbolic in that
    environment. Under TorchDynamo's own context, nothing changes."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if TracingContext.try_get() is not None:
        yield example_inputs
        return
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    fake = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with tracing(TracingContext(mode)):
        yield fake


def _as_placed(graph: torch.fx.GraphModule, inputs: Sequence) -> list:
    """``inputs`` with each tensor on the device ``graph``'s placeholder says (the lowering puts a GPU input that
    starts the step in remote memory in host memory, where the caller keeps it)."""
    placed = list(inputs)
    for i, node in enumerate(graph.graph.find_nodes(op="placeholder")):
        val = node.meta.get("val")
        if i < len(placed) and isinstance(val, torch.Tensor) and isinstance(placed[i], torch.Tensor) \
                and val.device != placed[i].device:
            placed[i] = val
    return placed


def _boxed(compiled: Callable) -> Callable:
    """``compiled`` (Inductor's output: called with one list of inputs, which it empties as it drops each
    input after its last use) as a plain function marked boxed (``_boxed_call``)."""

    def run(args: list):
        return compiled(args)

    run._boxed_call = True
    return run


__all__ = ["KeepPlanOrder", "PLANNED_GRAPH_CONFIG", "PlannedPartition", "compile_planned",
           "realize_before_releases"]
