import pytest
import torch
from torch import nn

from hyperoffload.capture import AdamW, CaptureError, capture_decode_step, capture_prefill_step, capture_train_step
from hyperoffload.capture import fake_build
from hyperoffload.ir import Phase, ValueKind, kind_bytes
from hyperoffload.workloads import Llama, LlamaConfig, capture_workload, get_workload
from helpers import assert_matches_eager, random_valid_order

TINY = get_workload("tiny-llama")


@pytest.fixture(scope="module")
def tiny_train():
    return capture_workload(TINY, "train", fake=False)


def test_train_step_graph_equals_eager_bit_for_bit(tiny_train):
    assert_matches_eager(tiny_train)


def test_train_step_in_another_valid_order_equals_eager(tiny_train):
    order = random_valid_order(tiny_train.program, seed=1)
    assert order != list(range(len(tiny_train.program.ops)))
    assert_matches_eager(tiny_train, order)


def test_train_step_phases_are_contiguous_and_ordered(tiny_train):
    phases = [op.phase for op in tiny_train.program.ops]
    first = {p: phases.index(p) for p in Phase}
    last = {p: len(phases) - 1 - phases[::-1].index(p) for p in Phase}
    assert last[Phase.FORWARD] < first[Phase.BACKWARD] <= last[Phase.BACKWARD] < first[Phase.OPTIMIZER]


def test_train_step_kinds(tiny_train):
    program = tiny_train.program
    params = kind_bytes(program, [ValueKind.PARAMETER])
    n_params = sum(p.numel() for p in Llama(TINY.config).parameters())
    assert params == 4 * n_params
    assert kind_bytes(program, [ValueKind.GRADIENT]) == params  # one fp32 gradient per parameter
    assert kind_bytes(program, [ValueKind.OPTIMIZER_STATE]) == 2 * params + 4  # two moments and the step count
    gradients = [v for v in program.values if v.kind is ValueKind.GRADIENT and v.owns_storage]
    assert len(gradients) == len(list(Llama(TINY.config).parameters()))
    # saved activations: made in forward, read in backward
    producer = program.producers()
    for v in program.values:
        if v.kind is ValueKind.ACTIVATION and v.owns_storage:
            assert program.ops[producer[v.id]].phase is Phase.FORWARD
    assert kind_bytes(program, [ValueKind.ACTIVATION]) > 0


def test_views_move_no_bytes(tiny_train):
    views = [op for op in tiny_train.program.ops if op.target in ("aten.t.default", "aten.view.default")]
    assert views and all(op.is_view for op in views)
    mms = [op for op in tiny_train.program.ops if op.target == "aten.mm.default"]
    for op in mms:
        a, b = (tiny_train.program.values[v].shape for v in op.inputs)
        assert op.flops == 2 * a[0] * a[1] * b[1]


def test_prefill_graph_equals_eager_and_the_plain_model():
    captured = capture_workload(TINY, "prefill", fake=False)
    assert_matches_eager(captured)
    torch.manual_seed(0)
    model = Llama(TINY.config)
    tokens = captured.inputs[-1]
    from hyperoffload.runtime import run_reference
    with torch.no_grad():
        assert torch.equal(run_reference(captured.program, list(captured.inputs)).outputs[0], model(tokens))


def test_decode_graph_equals_eager_and_updates_the_cache():
    captured = capture_workload(TINY, "decode", fake=False, context=10)
    program = captured.program
    assert kind_bytes(program, [ValueKind.KV_CACHE]) == 2 * TINY.config.layers * 2 * 2 * 11 * 32 * 4
    assert any(program.values[v].kind is ValueKind.KV_CACHE for op in program.ops for v in op.mutates)
    assert_matches_eager(captured)


