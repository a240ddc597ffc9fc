"""Where a compiled graph's inputs lie in their storages: as planned, whatever the caller passes.

A plan moves whole storages, and the lowered graph rebuilds every view of a transferred storage
from its fake tensor's size, stride and storage offset (``hyperoffload.lower``). For a storage
the step allocates, the fake tensors say exactly where each view lies. For a graph input they
say where the tensor lay when the graph was traced, and TorchDynamo and aot_autograd fix only an
input's size and stride, not its storage offset or the size of the storage it lives in:

* a tangent is traced as a detached alias of its forward output, so it views whatever storage
  the output views (a sliding-window KV cache's last rows: a view at storage offset 208 of a
  1024-element storage). At run time it is what autograd hands the backward, re-strided by
  aot_autograd with ``torch.empty_strided`` when its strides differ: storage offset 0, a storage
  just large enough. ``compact_tangents`` plans every tangent laid out that way;
* a primal is the caller's tensor: a later call may pass a tensor of the same size and stride
  that lies elsewhere in another storage, and TorchDynamo reuses the graph.

A transfer of such an input would copy a storage of another size, and the views rebuilt on the
copy would read the wrong elements or lie outside it. ``planned_layouts`` records, for each
input whose storage the plan moves, the layout it was planned with, and ``with_planned_layouts``
runs the graph on a copy of any input laid out otherwise (copying it back into the caller's
tensor if the step updates it in place). Inputs the plan does not move are passed as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from hyperoffload.capture.graph_to_program import CaptureError
from hyperoffload.instructions import COPIES
from hyperoffload.ir import Program
from hyperoffload.plans import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class InputLayout:
    """Where a graph input lay in its storage when its plan was made."""

    storage_offset: int
    """Elements of the input's dtype before its first element in its storage."""
    storage_bytes: int
    """Bytes of the whole storage the input lives in (what a transfer of it copies)."""
    written: bool
    """Whether the step updates the input's storage in place, so a copy's contents go back to the caller."""

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` lies in its storage as planned (its size and stride are TorchDynamo's to check)."""
        return x.storage_offset() == self.storage_offset and x.untyped_storage().nbytes() == self.storage_bytes

    def relaid(self, x: torch.Tensor) -> torch.Tensor:
        """A copy of ``x`` with ``x``'s size and stride, laid out as planned in a storage of its own."""
        storage = torch.empty(self.storage_bytes, dtype=torch.uint8, device=x.device).untyped_storage()
        with torch.no_grad():
            copy = x.new_empty(0).set_(storage, self.storage_offset, x.size(), x.stride())
            return copy.copy_(x)


def propagate_fake_values(gm: torch.fx.GraphModule) -> None:
    """Give every node of ``gm`` a fake tensor in ``meta["val"]`` by running it on its placeholders' fake
    tensors (the nodes' own fakes are replaced; the placeholders' are kept)."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(inputs)
    if mode is None:
        raise CaptureError("the graph's inputs carry no fake tensors to propagate; use graphs traced by aot_autograd")
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


def _is_compact(x: torch.Tensor) -> bool:
    """Whether ``x`` starts its storage and the storage ends with its last element (``torch.empty_strided``'s
    layout)."""
    if x.storage_offset() != 0:
        return False
    span = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride())) if x.numel() else 0
    return x.untyped_storage().nbytes() == span * x.element_size()


def compact_tangents(gm: torch.fx.GraphModule, tangents: Sequence[str]) -> None:
    """Lay each placeholder of ``gm`` named in ``tangents`` out as aot_autograd makes a tangent it re-strides
    (``torch.empty_strided`` of its size and stride: storage offset 0, a storage of its own just large
    enough), and propagate the new fake tensors to every node of ``gm``. A graph whose tangents are all
    laid out so already is left as it is."""
    names = set(tangents)
    changed = False
    for n in gm.graph.find_nodes(op="placeholder"):
        val = n.meta.get("val")
        if n.name not in names or not isinstance(val, torch.Tensor) or _is_compact(val):
            continue
        with val.fake_mode:
            n.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device,
                                                requires_grad=val.requires_grad)
        changed = True
    if changed:
        propagate_fake_values(gm)


def moved_storages(plan: Plan) -> set[int]:
    """Storages a plan transfers: the ones it copies (``instructions.COPIES``: offloads and prefetches), and those it
    keeps remote at the start."""
    moved = {i.target for i in plan.instructions if i.kind in COPIES}
    return moved | set(plan.initial_remote)


def planned_layouts(gm: torch.fx.GraphModule, plan: Plan) -> tuple[InputLayout | None, ...]:
    """For each placeholder of ``gm`` (a graph lowered from ``plan``, or a part of one), the layout it was
    planned with if it is a step input whose storage the plan moves; None for the others, which may lie
    anywhere (a value the forward saves for the backward crosses as the tensor the forward made)."""
    program: Program = plan.program
    inputs = set(program.inputs)
    moved = moved_storages(plan)
    written = {program.values[v].storage for op in program.ops for v in op.mutates}
    layouts: list[InputLayout | None] = []
    for n in gm.graph.find_nodes(op="placeholder"):
        vid = program.node_values.get(n.name)
        val = n.meta.get("val")
        storage = program.values[vid].storage if vid in inputs else None
        if storage not in moved or not isinstance(val, torch.Tensor):
            layouts.append(None)
            continue
        layouts.append(InputLayout(storage_offset=int(val.storage_offset()),
                                   storage_bytes=int(val.untyped_storage().nbytes()), written=storage in written))
    return tuple(layouts)


def with_planned_layouts(gm: Callable, layouts: Sequence[InputLayout | None]) -> Callable:
    """``gm`` as a boxed function (called with a list of its inputs) that first copies each input whose layout
    differs from ``layouts`` into one laid out as planned, and after the call copies every such copy the step
    updates in place back into the caller's tensor. ``gm`` is called with its inputs as arguments, or, if it is
    boxed itself (``gm._boxed_call``, as Inductor's compiled graphs are), with a list of them, which it may
    empty to drop each input after its last use; the caller's list is emptied first, so that holds nothing."""
    checked = [(i, layout) for i, layout in enumerate(layouts) if layout is not None]
    boxed = getattr(gm, "_boxed_call", False)
    if not checked and boxed:
        return gm  # nothing to relay: no per-call wrapper

    def run(args: list) -> object:
        written: list[tuple[torch.Tensor, torch.Tensor]] = []
        inputs = None
        for i, layout in checked:
            x = args[i]
            if not isinstance(x, torch.Tensor) or layout.fits(x):
                continue
            inputs = list(args) if inputs is None else inputs
            inputs[i] = layout.relaid(x)
            if layout.written:
                written.append((x, inputs[i]))
        if boxed:
            inputs = list(args) if inputs is None else inputs
            args.clear()
            out = gm(inputs)
        else:
            out = gm(*(args if inputs is None else inputs))
        for x, copy in written:
            with torch.no_grad():
                x.copy_(copy)
        return out

    run._boxed_call = True  # aot_autograd's calling convention: one list of inputs
    return run


__all__ = ["InputLayout", "compact_tangents", "moved_storages", "planned_layouts",
           "propagate_fake_values", "with_planned_layouts"]
