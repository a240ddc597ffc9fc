"""Capture a training or inference step of an ``nn.Module`` as a Program.

Each capture builds a plain step function over a flat list of tensors, traces it
with ``make_fx`` in fake mode (so no memory is allocated by tracing, and models
built under ``fake_build`` never allocate any), and converts the graph. The
returned ``Captured`` also holds the step function, so a test or a user can run
the same step eagerly and compare.

Steps:

* train: forward, loss, ``torch.autograd.grad``, then an in-place AdamW update of
  every trainable parameter (moments in float32; an optional float32 master copy).
  Gradients are freed after their update, as a compiled step would.
* prefill: a forward pass under ``no_grad`` returning the model output. The model's
  train/eval mode is used as given: call ``model.eval()`` first to leave dropout out.
* decode: one new token per sequence against a KV cache passed in as input and
  updated in place (models that implement ``new_cache`` and take ``cache`` and
  ``start`` in ``forward``, like the built-in LLaMA).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyperoffload.capture.graph_to_program import CaptureError, program_from_graph
from hyperoffload.capture.tags import mark_phase, tag_values
from hyperoffload.ir import Phase, Program, ValueKind


MAX_STEP_TOKENS = 2**32
"""The most tokens (sequences x tokens each) one captured step may hold: about 250 times the largest published
training batches (16M tokens), and small enough that no activation's element count overflows 64 bits."""


