"""Hugging Face causal LMs of several architectures through the whole pipeline: a tiny config written to a
folder (random weights, nothing downloaded), built with ``build_hf_model`` as ``hf:PATH`` does, captured for
train and prefill, planned under half the no-offload peak and run: the planned step bit-identical to the
unplanned one."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hyperoffload import plan  # noqa: E402
from hyperoffload.analysis import memory_profile  # noqa: E402
from hyperoffload.capture.hf import build_hf_model, capture_hf  # noqa: E402
from hyperoffload.hardware import get_hardware  # noqa: E402
from hyperoffload.plans import plan_without_offload  # noqa: E402
from hyperoffload.policies import PlannerConfig, plan_hyperoffload  # noqa: E402
from hyperoffload.runtime import EmulatedLink, compare_with_eager, run_plan  # noqa: E402
from hyperoffload.runtime.measure import RunConfig, measure_run, replayed_random_numbers  # noqa: E402
from helpers import assert_matches_eager  # noqa: E402
from hf_configs import SEQ, TASK_ARCHITECTURES  # noqa: E402

_TOKENS = dict(vocab_size=256, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **_TOKENS)
# Each architecture's tiny config, as AutoConfig.for_model(model_type, **sizes) takes it. Their default
# dropout is kept: GPT-2 trains with dropout 0.1 (random ops in the step).
ARCHITECTURES = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=256, bos_token_id=1, eos_token_id=2),
    "llama": dict(_DECODER, num_key_value_heads=2),
    "mistral": dict(_DECODER, num_key_value_heads=2, sliding_window=8),
    "qwen2": dict(_DECODER, num_key_value_heads=2),
    "phi3": dict(_DECODER, num_key_value_heads=2, pad_token_id=0),
    "phi": dict(_DECODER, num_key_value_heads=4),
    "gemma": dict(_DECODER, num_key_value_heads=2, head_dim=16),
    "gemma2": dict(_DECODER, num_key_value_heads=2, head_dim=16, sliding_window=8),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                **_TOKENS),
    "gpt_neox": dict(_DECODER),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **_TOKENS),
    "mixtral": dict(_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_DECODER, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64),
}


def _config_path(tmp_path, arch: str) -> str:
    try:
        config = transformers.AutoConfig.for_model(arch, **ARCHITECTURES[arch])
    except (KeyError, ValueError):
        pytest.skip(f"transformers {transformers.__version__} has no {arch} architecture")
    config.save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def _capture(tmp_path, arch: str, mode: str):
    model = build_hf_model(_config_path(tmp_path, arch), fake=False)
    torch.manual_seed(0)
    return capture_hf(model, mode, batch=1, seq=SEQ)


@pytest.mark.parametrize("mode", ["train", "prefill"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_architecture_plans_and_runs_bit_identical(tmp_path, arch: str, mode: str) -> None:
    captured = _capture(tmp_path, arch, mode)
    program = captured.program
    assert program.meta["model_type"] == arch and program.mode == mode
    peak = memory_profile(program).peak_bytes
    # Planned for 60% of the peak: tied-embedding models (GPT-2) have a prefill whose output projection
    # alone needs more than half of the tiny step's peak.
    planned = plan(program, "h100-sxm", int(peak * 0.6))
    assert planned.budget_bytes < peak
    reference_inputs = [t.clone() for t in captured.inputs]
    planned_inputs = [t.clone() for t in captured.inputs]
    torch.manual_seed(1)  # the same random state for both runs: GPT-2's dropout draws from it
    reference = run_plan(plan_without_offload(program), reference_inputs)
    torch.manual_seed(1)
    planned_run = run_plan(planned, planned_inputs)
    assert planned_run.peak_bytes <= planned.budget_bytes
    assert len(planned_run.outputs) == len(reference.outputs)
    assert all(torch.equal(a, b) for a, b in zip(planned_run.outputs, reference.outputs))
    assert all(torch.equal(a, b) for a, b in zip(planned_inputs, reference_inputs))
    if mode == "train":  # the update did land
        assert not all(torch.equal(a, b) for a, b in zip(reference_inputs, captured.inputs))

@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_architecture_trains_from_a_static_arena_bit_identical(tmp_path, arch: str) -> None:
    """Planned with a static layout and run from one arena: each architecture's ops either write into their
    slots through their ``out=`` overloads or are copied in, and the step is bit-identical either way."""
    captured = _capture(tmp_path, arch, "train")
    program = captured.program
    hardware = get_hardware("h100-sxm")
    planned = plan_hyperoffload(program, hardware, int(memory_profile(program).peak_bytes * 0.7),
                                config=PlannerConfig(static_layout=True))
    reference_inputs = [t.clone() for t in captured.inputs]
    arena_inputs = [t.clone() for t in captured.inputs]
    with replayed_random_numbers():
        reference = run_plan(plan_without_offload(program), reference_inputs)
    run = run_plan(planned, arena_inputs, arena=True)
    assert run.arena_bytes == planned.layout.arena_bytes <= planned.budget_bytes
    assert all(torch.equal(a, b) for a, b in zip(run.outputs, reference.outputs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(arena_inputs, reference_inputs, strict=True))
    made = sum(program.values[o].alloc_bytes for op in program.ops for o in op.outputs
               if program.values[o].owns_storage)
    assert run.arena_copied_bytes < 0.25 * made  # most results are written into their slots


def test_dropout_step_compares_bit_identical(tmp_path) -> None:
    """GPT-2 trains with dropout: the step draws random masks. The comparisons run both sides from the same
    random state, so a correct plan (and the graph against eager) is bit-identical rather than off by a mask."""
    captured = _capture(tmp_path, "gpt2", "train")
    assert any(op.target.startswith("aten.bernoulli") for op in captured.program.ops)
    comparison = compare_with_eager(captured)
    assert comparison.identical and comparison.max_abs_diff == 0.0
    program = captured.program
    planned = plan(program, "h100-sxm", "50%")
    with EmulatedLink(h2d_bw=1e12, d2h_bw=1e12) as link:
        figures = measure_run(planned, captured.inputs, link, get_hardware("h100-sxm"), RunConfig(steps=1, warmup=0))
    assert figures.max_abs_diff == 0.0
    assert figures.measured_peak_bytes <= planned.budget_bytes


def _expert_products(program, target: str) -> list[tuple[int, int]]:
    """(FLOPs, 2 x rows x k x n) of each forward grouped expert product in ``program``."""
    found = []
    for op in program.ops:
        if op.target.startswith(target + "."):
            rows, k = program.values[op.inputs[0]].shape
            n = program.values[op.outputs[0]].shape[-1]
            found.append((op.flops, 2 * rows * k * n))
    return found


def test_float32_moe_experts_trace_and_match_eager(tmp_path) -> None:
    """transformers' grouped_mm experts fail to trace in float32 (torch's fake-tensor shape function for
    grouped_mm takes bfloat16 only): the capture routes them to transformers' fallback op, in the graph and in
    the eager step alike, and counts its FLOPs as one (rows x k) @ (k x n) product."""
    captured = _capture(tmp_path, "mixtral", "train")
    products = _expert_products(captured.program, "transformers.grouped_mm_fallback")
    assert len(products) == 4  # 2 layers x (gate_up, down)
    assert all(flops == expected and flops > 0 for flops, expected in products)
    assert any(op.target.startswith("transformers.grouped_mm_fallback_backward") and op.flops > 0
               for op in captured.program.ops)
    assert_matches_eager(captured)


def test_bfloat16_moe_keeps_grouped_mm_with_matmul_flops(tmp_path) -> None:
    sizes = dict(ARCHITECTURES["mixtral"], dtype="bfloat16")
    transformers.AutoConfig.for_model("mixtral", **sizes).save_pretrained(tmp_path)
    model = build_hf_model(str(tmp_path), fake=True)
    captured = capture_hf(model, "prefill", batch=1, seq=SEQ)
    products = _expert_products(captured.program, "aten._grouped_mm")
    assert len(products) == 4
    assert all(flops == expected for flops, expected in products)


# Decode keeps the KV cache in transformers' StaticCache layout (Mistral and Gemma 2 as configured above with
# sliding-window layers of 8 tokens); OPT (learned positions from the cache length as a Python number) is refused.
DECODE_REFUSED = {"opt": "reads a tensor's value as a Python number"}


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in DECODE_REFUSED])
def test_architecture_decode_plans_and_runs_bit_identical(tmp_path, arch: str) -> None:
    model = build_hf_model(_config_path(tmp_path, arch), fake=False)
    torch.manual_seed(0)
    captured = capture_hf(model, "decode", batch=2, context=12)
    program = captured.program
    assert program.mode == "decode" and program.meta["context"] == 12
    cache = [program.values[v] for v in program.inputs if program.values[v].kind.value == "kv_cache"]
    # (batch, kv heads, slots, head dim): context + 1 slots, or a sliding window's 8 (every Mistral layer)
    assert cache and all(v.shape[2] == (8 if arch == "mistral" else 13) or arch == "gemma2" and v.shape[2] == 8
                         for v in cache)
    peak = memory_profile(program).peak_bytes
    planned = plan(program, "h100-sxm", int(peak * 0.7))
    reference = run_plan(plan_without_offload(program), [t.clone() for t in captured.inputs])
    planned_run = run_plan(planned, [t.clone() for t in captured.inputs])
    assert planned_run.peak_bytes <= planned.budget_bytes < peak
    assert all(torch.equal(a, b) for a, b in zip(planned_run.outputs, reference.outputs))


# Real weights; fake weights, as the command line builds them; fake inputs for real weights. On fake tensors the
# value read fails inside the trace rather than showing in the graph: the refusal must be the same.
@pytest.mark.parametrize(("fake", "fake_inputs"), [(False, None), (True, None), (False, True)])
@pytest.mark.parametrize("arch", list(DECODE_REFUSED))
def test_decode_of_an_unsupported_cache_is_refused_by_name(tmp_path, arch: str, fake: bool,
                                                           fake_inputs: bool | None) -> None:
    from hyperoffload.capture import CaptureError

    model = build_hf_model(_config_path(tmp_path, arch), fake=fake)
    with pytest.raises(CaptureError, match=DECODE_REFUSED[arch]) as raised:
        capture_hf(model, "decode", batch=1, context=8, fake_inputs=fake_inputs)
    assert "prefill" in str(raised.value) and "tracing the decode step" not in str(raised.value)


@pytest.mark.parametrize("context", [5, 12])  # Mistral's and Gemma 2's windows (8 tokens): not yet full, full
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_the_decode_step_continues_what_a_prompt_left_in_the_cache(tmp_path, arch: str, context: int) -> None:
    """The captured decode step, run by the reference executor on a cache the same adapter filled from a prompt,
    gives the next token's logits of a full forward pass over prompt and token (the last bits aside: one
    attention over the cache's slots against a causal one over the tokens)."""
    from hyperoffload.capture.hf import StaticCacheDecoder
    from hyperoffload.runtime import run_reference

    model = build_hf_model(_config_path(tmp_path, arch), fake=False)
    torch.manual_seed(0)
    captured = capture_hf(model, "decode", batch=2, context=context)
    program = captured.program
    decoder = StaticCacheDecoder(model, position=0)  # the prompt goes in from slot 0
    prompt = torch.randint(0, 256, (2, context))
    token = torch.randint(0, 256, (2, 1))
    cache = decoder.new_cache(2, context + 1)
    with torch.no_grad():
        decoder(prompt, cache, torch.zeros(1, dtype=torch.int64))  # the prefill writes the prompt's slots
        want = model(torch.cat((prompt, token), 1)).logits[:, -1:]
    inputs = list(captured.inputs)
    flat_cache = [t for pair in cache for t in pair]
    kv_positions = [i for i, v in enumerate(program.inputs) if program.values[v].kind.value == "kv_cache"]
    for position, tensor in zip(kv_positions, flat_cache, strict=True):
        inputs[position] = tensor.clone()
    inputs[-2] = token  # tokens, then start (= context)
    got = run_reference(program, inputs).outputs[0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in DECODE_REFUSED])
