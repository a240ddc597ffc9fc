"""Capture a Hugging Face ``transformers`` causal language model (train or prefill) as a Program.

``transformers`` is an optional dependency: this module never imports it at import time. It
works with any ``nn.Module`` that has a ``config.vocab_size`` and a Hugging Face style
``forward(input_ids, use_cache=..., return_dict=...)`` returning an object with ``.logits``
(``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``, ...).

The adapter only makes the example batch and the call pure; the capture itself is the
project's ``capture_train_step`` / ``capture_prefill_step``, so an HF step and a built-in
workload step become the same kind of Program. A model built under ``fake_build()`` (no
memory) gets fake example inputs from the same fake mode, so a 70B HF model can be planned
on a laptop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from hyperoffload.capture.fake import default_dtype, fake_build, is_fake
from hyperoffload.capture.graph_to_program import CaptureError
from hyperoffload.capture.steps import Captured, capture_prefill_step, capture_train_step

HF_MODES = ("train", "prefill")

# use_cache=False: no DynamicCache object is created or returned, so the forward is a pure
# function of (weights, input_ids). return_dict=True: the output has ``.logits``, which
# ``lm_loss`` and ``capture_prefill_step`` read.
_CALL_KWARGS = {"use_cache": False, "return_dict": True}


def capture_hf(model: nn.Module, mode: str, *, batch: int, seq: int, fake_inputs: bool | None = None,
               name: str | None = None) -> Captured:
    """Capture one ``mode`` step ("train" or "prefill") of a Hugging Face causal LM.

    The example batch is ``input_ids`` of ``batch`` sequences of ``seq`` tokens (int64, random
    ids below ``config.vocab_size``, drawn from torch's global generator: seed it for a
    reproducible batch). "train" adds next-token targets of the same shape (the input shifted
    by one token; the last target is the token after the batch) and captures forward,
    cross-entropy loss, backward and an AdamW update; the model's train/eval mode is kept as
    given, so dropout (if the config has any) is part of the step. "prefill" captures one
    forward without gradients returning the logits, and puts the model in eval mode (dropout
    off) first, as inference runs it; call ``model.train()`` afterwards to train it again.

    ``fake_inputs``: ``None`` (the default) makes fake inputs exactly when the model's
    parameters are fake (built under ``fake_build()``), in the same fake mode; ``True`` makes
    fake inputs for a real model too (the step can then only be inspected, not run); ``False``
    insists on real inputs and so needs a real model. ``name`` defaults to the model's class.
    """
    if mode == "decode":
        raise CaptureError(
            "Hugging Face decode capture is not supported yet: HF models keep the KV cache in a Cache object "
            "that grows by concatenation each token, not in fixed-size tensors passed in and updated in place, "
            "which a decode Program needs. Capture mode='prefill' of this model, or capture decode of a "
            "built-in workload (hyperoffload.workloads.capture_workload(get_workload('llama3-8b'), 'decode') "
            "or capture_decode_step with workloads.Llama, whose new_cache() gives a static KV cache)")
    if mode not in HF_MODES:
        raise CaptureError(f"unknown mode {mode!r} for a Hugging Face model; choose one of: {', '.join(HF_MODES)}")
    vocab = _vocab_size(model)
    _check_count("batch", batch, "sequences")
    _check_count("seq", seq, "tokens")
    _check_positions(model, seq)
    params = list(model.parameters())
    if not params:
        raise CaptureError(f"{type(model).__name__} has no parameters; pass the model itself (e.g. a "
                           f"LlamaForCausalLM), not a wrapper or a config")
    fake_mode = _input_fake_mode(model, fake_inputs)
    # Inputs go where the embedding weights are; under a fake mode they are fake tensors of that mode,
    # so the trace sees one consistent set of fake tensors.
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        stream = torch.randint(0, vocab, (batch, seq + 1), dtype=torch.int64, device=params[0].device)
        # Clones, not views: the two inputs must own separate storages, or the capture would count one
        # buffer for both while a caller passing separate tensors holds two.
        input_ids = stream[:, :-1].clone()
        targets = stream[:, 1:].clone()
        del stream
    config = model.config
    meta = {"source": "transformers", "model_type": getattr(config, "model_type", None), "batch": batch,
            "seq": seq, "dtype": str(params[0].dtype).removeprefix("torch.")}
    with _unpacked_positions(), _traceable_experts():
        if mode == "train":
            captured = capture_train_step(model, (input_ids,), targets, kwargs=dict(_CALL_KWARGS), name=name,
                                          meta=meta)
        else:
            model.eval()
            captured = capture_prefill_step(model, (input_ids,), kwargs=dict(_CALL_KWARGS), name=name, meta=meta)
    # The eager step computes the experts the way the graph does (see _traceable_experts).
    return dataclasses.replace(captured, step=_with_traceable_experts(captured.step))


def _text_config(model: nn.Module) -> Any:
    """The config holding the language model's sizes (multimodal configs nest it as a text config)."""
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _vocab_size(model: nn.Module) -> int:
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture_hf takes a Hugging Face model instance (an nn.Module such as "
                           f"LlamaForCausalLM(config)), got {type(model).__name__}")
    vocab = getattr(_text_config(model), "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        raise CaptureError(
            f"{type(model).__name__} has no usable config.vocab_size (got {vocab!r}); capture_hf needs a "
            f"transformers causal LM (a PreTrainedModel with a config, e.g. LlamaForCausalLM). For any other "
            f"nn.Module use capture_train_step / capture_prefill_step with your own example inputs")
    return vocab


