"""Hugging Face configs as untrusted input, through the API: code a model folder names (``auto_map``) is refused
without trust_remote_code; a config's dtype sets the weights; long captures report progress per layer. The same
through the command line: tests/cli/test_hf_tasks_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_configs import LLAMA  # noqa: E402
from hf_configs import remote_code_folder  # noqa: E402

from hyperoffload.capture import CaptureError  # noqa: E402
from hyperoffload.capture.hf import build_hf_model, capture_hf  # noqa: E402


def test_the_api_refuses_a_model_folders_code_by_default(tmp_path) -> None:
    folder = remote_code_folder(tmp_path)
    with pytest.raises(CaptureError, match=r"auto_map \(AutoModelForCausalLM\) .*modeling_evil\.py.*"
                                           r"trust_remote_code=True"):
        build_hf_model(str(folder))
    assert not (folder / "MARKER").exists()


def test_a_config_dtype_sets_the_weights() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": "bfloat16"}))
        model = build_hf_model(folder)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_progress_is_reported_per_layer_of_each_stack(tmp_path) -> None:
    """A causal LM's decoder layers, and an encoder-decoder's two stacks, each layer once as the trace reaches it."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    calls: list[tuple[str, int, int]] = []
    capture_hf(build_hf_model(str(tmp_path)), "train", batch=1, seq=8, progress=lambda *call: calls.append(call))
    assert calls == [("tracing layers", 1, 2), ("tracing layers", 2, 2)]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32, "d_kv": 16, "d_ff": 64,
                                                      "num_layers": 2, "num_decoder_layers": 1, "num_heads": 2,
                                                      "vocab_size": 128, "decoder_start_token_id": 0}))
    calls.clear()
    capture_hf(build_hf_model(str(tmp_path)), "prefill", batch=1, seq=8, progress=lambda *call: calls.append(call))
    assert [done for _, done, _ in calls] == [1, 2, 3] and {total for _, _, total in calls} == {3}
