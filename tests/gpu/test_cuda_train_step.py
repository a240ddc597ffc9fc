"""``train_step`` and the cache operators on a CUDA GPU: copies on side streams inside Inductor-compiled graphs.
Skipped without a GPU (the first test runs anywhere); ``make gpu-check`` runs these."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hyperoffload
from hyperoffload import cache_ops
from hyperoffload.ir import ValueKind
from hyperoffload.runtime.cuda_copies import CudaCopyStreams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_copies_import_anywhere_and_say_what_to_use_without_a_gpu():
    if torch.cuda.is_available():
        assert CudaCopyStreams().device.type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="emulated link"):
            CudaCopyStreams()


class MLP(nn.Module):
    def __init__(self, width: int = 1024, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _batches(count: int, device: str = "cuda"):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(256, 1024, generator=gen).to(device), torch.randint(0, 16, (256,), generator=gen).to(device))
            for _ in range(count)]


@needs_cuda
def test_cache_operators_copy_asynchronously_between_the_gpu_and_pinned_host_memory():
    copies = cache_ops.AsyncCopies(client=CudaCopyStreams(), release_waits=True)
    x = torch.randn(1 << 20, device="cuda")
    with cache_ops.copies_on(copies):
        remote = torch.ops.hyperoffload.wait(torch.ops.hyperoffload.offload(x))
        assert remote.device.type == "cpu" and remote.is_pinned()
        back = torch.ops.hyperoffload.wait(torch.ops.hyperoffload.prefetch(remote, x.device))
        torch.ops.hyperoffload.release(x)
    torch.cuda.synchronize()
    assert back.device == x.device and torch.equal(back, x)
    assert copies.d2h_bytes == copies.h2d_bytes == x.untyped_storage().nbytes()


@needs_cuda
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_train_step_on_a_gpu_equals_the_unplanned_compiled_step_and_holds_its_budget(optimizer):
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
            "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)}[optimizer]
    torch.manual_seed(0)
    planned_model = MLP().cuda()
    plain_model = copy.deepcopy(planned_model)
    planned = hyperoffload.train_step(planned_model, make(planned_model.parameters()), loss_fn, _batches(1)[0],
                                      budget="50%", hardware="h200")
    plain = hyperoffload.train_step(plain_model, make(plain_model.parameters()), loss_fn, _batches(1)[0],
                                    budget="100%", hardware="h200", offload=False)
    for batch in _batches(3):
        torch.testing.assert_close(planned(batch), plain(batch), rtol=1e-5, atol=1e-6)
        assert planned.last.peak_bytes <= planned.last.budget_bytes
        assert planned.last.h2d_bytes > 0 and planned.last.d2h_bytes > 0
    planned_state = planned_model.state_dict()
    for name, value in plain_model.state_dict().items():
        torch.testing.assert_close(planned_state[name].to(value.device), value, rtol=1e-5, atol=1e-6)
    # State the plan keeps in remote memory lives in page-locked host memory between steps, as the model's own.
    remote = [p for p in planned_model.parameters() if p.device.type == "cpu"]
    assert all(p.is_pinned() for p in remote)
    kept = {planned.program.values[s].kind for s in planned.plan.initial_remote}
    assert (ValueKind.PARAMETER in kept) == bool(remote)
