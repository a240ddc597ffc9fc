"""Everyday model classes through capture, planning and execution: convolutional networks (a ResNet-style CNN, a
ViT's conv patch embedding), activation checkpointing, recurrent layers. Each trains planned at half its peak and
gives the unplanned step bit for bit (float32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import hyperoffload
from helpers import assert_matches_eager
from hyperoffload.capture import capture_prefill_step, capture_train_step, fake_build
from hyperoffload.policies import InfeasibleBudget
from hyperoffload.policies.hyperoffload import minimum_budget
from hyperoffload.runtime import run_plan, run_reference
from hyperoffload.runtime.reference import replayed_random_numbers

H100 = "h100-sxm"


def assert_identical(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def assert_plans_bit_identical(captured, budget="50%"):
    """Plan ``captured`` at ``budget`` (a verified plan), run it and the unplanned step on clones of the inputs, and
    check the loss and every updated input agree bit for bit; returns the plan."""
    program = captured.program
    plan = hyperoffload.plan(program, H100, budget)
    planned_inputs = [t.clone() for t in captured.inputs]
    reference_inputs = [t.clone() for t in captured.inputs]
    with replayed_random_numbers():  # both runs draw the same dropout masks
        planned = run_plan(plan, planned_inputs)
    reference = run_reference(program, reference_inputs)
    assert_identical(planned.outputs, reference.outputs)
    assert_identical(planned_inputs, reference_inputs)
    return plan


# --- convolutional networks ---------------------------------------------------------------------------


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN, the input added back, ReLU (in place)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + x)


class TinyResNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))


class TinyViT(nn.Module):
    """A vision transformer: a conv patch embedding (the conv's input needs no gradient), a class token, position
    embeddings, two encoder layers and a linear head on the class token."""

    def __init__(self, dim: int = 32, patch: int = 4, image: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1) + self.pos
        return self.head(self.norm(self.encoder(tokens))[:, 0])


def test_resnet_style_cnn_trains_planned_at_half_its_peak_bit_identical():
    torch.manual_seed(0)
    captured = capture_train_step(TinyResNet(), (torch.randn(4, 3, 16, 16),), torch.randint(0, 10, (4,)))
    targets = {op.target for op in captured.program.ops}
    assert "aten.convolution_backward.default" in targets
    conv_backward = [op for op in captured.program.ops if op.target == "aten.convolution_backward.default"]
    assert all(op.flops > 0 for op in conv_backward)
    assert_plans_bit_identical(captured)


def test_vit_with_a_conv_patch_embedding_trains_planned_at_half_its_peak_bit_identical():
    torch.manual_seed(0)
    captured = capture_train_step(TinyViT(), (torch.randn(4, 3, 16, 16),), torch.randint(0, 10, (4,)))
    assert_plans_bit_identical(captured)


def test_bfloat16_cnn_captures_and_plans():
    with fake_build(torch.bfloat16):
        model = TinyResNet(channels=32)
        batch = torch.randn(4, 3, 16, 16)
    captured = capture_train_step(model, (batch,), torch.randint(0, 10, (4,)))
    program = captured.program
    convs = [op for op in program.ops if op.target.startswith("aten.convolution")]
    assert convs and {program.values[o].dtype for op in convs for o in op.outputs} == {"bfloat16"}
    plan = hyperoffload.plan(program, H100, "50%")
    assert plan.budget_bytes < hyperoffload.memory_profile(program).peak_bytes


@pytest.mark.parametrize("model_class", [TinyResNet, TinyViT])
def test_cnns_train_through_the_compile_backend_as_eager(model_class):
    """The backend converts its graphs with the same rules: a conv whose input needs no gradient, BatchNorm (its
    running statistics updated in place) and in-place ReLU train as eager does, bit for bit."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_class()
    eager = copy.deepcopy(model)
    backend = hyperoffload.backend(budget="75%", hardware=H100)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    loss = F.cross_entropy(compiled(images), labels)
    loss.backward()
    eager_loss = F.cross_entropy(eager(images), labels)
    eager_loss.backward()
    torch._dynamo.reset()
    assert torch.equal(loss, eager_loss)
    for p, e in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, e.grad)
    for b, e in zip(model.buffers(), eager.buffers()):
        assert torch.equal(b, e)
    assert backend.last.feasible and backend.last.budget_bytes < backend.last.unplanned_peak_bytes


