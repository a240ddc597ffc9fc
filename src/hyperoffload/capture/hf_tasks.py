"""The Hugging Face tasks ``capture_hf`` captures: for each, the transformers auto class that builds its model and
how to make an example batch of the right kind and shapes.

One registry (``TASKS``), in order of precedence: a model type that several auto classes know (BART is a seq2seq LM,
a masked LM and a causal LM; Whisper a speech seq2seq model and a causal LM) is taken as the first task that knows
it, its main one. A config's ``architectures`` (or a model's own class) names the task exactly where it is given.
``transformers`` is imported only when a task is looked up, never at import time.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyperoffload.capture.graph_to_program import CaptureError


@dataclass(frozen=True, slots=True, kw_only=True)
class Example:
    """One example batch: the forward's tensor inputs by keyword, and the train step's targets (what the loss
    compares the logits with: integer token or class ids)."""

    inputs: dict[str, torch.Tensor]
    targets: torch.Tensor
    meta: dict[str, Any]
    """Sizes the Program's meta records (``seq``, ``image_size``, ...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HfTask:
    name: str
    """As ``task=`` and ``--hf-task`` take it."""
    auto_class: str
    """The transformers auto class that builds the task's model from a config."""
    mapping: str
    """That auto class's table of model types to classes in ``transformers.models.auto.modeling_auto``."""
    takes_seq: bool
    """Whether ``seq`` (tokens per sequence) sizes the batch; image classification takes the config's image size."""
    positions_field: str | None
    """The config field that bounds ``seq`` (None: no bound)."""
    example: Callable[[nn.Module, int, int | None], Example]
    """``example(model, batch, seq)``: random inputs from torch's global generator, on the model's device."""
    no_decode: str | None
    """Why the task has no decode step and what to capture instead; None where decode is captured."""


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point weights, which float inputs (pixels, mel features) take."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def text_config(model: nn.Module) -> Any:
    """The config holding the language model's sizes (multimodal configs nest it as a text config)."""
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def vocab_size(model: nn.Module) -> int:
    vocab = getattr(text_config(model), "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        raise CaptureError(
            f"{type(model).__name__} has no usable config.vocab_size (got {vocab!r}); capture_hf needs a "
            f"transformers model of one of its tasks ({', '.join(TASK_NAMES)}; a PreTrainedModel with a config, e.g. "
            f"LlamaForCausalLM). For any other nn.Module use capture_train_step / capture_prefill_step with your own "
            f"example inputs")
    return vocab


def _config_int(model: nn.Module, field: str, task: str, default: int | None = None) -> int:
    value = getattr(model.config, field, None)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CaptureError(f"a {task} step of {type(model).__name__} needs config.{field}, a positive int, got "
                           f"{value!r}; set it in the config, or pass your own inputs to capture_train_step")
    return value


