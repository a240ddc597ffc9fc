"""The remote KV cache of the DeepSeek-style workload: indexed prefetch, remote decode, block pool."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from hyperoffload.cache_ops import PREFETCH_BLOCKS, prefetch_blocks


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
