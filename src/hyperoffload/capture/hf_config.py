"""Read and check a local Hugging Face ``config.json`` before ``transformers`` sees it.

A config file is input from the user's disk, so it is checked as such: valid JSON holding one object, nested no
deeper than configs are, every size a positive whole number within what real models use (a config with a million
layers would otherwise be built and traced for ever while memory grows), a dtype that names a floating-point torch
dtype, no attention kernel named by a Hub repository, and no ``auto_map`` (Python files of the model folder that
transformers would import and run) unless the caller asked for remote code explicitly. Each refusal is one
``CaptureError`` naming the file, the field and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyperoffload.capture.graph_to_program import CaptureError

MAX_CONFIG_BYTES = 16 * 2**20
"""Largest config.json read (bytes); real ones are a few kilobytes."""

MAX_NESTING = 16
"""Deepest nesting of objects and lists accepted; real configs nest sub-configs two or three levels deep."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SizeRule:
    """Sane bounds of one kind of config size (inclusive), and the fields that hold it."""

    what: str
    """The unit, as the message says it ("layers")."""
    least: int
    most: int
    fields: tuple[str, ...]


# Upper bounds are several times the largest released models' figures, so that no real config is refused, and small
# enough that a typo (an extra three zeros) is caught before a build that never ends.
SIZE_RULES = (
    SizeRule(what="layers", least=1, most=1024,
             fields=("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "encoder_layers",
                     "decoder_layers")),
    SizeRule(what="channels", least=1, most=2**20,
             fields=("hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "d_ff", "ffn_dim",
                     "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "head_dim", "d_kv", "word_embed_proj_dim")),
    SizeRule(what="heads", least=1, most=4096,
             fields=("num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads")),
    SizeRule(what="tokens", least=1, most=2**24, fields=("vocab_size",)),
    SizeRule(what="positions", least=1, most=2**24,
             fields=("max_position_embeddings", "n_positions", "n_ctx", "max_source_positions",
                     "max_target_positions")),
    SizeRule(what="pixels", least=1, most=2**15, fields=("image_size", "patch_size")),
    SizeRule(what="channels", least=1, most=4096, fields=("num_channels", "num_mel_bins")),
    SizeRule(what="experts", least=0, most=2**14,
             fields=("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok")),
)
_RULE_OF_FIELD = {field: rule for rule in SIZE_RULES for field in rule.fields}

# Keys whose objects map labels or options, not sub-configs: their keys are not size fields.
_NOT_SUBCONFIGS = frozenset({"id2label", "label2id", "auto_map", "rope_scaling", "rope_parameters",
                             "quantization_config", "task_specific_params"})

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
"""The weight dtypes a config may name in ``torch_dtype`` / ``dtype``."""


def read_config(config_path: str) -> tuple[Path, dict[str, Any]]:
    """The folder of a ``config.json`` (the file or a folder holding one) and its checked contents."""
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
    file = folder / "config.json"
    try:
        size = file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise CaptureError(f"{file} is {size:,} bytes, more than any Hugging Face config (at most "
                               f"{MAX_CONFIG_BYTES:,} bytes read): give the model's config.json")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CaptureError(f"cannot read the Hugging Face config {file}: {error}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise CaptureError(f"{file} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}; "
                           f"fix the file or write it again with config.save_pretrained(folder)") from None
    except RecursionError:
        raise CaptureError(f"{file} nests objects or lists deeper than a JSON reader follows; a Hugging Face config "
                           f"nests at most a few levels (at most {MAX_NESTING} accepted)") from None
    if not isinstance(config, dict):
        raise CaptureError(f"{file} holds a JSON {type(config).__name__}, not an object of config fields such as "
                           f'{{"model_type": "llama", ...}}')
    _check_nesting(config, file)
    for where, fields in _subconfigs(config):
        _check_sizes(fields, where, file)
        _check_dtype(fields, where, file)
        _check_attention(fields, where, file)
    return folder, config


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    """The weight dtype a checked config names (``dtype``, else ``torch_dtype``), float32 when it names none."""
    name = config.get("dtype") or config.get("torch_dtype")
    return DTYPES[name.removeprefix("torch.")] if name else torch.float32


def remote_code_files(config: dict[str, Any]) -> list[str]:
    """The Python files of the model folder that ``config["auto_map"]`` has transformers import, sorted."""
    auto_map = config.get("auto_map")
    if auto_map is None:
        return []
    if not isinstance(auto_map, dict):
        raise CaptureError(f"config.json field auto_map must be an object mapping auto classes to code, got "
                           f"{type(auto_map).__name__}")
    files = set()
    for reference in auto_map.values():
        for name in reference if isinstance(reference, list) else [reference]:
            if isinstance(name, str) and name:
                # "module.Class", or "repo--module.Class" for code in another repository.
                module = name.split("--")[-1].rpartition(".")[0] or name
                files.add(module.replace(".", "/") + ".py")
    return sorted(files)


def check_remote_code(config: dict[str, Any], folder: Path, trust_remote_code: bool) -> None:
    """Refuse a config whose ``auto_map`` would run code from the model folder, unless it was asked for."""
    if "auto_map" not in config or trust_remote_code:
        return
    files = remote_code_files(config)
    keys = ", ".join(sorted(config["auto_map"]))
    named = ", ".join(str(folder / f) for f in files) or "(no file named)"
    raise CaptureError(f"{folder}/config.json has an auto_map ({keys}) that would import and run Python code from "
                       f"the model folder: {named}. hyperoffload runs a model folder's code only when asked: read "
                       f"the files, and if you trust them pass --trust-remote-code (trust_remote_code=True in "
                       f"Python); otherwise remove auto_map to build the model from transformers' own classes")


def _check_nesting(config: Any, file: Path) -> None:
    # Iterative, so that checking a deep document cannot itself overflow the stack.
    stack = [(config, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            raise CaptureError(f"{file} nests objects or lists {depth} levels deep; a Hugging Face config nests at "
                               f"most a few (at most {MAX_NESTING} accepted)")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _subconfigs(config: dict[str, Any], where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """The config and each object nested in it as a sub-config (``text_config``, ``encoder``, ...), with its
    dotted prefix."""
    yield where, config
    for key, value in config.items():
        if isinstance(value, dict) and key not in _NOT_SUBCONFIGS:
            yield from _subconfigs(value, f"{where}{key}.")


def _check_sizes(fields: dict[str, Any], where: str, file: Path) -> None:
    for field, value in fields.items():
        rule = _RULE_OF_FIELD.get(field)
        if rule is None or value is None:
            continue
        for size in value if isinstance(value, list) and field == "image_size" else [value]:
            if isinstance(size, bool) or not isinstance(size, int):
                raise CaptureError(f"{file}: field {where}{field} must be a whole number of {rule.what}, got "
                                   f"{json.dumps(value)}")
            if size < rule.least:
                raise CaptureError(f"{file}: field {where}{field} must be at least {rule.least} {rule.what}, got "
                                   f"{size}")
            if size > rule.most:
                raise CaptureError(f"{file}: field {where}{field} = {size:,} is more than any real model has (at "
                                   f"most {rule.most:,} {rule.what} accepted); fix the config")


def _check_attention(fields: dict[str, Any], where: str, file: Path) -> None:
    # transformers takes "org/repo" (or "org/repo:kernel") as a kernel to fetch from the Hub and load: code from
    # outside, which an offline build never needs.
    for field in ("attn_implementation", "_attn_implementation"):
        value = fields.get(field)
        if value is not None and (not isinstance(value, str) or "/" in value or ":" in value):
            raise CaptureError(f"{file}: field {where}{field} is {json.dumps(value)}; a kernel named by repository "
                               f"would be downloaded and run: use one of transformers' own attention "
                               f"implementations (eager, sdpa) or leave the field out")


def _check_dtype(fields: dict[str, Any], where: str, file: Path) -> None:
    for field in ("torch_dtype", "dtype"):
        value = fields.get(field)
        if value is None:
            continue
        if not isinstance(value, str) or value.removeprefix("torch.") not in DTYPES:
            raise CaptureError(f"{file}: field {where}{field} is {json.dumps(value)}, not a weight dtype; use one "
                               f"of: {', '.join(DTYPES)} (or leave it out for float32)")