def _check_count(label: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CaptureError(f"{label} must be a positive int number of {unit}, got {value!r}")


def _check_positions(model: nn.Module, seq: int) -> None:
    # Learned position tables (GPT-2's wpe) fail with an index error past their end; RoPE models
    # would run but outside what they were trained for. Either way the config states the limit.
    limit = getattr(_text_config(model), "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < seq:
        raise CaptureError(f"seq={seq} tokens is more than {type(model).__name__} supports "
                           f"(config.max_position_embeddings={limit}); use seq <= {limit}, or raise "
                           f"max_position_embeddings in the config if the model really handles longer contexts")


def _input_fake_mode(model: nn.Module, fake_inputs: bool | None) -> FakeTensorMode | None:
    """The fake mode to create the example inputs in, or None for real inputs."""
    params = list(model.parameters())
    fakes = [p for p in params if is_fake(p)]
    if fakes and len(fakes) != len(params):
        raise CaptureError(f"{type(model).__name__} mixes fake and real parameters ({len(fakes)} of {len(params)} "
                           f"fake); build the whole model either inside fake_build() or outside it")
    if not fakes:
        # A fresh mode for a real model: make_fx adopts the inputs' mode and converts the real weights.
        return FakeTensorMode(allow_non_fake_inputs=True) if fake_inputs else None
    if fake_inputs is False:
        raise CaptureError(f"{type(model).__name__} was built under fake_build() (its parameters are fake), so "
                           f"its inputs must be fake too; leave fake_inputs=None, or build the model outside "
                           f"fake_build() to run it")
    from torch._guards import detect_fake_mode  # private torch API; kept local so a rename breaks only this path

    try:
        mode = detect_fake_mode(fakes)
    except AssertionError as error:  # detect_fake_mode asserts that every fake tensor has the same mode
        raise CaptureError(f"the parameters of {type(model).__name__} come from different fake modes; build the "
                           f"model inside a single fake_build() block") from error
    return mode if mode is not None else fakes[0].fake_mode


@contextlib.contextmanager
def _unpacked_positions() -> Iterator[None]:
    """Tell transformers' mask code, while tracing, that the batch holds no packed sequences.

    Called without ``position_ids`` or ``attention_mask``, an HF decoder uses positions
    ``arange(seq)`` for every row and checks them for packing (several sequences in one row,
    ``find_packed_sequence_indices``). On real tensors the check reads the values, finds no packing
    and returns None, so SDPA runs with ``is_causal=True`` and no mask. On fake tensors it cannot
    read values, so it assumes packing: it builds an explicit (batch, 1, seq, seq) mask, which also
    turns off SDPA's grouped-query path (K/V get repeated). The traced step would then differ from
    the step that really runs: other ops, seq**2 more bytes of mask and K/V copies in the memory
    profile, and gradients that differ from eager in the last bits. The positions come from
    ``arange`` inside the step, never from an input, so they are unpacked by construction and
    answering None is exact. Only the trace runs inside this block; the eager step needs no patch.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # not a transformers model, or transformers not installed: nothing to patch
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # a transformers version without the check has nothing to fix
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _traceable_experts() -> Iterator[None]:
    """Have mixture-of-experts layers use transformers' own grouped-matmul fallback op unless the weights are
    bfloat16.

    transformers' default experts implementation (``grouped_mm``) calls ``torch.nn.functional.grouped_mm``
    whenever torch has it. Its CPU kernel takes float32, but torch's shape function for fake tensors
    (``meta_grouped_mm``) accepts bfloat16 only, so tracing a float32 (or float16) MoE model fails with
    "Expected inputs of BF16 type". transformers routes non-bfloat16 weights to its fallback
    (``transformers::grouped_mm_fallback``, a custom op with a fake implementation and a backward: one matmul
    per expert) under torch.compile for the same reason; this does the same while capturing, and while the
    eager step runs, so that graph and eager compute the same products. bfloat16 experts keep
    ``grouped_mm``.
    """
    try:
        from transformers.integrations import moe
    except ImportError:  # not a transformers model, or a transformers version without grouped experts
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype == torch.bfloat16 and original(
        input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def _with_traceable_experts(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _traceable_experts():
            return step(*args, **kwargs)

    return run


def build_hf_model(config_path: str, *, fake: bool = True, seed: int = 0) -> nn.Module:
    """A causal LM built from a local Hugging Face ``config.json`` (a file or a folder holding one),
    with random weights; nothing is downloaded. ``fake=True`` builds it on fake tensors (no memory).

    Weights take the config's ``torch_dtype``/``dtype`` when it names one, else float32.
    """
    from pathlib import Path

    try:
        import transformers
    except ImportError as error:
        raise CaptureError("Hugging Face models need the optional dependency transformers: "
                           "pip install 'hyperoffload[hf]'") from error
    path = Path(config_path)
    folder = path.parent if path.is_file() else path
    if not (folder / "config.json").is_file() or (path.is_file() and path.name != "config.json"):
        raise CaptureError(f"no Hugging Face config at {config_path}: give a config.json file or a folder "
                           f"that holds one (for example one written by config.save_pretrained(folder))")
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise CaptureError(f"cannot read the Hugging Face config at {folder}/config.json: {error}") from error
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if not fake:
        torch.manual_seed(seed)
    with fake_build(dtype) if fake else default_dtype(dtype):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as error:
            raise CaptureError(f"transformers cannot build a causal LM from {folder}/config.json: {error}") from error