def check_step_tokens(batch: int, tokens_per_sequence: int, flag: str) -> None:
    """Refuse a step of more than ``MAX_STEP_TOKENS`` tokens, naming ``--batch`` and ``--<flag>``: tracing it
    would fail inside torch on sizes that overflow (real tensors) or plan a step no device runs (fake ones)."""
    tokens = batch * tokens_per_sequence
    if tokens > MAX_STEP_TOKENS:
        raise CaptureError(f"batch x {flag} is {tokens:,} tokens in one step, more than {MAX_STEP_TOKENS:,}: no real "
                           f"step is that large; give a smaller --batch or --{flag}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamW:
    """AdamW hyper-parameters (PyTorch's defaults, decoupled weight decay)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    master_weights: bool = False
    """Keep a float32 master copy of each low-precision parameter and update that."""


@dataclass(frozen=True, slots=True)
class Captured:
    """A captured step: the Program, example inputs in ``program.inputs`` order, and the eager step.

    ``step(*inputs)`` runs the same computation eagerly (mutating optimizer state,
    parameters and KV caches in place, as the graph does). For a fake capture the
    inputs are fake tensors and can only be inspected.
    """

    program: Program
    inputs: tuple[torch.Tensor, ...]
    step: Callable[..., Any] = field(repr=False)
    capture_s: float = 0.0
    """Wall time the trace and conversion took (seconds)."""


def lm_loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    """Default loss: cross-entropy of logits against integer targets, MSE against float targets,
    or the mean of the output when there is no target. Logits are read from ``output.logits``,
    ``output[0]`` or ``output`` itself, and cast to float32 first."""
    if hasattr(output, "logits"):
        output = output.logits
    elif isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise CaptureError(f"the model returned {type(output).__name__}; pass loss_fn= to turn it into a loss")
    if target is None:
        return output.float().mean()
    if target.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())
    # Written out rather than F.mse_loss: its CPU kernel returns a 0-d view of a buffer the size of the
    # input, which would make the real live bytes differ from what the fake trace records.
    return (output.float() - target.float()).pow(2).mean()


def adamw_update(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                 masters: Sequence[torch.Tensor] | None, step: torch.Tensor, cfg: AdamW) -> None:
    """One AdamW step in place. ``step`` is a float32 scalar tensor, so one graph serves every step."""
    beta1, beta2 = cfg.betas
    step.add_(1)
    step_size = cfg.lr / (1 - torch.pow(beta1, step))
    bias_correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
    for i, (param, grad) in enumerate(zip(params, grads)):
        if grad is None:
            continue  # as torch.optim does for parameters that got no gradient
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        weights = masters[i] if masters is not None else param
        grad = grad.to(exp_avg.dtype)
        weights.mul_(1 - cfg.lr * cfg.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
        update = (exp_avg / denom).mul_(step_size)
        weights.sub_(update.to(weights.dtype))
        if masters is not None:
            param.copy_(weights)


@contextlib.contextmanager
def recurrent_layers_without_onednn(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s recurrent layers (``nn.RNNBase``: LSTM, GRU, RNN) run without oneDNN.

    In training, oneDNN's CPU LSTM layer (``aten.mkldnn_rnn_layer``) keeps a workspace for its backward whose size
    only the kernel knows: the fake kernel states it empty, so a captured step would hold bytes its Program does
    not count, and a planned run would exceed its budget. Without oneDNN the layer is traced as the plain ops it
    runs (matrix products and pointwise gates), every byte counted, and the eager step runs the same kernels.
    Other layers (convolutions) keep oneDNN: the flag is off only while a recurrent layer's forward runs."""
    layers = [m for m in model.modules() if isinstance(m, nn.RNNBase)]
    enabled = torch.backends.mkldnn.enabled
    if not layers or not enabled:
        yield
        return
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(lambda *_: torch._C._set_mkldnn_enabled(False)))
        handles.append(layer.register_forward_hook(lambda *_: torch._C._set_mkldnn_enabled(enabled)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        torch._C._set_mkldnn_enabled(enabled)


def _split_state(model: nn.Module):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    buffers = list(model.named_buffers())
    return trainable, frozen, buffers


def trace_step(step: Callable, flat: Sequence[torch.Tensor], kinds: Sequence[ValueKind], input_names: Sequence[str], *,
               name: str, mode: str, meta: dict, remote_inputs: Sequence[int] = (),
               fetch_fraction: float = 1.0) -> Captured:
    """Trace ``step(*flat)`` into a Program: ``kinds`` and ``input_names`` per input, ``remote_inputs`` the
    indices of inputs that live in remote memory, ``fetch_fraction`` the share of selected blocks a pooled
    fetch moves (``program_from_graph``)."""
    start = time.perf_counter()
    flat = _own_storages(flat)
    try:
        gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)
    except CaptureError:
        raise
    except Exception as error:  # tracing runs arbitrary model code; report it as a capture problem
        raise CaptureError(
            f"tracing the {mode} step of {name} failed: {type(error).__name__}: {error}. The model must run "
            f"on the example inputs with static shapes and no data-dependent Python control flow") from error
    program = program_from_graph(gm, kinds, name=name, mode=mode, input_names=input_names, meta=meta,
                                 remote_inputs=remote_inputs, fetch_fraction=fetch_fraction)
    return Captured(program=program, inputs=tuple(flat), step=step, capture_s=time.perf_counter() - start)


def _own_storages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each input in a storage of its own and of its own size: copies of inputs that share a buffer
    with another input or view part of a larger one. The Program holds each input's storage for the
    whole step; a shared or larger buffer would be counted differently from separate tensors."""
    seen: set[int] = set()
    result = []
    for t in tensors:
        storage = t.untyped_storage()
        whole = t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        if storage._cdata in seen or not whole:
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage()._cdata)
        result.append(t)
    return result


def _batch(args: Any, kwargs: dict | None) -> tuple[list[torch.Tensor], Any, list[Any]]:
    leaves, spec = tree_flatten((tuple(args) if isinstance(args, (tuple, list)) else (args,), dict(kwargs or {})))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    return tensors, spec, leaves


def _batch_names(count: int) -> list[str]:
    return ["batch"] if count == 1 else [f"batch.{i}" for i in range(count)]


def _rebuild(spec, leaves: list[Any], tensors: Sequence[torch.Tensor]):
    it = iter(tensors)
    return tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def capture_train_step(model: nn.Module, args: Any, target: torch.Tensor | None = None, *,
                       kwargs: dict | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] = lm_loss,
                       optimizer: AdamW = AdamW(), name: str | None = None, meta: dict | None = None) -> Captured:
    """Capture forward, loss, backward and an AdamW update of ``model`` on one batch.

    ``args``/``kwargs`` are the model's example inputs, ``target`` what ``loss_fn(output, target)``
    compares against. Optimizer state starts at zero (the first step); its tensors are inputs of the
    Program, so the same graph runs every later step.
    """
    trainable, frozen, buffers = _split_state(model)
    if not trainable:
        raise CaptureError("the model has no parameters with requires_grad=True; nothing to train")
    batch, spec, leaves = _batch(args, kwargs)
    targets = [target] if target is not None else []
    moment_dtype = torch.float32
    exp_avgs = [torch.zeros_like(p, dtype=moment_dtype) for _, p in trainable]
    exp_avg_sqs = [torch.zeros_like(p, dtype=moment_dtype) for _, p in trainable]
    masters = [p.detach().to(torch.float32, copy=True) for _, p in trainable] if optimizer.master_weights else []
    step_count = trainable[0][1].new_zeros((), dtype=torch.float32)  # fake when the model is fake
    groups = [[p.detach() for _, p in trainable], [p.detach() for _, p in frozen], [b for _, b in buffers],
              exp_avgs, exp_avg_sqs, masters, [step_count], batch, targets]
    kinds = [ValueKind.PARAMETER] * (len(trainable) + len(frozen) + len(buffers)) + [ValueKind.OPTIMIZER_STATE] * (
        2 * len(trainable) + len(masters) + 1) + [ValueKind.INPUT] * (len(batch) + len(targets))
    sizes = [len(g) for g in groups]
    names = [n for n, _ in trainable] + [n for n, _ in frozen] + [n for n, _ in buffers]

    def make_step(accumulate: bool) -> Callable[..., torch.Tensor]:
        """The step; ``accumulate``: gradients by ``loss.backward()`` into the leaves' ``.grad`` rather than by
        ``torch.autograd.grad`` (reentrant activation checkpointing supports only the former)."""
        return lambda *flat: step(*flat, accumulate=accumulate)

    def step(*flat: torch.Tensor, accumulate: bool) -> torch.Tensor:
        parts, at = [], 0
        for size in sizes:
            parts.append(list(flat[at:at + size]))
            at += size
        params, frozen_t, buffers_t, m, v, w, (count,), batch_t, target_t = parts
        call_args, call_kwargs = _rebuild(spec, leaves, batch_t)
        leaves_t = [p.detach().requires_grad_() for p in params]
        state = dict(zip(names, [*leaves_t, *frozen_t, *buffers_t]))
        # The step's tensors stand in for the model's own through the backward as well as the forward (what
        # ``functional_call`` does for the forward alone): activation checkpointing runs the forward again
        # during the backward, and must read the step's parameters there, not the model's.
        with (torch.enable_grad(), _reparametrize_module(model, state, tie_weights=True, strict=False),
              recurrent_layers_without_onednn(model)):
            output = model(*call_args, **call_kwargs)
            loss = loss_fn(output, target_t[0] if target_t else None)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise CaptureError("loss_fn must return a single-element tensor")
            mark_phase(Phase.BACKWARD)
            if accumulate:
                loss.backward()
                grads = tuple(leaf.grad for leaf in leaves_t)
            else:
                grads = torch.autograd.grad(loss, leaves_t, allow_unused=True)
        tag_values(grads, ValueKind.GRADIENT)
        mark_phase(Phase.OPTIMIZER)
        with torch.no_grad():
            adamw_update(params, grads, m, v, w or None, count, optimizer)
        return loss.detach()

    flat = [t for g in groups for t in g]
    trained = [n for n, _ in trainable]
    input_names = [*names, *(f"exp_avg:{n}" for n in trained), *(f"exp_avg_sq:{n}" for n in trained),
                   *(f"master:{n}" for n in trained[:len(masters)]), "adamw_step",
                   *_batch_names(len(batch)), *(["target"] if targets else [])]
    info = {"mode": "train", "optimizer": "adamw", "master_weights": optimizer.master_weights, **(meta or {})}
    name = name or type(model).__name__
    try:
        return trace_step(make_step(False), flat, kinds, input_names, name=name, mode="train", meta=info)
    except CaptureError as error:
        if not _needs_backward_call(error):
            raise
    return trace_step(make_step(True), flat, kinds, input_names, name=name, mode="train", meta=info)


def _needs_backward_call(error: CaptureError) -> bool:
    """Whether tracing failed because the model checkpoints activations reentrantly
    (``checkpoint(..., use_reentrant=True)``), which refuses ``torch.autograd.grad`` and needs ``.backward()``."""
    cause = error.__cause__
    return isinstance(cause, RuntimeError) and "use_reentrant=True" in str(cause) and ".grad()" in str(cause)


def capture_prefill_step(model: nn.Module, args: Any, *, kwargs: dict | None = None, name: str | None = None,
                         meta: dict | None = None) -> Captured:
    """Capture one forward pass of ``model`` without gradients (the prefill of inference)."""
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    batch, spec, leaves = _batch(args, kwargs)
    names = [n for n, _ in params] + [n for n, _ in buffers]
    n_state = len(names)

    def step(*flat: torch.Tensor):
        call_args, call_kwargs = _rebuild(spec, leaves, flat[n_state:])
        with torch.no_grad():
            output = functional_call(model, dict(zip(names, flat[:n_state])), call_args, call_kwargs)
        return output.logits if hasattr(output, "logits") else output

    flat = [p.detach() for _, p in params] + [b for _, b in buffers] + batch
    kinds = [ValueKind.PARAMETER] * n_state + [ValueKind.INPUT] * len(batch)
    return trace_step(step, flat, kinds, [*names, *_batch_names(len(batch))], name=name or type(model).__name__,
                  mode="prefill",
                  meta={"mode": "prefill", **(meta or {})})


def capture_decode_step(model: nn.Module, tokens: torch.Tensor, context: int, *, name: str | None = None,
                        meta: dict | None = None, cache: Any = None, cache_names: Sequence[str] | None = None,
                        remote: Sequence[int] = (), fetch_fraction: float = 1.0) -> Captured:
    """Capture one decode step: ``tokens`` (batch, 1) at position ``context`` of a KV cache that
    holds ``context`` earlier tokens. The cache (from ``model.new_cache(batch, context + 1)``, or ``cache``,
    any pytree of tensors the model takes) is an input of the step and is written in place. ``cache_names``
    name its tensors in flattening order (default: the model's ``cache_names()``, else numbers); ``remote``
    gives the indices among them that live in remote memory (``Value.remote``); ``fetch_fraction`` the share of
    selected blocks a pooled block fetch moves (``program_from_graph``)."""
    if not hasattr(model, "new_cache"):
        raise CaptureError(f"{type(model).__name__} does not provide new_cache(batch, context); decode capture "
                           f"needs a model that takes its KV cache as an input (the built-in workloads do)")
    if context < 0:
        raise CaptureError(f"context must be >= 0 tokens, got {context}")
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    names = [n for n, _ in params] + [n for n, _ in buffers]
    n_state = len(names)
    if cache is None:
        cache = model.new_cache(tokens.shape[0], context + tokens.shape[1])
    cache_flat, cache_spec = tree_flatten(cache)
    start = tokens.new_full((1,), context, dtype=torch.int64)  # fake when tokens are fake

    def step(*flat: torch.Tensor):
        state = dict(zip(names, flat[:n_state]))
        cache_t = tree_unflatten(list(flat[n_state:n_state + len(cache_flat)]), cache_spec)
        tokens_t, start_t = flat[n_state + len(cache_flat):]
        with torch.no_grad():
            return functional_call(model, state, (tokens_t,), {"cache": cache_t, "start": start_t})

    flat = [p.detach() for _, p in params] + [b for _, b in buffers] + cache_flat + [tokens, start]
    kinds = [ValueKind.PARAMETER] * n_state + [ValueKind.KV_CACHE] * len(cache_flat) + [ValueKind.INPUT] * 2
    # A model may name its cache tensors (``cache_names()``, in flattening order); else they are numbered.
    if cache_names is None:
        cache_names = model.cache_names() if hasattr(model, "cache_names") else range(len(cache_flat))
    input_names = [*names, *(f"kv_cache.{n}" for n in cache_names), "tokens", "start"]
    return trace_step(step, flat, kinds, input_names, name=name or type(model).__name__, mode="decode",
                      remote_inputs=[n_state + i for i in remote], fetch_fraction=fetch_fraction,
                      meta={"mode": "decode", "context": context, **(meta or {})})