def test_architecture_decode_captures_on_fake_weights(tmp_path, arch: str) -> None:
    """As ``hf:PATH`` captures by default: weights and cache on fake tensors (float32 experts included: the
    call that sizes the cache takes the same traceable paths as the capture)."""
    model = build_hf_model(_config_path(tmp_path, arch), fake=True)
    program = capture_hf(model, "decode", batch=2, context=12).program
    assert program.mode == "decode" and any(program.values[v].kind.value == "kv_cache" for v in program.inputs)


# The batch each task's capture feeds its model, by keyword, with its shape at batch=2, seq=SEQ.
TASK_INPUTS = {
    "bert": {"input_ids": (2, SEQ)},
    "t5": {"input_ids": (2, SEQ), "decoder_input_ids": (2, SEQ)},
    "bart": {"input_ids": (2, SEQ), "decoder_input_ids": (2, SEQ)},
    "vit": {"pixel_values": (2, 3, 32, 32)},
    "whisper": {"input_features": (2, 16, 32), "decoder_input_ids": (2, SEQ)},  # 2 x max_source_positions frames
}


def _task_config_path(tmp_path, arch: str) -> str:
    sizes, _, _ = TASK_ARCHITECTURES[arch]
    try:
        config = transformers.AutoConfig.for_model(arch, **sizes)
    except (KeyError, ValueError):
        pytest.skip(f"transformers {transformers.__version__} has no {arch} architecture")
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def _task_seq(arch: str) -> int | None:
    return None if TASK_ARCHITECTURES[arch][1] == "image-classification" else SEQ