def _next_tokens(vocab: int, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq`` tokens per sequence and their next-token targets (the tokens shifted by one)."""
    stream = torch.randint(0, vocab, (batch, seq + 1), dtype=torch.int64, device=device)
    # Clones, not views: the two inputs must own separate storages, or the capture would count one buffer for
    # both while a caller passing separate tensors holds two.
    return stream[:, :-1].clone(), stream[:, 1:].clone()


def _causal_lm(model: nn.Module, batch: int, seq: int | None) -> Example:
    ids, targets = _next_tokens(vocab_size(model), batch, seq, _device(model))
    return Example(inputs={"input_ids": ids}, targets=targets, meta={"seq": seq})


def _masked_lm(model: nn.Module, batch: int, seq: int | None) -> Example:
    # The targets are the tokens themselves, as a masked LM restores the masked ones: which positions are masked
    # (a mask token in the input, -100 in HF's labels elsewhere) changes no shape and no op of the step.
    ids = torch.randint(0, vocab_size(model), (batch, seq), dtype=torch.int64, device=_device(model))
    return Example(inputs={"input_ids": ids}, targets=ids.clone(), meta={"seq": seq})


def _seq2seq_lm(model: nn.Module, batch: int, seq: int | None) -> Example:
    vocab, device = vocab_size(model), _device(model)
    source = torch.randint(0, vocab, (batch, seq), dtype=torch.int64, device=device)
    decoder_ids, targets = _next_tokens(vocab, batch, seq, device)
    return Example(inputs={"input_ids": source, "decoder_input_ids": decoder_ids}, targets=targets,
                   meta={"seq": seq, "decoder_seq": seq})


def _image_classification(model: nn.Module, batch: int, seq: int | None) -> Example:
    task = "image-classification"
    size = getattr(model.config, "image_size", None)
    # Convolutional classifiers (ResNet, ConvNeXt) take any size and their configs state none: 224, as they train.
    height, width = (size, size) if isinstance(size, int) else tuple(size) if size else (224, 224)
    channels = _config_int(model, "num_channels", task, default=3)
    classes = _config_int(model, "num_labels", task)
    pixels = torch.randn((batch, channels, height, width), dtype=_float_dtype(model), device=_device(model))
    labels = torch.randint(0, classes, (batch,), dtype=torch.int64, device=_device(model))
    return Example(inputs={"pixel_values": pixels}, targets=labels, meta={"image_size": [height, width]})


def _speech_seq2seq(model: nn.Module, batch: int, seq: int | None) -> Example:
    task = "speech-seq2seq"
    mels = _config_int(model, "num_mel_bins", task)
    # Whisper's encoder halves the frames once (its second convolution has stride 2) to max_source_positions, and
    # checks that the features have exactly twice as many.
    frames = 2 * _config_int(model, "max_source_positions", task)
    features = torch.randn((batch, mels, frames), dtype=_float_dtype(model), device=_device(model))
    decoder_ids, targets = _next_tokens(vocab_size(model), batch, seq, _device(model))
    return Example(inputs={"input_features": features, "decoder_input_ids": decoder_ids}, targets=targets,
                   meta={"seq": seq, "frames": frames})


_ENCODER_DECODER_DECODE = ("decode capture of encoder-decoder models is not supported: their decode step also reads "
                           "the encoder's outputs and a cross-attention cache; capture mode='train' or 'prefill' "
                           "(--mode train or --mode prefill)")

TASKS = (
    HfTask(name="speech-seq2seq", auto_class="AutoModelForSpeechSeq2Seq",
           mapping="MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", takes_seq=True, positions_field="max_target_positions",
           example=_speech_seq2seq,
           no_decode=_ENCODER_DECODER_DECODE),
    HfTask(name="seq2seq-lm", auto_class="AutoModelForSeq2SeqLM",
           mapping="MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", takes_seq=True,
           positions_field="max_position_embeddings", example=_seq2seq_lm,
           no_decode=_ENCODER_DECODER_DECODE),
    HfTask(name="masked-lm", auto_class="AutoModelForMaskedLM", mapping="MODEL_FOR_MASKED_LM_MAPPING_NAMES",
           takes_seq=True, positions_field="max_position_embeddings", example=_masked_lm,
           no_decode="a masked LM has no decode step (it does not generate token by token); capture mode='train' "
                     "or 'prefill' (--mode train or --mode prefill)"),
    HfTask(name="causal-lm", auto_class="AutoModelForCausalLM", mapping="MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
           takes_seq=True, positions_field="max_position_embeddings", example=_causal_lm, no_decode=None),
    HfTask(name="image-classification", auto_class="AutoModelForImageClassification",
           mapping="MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", takes_seq=False, positions_field=None,
           example=_image_classification,
           no_decode="an image classifier has no decode step; capture mode='train' or 'prefill' (--mode train or "
                     "--mode prefill)"),
)
TASK_NAMES = tuple(task.name for task in TASKS)
_DEFAULT = "causal-lm"


def get_task(name: str) -> HfTask:
    for task in TASKS:
        if task.name == name:
            return task
    raise CaptureError(f"unknown Hugging Face task {name!r}; choose one of: {', '.join(TASK_NAMES)}")


def _mapping(task: HfTask) -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, task.mapping, {})


def task_of_config(*, architectures: Iterable[str] | None, model_type: str | None,
                   auto_map: Iterable[str] | None = None) -> HfTask | None:
    """The task a config describes: by the auto classes its ``auto_map`` names (remote code), else by its
    ``architectures`` (model class names), else by its ``model_type``; None where none names a task."""
    keys = set(auto_map or ())
    for task in TASKS:
        if task.auto_class in keys:
            return task
    for architecture in architectures or ():
        for task in TASKS:
            if architecture in _mapping(task).values():
                return task
    for task in TASKS:
        if model_type in _mapping(task):
            return task
    return None


def tasks_of_model_type(model_type: str | None) -> list[HfTask]:
    """The tasks whose auto class builds a model of ``model_type``, in precedence order."""
    return [task for task in TASKS if model_type in _mapping(task)]


def task_of_model(model: nn.Module) -> HfTask:
    """The task of a model instance: its class's, else its config's, else causal LM (any module with a
    ``config.vocab_size`` and an HF-style ``forward(input_ids)``)."""
    if importlib.util.find_spec("transformers") is None:  # no auto classes to ask
        return get_task(_DEFAULT)
    own = type(model).__name__
    config = getattr(model, "config", None)
    auto_map = getattr(config, "auto_map", None)
    return (task_of_config(architectures=[own], model_type=None)
            or task_of_config(architectures=getattr(config, "architectures", None),
                              model_type=getattr(config, "model_type", None),
                              auto_map=auto_map if isinstance(auto_map, dict) else None)
            or get_task(_DEFAULT))


def call_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword options of every captured call: ``return_dict=True`` (the output has ``.logits``) and, where the
    forward takes it, ``use_cache=False`` (no cache object made or returned: the forward is a pure function of
    weights and batch)."""
    options: dict[str, Any] = {"return_dict": True}
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {"use_cache": None}
    if "use_cache" in parameters:
        options["use_cache"] = False
    return options
