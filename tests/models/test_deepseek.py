"""The DeepSeek-style workload: MLA + NSA attention, MoE dispatch, cached greedy decode, capture."""

import dataclasses

import pytest
import torch

from hyperoffload.capture import fake_build
from hyperoffload.ir import ValueKind
from hyperoffload.runtime import compare_with_eager
from hyperoffload.workloads import (DeepSeek, DeepSeekConfig, Llama, capture_workload, get_workload, greedy_generate,
                                    greedy_generate_uncached)
from hyperoffload.workloads.deepseek_attention import nsa_select
from hyperoffload.workloads.deepseek_moe import MoE, expert_capacity

TINY = get_workload("tiny-deepseek")


def tiny_model(seed=0, **changes):
    torch.manual_seed(seed)
    return DeepSeek(dataclasses.replace(TINY.config, **changes)).eval()


def test_cached_greedy_decode_matches_full_rerun():
    cfg = TINY.config
    model = tiny_model()
    prompt = torch.randint(0, cfg.vocab_size, (2, 41))
    # 41 + 39 = 80 tokens: 5 selection blocks of 16 for top-4 selection, past the window of 16, and the
    # prompt ends inside a compression block, so decode completes blocks the prefill left partial.
    cached = greedy_generate(model, prompt, 39)
    full = greedy_generate_uncached(model, prompt, 39)
    assert torch.equal(cached.tokens, full.tokens)
    torch.testing.assert_close(cached.logits, full.logits, rtol=1e-4, atol=1e-4)
    assert cached.tokens.unique().numel() > 10  # not a degenerate constant sequence


def test_greedy_generate_serves_the_llama_workload_too():
    torch.manual_seed(0)
    model = Llama(get_workload("tiny-llama").config).eval()
    prompt = torch.randint(0, 512, (1, 10))
    assert torch.equal(greedy_generate(model, prompt, 12).tokens, greedy_generate_uncached(model, prompt, 12).tokens)
    with pytest.raises(ValueError, match="steps must be positive"):
        greedy_generate(model, prompt, 0)


def test_gathered_and_dense_branches_agree_on_a_decode_step():
    model = tiny_model(seed=1)
    prompt = torch.randint(0, TINY.config.vocab_size, (2, 70))
    outputs = []
    for dense in (False, True):
        for layer in model.layers:
            layer.attn.dense_branches = dense
        cache = model.new_cache(2, 72)
        with torch.no_grad():
            model(prompt[:, :-1], cache=cache, start=torch.tensor([0]))
            outputs.append(model(prompt[:, -1:], cache=cache, start=torch.tensor([69])))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_decode_writes_compressed_keys_as_a_prefill_would():
    model = tiny_model(seed=2)
    tokens = torch.randint(0, TINY.config.vocab_size, (1, 40))
    by_prefill, by_decode = model.new_cache(1, 40), model.new_cache(1, 40)
    with torch.no_grad():
        model(tokens, cache=by_prefill, start=torch.tensor([0]))
        model(tokens[:, :1], cache=by_decode, start=torch.tensor([0]))
        for position in range(1, 40):
            model(tokens[:, position:position + 1], cache=by_decode, start=torch.tensor([position]))
    cfg = TINY.config
    complete = (40 - cfg.nsa_cmp_block) // cfg.nsa_cmp_stride + 1  # blocks whose last token is cached
    for (latent_p, compressed_p), (latent_d, compressed_d) in zip(by_prefill, by_decode):
        torch.testing.assert_close(latent_d, latent_p, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compressed_d[:, :complete], compressed_p[:, :complete], rtol=1e-5, atol=1e-5)
        assert compressed_d[:, complete:].abs().sum() == 0  # later blocks are never written early


def test_nsa_select_sums_heads_and_forces_first_and_local_blocks():
    # 8 selection blocks of 16 tokens; compressed blocks of 16 every 16 tokens, so block i is selection block i.
    probs = torch.zeros(1, 2, 1, 8)
    probs[0, 0, 0, 3] = 0.4
    probs[0, 1, 0, 2] = 0.3
    probs[0, 1, 0, 3] = 0.1  # summed over heads block 3 (0.5) beats block 2 (0.3)
    probs[0, :, 0, 7] = 0.5  # block 7 starts after the query: never chosen
    position = torch.tensor([16 * 6 + 3])  # in block 6, so blocks 6 and 5 are local
    chosen = nsa_select(probs, position, 16, 16, 16, 8, 4, 2)
    assert chosen.shape == (1, 1, 4)
    assert set(chosen.flatten().tolist()) == {0, 5, 6, 3}
    fewer = nsa_select(probs, position, 16, 16, 16, 8, 3, 1)
    assert set(fewer.flatten().tolist()) == {0, 6, 3}


def test_nsa_select_never_picks_future_blocks_when_enough_are_valid():
    torch.manual_seed(0)
    probs = torch.rand(2, 4, 5, 16)
    positions = torch.tensor([70, 100, 130, 200, 255])  # at least 5 valid blocks each
    chosen = nsa_select(probs, positions, 32, 16, 16, 16, 4, 2)
    assert (chosen * 16 <= positions[:, None]).all()