# --- activation checkpointing ----------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """A layer, then a checkpointed region (its activations recomputed in the backward), then a head."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.up, self.down = nn.Linear(8, 64), nn.Linear(64, 8)
        self.head = nn.Linear(8, 2)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        x = self.first(x)
        x = checkpoint(lambda t: self.down(torch.relu(self.up(t))), x, use_reentrant=self.use_reentrant)
        return self.head(x)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_step_recomputes_with_the_steps_parameters_and_plans(use_reentrant):
    """The recomputation runs during the backward: it must read the step's parameters (inputs of the Program),
    not the model's own tensors as graph constants, which no plan may start in remote memory."""
    torch.manual_seed(0)
    captured = capture_train_step(Checkpointed(use_reentrant), (torch.randn(4, 8),), torch.tensor([0, 1, 0, 1]))
    program = captured.program
    assert not program.constants
    up = [op for op in program.ops if op.target == "aten.addmm.default"]
    assert len(up) > 4  # first, up, down, head, and the region again in the backward
    assert_matches_eager(captured)
    assert_plans_bit_identical(captured)
    assert_plans_bit_identical(captured, minimum_budget(program)[0])


class RandomMLP(nn.Module):
    """A random small MLP: the batch arrives as a view (a slice, a transpose or a reshape of what is passed in),
    each layer reads its weight directly or through a view (transposed twice, sliced, reshaped from a flat
    parameter), and each layer runs plain or in a checkpointed region (reentrant or not). With ``constant`` the
    batch is first scaled by a plain tensor attribute (neither parameter nor buffer: a graph constant)."""

    def __init__(self, width: int, layers: list[tuple[str, str]], batch_view: str, constant: bool = False) -> None:
        super().__init__()
        self.width, self.layers, self.batch_view = width, layers, batch_view
        self.scale = torch.rand(width) + 0.5 if constant else None
        self.weights = nn.ParameterList()
        for _, weight_view in layers:
            shape = {"plain": (width, width), "transposed": (width, width), "sliced": (width, width + 3),
                     "reshaped": (width * width,)}[weight_view]
            self.weights.append(nn.Parameter(torch.randn(shape) / width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.head = nn.Linear(width, 2)

    def weight(self, i: int) -> torch.Tensor:
        w, view = self.weights[i], self.layers[i][1]
        if view == "transposed":
            return w.t().t()
        if view == "sliced":
            return w[:, 1:self.width + 1]
        if view == "reshaped":
            return w.reshape(self.width, self.width)
        return w

    def forward(self, x):
        if self.batch_view == "sliced":
            x = x[1:]
        elif self.batch_view == "transposed":
            x = x.t()
        elif self.batch_view == "reshaped":
            x = x.reshape(-1, self.width)
        if self.scale is not None:
            x = x * self.scale
        for i, (mode, _) in enumerate(self.layers):
            layer = lambda t, i=i: torch.tanh(t @ self.weight(i).t() + self.bias)  # noqa: E731
            x = layer(x) if mode == "plain" else checkpoint(layer, x, use_reentrant=mode == "reentrant")
        return self.head(x)


def random_batch(width: int, batch: int, view: str) -> torch.Tensor:
    shape = {"none": (batch, width), "sliced": (batch + 1, width), "transposed": (width, batch),
             "reshaped": (batch * width,)}[view]
    return torch.randn(shape)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # a reentrant region reading the batch
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from([4, 8]), batch_view=st.sampled_from(["none", "sliced", "transposed", "reshaped"]),
       layers=st.lists(st.tuples(st.sampled_from(["plain", "reentrant", "non_reentrant"]),
                                 st.sampled_from(["plain", "transposed", "sliced", "reshaped"])),
                       min_size=1, max_size=3),
       constant=st.booleans(), seed=st.integers(0, 2**16))
def test_captured_checkpointed_steps_plan_validly_or_are_refused(width, batch_view, layers, constant, seed):
    """Capture then plan at half the peak and at the smallest budget the planner states it meets: each either
    gives a verified plan whose run is bit-identical to the unplanned step, or is refused with InfeasibleBudget;
    the planner never fails on its own rules."""
    torch.manual_seed(seed)
    model = RandomMLP(width, layers, batch_view, constant)
    batch = 4
    captured = capture_train_step(model, (random_batch(width, batch, batch_view),), torch.randint(0, 2, (batch,)))
    reference_inputs = [t.clone() for t in captured.inputs]
    reference = run_reference(captured.program, reference_inputs)
    for budget in ("50%", minimum_budget(captured.program)[0]):
        try:
            plan = hyperoffload.plan(captured.program, H100, budget)
        except InfeasibleBudget:
            continue
        hyperoffload.verify(plan, hyperoffload.get_hardware(H100))
        planned_inputs = [t.clone() for t in captured.inputs]
        planned = run_plan(plan, planned_inputs)
        assert_identical(planned.outputs, reference.outputs)
        assert_identical(planned_inputs, reference_inputs)


def test_a_step_reading_a_graph_constant_plans_with_the_constant_kept_on_the_device():
    """A plain tensor attribute becomes a constant of the graph, not an input: no plan may start it in remote
    memory (the planner gave it a cyclic span as if the caller handed it over each step)."""
    torch.manual_seed(0)
    model = RandomMLP(64, [("plain", "plain")] * 3, "none", constant=True)
    model.scale = torch.rand(2**16) + 0.5  # large enough to be worth moving
    model.forward = lambda x: model.head(torch.tanh(x @ model.weights[0].t()) * model.scale[:64].sum())
    captured = capture_train_step(model, (torch.randn(4, 64),), torch.tensor([0, 1, 0, 1]))
    assert captured.program.constants
    for budget in ("90%", minimum_budget(captured.program)[0]):
        plan = assert_plans_bit_identical(captured, budget)
        assert not plan.initial_remote & {captured.program.values[v].storage for v in captured.program.constants}


# --- recurrent layers ------------------------------------------------------------------------------------


class Recurrent(nn.Module):
    """A recurrent layer over a sequence, then an MLP head on its last step."""

    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(8, 16, batch_first=True)
        self.head = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_layer_trains_planned_at_half_its_peak_bit_identical(cell):
    """The layer runs without oneDNN in a training step, whose LSTM kernel keeps a workspace the capture cannot
    size: traced as plain ops, the step holds exactly the bytes its Program counts."""
    torch.manual_seed(0)
    captured = capture_train_step(Recurrent(cell), (torch.randn(4, 5, 8),), torch.randint(0, 2, (4,)))
    assert_matches_eager(captured)  # bit for bit, and every byte the step holds counted
    plan = assert_plans_bit_identical(captured)
    assert run_plan(plan, [t.clone() for t in captured.inputs]).peak_bytes <= plan.budget_bytes


def test_lstm_inference_step_runs_as_eager():
    """Without gradients oneDNN's LSTM layer returns None for the workspace the fake kernel gives as an empty
    tensor: outputs are matched by position, so the step runs and its live bytes are what the analysis says."""
    torch.manual_seed(0)
    model = Recurrent(nn.LSTM).eval()
    captured = capture_prefill_step(model, (torch.randn(4, 5, 8),))
    assert "aten.mkldnn_rnn_layer.default" in {op.target for op in captured.program.ops}
    assert_matches_eager(captured)