def test_decode_matches_prefill_logits():
    """A decode step at position t over a cache filled by earlier decode steps gives the logits prefill
    gives at t (different attention kernels: equal to float32 rounding)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden=32, ffn=64, layers=2, heads=4, kv_heads=2)
    model = Llama(cfg)
    tokens = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 6)
        for t in range(6):
            logits = model(tokens[:, t:t + 1], cache=cache, start=torch.tensor([t]))
            torch.testing.assert_close(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_master_weights_bf16_graph_equals_eager():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden=32, ffn=64, layers=1, heads=4, kv_heads=2)
    model = Llama(cfg).to(torch.bfloat16)
    tokens, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    captured = capture_train_step(model, (tokens,), targets, optimizer=AdamW(master_weights=True))
    program = captured.program
    params = kind_bytes(program, [ValueKind.PARAMETER])
    # two fp32 moments and an fp32 master copy: 12 bytes per 2-byte parameter, plus the step count
    assert kind_bytes(program, [ValueKind.OPTIMIZER_STATE]) == 6 * params + 4
    assert_matches_eager(captured)


def test_bf16_policy_on_fake_capture():
    cfg = LlamaConfig(vocab_size=256, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2)
    with fake_build(torch.bfloat16):
        model = Llama(cfg)
        tokens, targets = torch.randint(0, 256, (1, 32)), torch.randint(0, 256, (1, 32))
    program = capture_train_step(model, (tokens,), targets).program
    by_kind = {}
    for v in program.values:
        if v.owns_storage:
            by_kind.setdefault(v.kind, set()).add(v.dtype)
    assert by_kind[ValueKind.PARAMETER] == {"bfloat16"}
    assert by_kind[ValueKind.GRADIENT] == {"bfloat16"}
    assert by_kind[ValueKind.OPTIMIZER_STATE] == {"float32"}
    assert "bfloat16" in by_kind[ValueKind.ACTIVATION]


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow cannot be captured as one graph
            return self.lin(x)
        return -self.lin(x)


def test_untraceable_module_gives_a_clear_error():
    with pytest.raises(CaptureError, match="data-dependent"):
        capture_train_step(Branchy(), (torch.randn(2, 4),))


def test_frozen_model_cannot_be_trained():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(CaptureError, match="requires_grad"):
        capture_train_step(model, (torch.randn(2, 4),))


def test_decode_needs_a_cache_protocol():
    with pytest.raises(CaptureError, match="new_cache"):
        capture_decode_step(nn.Linear(4, 4), torch.zeros(1, 1, dtype=torch.long), 4)


def test_generic_module_train_and_prefill():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))
    x, y = torch.randn(5, 8), torch.randn(5, 3)
    assert_matches_eager(capture_train_step(model, (x,), y))
    assert_matches_eager(capture_prefill_step(model, (x,)))


def test_impossible_sizes_are_rejected():
    with pytest.raises(CaptureError, match=r"seq \(--seq\) must be a whole number of tokens, at least 1; got 0"):
        capture_workload(TINY, "train", seq=0)
    with pytest.raises(CaptureError, match=r"context \(--context\) must be .* at least 0; got -1"):
        capture_workload(TINY, "decode", context=-1)
    with pytest.raises(CaptureError, match=r"batch \(--batch\) must be a whole number of sequences, .* got 2.5"):
        capture_workload(TINY, "train", batch=2.5)
    with pytest.raises(CaptureError, match="unknown mode"):
        capture_workload(TINY, "serve")


def test_sizes_a_step_would_not_use_are_refused_not_ignored():
    """From Python as from the command line: seq= on a decode step (or context= on a training step) would
    otherwise leave the size the user meant at the preset's without a word."""
    with pytest.raises(CaptureError, match="give context=100 instead"):
        capture_workload(TINY, "decode", seq=100)
    with pytest.raises(CaptureError, match="give seq=100 instead"):
        capture_workload(TINY, "prefill", context=100)
    with pytest.raises(CaptureError, match="has no optimizer"):
        capture_workload(TINY, "decode", master_weights=True)
