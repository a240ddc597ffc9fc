"""Capture a Hugging Face ``transformers`` causal language model (train, prefill or decode) as a Program.

``transformers`` is an optional dependency: this module never imports it at import time. It
works with any ``nn.Module`` that has a ``config.vocab_size`` and a Hugging Face style
``forward(input_ids, use_cache=..., return_dict=...)`` returning an object with ``.logits``
(``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``, ...).

The adapter only makes the example batch and the call pure; the capture itself is the
project's ``capture_train_step`` / ``capture_prefill_step`` / ``capture_decode_step``, so an HF step
and a built-in workload step become the same kind of Program. A decode step keeps its KV cache in
transformers' ``StaticCache`` layout (per layer, keys and values of (batch, kv heads, slots, head
dim), written in place with ``index_copy_``), with the tensors passed in as step inputs
(``StaticCacheDecoder``). A model built under ``fake_build()`` (no
memory) gets fake example inputs from the same fake mode, so a 70B HF model can be planned
on a laptop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from hyperoffload.capture.fake import default_dtype, fake_build, is_fake
from hyperoffload.capture.graph_to_program import CaptureError, DataDependentValue
from hyperoffload.capture.steps import Captured, capture_decode_step, capture_prefill_step, capture_train_step

HF_MODES = ("train", "prefill", "decode")

# use_cache=False: no DynamicCache object is created or returned, so the forward is a pure
# function of (weights, input_ids). return_dict=True: the output has ``.logits``, which
# ``lm_loss`` and ``capture_prefill_step`` read.
_CALL_KWARGS = {"use_cache": False, "return_dict": True}


def capture_hf(model: nn.Module, mode: str, *, batch: int, seq: int | None = None, context: int | None = None,
               fake_inputs: bool | None = None, name: str | None = None) -> Captured:
    """Capture one ``mode`` step ("train", "prefill" or "decode") of a Hugging Face causal LM.

    The example batch is ``input_ids`` of ``batch`` sequences of ``seq`` tokens (int64, random
    ids below ``config.vocab_size``, drawn from torch's global generator: seed it for a
    reproducible batch). "train" adds next-token targets of the same shape (the input shifted
    by one token; the last target is the token after the batch) and captures forward,
    cross-entropy loss, backward and an AdamW update; the model's train/eval mode is kept as
    given, so dropout (if the config has any) is part of the step. "prefill" captures one
    forward without gradients returning the logits, and puts the model in eval mode (dropout
    off) first, as inference runs it; call ``model.train()`` afterwards to train it again.
    "decode" (``context`` tokens already cached, no ``seq``) captures one token per sequence
    against a static KV cache of ``context + 1`` slots that is an input of the step and is written
    in place (``StaticCacheDecoder``; sliding-window layers hold their window), also in eval mode; models
    whose cache has linear-attention or other non-static layers are refused.

    ``fake_inputs``: ``None`` (the default) makes fake inputs exactly when the model's
    parameters are fake (built under ``fake_build()``), in the same fake mode; ``True`` makes
    fake inputs for a real model too (the step can then only be inspected, not run); ``False``
    insists on real inputs and so needs a real model. ``name`` defaults to the model's class.
    """
    if mode not in HF_MODES:
        raise CaptureError(f"unknown mode {mode!r} for a Hugging Face model; choose one of: {', '.join(HF_MODES)}")
    vocab = _vocab_size(model)
    _check_count("batch", batch, "sequences")
    if mode == "decode":
        if seq is not None:
            raise CaptureError("a decode step feeds one token per sequence: pass context (the tokens already "
                               "cached), not seq")
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise CaptureError(f"decode needs context, the tokens already in the KV cache: an int >= 0, "
                               f"got {context!r}")
        _check_positions(model, context + 1, context=context)
    else:
        if context is not None:
            raise CaptureError(f"context sets the KV cache of a decode step; a {mode} step has none: drop it")
        _check_count("seq", seq, "tokens")
        _check_positions(model, seq)
    params = list(model.parameters())
    if not params:
        raise CaptureError(f"{type(model).__name__} has no parameters; pass the model itself (e.g. a "
                           f"LlamaForCausalLM), not a wrapper or a config")
    fake_mode = _input_fake_mode(model, fake_inputs)
    inputs_mode = fake_mode if fake_mode is not None else contextlib.nullcontext()
    meta = {"source": "transformers", "model_type": getattr(model.config, "model_type", None), "batch": batch,
            "dtype": str(params[0].dtype).removeprefix("torch.")}
    if mode == "decode":
        captured = _capture_decode(model, batch, context, vocab, inputs_mode, name, meta)
    else:
        # Inputs go where the embedding weights are; under a fake mode they are fake tensors of that mode,
        # so the trace sees one consistent set of fake tensors.
        with inputs_mode:
            stream = torch.randint(0, vocab, (batch, seq + 1), dtype=torch.int64, device=params[0].device)
            # Clones, not views: the two inputs must own separate storages, or the capture would count one
            # buffer for both while a caller passing separate tensors holds two.
            input_ids = stream[:, :-1].clone()
            targets = stream[:, 1:].clone()
            del stream
        meta["seq"] = seq
        with _unpacked_positions(), _traceable_experts():
            if mode == "train":
                captured = capture_train_step(model, (input_ids,), targets, kwargs=dict(_CALL_KWARGS), name=name,
                                              meta=meta)
            else:
                model.eval()
                captured = capture_prefill_step(model, (input_ids,), kwargs=dict(_CALL_KWARGS), name=name,
                                                meta=meta)
    # The eager step computes the experts the way the graph does (see _traceable_experts).
    return dataclasses.replace(captured, step=_with_traceable_experts(captured.step))


def _capture_decode(model: nn.Module, batch: int, context: int, vocab: int, inputs_mode, name: str | None,
                    meta: dict) -> Captured:
    """``capture_hf``'s decode step: one token per sequence against a static cache of ``context + 1`` slots."""
    model.eval()
    decoder = StaticCacheDecoder(model, position=context)
    device = next(model.parameters()).device
    with _unpacked_positions(), _traceable_experts():
        with inputs_mode:
            tokens = torch.randint(0, vocab, (batch, 1), dtype=torch.int64, device=device)
            cache = decoder.new_cache(batch, context + 1)  # a first call sizes the cache: traced code paths
        try:
            return capture_decode_step(decoder, tokens, context, cache=cache, name=name or type(model).__name__,
                                       meta={**meta, "context": context})
        except CaptureError as error:
            # On real weights the read shows up in the traced graph (DataDependentValue). On fake tensors, as the
            # command line captures, there is no value to read, so FakeTensor fails inside the trace instead
            # (DataDependentOutputException, wrapped by trace_step): the same cause, so the same refusal.
            if isinstance(error, DataDependentValue):
                detail = str(error)
            elif isinstance(error.__cause__, DataDependentOutputException):
                detail = f"on fake tensors {error.__cause__.func} has no value to read"
            else:
                raise
            raise CaptureError(
                f"{type(model).__name__}'s decode step reads a tensor's value as a Python number (for OPT, the cache "
                f"length its learned positions start from), which a captured step cannot follow. Hugging Face decode "
                f"capture works for models that place tokens by cache_position (checked: LLaMA, Mistral, Qwen2, "
                f"Phi-3, Phi, Gemma, Gemma 2, Falcon, GPT-2, GPT-NeoX, Mixtral, Qwen2-MoE); capture mode='prefill' "
                f"of this model instead ({detail})") from None


