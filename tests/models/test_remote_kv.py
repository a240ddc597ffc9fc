"""The remote KV cache of the DeepSeek-style workload: indexed prefetch, remote decode, block pool."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from hyperoffload.block_ops import PREFETCH_BLOCKS, prefetch_blocks
from hyperoffload.workloads import DeepSeek, get_workload, greedy_generate
from hyperoffload.workloads.deepseek_remote import new_remote_cache


def test_prefetch_blocks_returns_exactly_the_selected_rows():
    remote = torch.randn(2, 6 * 4, 5)
    ids = torch.tensor([[3, 0, 3], [5, 1, 2]])  # repeated and out of order
    out = prefetch_blocks(remote, ids, 4)
    assert out.shape == (2, 3, 4, 5)
    for b in range(2):
        for i, j in enumerate(ids[b].tolist()):
            assert torch.equal(out[b, i], remote[b, 4 * j:4 * j + 4])
    assert out.untyped_storage().data_ptr() != remote.untyped_storage().data_ptr()  # a copy, not a view
    # One sequence (no leading dimension) and no blocks at all.
    assert torch.equal(prefetch_blocks(remote[1], torch.tensor([2]), 4)[0], remote[1, 8:12])
    assert prefetch_blocks(remote, torch.zeros(2, 0, dtype=torch.int64), 4).shape == (2, 0, 4, 5)


def test_prefetch_blocks_rejects_bad_ids_and_shapes():
    remote = torch.zeros(1, 8, 3)
    with pytest.raises(IndexError, match="block id 2 is out of range .* 2 blocks of 4 slots"):
        prefetch_blocks(remote, torch.tensor([[0, 2]]), 4)
    with pytest.raises(IndexError, match="block id -1"):
        prefetch_blocks(remote, torch.tensor([[-1]]), 4)
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        prefetch_blocks(remote, torch.tensor([[0]]), 3)
    with pytest.raises(ValueError, match="block_ids must be int64 of shape"):
        prefetch_blocks(remote, torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="block_ids must be int64"):
        prefetch_blocks(remote, torch.tensor([[0.0]]), 4)


def test_prefetch_blocks_traces_under_make_fx_and_fake_mode():
    def step(remote, ids):
        return prefetch_blocks(remote, ids, 4).sum(-1)

    remote, ids = torch.randn(2, 16, 3), torch.tensor([[1, 0], [3, 3]])
    graph = make_fx(step)(remote, ids)
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"].count(PREFETCH_BLOCKS) == 1
    assert torch.equal(graph(remote, ids), step(remote, ids))
    with FakeTensorMode() as mode:
        fake = prefetch_blocks(mode.from_tensor(remote), mode.from_tensor(ids), 4)
    assert fake.shape == (2, 2, 4, 3)
    fake_graph = make_fx(step, tracing_mode="fake")(remote, ids)
    assert sum(n.target == PREFETCH_BLOCKS for n in fake_graph.graph.nodes) == 1


def test_prefetch_blocks_passes_opcheck():
    torch.library.opcheck(prefetch_blocks, (torch.randn(2, 16, 3), torch.tensor([[1, 0], [3, 3]]), 4))


TINY = get_workload("tiny-deepseek")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = DeepSeek(TINY.config).eval()
    # 100 + 65 tokens: 11 selection blocks of 16 for top-4 selection, so selection has real choices.
    prompt = torch.randint(0, TINY.config.vocab_size, (2, 100))
    return model, prompt, greedy_generate(model, prompt, 65)  # the prefill's token + 64 decode steps


@pytest.mark.parametrize("pool_blocks", [None, 4, 6, "speculative"])
def test_remote_kv_decode_gives_exactly_the_on_device_tokens(tiny, pool_blocks):
    model, prompt, on_device = tiny
    cfg = TINY.config
    speculative = pool_blocks == "speculative"
    if speculative:
        pool_blocks = None
    cache = new_remote_cache(model, 2, 165, pool_blocks=pool_blocks, speculative=speculative)
    remote = greedy_generate(model, prompt, 65, cache=cache)
    assert torch.equal(remote.tokens, on_device.tokens)
    assert torch.equal(remote.logits, on_device.logits)  # the same values read in the same order
    assert on_device.tokens.unique().numel() > 10
    stats = cache.stats
    assert stats.decode_steps == 64 and stats.tokens_decoded == 128
    block_bytes = cfg.nsa_sel_block * cfg.kv_dim * 4
    assert stats.selected_blocks == 64 * 2 * cfg.layers * cfg.nsa_top_n
    assert stats.written_bytes == 2 * 164 * cfg.layers * cfg.kv_dim * 4  # every token once, every layer
    if speculative:  # the whole previous selection, then what it missed
        assert stats.selected_blocks < stats.fetched_blocks < 2 * stats.selected_blocks
        assert stats.fetched_bytes == stats.fetched_blocks * block_bytes
    elif pool_blocks is None:
        assert stats.fetched_bytes == stats.selected_blocks * block_bytes
        assert stats.pool_hit_rate == 0
    else:
        assert stats.fetched_bytes == stats.fetched_blocks * block_bytes
        assert 0.5 < stats.pool_hit_rate < 1  # blocks selected again are not moved again
    # The device keeps the compressed keys, the window and the pool; the latent cache is remote.
    layer = cache[0]
    assert layer.remote.shape == (2, 176, cfg.kv_dim) and layer.window.shape == (2, cfg.nsa_window, cfg.kv_dim)
    assert layer.compressed.shape == (2, (176 - 8) // 4 + 1, cfg.kv_dim)
    # The pool, and its block table: a block id and a last-read counter per slot (int64).
    pool_bytes = 0 if pool_blocks is None else 2 * pool_blocks * (block_bytes + 2 * 8)
    pool_bytes += 2 * cfg.nsa_top_n * 8 if speculative else 0  # the previous selection's block ids
    assert cache.device_bytes() == cfg.layers * (2 * (43 + 16) * cfg.kv_dim * 4 + pool_bytes)
    assert 0 < stats.free_reselection_rate < stats.reselection_rate < 1


def test_larger_pool_fetches_less_and_the_smallest_pool_evicts():
    torch.manual_seed(3)
    model = DeepSeek(TINY.config).eval()
    prompt = torch.randint(0, TINY.config.vocab_size, (1, 120))
    fetched = []
    for pool_blocks in (None, 4, 8, 11):
        cache = new_remote_cache(model, 1, 150, pool_blocks=pool_blocks)
        greedy_generate(model, prompt, 30, cache=cache)
        fetched.append(cache.stats.fetched_blocks)
        if pool_blocks == 4:
            assert all(bool((layer.slots[..., 0] >= 0).all()) for layer in cache.layers)  # every slot holds a block
    assert fetched[0] > fetched[1] > fetched[2] >= fetched[3]
    # A pool holding every block of the sequence fetches each block at most once per layer.
    assert fetched[3] <= TINY.config.layers * 10


def test_remote_cache_errors_name_the_problem():
    model = DeepSeek(TINY.config).eval()
    with pytest.raises(ValueError, match="pool_blocks .3. must be at least nsa_top_n .4."):
        new_remote_cache(model, 1, 64, pool_blocks=3)
    with pytest.raises(ValueError, match="nsa_window .4. >= nsa_cmp_block .8."):
        new_remote_cache(DeepSeek(dataclasses.replace(TINY.config, nsa_window=4)), 1, 64)
    with pytest.raises(ValueError, match="batch and context must be positive"):
        new_remote_cache(model, 0, 64)
