"""Compile planned graphs with Inductor: the route ``torch.compile(model)`` takes, with the plan's partition.

``compile_planned`` runs ``torch._inductor.compile_fx.compile_fx`` on a TorchDynamo graph, so the
decompositions, the joint-graph passes, the forward and backward compilers and the inference
compiler are plain Inductor's; only the partition is the backend's (``partition``: the default
partition, planned and lowered, see ``hyperoffload.compile.backend``), handed to Inductor as its
``custom_partitioner_fn``. An inference graph, which is never partitioned, is planned by ``inner``
just before Inductor compiles it. The cache operators survive Inductor as fallback kernels: they
are side-effectful (``torch.fx.node.has_side_effect``, which Inductor's ``FallbackKernel`` reads), so
nothing drops them, and their data dependencies (a wait's result is what its readers read) order them.

Inductor compiles the planned graphs with ``PLANNED_GRAPH_CONFIG``: the plan already fixes the order
of compute and transfers, so Inductor's reordering passes (for peak memory, for locality) would
undo it, and a copy runs asynchronously on the link's engines while compute goes on, so Inductor
must not reuse a buffer (or write a result into an input's buffer) that a copy may still be reading
or writing. Neither changes what the kernels compute: results equal ``torch.compile(model)``'s with
nothing offloaded, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

PLANNED_GRAPH_CONFIG = {
    "reorder_for_peak_memory": False,  # the plan's order is already the memory schedule
    "reorder_for_locality": False,
    "allow_buffer_reuse": False,  # an asynchronous copy may still read or write the buffer
    "inplace_buffers": False,
}
"""``torch._inductor.config`` settings every planned graph is compiled with (see the module docstring)."""

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


def compile_planned(gm: torch.fx.GraphModule, example_inputs: Sequence, *, partition: Partition,
                    plan_inference: Callable[[torch.fx.GraphModule], torch.fx.GraphModule],
                    finish: Callable[[torch.fx.GraphModule, Callable], Callable]) -> Callable:
    """Compile TorchDynamo's graph ``gm`` with Inductor, planned.

    ``partition`` plans a training step (aot_autograd's joint graph, after Inductor's joint-graph
    passes) and returns the lowered forward and backward; ``plan_inference(gm)`` plans and lowers an
    inference graph. ``finish(graph, compiled)`` gets each graph Inductor compiled (as lowered) and
    its compiled function (boxed: called with one list of inputs) and returns what runs in its place.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: torch.fx.GraphModule, inputs: Sequence, **kwargs: Any):
        if kwargs.get("is_inference"):
            graph = plan_inference(graph)
        with config.patch(PLANNED_GRAPH_CONFIG):
            compiled = compile_fx_inner(graph, inputs, **kwargs)
        return finish(graph, _boxed(compiled))

    # aot_autograd's cache would hand back graphs compiled for another backend (or budget) without planning.
    with config.patch(custom_partitioner_fn=PlannedPartition(partition)), \
            functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner)


def _boxed(compiled: Callable) -> Callable:
    """``compiled`` (Inductor's output: called with one list of inputs, which it empties) as a function
    of positional inputs."""

    def run(*args):
        return compiled(list(args))

    return run


__all__ = ["PLANNED_GRAPH_CONFIG", "compile_planned"]
