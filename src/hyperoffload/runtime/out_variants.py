"""``out=`` variants: how an op writes its one new storage straight into its arena slot.

An op that makes one new storage and has an ``out=`` overload with the same arguments (``mm.out`` for ``mm``,
``mul.out`` for ``mul.Tensor``) writes into its slot, as a view with the size and strides the capture recorded;
other ops allocate through PyTorch and their result is copied into the slot.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
"""Device type -> the dispatch key an ``out=`` kernel must be registered under to write into its ``out``."""


def _copy_into(self: torch.Tensor, *, out: torch.Tensor, dtype=None, layout=None, device=None, pin_memory=None,
               non_blocking: bool = False, memory_format=None) -> torch.Tensor:
    """``_to_copy`` or ``clone`` of ``self`` written into ``out`` (laid out as the captured result). Only a
    strided copy on ``self``'s own device: anything else raises, and the executor runs the op as captured."""
    target = None if device is None else torch.device(device)
    if layout not in (None, torch.strided) or pin_memory or (target is not None and (
            target.type != self.device.type or target.index not in (None, self.device.index))):
        raise RuntimeError("not a strided copy on the source's device")
    return out.copy_(self)


_WRITTEN_INTO_OUT: dict[Any, tuple[Any, str]] = {
    torch.ops.aten._to_copy.default: (_copy_into, "out"),
    torch.ops.aten.clone.default: (_copy_into, "out"),
    torch.ops.aten.mul.Scalar: (torch.ops.aten.mul.out, "out"),
    torch.ops.aten.div.Scalar: (torch.ops.aten.div.out, "out"),
}
"""Ops whose result the arena writes into its slot some other way than through their own ``out=`` overload."""


@functools.cache
def out_variant(target, device_type: str = "cpu") -> tuple[Any, str] | None:
    """The ``out=`` overload of aten overload ``target`` that takes the same arguments (names and types) and has a
    kernel of its own on ``device_type``, and the name of its one out argument; None if it has none (``mm.default``
    -> ``mm.out``, ``mul.Tensor`` -> ``mul.out``, ``silu_backward.default`` -> ``silu_backward.grad_input``).

    An ``out=`` overload with only a composite kernel (``mul.Scalar_out``, ``clone.out``) runs the op as usual and
    copies its result into ``out``: it would allocate outside the arena all the same, so it does not count.
    Instead, ``_to_copy`` and ``clone`` write with ``copy_`` (what both do once they have allocated), and
    ``mul.Scalar`` and ``div.Scalar`` with the tensor overload's ``out=`` kernel, which they call with the scalar
    wrapped (``_WRITTEN_INTO_OUT``): the same bytes without the allocation. The largest of these in a LLaMA step,
    the logits' upcast to float32, is one of the step's largest blocks, which a bf16 step on a GPU held outside
    its arena before (docs/results.md, "Measured on an H200")."""
    written = _WRITTEN_INTO_OUT.get(target)
    if written is not None:
        overload, out_name = written
        key = _DISPATCH_KEYS.get(device_type)
        has_kernel = overload is _copy_into or (
            key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key))
        return (overload, out_name) if has_kernel else None
    packet = getattr(target, "overloadpacket", None)
    schema = getattr(target, "_schema", None)
    key = _DISPATCH_KEYS.get(device_type)
    if packet is None or schema is None or key is None:
        return None
    name = target._overloadname
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    for candidate in dict.fromkeys(("out" if name == "default" else f"{name}_out", "out", *packet.overloads())):
        if candidate not in packet.overloads():
            continue
        overload = getattr(packet, candidate)
        outs = [a for a in overload._schema.arguments if a.is_out]
        ins = [(a.name, str(a.type)) for a in overload._schema.arguments if not a.is_out]
        if len(outs) == 1 and ins == wanted and torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key):
            return overload, outs[0].name
    return None
