"""Per-op rules for FLOPs and bytes moved, in a registry with a default.

A rule receives an ``OpCall`` (the op's example input and output tensors, real or
fake) and returns the op's FLOPs. Bytes are not per-op: an op reads its tensor
inputs and writes its tensor outputs, except pure view ops, which move nothing.
Matrix products and attention use ``torch.utils.flop_counter``'s formulas where
they exist (a multiply-add counts 2 FLOPs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.flop_counter as flop_counter


@dataclass(frozen=True, slots=True)
class OpCall:
    """An op applied to example tensors: what a FLOP rule may look at."""

    target: str
    """Overload packet name, e.g. ``"aten.mm"``."""
    args: tuple
    """Positional arguments with tensors (real or fake) in place of graph nodes."""
    kwargs: dict
    inputs: tuple[torch.Tensor, ...]
    """The tensors read, without repeats."""
    outputs: tuple[torch.Tensor, ...]
    """The tensors produced."""
    argument_names: tuple[str, ...] = ()
    """Names of the op schema's arguments, in order (to read an argument by name)."""
    result: Any = None
    """The op's result as it returned it: a tensor, or a tuple holding None at each optional output the op did
    not compute (``convolution_backward`` without the input's gradient). None when not given: then ``outputs``
    (one tensor, or a tuple of them) stands for it."""

    def returned(self) -> Any:
        """The op's result, position for position as the op returns it (what torch's FLOP formulas take)."""
        if self.result is not None:
            return self.result
        return self.outputs[0] if len(self.outputs) == 1 else self.outputs

    def argument(self, name: str, default=None):
        """The argument called ``name``, whether passed by position or keyword."""
        if name in self.argument_names:
            index = self.argument_names.index(name)
            if index < len(self.args):
                return self.args[index]
        return self.kwargs.get(name, default)


FlopRule = Callable[[OpCall], int]
_RULES: dict[str, FlopRule] = {}


def register_flop_rule(*targets: str) -> Callable[[FlopRule], FlopRule]:
    """Register ``rule`` for the named overload packets (``"aten.mm"``); later registrations win."""

    def wrap(rule: FlopRule) -> FlopRule:
        for t in targets:
            _RULES[t] = rule
        return rule

    return wrap


def default_flops(call: OpCall) -> int:
    """One FLOP per element of the largest tensor the op touches (pointwise ops and reductions)."""
    return max((t.numel() for t in (*call.inputs, *call.outputs)), default=0)


def count_flops(call: OpCall) -> int:
    """FLOPs of ``call`` by its registered rule, or by ``default_flops``."""
    return int(_RULES.get(call.target, default_flops)(call))


# Data movement: these copy or gather bytes and do no arithmetic worth counting.
register_flop_rule(
    "aten.clone", "aten._to_copy", "aten.copy", "aten.copy_", "aten.cat", "aten.stack", "aten.index_copy",
    "aten.index_copy_", "aten.index_select", "aten.index", "aten.index_put", "aten.index_put_", "aten.embedding",
    "aten.slice_scatter", "aten.select_scatter", "aten.slice_backward", "aten.select_backward", "aten.zeros",
    "aten.zeros_like", "aten.ones", "aten.ones_like", "aten.empty", "aten.empty_like", "aten.full", "aten.full_like",
    "aten.arange", "aten.new_zeros", "aten.new_ones", "aten.new_empty", "aten.fill", "aten.fill_", "aten.zero_",
    "aten.scalar_tensor", "aten.lift_fresh_copy", "aten.gather", "aten.scatter", "aten.repeat",
    "aten.repeat_interleave", "aten.constant_pad_nd", "aten.where", "aten._unsafe_view",
)(lambda call: 0)


def _torch_formula(name: str) -> FlopRule:
    """torch's formula for ``name``: it reads outputs by their position in the op's result (``out_val``), so it is
    handed the result as returned, None at each output not computed, never the tensors alone."""
    packet = getattr(torch.ops.aten, name.removeprefix("aten."))
    formula = flop_counter.flop_registry[packet]
    return lambda call: formula(*call.args, out_val=call.returned(), **call.kwargs)


for _name in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution", "aten.convolution_backward"):
    register_flop_rule(_name)(_torch_formula(_name))


def _attention_flops(query: torch.Tensor, key: torch.Tensor, causal: bool) -> int:
    """QK^T and PV products: 2 matmuls of b*h*s_q*s_k*d multiply-adds; a causal mask halves the work."""
    *batch, s_q, d = query.shape
    s_k = key.shape[-2]
    b_h = 1
    for n in batch:
        b_h *= n
    flops = 2 * 2 * b_h * s_q * s_k * d
    return flops // 2 if causal and s_q == s_k else flops


