"""Capture of Hugging Face models: tiny LLaMA and Qwen2 built from configs with random weights
(nothing is downloaded). Each capture is checked against an eager run of the same step, bit for
bit in float32, and the reference executor's measured bytes against the lifetime analysis."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hyperoffload.analysis import memory_profile  # noqa: E402
from hyperoffload.capture import CaptureError, fake_build, is_fake  # noqa: E402
from hyperoffload.capture.hf import capture_hf  # noqa: E402
from hyperoffload.runtime import run_reference  # noqa: E402
from helpers import assert_matches_eager  # noqa: E402

BATCH, SEQ = 2, 8
# Tiny, dropout-free (both families default attention_dropout to 0.0), GQA 2:1 like the real models.
SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")


def build(family: str):
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES))
    raise AssertionError(family)


FAMILIES = ("llama", "qwen2")


@pytest.mark.parametrize("mode", ["train", "prefill"])
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_matches_eager_step_and_profile(family: str, mode: str) -> None:
    model = build(family)
    torch.manual_seed(1)
    captured = capture_hf(model, mode, batch=BATCH, seq=SEQ)
    program = captured.program
    assert program.mode == mode and program.meta["batch"] == BATCH and program.meta["seq"] == SEQ
    assert all(t.dtype in (torch.float32, torch.int64) for t in captured.inputs)
    ids = captured.inputs[-2 if mode == "train" else -1]
    assert ids.shape == (BATCH, SEQ) and ids.dtype == torch.int64 and int(ids.max()) < 128
    if mode == "train":
        targets = captured.inputs[-1]
        assert targets.shape == (BATCH, SEQ) and torch.equal(targets[:, :-1], ids[:, 1:])  # next-token targets

    assert_matches_eager(captured)
    if mode == "train":  # the update did land
        updated = [t.clone() for t in captured.inputs]
        run_reference(program, updated)
        assert not all(torch.equal(u, o) for u, o in zip(updated, captured.inputs))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_plain_forward(family: str) -> None:
    model = build(family)
    torch.manual_seed(1)
    captured = capture_hf(model, "prefill", batch=BATCH, seq=SEQ)
    assert not model.training  # prefill is inference: eval mode
    ids = captured.inputs[-1]
    with torch.no_grad():
        plain = model(ids).logits
    # Exact, not allclose: the adapter keeps the traced step on HF's eager path (no mask, SDPA
    # is_causal with grouped-query K/V), so the graph runs the very same CPU kernels as model(ids).
    assert torch.equal(captured.step(*captured.inputs), plain)
    assert torch.equal(run_reference(captured.program, list(captured.inputs)).outputs[0], plain)


def test_no_explicit_attention_mask_in_graph() -> None:
    model = build("llama")
    masking_utils = transformers.masking_utils
    original = masking_utils.find_packed_sequence_indices
    captured = capture_hf(model, "prefill", batch=BATCH, seq=SEQ)
    assert masking_utils.find_packed_sequence_indices is original  # the trace-time patch is undone
    # A (batch, 1, seq, seq) mask would show up as a where() feeding attention and cost seq**2 bytes.
    assert not any(op.target.startswith("aten.where") for op in captured.program.ops)


@pytest.mark.parametrize("mode", ["train", "prefill"])
def test_fake_capture_matches_real(mode: str) -> None:
    real = build("llama")
    with fake_build():
        fake = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    assert all(is_fake(p) for p in fake.parameters())
    fake_captured = capture_hf(fake, mode, batch=BATCH, seq=SEQ)
    real_captured = capture_hf(real, mode, batch=BATCH, seq=SEQ)
    assert all(is_fake(t) for t in fake_captured.inputs)  # nothing of a fake capture is allocated
    assert len(fake_captured.program.ops) == len(real_captured.program.ops)
    fake_profile, real_profile = memory_profile(fake_captured.program), memory_profile(real_captured.program)
    assert fake_profile.peak_bytes == real_profile.peak_bytes
    assert fake_profile.live_bytes == real_profile.live_bytes
    with pytest.raises(CaptureError, match="fake"):
        capture_hf(fake, mode, batch=BATCH, seq=SEQ, fake_inputs=False)


def test_fake_inputs_for_real_model() -> None:
    real = build("llama")
    captured = capture_hf(real, "prefill", batch=BATCH, seq=SEQ, fake_inputs=True)
    assert is_fake(captured.inputs[-1]) and not is_fake(captured.inputs[0])
    assert memory_profile(captured.program).peak_bytes == memory_profile(
        capture_hf(real, "prefill", batch=BATCH, seq=SEQ).program).peak_bytes


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "decode", "seq": SEQ}, "pass context"),
    ({"mode": "decode"}, "decode needs context"),
    ({"mode": "decode", "context": -1}, "decode needs context"),
    ({"mode": "decode", "context": 10**6}, "max_position_embeddings"),
    ({"mode": "train", "seq": SEQ, "context": 8}, "a train step has none"),
])
def test_decode_input_is_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(CaptureError, match=match):
        capture_hf(build("llama"), batch=BATCH, **kwargs)


def test_too_long_a_context_is_reported_as_the_context() -> None:
    # The user sets the context; the step needs one position more, for the new token.
    model = build("llama")  # max_position_embeddings 2048
    with pytest.raises(CaptureError) as raised:
        capture_hf(model, "decode", batch=BATCH, context=4096)
    message = str(raised.value)
    assert message.startswith("a decode step at context=4096 needs 4097 positions")
    assert "max_position_embeddings=2048" in message and "at most 2047 (--context" in message
    assert "seq" not in message
    capture_hf(model, "decode", batch=1, context=2047, fake_inputs=True)  # the largest context it names fits


def test_a_config_path_not_named_config_json_names_the_rule(tmp_path) -> None:
    from hyperoffload.capture.hf import build_hf_model

    transformers.LlamaConfig(**SIZES).save_pretrained(tmp_path)
    other = tmp_path / "badcfg.json"
    other.write_text((tmp_path / "config.json").read_text())
    with pytest.raises(CaptureError, match=r"must be a file named config\.json or a folder that holds one; "
                                           r".*badcfg\.json is named badcfg\.json: rename or copy it"):
        build_hf_model(str(other))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CaptureError, match="no Hugging Face config at .*: the folder holds no config.json"):
        build_hf_model(str(tmp_path / "empty"))
    with pytest.raises(CaptureError, match="no Hugging Face config at .*: no such file or folder"):
        build_hf_model(str(tmp_path / "missing"))


def test_a_model_that_cannot_decode_against_a_static_cache_is_a_capture_error(monkeypatch) -> None:
    model = build("llama")

    def old_forward(input_ids, **kwargs):  # a forward from before cache_position
        raise TypeError("forward() got an unexpected keyword argument 'cache_position'")

    monkeypatch.setattr(model, "forward", old_forward)
    with pytest.raises(CaptureError, match="does not decode one token against a StaticCache .*prefill"):
        capture_hf(model, "decode", batch=BATCH, context=8)


@pytest.mark.parametrize(("model", "kwargs", "match"), [
    (lambda: transformers.LlamaConfig(**SIZES), {}, "nn.Module"),
    (lambda: torch.nn.Linear(4, 4), {}, "vocab_size"),
    (lambda: build("llama"), {"batch": 0}, "batch must be a positive"),
    (lambda: build("llama"), {"seq": -1}, "seq must be a positive"),
    (lambda: build("llama"), {"seq": 10**6}, "max_position_embeddings"),
    (lambda: build("llama"), {"mode": "generate"}, "unknown mode"),
])
def test_bad_input_is_a_capture_error(model, kwargs: dict, match: str) -> None:
    args = {"mode": "train", "batch": BATCH, "seq": SEQ, **kwargs}
    with pytest.raises(CaptureError, match=match):
        capture_hf(model(), args.pop("mode"), **args)


def test_importing_the_adapter_does_not_import_transformers() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    code = ("import sys; sys.path.insert(0, %r); import hyperoffload, hyperoffload.capture.hf; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'" % str(src))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