def reference_moe(moe: MoE, x):
    """Token by token, expert by expert: what real sparse dispatch computes."""
    probs = moe.gate(x).float().softmax(-1)
    weights, chosen = probs.topk(moe.per_token, -1)
    out = moe.shared(x) if moe.shared is not None else torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], chosen[t]):
            h = torch.nn.functional.silu(x[t] @ moe.w1[e]) * (x[t] @ moe.w3[e])
            out[t] += w * moe.routed_scale * (h @ moe.w2[e])
    return out


def test_moe_capacity_dispatch_matches_sparse_reference_when_drop_free():
    torch.manual_seed(0)
    moe = MoE(32, 24, 8, 1, 2, capacity_factor=None, norm_topk=False, routed_scale=1.5)
    x = torch.randn(10, 32)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-5, atol=1e-5)


def test_moe_capacity_drops_assignments_past_capacity():
    torch.manual_seed(0)
    moe = MoE(16, 8, 4, 0, 1, capacity_factor=0.25, norm_topk=False, routed_scale=1.0)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[2, 0] = 10.0  # every token prefers expert 2
        x = torch.randn(8, 16)
        x[:, 0] = 1.0
        assert expert_capacity(8, 4, 1, 0.25) == 1
        out = moe(x)
        # Only the first token fits in expert 2's single row; the others get nothing (no shared expert).
        assert out[0].abs().sum() > 0 and out[1:].abs().sum() == 0


def test_expert_capacity():
    assert expert_capacity(32, 64, 6, None) == 32
    assert expert_capacity(32, 64, 6, 1.25) == 4  # ceil(1.25 * 32 * 6 / 64)
    assert expert_capacity(1, 256, 8, 1.25) == 1  # at least one row per expert
    assert expert_capacity(4, 2, 2, 1.25) == 4  # never more rows than tokens


@pytest.mark.parametrize("mode", ["decode", "prefill", "train"])
def test_tiny_capture_runs_like_eager(mode):
    captured = capture_workload(TINY, mode, fake=False, **({"context": 37} if mode == "decode" else {}))
    result = compare_with_eager(captured)
    assert result.identical and result.live_bytes_agree
    targets = [op.target for op in captured.program.ops]
    assert sum(t == "hyperoffload.nsa_select.default" for t in targets) == TINY.config.layers


def test_decode_capture_takes_the_named_cache_as_input():
    cfg = TINY.config
    program = capture_workload(TINY, "decode", batch=3, context=40).program
    caches = [program.values[v] for v in program.inputs if program.values[v].kind == ValueKind.KV_CACHE]
    assert [v.name for v in caches[:2]] == ["kv_cache.layers.0.kv_latent", "kv_cache.layers.0.kv_compressed"]
    assert len(caches) == 2 * cfg.layers
    # 41 tokens rounded up to 3 selection blocks of 16; compressed blocks of 8 every 4 tokens over 48 slots.
    assert caches[0].shape == (3, 48, cfg.kv_dim)
    assert caches[1].shape == (3, (48 - 8) // 4 + 1, cfg.kv_dim)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="nsa_cmp_block"):
        dataclasses.replace(TINY.config, nsa_cmp_block=32).check()
    with pytest.raises(ValueError, match="experts_per_token"):
        dataclasses.replace(TINY.config, experts_per_token=9).check()
    with pytest.raises(ValueError, match="nsa_top_n"):
        dataclasses.replace(TINY.config, nsa_top_n=2).check()
    with pytest.raises(ValueError, match="start="):
        tiny_model()(torch.zeros(1, 4, dtype=torch.int64), cache=tiny_model().new_cache(1, 4))


def count_params(cfg: DeepSeekConfig) -> int:
    with fake_build(torch.bfloat16):
        return sum(p.numel() for p in DeepSeek(cfg).parameters())


def test_v2_lite_decode_fake_capture_sizes():
    workload = get_workload("deepseek-v2-lite")
    cfg = workload.config
    program = capture_workload(workload, "decode").program  # batch 32, context 32768
    params = sum(program.values[v].nbytes for v in program.inputs if program.values[v].kind == ValueKind.PARAMETER)
    assert params == 2 * count_params(cfg)
    assert 15.5e9 < count_params(cfg) < 16.0e9  # DeepSeek-V2-Lite: about 15.7B total
    kv = sum(program.values[v].nbytes for v in program.inputs if program.values[v].kind == ValueKind.KV_CACHE)
    slots = 32769 + 63 - (32769 + 63) % 64  # 32768 cached + 1 new token, in whole blocks of 64
    latent = cfg.layers * 32 * slots * 576 * 2
    compressed = cfg.layers * 32 * ((slots - 32) // 16 + 1) * 576 * 2
    assert kv == latent + compressed
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 27 * 576 * 2


@pytest.mark.slow
def test_v3_decode_fake_capture_sizes():
    workload = get_workload("deepseek-v3")
    assert 670e9 < count_params(workload.config) < 673e9  # 671B without the multi-token prediction module
    assert workload.config.kv_bytes_per_token(torch.bfloat16) == 70_272  # docs/references.md
    program = capture_workload(workload, "decode", context=4096).program
    assert sum(op.target == "hyperoffload.nsa_select.default" for op in program.ops) == 61
