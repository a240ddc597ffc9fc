"""Capture a Hugging Face ``transformers`` model (train, prefill or decode) as a Program.

``transformers`` is an optional dependency: this module never imports it at import time. The tasks it
captures, and the example batch of each, are the registry in ``hf_tasks``: causal LMs (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ...), masked LMs (BERT), seq2seq LMs (T5, BART), image classifiers (ViT) and speech
seq2seq models (Whisper). Configs read from disk are checked first (``hf_config``); code from a model folder
(``auto_map``) runs only when the caller asks for it.

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
from hyperoffload.capture.hf_config import check_remote_code, config_dtype, read_config
from hyperoffload.capture.hf_tasks import (TASK_NAMES, call_kwargs, get_task, task_of_config, task_of_model,
                                           tasks_of_model_type, text_config, vocab_size)
from hyperoffload.capture.steps import (Captured, capture_decode_step, capture_prefill_step, capture_train_step,
                                        check_step_tokens)

HF_MODES = ("train", "prefill", "decode")


def capture_hf(model: nn.Module, mode: str, *, batch: int, seq: int | None = None, context: int | None = None,
               fake_inputs: bool | None = None, name: str | None = None, task: str | None = None,
               progress: Callable[[str, int, int], None] | None = None) -> Captured:
    """Capture one ``mode`` step ("train", "prefill" or "decode") of a Hugging Face model of one of the
    ``hf_tasks.TASKS``: causal LM, masked LM, seq2seq LM, image classification or speech seq2seq.

    ``task`` (one of ``hf_tasks.TASK_NAMES``) defaults to the model's own: its class (``BertForMaskedLM`` is a
    masked LM), else its config's ``architectures`` or ``model_type``, else causal LM. The example batch is the
    task's (``hf_tasks``), random, drawn from torch's global generator (seed it for a reproducible batch):
    ``batch`` sequences of ``seq`` token ids for the text tasks (a seq2seq LM's encoder and decoder both take
    ``seq``), with the decoder's next tokens as targets for causal and seq2seq LMs and the tokens themselves for a
    masked LM; ``batch`` images of the config's ``image_size`` and ``num_channels`` with class ids below
    ``num_labels`` (no ``seq``); ``batch`` log-mel spectrograms of the config's ``num_mel_bins`` by
    ``2 * max_source_positions`` frames with ``seq`` decoder tokens. "train" captures forward, cross-entropy of
    the logits against those targets, backward and an AdamW update; the model's train/eval mode is kept as
    given, so dropout (if the config has any) is part of the step. "prefill" captures one forward without
    gradients returning the logits, and puts the model in eval mode (dropout off) first, as inference runs it;
    call ``model.train()`` afterwards to train it again. "decode" (causal LMs; ``context`` tokens already
    cached, no ``seq``) captures one token per sequence against a static KV cache of ``context + 1`` slots that
    is an input of the step and is written in place (``StaticCacheDecoder``; sliding-window layers hold their
    window), also in eval mode; models whose cache has linear-attention or other non-static layers, and the
    tasks without a decode step of that form, are refused with what to capture instead.

    ``fake_inputs``: ``None`` (the default) makes fake inputs exactly when the model's
    parameters are fake (built under ``fake_build()``), in the same fake mode; ``True`` makes
    fake inputs for a real model too (the step can then only be inspected, not run); ``False``
    insists on real inputs and so needs a real model. ``name`` defaults to the model's class.
    ``progress(phase, done, total)``, when given, is called as the trace reaches each of the model's layers.
    """
    if mode not in HF_MODES:
        raise CaptureError(f"unknown mode {mode!r} for a Hugging Face model; choose one of: {', '.join(HF_MODES)}")
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture_hf takes a Hugging Face model instance (an nn.Module such as "
                           f"LlamaForCausalLM(config)), got {type(model).__name__}")
    spec = get_task(task) if task is not None else task_of_model(model)
    if spec.takes_seq:
        vocab_size(model)  # a model without a vocabulary is refused before any other check
    _check_count("batch", batch, "sequences" if spec.takes_seq else "images")
    if mode == "decode":
        if spec.no_decode is not None:
            raise CaptureError(f"{type(model).__name__} ({spec.name}): {spec.no_decode}")
        if seq is not None:
            raise CaptureError("a decode step feeds one token per sequence: pass context (the tokens already "
                               "cached), not seq")
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise CaptureError(f"decode needs context, the tokens already in the KV cache: an int >= 0, "
                               f"got {context!r}")
        _check_positions(model, context + 1, spec.positions_field, context=context)
        check_step_tokens(batch, context + 1, "context")
    else:
        if context is not None:
            raise CaptureError(f"context sets the KV cache of a decode step; a {mode} step has none: drop it")
        if spec.takes_seq:
            _check_count("seq", seq, "tokens")
            _check_positions(model, seq, spec.positions_field)
            check_step_tokens(batch, seq, "seq")
        elif seq is not None:
            raise CaptureError(f"seq sets tokens per sequence; {type(model).__name__} ({spec.name}) takes whole "
                               f"images of the config's image_size: drop seq (--seq)")
    params = list(model.parameters())
    if not params:
        raise CaptureError(f"{type(model).__name__} has no parameters; pass the model itself (e.g. a "
                           f"LlamaForCausalLM), not a wrapper or a config")
    fake_mode = _input_fake_mode(model, fake_inputs)
    inputs_mode = fake_mode if fake_mode is not None else contextlib.nullcontext()
    meta = {"source": "transformers", "model_type": getattr(model.config, "model_type", None), "task": spec.name,
            "batch": batch, "dtype": str(params[0].dtype).removeprefix("torch.")}
    with _layer_progress(model, progress):
        if mode == "decode":
            captured = _capture_decode(model, batch, context, vocab_size(model), inputs_mode, name, meta)
        else:
            # Inputs go where the embedding weights are; under a fake mode they are fake tensors of that mode,
            # so the trace sees one consistent set of fake tensors.
            with inputs_mode:
                example = spec.example(model, batch, seq)
            meta.update(example.meta)
            kwargs = {**example.inputs, **call_kwargs(model)}
            with _unpacked_positions(), _traceable_experts():
                if mode == "train":
                    captured = capture_train_step(model, (), example.targets, kwargs=kwargs, name=name, meta=meta)
                else:
                    model.eval()
                    captured = capture_prefill_step(model, (), kwargs=kwargs, name=name, meta=meta)
    # The eager step computes the experts the way the graph does (see _traceable_experts).
    return dataclasses.replace(captured, step=_with_traceable_experts(captured.step))


@contextlib.contextmanager
def _layer_progress(model: nn.Module, progress: Callable[[str, int, int], None] | None) -> Iterator[None]:
    """Within the block, ``progress("tracing layers", done, total)`` as each layer of the model's layer stacks
    (its outermost ``nn.ModuleList``s: a decoder's layers, an encoder-decoder's two stacks) starts its forward."""
    if progress is None:
        yield
        return
    stacks: list[str] = []
    layers: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(f"{stack}.") for stack in stacks):
            stacks.append(name)
            layers.extend(module)
    total = len(layers)
    done = 0

    def hook(module: nn.Module, args: Any) -> None:
        nonlocal done
        done = done % total + 1  # a second forward (the decode step's cache sizing) counts again from 1
        progress("tracing layers", done, total)

    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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


def _check_count(label: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CaptureError(f"{label} must be a positive int number of {unit}, got {value!r}")


def _check_positions(model: nn.Module, seq: int, field: str | None, *, context: int | None = None) -> None:
    """``seq`` positions must fit the model's ``config.<field>``; ``context`` is given for a decode step (``seq``
    is then ``context + 1``), so that the message names what the caller set."""
    # Learned position tables (GPT-2's wpe) fail with an index error past their end; RoPE models
    # would run but outside what they were trained for. Either way the config states the limit.
    limit = getattr(text_config(model), field, None) if field else None
    if not (isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < seq):
        return
    raise_it = f"raise {field} in the config if the model really handles longer contexts"
    if context is None:
        raise CaptureError(f"seq={seq} tokens is more than {type(model).__name__} supports "
                           f"(config.{field}={limit}); use seq <= {limit}, or {raise_it}")
    # The user set the context, not seq: the new token takes one position past it.
    raise CaptureError(f"a decode step at context={context} needs {seq} positions (the cached tokens and the new "
                       f"one), more than {type(model).__name__} supports (config.{field}={limit}); "
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


@contextlib.contextmanager
def _fake_safe_init() -> Iterator[None]:
    """Within the block, a truncated-normal initialization of a fake tensor leaves it as it is.

    torch's ``trunc_normal_`` draws by rejection (redrawing until no value is out of bounds), which reads values
    (``.item()``, ``mask.any()``) that a fake tensor does not have, so building a model that uses it (ViT, Swin,
    DeiT, ...) under ``fake_build()`` fails. A fake weight has no values to initialize: skipping the draw is exact.
    Real tensors are drawn as before. transformers' own ``initialization.trunc_normal_`` (what its models call)
    and torch's are both covered."""
    def skip_fake(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def trunc_normal_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return tensor if is_fake(tensor) else original(tensor, *args, **kwargs)

        return trunc_normal_

    with _patched("torch.nn.init", "trunc_normal_", skip_fake), \
            _patched("transformers.initialization", "trunc_normal_", skip_fake):
        yield


def _with_traceable_experts(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _traceable_experts():
            return step(*args, **kwargs)

    return run


def build_hf_model(config_path: str, *, fake: bool = True, seed: int = 0, task: str | None = None,
                   trust_remote_code: bool = False) -> nn.Module:
    """A model built from a local Hugging Face ``config.json`` (a file or a folder holding one), with random
    weights; nothing is downloaded. ``fake=True`` builds it on fake tensors (no memory).

    ``task`` (one of ``hf_tasks.TASK_NAMES``) picks the auto class; by default the config's: the auto classes
    its ``auto_map`` names, else its ``architectures``, else its ``model_type`` (``hf_tasks.task_of_config``).
    Weights take the config's ``torch_dtype``/``dtype`` when it names one, else float32. The file is checked
    first (``hf_config.read_config``: valid JSON, sane sizes, a known dtype). A config whose ``auto_map`` points
    at Python files of the model folder is refused unless ``trust_remote_code=True``: with it, transformers
    imports and runs those files (and copies them to its modules cache, ``HF_MODULES_CACHE``).
    """
    try:
        import transformers
    except ImportError as error:
        raise CaptureError("Hugging Face models need the optional dependency transformers: "
                           "pip install 'hyperoffload[hf]'") from error
    folder, fields = read_config(config_path)
    check_remote_code(fields, folder, trust_remote_code)
    try:
        # trust_remote_code is passed as given, never left None: transformers would then ask on stdin.
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True,
                                                         trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CaptureError(f"cannot read the Hugging Face config at {folder}/config.json: {error}") from None
    auto_map = fields.get("auto_map") if trust_remote_code else None
    spec = get_task(task) if task is not None else task_of_config(
        architectures=fields.get("architectures") if isinstance(fields.get("architectures"), list) else None,
        model_type=getattr(config, "model_type", None), auto_map=auto_map)
    if spec is None:
        raise CaptureError(f"{folder}/config.json names no model class of a task capture_hf knows (architectures "
                           f"{fields.get('architectures')!r}, model_type {getattr(config, 'model_type', None)!r}); "
                           f"pick one with task= (--hf-task): {', '.join(TASK_NAMES)}")
    model_type = getattr(config, "model_type", None)
    if auto_map is None and spec not in tasks_of_model_type(model_type):
        fitting = ", ".join(task.name for task in tasks_of_model_type(model_type)) or "none"
        raise CaptureError(f"transformers has no {spec.name} model ({spec.auto_class}) of model_type {model_type!r} "
                           f"({folder}/config.json); the tasks of that model type: {fitting} (task=, --hf-task)")
    auto_class = getattr(transformers, spec.auto_class)
    if not fake:
        torch.manual_seed(seed)
    with fake_build(config_dtype(fields)) if fake else default_dtype(config_dtype(fields)), _fake_safe_init():
        try:
            return auto_class.from_config(config, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, TypeError) as error:
            detail = " ".join(str(error).split())  # one line: transformers' messages run over several
            raise CaptureError(f"transformers cannot build a {spec.name} model ({spec.auto_class}) from "
                               f"{folder}/config.json: {detail}; pick another task with task= (--hf-task): "
                               f"{', '.join(TASK_NAMES)}") from None