@pytest.mark.parametrize("mode", ["train", "prefill"])
@pytest.mark.parametrize("arch", list(TASK_ARCHITECTURES))
def test_task_plans_and_runs_bit_identical(tmp_path, arch: str, mode: str) -> None:
    """Each task's model is built from its config alone (the task from its model type), fed its own kind of batch,
    planned under half its peak and run: planned and unplanned steps bit-identical, the graph the eager step."""
    _, task, model_class = TASK_ARCHITECTURES[arch]
    model = build_hf_model(_task_config_path(tmp_path, arch), fake=False)
    assert type(model).__name__ == model_class
    torch.manual_seed(0)
    captured = capture_hf(model, mode, batch=2, seq=_task_seq(arch))
    program = captured.program
    assert program.meta["model_type"] == arch and program.meta["task"] == task and program.mode == mode
    batch = [program.values[v] for v in program.inputs if program.values[v].name.startswith("batch")]
    assert [tuple(v.shape) for v in batch] == list(TASK_INPUTS[arch].values())
    if mode == "train":  # the targets: class ids per image, else a token id per (decoder) position
        target = captured.inputs[-1]
        assert target.dtype == torch.int64
        assert target.shape == ((2,) if task == "image-classification" else (2, SEQ))
    assert_matches_eager(captured)
    peak = memory_profile(program).peak_bytes
    planned = plan(program, "h100-sxm", "50%")
    assert planned.budget_bytes <= peak // 2 + 1
    reference_inputs = [t.clone() for t in captured.inputs]
    planned_inputs = [t.clone() for t in captured.inputs]
    torch.manual_seed(1)  # the same random state for both runs: BERT's and T5's dropout draw from it
    reference = run_plan(plan_without_offload(program), reference_inputs)
    torch.manual_seed(1)
    planned_run = run_plan(planned, planned_inputs)
    assert planned_run.peak_bytes <= planned.budget_bytes
    assert all(torch.equal(a, b) for a, b in zip(planned_run.outputs, reference.outputs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(planned_inputs, reference_inputs, strict=True))
    if mode == "train":  # the update did land
        assert not all(torch.equal(a, b) for a, b in zip(reference_inputs, captured.inputs))


@pytest.mark.parametrize("arch", list(TASK_ARCHITECTURES))
def test_task_captures_on_fake_weights(tmp_path, arch: str) -> None:
    """As ``hf:PATH`` captures by default: weights and batch on fake tensors (ViT's truncated-normal init draws by
    rejection, which a fake tensor cannot: the fake build skips it)."""
    model = build_hf_model(_task_config_path(tmp_path, arch), fake=True)
    program = capture_hf(model, "train", batch=2, seq=_task_seq(arch)).program
    assert program.meta["task"] == TASK_ARCHITECTURES[arch][1] and program.mode == "train"


@pytest.mark.parametrize("arch", list(TASK_ARCHITECTURES))
def test_decode_of_a_task_without_one_says_what_works(tmp_path, arch: str) -> None:
    from hyperoffload.capture import CaptureError

    model = build_hf_model(_task_config_path(tmp_path, arch), fake=True)
    with pytest.raises(CaptureError, match=r"decode .*--mode train or --mode prefill"):
        capture_hf(model, "decode", batch=1, context=4)


def test_the_task_follows_architectures_and_can_be_overridden(tmp_path) -> None:
    """BART is a seq2seq LM, a masked LM and a causal LM in transformers' tables: by default its main task, by its
    config's architectures where they name one, and by task= where the caller picks one."""
    path = _task_config_path(tmp_path, "bart")
    assert type(build_hf_model(path)).__name__ == "BartForConditionalGeneration"
    assert type(build_hf_model(path, task="causal-lm")).__name__ == "BartForCausalLM"
    config = transformers.AutoConfig.from_pretrained(path)
    config.architectures = ["BartForCausalLM"]
    config.save_pretrained(tmp_path)
    model = build_hf_model(path, fake=False)
    assert type(model).__name__ == "BartForCausalLM"
    torch.manual_seed(0)
    assert capture_hf(model, "prefill", batch=1, seq=SEQ).program.meta["task"] == "causal-lm"
    from hyperoffload.capture import CaptureError

    with pytest.raises(CaptureError, match="unknown Hugging Face task 'vision'; choose one of: .*masked-lm"):
        build_hf_model(path, task="vision")
    with pytest.raises(CaptureError, match="no image-classification model .* of model_type 'bart' .*; the tasks of "
                                           "that model type: seq2seq-lm, masked-lm, causal-lm"):
        build_hf_model(path, task="image-classification")
    with pytest.raises(CaptureError, match="drop seq"):
        capture_hf(build_hf_model(_task_config_path(tmp_path / "vit", "vit")), "train", batch=1, seq=SEQ)
