"""The torch.compile backend on values that view a larger storage (a storage offset, gaps between rows, a
storage larger than the view): tangents of such outputs, saved activations that are such views, and inputs
that a later call passes laid out elsewhere in another storage. Compiled training stays bit-identical to
eager (float32, CPU) while the plan moves those storages."""

from __future__ import annotations

import pytest
import torch
from backend_checks import assert_really_offloads, train_side_by_side
from torch import nn

import hyperoffload
from hyperoffload.compile.layouts import InputLayout, with_planned_layouts
from hyperoffload.plans import Kind


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


WIDTH = 32


def deep_mlp(features: int, width: int) -> nn.Sequential:
    """Enough saved activations that half the no-offload peak needs offloads in the forward."""
    layers = (m for _ in range(6) for m in (nn.Tanh(), nn.Linear(width, width)))
    return nn.Sequential(nn.Linear(features, width), *layers)


class WindowedKeys(nn.Module):
    """Like a sliding-window KV cache: the step returns each row's last three of four blocks (a view at a
    storage offset, with a gap per row), so its tangent is traced as a view of a larger storage; ``sin``
    saves another such view, read again only at the end of the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, 4 * WIDTH)
        self.body = deep_mlp(3 * WIDTH, 3 * WIDTH)
        self.keys = nn.Linear(WIDTH, 4 * WIDTH)
        self.head = nn.Linear(3 * WIDTH, 8)

    def forward(self, x):
        window = self.first(x).view(-1, 4, WIDTH)[:, 1:]
        y = self.head(self.body(torch.sin(window).flatten(1)))
        keys = self.keys(x).view(-1, 4, WIDTH)[:, 1:]
        return y, keys


def windowed_loss(model, batch):
    y, keys = model(batch[0])
    return y.square().mean() + keys.square().mean()


def storage_of(record, name: str) -> int:
    program = record.program
    return program.values[program.node_values[name]].storage


def test_tangent_and_saved_activation_viewing_larger_storages_train_like_eager():
    torch.manual_seed(0)
    model = WindowedKeys()
    batches = [(torch.randn(256, WIDTH),) for _ in range(2)]
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm")
    train_side_by_side(model, backend, batches, windowed_loss)
    assert_really_offloads(backend)
    record = backend.last
    program, plan = record.program, record.plan
    prefetched = {i.target for i in plan.instructions if i.kind is Kind.PREFETCH}
    offloaded = {i.target for i in plan.instructions if i.kind is Kind.OFFLOAD}
    # The keys' tangent is prefetched, planned as aot_autograd hands it over: a storage of its own, just
    # large enough for its (256, 3, 32) elements at strides (128, 32, 1) (not the 256 * 128 its output views).
    tangent = storage_of(record, record.joint.backward_inputs[-1])
    assert tangent in prefetched
    assert program.values[tangent].shape == (256, 3, WIDTH)
    assert program.values[tangent].alloc_bytes == (255 * 4 * WIDTH + 3 * WIDTH) * 4
    fake = next(n for n in record.backward.graph.find_nodes(op="placeholder")
                if n.name == record.joint.backward_inputs[-1]).meta["val"]
    assert fake.storage_offset() == 0 and fake.stride() == (4 * WIDTH, WIDTH, 1)
    # The view ``sin`` saves (offset WIDTH into the first layer's output) leaves in the forward and comes back.
    window = next(n for n in record.joint.module.graph.nodes if n.target is torch.ops.aten.sin.default).args[0]
    assert window.meta["val"].storage_offset() == WIDTH
    assert storage_of(record, window.name) in offloaded & prefetched


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = deep_mlp(WIDTH, 4 * WIDTH)
        self.head = nn.Linear(4 * WIDTH, 8)

    def forward(self, x):
        return self.head(self.body(x))


def test_input_passed_as_a_view_elsewhere_on_a_later_call_trains_like_eager():
    """TorchDynamo reuses the graph for an input of the same size and stride at another storage offset in
    a larger storage; the plan moves that input's storage, which it planned from the first call's."""
    torch.manual_seed(0)
    rows = torch.randn(256 + 7, WIDTH)
    batches = [(torch.randn(256, WIDTH),), (rows[3:259],)]
    backend = hyperoffload.backend(budget="70%", hardware="h100-sxm")
    train_side_by_side(Mlp(), backend, batches, lambda m, b: m(b[0]).square().mean())
    assert len(backend.compiled) == 1
    record = backend.last
    program = record.program
    x = program.values[program.inputs[record.input_names.index("x")]].storage
    assert program.values[x].shape == (256, WIDTH)
    assert any(i.target == x and i.kind in (Kind.OFFLOAD, Kind.PREFETCH) for i in record.plan.instructions) \
        or x in record.plan.initial_remote


def test_inference_input_passed_as_a_view_elsewhere_on_a_later_call_matches_eager():
    torch.manual_seed(0)
    model = Mlp().eval()
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    rows = torch.randn(256 + 7, WIDTH)
    with torch.no_grad():
        for x in (torch.randn(256, WIDTH), rows[3:259], rows[7:]):
            assert torch.equal(compiled(x), model(x))
    assert len(backend.compiled) == 1
    record = backend.last
    program = record.program
    x = program.values[program.inputs[record.input_names.index("x")]].storage
    assert program.values[x].shape == (256, WIDTH)
    assert any(i.target == x and i.kind is Kind.PREFETCH for i in record.plan.instructions)  # the rows move


def test_input_laid_out_otherwise_runs_on_a_copy_and_its_update_reaches_the_caller():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.ops.aten.add_.Tensor, (x, 1.0))
    graph.output((graph.call_function(torch.ops.aten.as_strided.default, (x, [2, 3], [3, 1], 3)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)  # reads x's storage by offset, as a lowered plan does
    planned = InputLayout(storage_offset=3, storage_bytes=12 * 4, written=True)
    run = with_planned_layouts(gm, [planned])

    laid_out = torch.arange(12.0)[3:9].view(2, 3)  # as planned: passed as it is
    (out,) = run([laid_out])
    assert out.untyped_storage().data_ptr() == laid_out.untyped_storage().data_ptr()
    rows = torch.arange(20.0)
    elsewhere = rows[1:7].view(2, 3)  # same size and stride, another offset in a larger storage
    (out,) = run([elsewhere])
    assert torch.equal(out, torch.arange(2.0, 8.0).view(2, 3))
    assert torch.equal(rows, torch.cat([torch.tensor([0.0]), torch.arange(2.0, 8.0), torch.arange(7.0, 20.0)]))


# --- Hugging Face --------------------------------------------------------------------------------------

def sliding_window_model(transformers, family: str):
    """A tiny causal LM of ``family`` whose sliding window (4) is shorter than the sequence (16)."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, sliding_window=4, max_position_embeddings=64,
                 attn_implementation="sdpa")
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**shape))
    config = transformers.Gemma3TextConfig(**shape, head_dim=16, layer_types=["sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM(config)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_tiny_model_with_a_sliding_window_shorter_than_the_sequence_trains_like_eager(family):
    """The sliding-window cache returns each such layer's last keys and values (views of larger storages),
    so the backward's tangents for them are such views when traced."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = sliding_window_model(transformers, family)
    batches = [(torch.randint(0, 128, (2, 16)),) for _ in range(2)]
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm")
    train_side_by_side(model, backend, batches, lambda m, b: m(input_ids=b[0], labels=b[0]).loss)
    assert_really_offloads(backend)
    record = backend.last
    prefetched = {i.target for i in record.plan.instructions if i.kind is Kind.PREFETCH}
    window_tangents = [name for name in record.joint.backward_inputs
                       if record.program.values[storage_of(record, name)].shape == (2, 2, 3, 16)]
    assert window_tangents and any(storage_of(record, name) in prefetched for name in window_tangents)