@register_flop_rule("aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
                    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention")
def sdpa_forward_flops(call: OpCall) -> int:
    return _attention_flops(call.argument("query"), call.argument("key"), bool(call.argument("is_causal", False)))


@register_flop_rule("aten._scaled_dot_product_flash_attention_for_cpu_backward",
                    "aten._scaled_dot_product_flash_attention_backward",
                    "aten._scaled_dot_product_efficient_attention_backward",
                    "aten._scaled_dot_product_cudnn_attention_backward")
def sdpa_backward_flops(call: OpCall) -> int:
    """Backward recomputes QK^T and runs 4 more products: 2.5x the forward."""
    forward = _attention_flops(call.argument("query"), call.argument("key"), bool(call.argument("is_causal", False)))
    return forward * 5 // 2


# Arguments some kernels write in place although their schema does not mark them written (``Tensor?`` rather
# than ``Tensor(a!)``): eager batch norm in training updates its running statistics in place. Per op: the
# flag argument that must be true for the write, and the arguments written.
_UNDECLARED_WRITES: dict[str, tuple[str, tuple[str, ...]]] = {
    name: ("training", ("running_mean", "running_var"))
    for name in ("aten.native_batch_norm", "aten.cudnn_batch_norm", "aten.miopen_batch_norm",
                 "aten._batch_norm_impl_index")
}


def undeclared_writes(call: OpCall) -> tuple[str, ...]:
    """Names of the arguments ``call`` writes in place that its schema does not declare written."""
    rule = _UNDECLARED_WRITES.get(call.target)
    if rule is None:
        return ()
    flag, written = rule
    return written if call.argument(flag, False) else ()


def tensors_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the elements of ``tensors`` (numel x element size), summed."""
    return sum(t.numel() * t.element_size() for t in tensors)


# Indexed reads and in-place indexed writes touch only the rows they select, not the whole tensor
# indexed: a decode step's gather of KV blocks or write of one token's row must not be charged the
# whole cache's bytes (the memory-bound roofline would otherwise count gigabytes per layer).
_GATHERS = frozenset({"aten.index", "aten.index_select", "aten.gather", "aten.embedding"})
_INPLACE_SCATTERS = {"aten.index_copy_": "source", "aten.index_put_": "values", "aten.scatter_": "src"}


def count_bytes(call: OpCall) -> tuple[int, int]:
    """(bytes read, bytes written) of device memory by ``call``: every input read and every output
    written, except that a gather reads only what it returns (plus its indices) and an in-place
    indexed write reads and writes only the rows it writes (plus its indices)."""
    index_bytes = sum(t.numel() * t.element_size() for t in call.inputs if not t.is_floating_point())
    if call.target in _GATHERS:
        out = tensors_bytes(call.outputs)
        return out + index_bytes, out
    if call.target in _INPLACE_SCATTERS:
        rows = call.argument(_INPLACE_SCATTERS[call.target])
        if isinstance(rows, torch.Tensor):
            written = tensors_bytes((rows,))
            return written + index_bytes, written
    return tensors_bytes(call.inputs), tensors_bytes(call.outputs)


@register_flop_rule("aten._grouped_mm")
def grouped_mm_flops(call: OpCall) -> int:
    """A grouped matmul (mixture-of-experts layers): each row of ``self`` meets one group's matrix, so the
    work is that of one (rows x k) @ (k x n) product. ``self`` and ``mat2`` both 2-D with a 3-D result is
    the weight-gradient form, where the groups split the contraction instead."""
    a, b = call.argument("self"), call.argument("mat2")
    out = call.outputs[0]
    if a.dim() == 2 and b.dim() == 2 and out.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out.numel() * a.shape[-1]


@register_flop_rule("transformers.grouped_mm_fallback")
def grouped_mm_fallback_flops(call: OpCall) -> int:
    """transformers' grouped matmul fallback: ``input`` (rows, k) sorted by expert, each row times its expert's
    (k, n) matrix of ``weight`` (experts, k, n)."""
    x, weight = call.argument("input"), call.argument("weight")
    return 2 * x.shape[0] * x.shape[1] * weight.shape[2]


@register_flop_rule("transformers.grouped_mm_fallback_backward")
def grouped_mm_fallback_backward_flops(call: OpCall) -> int:
    """Gradients of the input and of the expert weights: two products the size of the forward's."""
    x, weight = call.argument("input"), call.argument("weight")
    return 2 * 2 * x.shape[0] * x.shape[1] * weight.shape[2]