class StaticCacheDecoder(nn.Module):
    """A Hugging Face causal LM as a decoder that takes its KV cache as tensors, the form a decode Program
    needs (``capture_decode_step``): ``forward(tokens, cache, start)`` with ``cache`` a list of (keys, values)
    per layer in transformers' ``StaticCache`` layout and ``start`` (1,) int64 the position of the first token.

    Each call wraps the given tensors in a ``StaticCache`` whose layers write the new tokens' keys and values in
    place at ``start`` (``index_copy_``) and attend over all slots with the positions past the sequence masked,
    as transformers' static-cache generation does. A sliding-window layer holds the last ``sliding_window``
    tokens and, once full, rolls its buffer by one per token; which of its code paths runs depends on a Python
    count of the tokens already cached, ``position``, not on the step's inputs: a captured step is for that
    count (``capture_hf`` sets it to the context). Other layer kinds (linear attention, indexed) are refused."""

    def __init__(self, model: nn.Module, position: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.position = position
        """Tokens already in the cache at the next call (sliding-window layers need it as a Python int)."""
        self.slots: int | None = None
        # transformers renames past_key_values to cache (deprecated from 5.x, to go in 5.40): take what it has.
        parameters = inspect.signature(model.forward).parameters
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"

    def new_cache(self, batch: int, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed keys and values of ``slots`` tokens per layer, shaped, typed and placed as the model's own
        ``StaticCache`` makes them (its layers size themselves on a first one-token call, run here)."""
        cache = self._static_cache(slots)
        self.slots = slots
        device = next(self.model.parameters()).device
        tokens = torch.zeros((batch, 1), dtype=torch.int64, device=device)
        with torch.no_grad():
            try:
                self._call(tokens, cache, torch.zeros(1, dtype=torch.int64, device=device))
            except (TypeError, ValueError, AttributeError, NotImplementedError) as error:
                raise CaptureError(f"{type(self.model).__name__} does not decode one token against a StaticCache "
                                   f"({type(error).__name__}: {error}); capture mode='prefill' of this model "
                                   f"instead") from error
        # The sizing call wrote its token at slot 0: clear it, and hand out the layers' own buffers.
        return [(layer.keys.zero_(), layer.values.zero_()) for layer in cache.layers]

    def cache_names(self) -> list[str]:
        layers = len(self._static_cache(1).layers)
        return [f"layers.{i}.{part}" for i in range(layers) for part in ("keys", "values")]

    def forward(self, tokens: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
                start: torch.Tensor) -> torch.Tensor:
        from transformers.cache_utils import StaticSlidingWindowLayer

        static = self._static_cache(self.slots or max(keys.shape[-2] for keys, _ in cache))
        for layer, (keys, values) in zip(static.layers, cache, strict=True):
            # What the layer's lazy_initialization would set, with the step's own tensors as its buffers.
            layer.keys, layer.values = keys, values
            layer.device = keys.device
            layer.batch_size, layer.num_heads = keys.shape[:2]
            layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
            layer.cumulative_length = start[0].clone()  # each layer advances its own count in place
            if isinstance(layer, StaticSlidingWindowLayer):
                if self.position is None:
                    raise CaptureError("a sliding-window KV cache needs the tokens already cached as a Python int: set "
                                       "StaticCacheDecoder.position before calling it")
                layer.cumulative_length_int = self.position
            layer.is_initialized = True
        return self._call(tokens, static, start).logits

    def _static_cache(self, slots: int):
        from transformers import StaticCache

        try:
            cache = StaticCache(config=self.model.config, max_cache_len=slots)
        except (TypeError, ValueError, AttributeError, NotImplementedError) as error:
            raise CaptureError(f"transformers cannot make a StaticCache for {type(self.model).__name__} "
                               f"({type(error).__name__}: {error}); capture mode='prefill' of this model "
                               f"instead") from error
        self._check_layers(cache)
        return cache

    def _check_layers(self, cache) -> None:
        import transformers

        try:
            from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
        except ImportError:  # transformers 4.x keeps the cache in per-kind lists, not per-layer objects
            StaticLayer = StaticSlidingWindowLayer = None
        if StaticLayer is None or not hasattr(cache, "layers"):
            raise CaptureError(f"Hugging Face decode capture needs transformers 5 (a StaticCache of per-layer "
                               f"objects); this is transformers {transformers.__version__}. Upgrade it, or capture "
                               f"mode='prefill'")
        known = (StaticLayer, StaticSlidingWindowLayer)
        other = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in known})
        if other:
            raise CaptureError(f"{type(self.model).__name__}'s KV cache has {', '.join(other)} layers; Hugging Face "
                               f"decode capture supports static full-attention and sliding-window layers only. "
                               f"Capture mode='prefill' of this model, or decode of a built-in workload")

    def _call(self, tokens: torch.Tensor, cache, start: torch.Tensor):
        positions = start + torch.arange(tokens.shape[1], device=start.device)
        # One row of positions for the whole batch, as transformers makes them itself from cache_position.
        return self.model(input_ids=tokens, **{self._cache_keyword: cache}, cache_position=positions,
                          position_ids=positions[None], use_cache=True, return_dict=True)


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


def _check_positions(model: nn.Module, seq: int, *, context: int | None = None) -> None:
    """``seq`` positions must fit the model; ``context`` is given for a decode step (``seq`` is then
    ``context + 1``), so that the message names what the caller set."""
    # Learned position tables (GPT-2's wpe) fail with an index error past their end; RoPE models
    # would run but outside what they were trained for. Either way the config states the limit.
    limit = getattr(_text_config(model), "max_position_embeddings", None)
    if not (isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < seq):
        return
    raise_it = "raise max_position_embeddings in the config if the model really handles longer contexts"
    if context is None:
        raise CaptureError(f"seq={seq} tokens is more than {type(model).__name__} supports "
                           f"(config.max_position_embeddings={limit}); use seq <= {limit}, or {raise_it}")
    # The user set the context, not seq: the new token takes one position past it.
    raise CaptureError(f"a decode step at context={context} needs {seq} positions (the cached tokens and the new "
                       f"one), more than {type(model).__name__} supports (config.max_position_embeddings={limit}); "
                       f"use a context of at most {limit - 1} (--context on the command line, context= in Python), "
                       f"or {raise_it}")


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
    with _patched("transformers.masking_utils", "find_packed_sequence_indices",
                  lambda original: lambda position_ids: None):
        yield


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
    with _patched("transformers.integrations.moe", "_can_use_grouped_mm",
                  lambda original: lambda input, weight, offs: weight.dtype == torch.bfloat16 and original(
                      input, weight, offs)):
        yield


@contextlib.contextmanager
def _patched(module: str, name: str, replacement: Callable[[Any], Any]) -> Iterator[None]:
    """Within the block, ``module.name`` is ``replacement(original)``; nothing changes where transformers (or
    that attribute: an older or newer version) is missing."""
    import importlib

    try:
        target = importlib.import_module(module)
    except ImportError:  # not a transformers model, or transformers not installed: nothing to patch
        yield
        return
    original = getattr(target, name, None)
    if original is None:
        yield
        return
    setattr(target, name, replacement(original))
    try:
        yield
    finally:
        setattr(target, name, original)


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
    # transformers reads a config from a folder, by the name config.json: a file of another name cannot be
    # handed on, and its folder may hold some other config.json.
    rule = ("give a config.json file or a folder that holds one (for example one written by "
            "config.save_pretrained(folder))")
    if path.is_file() and path.name != "config.json":
        raise CaptureError(f"a Hugging Face config must be a file named config.json or a folder that holds one; "
                           f"{config_path} is named {path.name}: rename or copy it to config.json and give that "
                           f"file or its folder")
    if path.is_dir() and not (folder / "config.json").is_file():
        raise CaptureError(f"no Hugging Face config at {config_path}: the folder holds no config.json; {rule}")
    if not path.exists():
        raise CaptureError(f"no Hugging Face config at {config_path}: no such file or folder; {rule}")
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise CaptureError(f"cannot read the Hugging Face config at {folder}/config.json: {error}") from error
    # Newer transformers name it dtype and warn when torch_dtype is read; older ones have torch_dtype only.
    dtype = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    dtype = dtype or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if not fake:
        torch.manual_seed(seed)
    with fake_build(dtype) if fake else default_dtype(dtype):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as error:
            raise CaptureError(f"transformers cannot build a causal LM from {folder}/config.json: {error}") from error
