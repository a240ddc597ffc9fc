"""The torch.compile backend: compiled training under a budget equals eager bit for bit (float32, CPU),
while the compiled graphs really move data: saved activations leave in the forward and come back in the
backward, and the plan's peak stays within the budget."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backend_checks import assert_really_offloads, train_side_by_side
from torch import nn

import hyperoffload
from hyperoffload.compile import SplitError, keep_backward_inputs_in_backward, split_lowered
from hyperoffload.compile.split import cut_index
from hyperoffload.ir import ValueKind
from hyperoffload.lower import lower_plan
from hyperoffload.plans import Instr, Kind, Plan, check_plan
from hyperoffload.policies import InfeasibleBudget
from hyperoffload.runtime import run_plan, run_reference
from hyperoffload.runtime.async_executor import run_async
from hyperoffload.runtime.emulated_link import EmulatedLink
from hyperoffload.runtime.native_link import NativeLink
from hyperoffload.workloads import Llama, get_workload


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own model; a clean cache keeps earlier tests' graphs and recompile limits out."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --- built-in workload ---------------------------------------------------------------------------------

def tiny_llama() -> tuple[nn.Module, list]:
    workload = get_workload("tiny-llama")
    torch.manual_seed(0)
    model = Llama(workload.config)
    vocab = workload.config.vocab_size
    batches = [(torch.randint(0, vocab, (2, 64)), torch.randint(0, vocab, (2, 64))) for _ in range(2)]
    return model, batches


@pytest.fixture(scope="module")
def compiled_tiny_llama():
    """tiny-llama compiled at 50% and run once (its output summed, so the tangent is the logits' shape):
    the model, the tokens and the backend's record, for tests that only inspect or replay the plan."""
    torch._dynamo.reset()
    model, batches = tiny_llama()
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm")
    tokens = batches[0][0]
    torch.compile(model, backend=backend, dynamic=False)(tokens).sum().backward()
    torch._dynamo.reset()
    return model, tokens, backend.last


def llama_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, -2), targets.flatten())


def test_tiny_llama_trains_like_eager_at_half_its_peak():
    model, batches = tiny_llama()
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm")
    train_side_by_side(model, backend, batches, llama_loss)
    assert len(backend.compiled) == 1  # one graph, reused by the second step
    assert_really_offloads(backend)
    record = backend.last
    assert record.budget_bytes == record.unplanned_peak_bytes // 2
    assert record.input_names[1] == "embed.weight"  # TorchDynamo's sources, made readable
    # Parameters enter as inputs; the tangent (the logits' gradient) only exists in the backward.
    kinds = {record.program.values[v].kind for v in record.program.inputs}
    assert ValueKind.PARAMETER in kinds
    tangents = [n for n in record.backward.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
    assert tangents and not any(n.name.startswith("tangents") for n in record.forward.graph.find_nodes(op="placeholder"))


def test_graphs_on_the_cpu_copy_asynchronously_by_default_and_synchronously_with_link_false():
    model, batches = tiny_llama()
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm")
    assert backend.copies is None  # made once a graph's device is known
    train_side_by_side(model, backend, batches, llama_loss)
    copies = backend.copies
    assert isinstance(copies.client.link, NativeLink) and copies.waits > 0 and copies.d2h_bytes > 0
    torch._dynamo.reset()
    model, batches = tiny_llama()
    synchronous = hyperoffload.backend(budget="50%", hardware="h100-sxm", link=False)
    train_side_by_side(model, synchronous, batches, llama_loss)
    assert synchronous.copies is None
    with pytest.raises(TypeError, match="False for synchronous copies"):
        hyperoffload.backend(link="fast")


def test_joint_plan_run_on_two_tiers_measures_the_planned_peak_and_unplanned_results(compiled_tiny_llama):
    """The plan the compiled graphs follow, executed by the two-tier executors on real tensors (synchronous,
    and with copy threads on an emulated link): the device bytes they measure are the plan's own
    accounting (under the budget), and the gradients are the unplanned joint step's."""
    model, tokens, record = compiled_tiny_llama
    program = record.program
    state = {**dict(model.named_parameters()), **dict(model.named_buffers()), "tokens": tokens}
    torch.manual_seed(2)
    placeholders = program.graph.graph.find_nodes(op="placeholder")
    inputs = [state[name].detach() if name in state else torch.randn(p.meta["val"].shape)  # the tangent
              for name, p in zip(record.input_names, placeholders)]
    assert sum(name not in state for name in record.input_names) == 1
    planned = run_plan(record.plan, [t.clone() for t in inputs])
    unplanned = run_reference(program, [t.clone() for t in inputs])
    assert planned.peak_bytes == record.planned_peak_bytes <= record.budget_bytes
    assert unplanned.peak_bytes == record.unplanned_peak_bytes
    assert len(planned.outputs) == len(unplanned.outputs)
    assert all(torch.equal(a, b) for a, b in zip(planned.outputs, unplanned.outputs))
    # The same plan with real asynchronous copies on an emulated link (copy threads): within the budget
    # (a released tensor counts until its copy out lands, so the measured peak depends on timing) and
    # the same results.
    link = EmulatedLink(h2d_bw=20e9, d2h_bw=20e9, h2d_latency_s=5e-6, d2h_latency_s=5e-6)
    overlapped = run_async(record.plan, [t.clone() for t in inputs], link=link)
    assert record.planned_peak_bytes <= overlapped.peak_bytes <= record.plan.budget_bytes
    assert all(torch.equal(a, b) for a, b in zip(overlapped.outputs, unplanned.outputs))


def test_inference_graph_is_planned_alone_and_matches_eager():
    model, batches = tiny_llama()
    model.eval()
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    tokens = batches[0][0]
    with torch.no_grad():
        assert torch.equal(compiled(tokens), model(tokens))
    record = backend.last
    assert record.mode == "inference" and record.backward is None
    assert record.planned_peak_bytes <= record.budget_bytes < record.unplanned_peak_bytes
    assert record.cache_op_counts()["prefetch"] > 0
    # Parameters are known as such, so the plan may keep them in remote memory between calls.
    assert any(record.program.values[s].kind is ValueKind.PARAMETER for s in record.plan.initial_remote)


def test_policy_none_compiles_without_cache_operators():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    backend = hyperoffload.backend(budget="50%", policy="none")
    x = torch.randn(8, 16)
    train_side_by_side(model, backend, [(x,)], lambda m, b: m(b[0]).square().mean(), steps=1)
    record = backend.last
    assert sum(record.cache_op_counts().values()) == 0
    assert not record.feasible  # what the step needs, over the budget asked for


def test_batch_norm_buffers_update_as_in_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 8))
    backend = hyperoffload.backend(budget="80%")
    x = torch.randn(256, 32)
    before = [b.clone() for b in model.buffers()]
    train_side_by_side(model, backend, [(x,)], lambda m, b: m(b[0]).square().mean())  # buffers compared too
    assert sum(backend.last.cache_op_counts().values()) > 0
    assert not all(torch.equal(a, b) for a, b in zip(model.buffers(), before))  # running statistics did move


class TwoHalves(nn.Module):
    """An MLP with a graph break in the middle: TorchDynamo hands the backend two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(32, 128), *(m for _ in range(4) for m in (nn.ReLU(), nn.Linear(128, 128))))
        self.second = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(128, 128), nn.ReLU())), nn.Linear(128, 8))

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h)


def test_graph_break_gives_two_graphs_each_planned_and_trained_like_eager():
    torch.manual_seed(0)
    backend = hyperoffload.backend(budget="80%")
    x = torch.randn(512, 32)
    train_side_by_side(TwoHalves(), backend, [(x,)], lambda m, b: m(b[0]).square().mean())
    assert [r.index for r in backend.compiled] == [0, 1]
    assert all(r.mode == "train" and r.planned_peak_bytes <= r.budget_bytes for r in backend.compiled)
    assert all(r.cache_op_counts()["offload"] > 0 for r in backend.compiled)


# --- Hugging Face --------------------------------------------------------------------------------------

def test_tiny_hugging_face_llama_trains_like_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    batches = [(torch.randint(0, 128, (2, 64)),) for _ in range(2)]
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm")
    train_side_by_side(model, backend, batches, lambda m, b: m(input_ids=b[0], labels=b[0]).loss)
    assert_really_offloads(backend)


# --- the plan's boundary -----------------------------------------------------------------------------

def test_tangent_prefetch_issued_in_the_forward_moves_to_the_backward(compiled_tiny_llama):
    _, _, record = compiled_tiny_llama
    program, joint = record.program, record.joint
    tangent = program.values[program.node_values[joint.backward_inputs[0]]].storage  # the logits' gradient
    # The plan, but with the tangent starting in remote memory and brought in before the forward's first op.
    others = [i for i in record.plan.instructions if i.target != tangent or i.kind is Kind.COMPUTE]
    cut = cut_index(record.plan, joint)
    cut -= sum(1 for i in record.plan.instructions[:cut] if i.target == tangent and i.kind is not Kind.COMPUTE)
    early = Plan(program=program, instructions=(Instr(Kind.PREFETCH, tangent), *others[:cut + 1],
                                                Instr(Kind.WAIT, tangent), *others[cut + 1:]),
                 policy="test", initial_remote=record.plan.initial_remote | {tangent})
    check_plan(early)
    with pytest.raises(SplitError, match="reads the backward input tangents_1"):
        split_lowered(lower_plan(early), joint)

    moved = keep_backward_inputs_in_backward(early, joint)
    position = next(i for i, ins in enumerate(moved.instructions) if ins.kind is Kind.PREFETCH and ins.target == tangent)
    assert position == cut_index(moved, joint) + 1
    # Later means less on the device in between: the moved plan never holds more than the early one.
    size = program.values[tangent].alloc_bytes
    later, sooner = check_plan(moved).live_bytes[:position], check_plan(early).live_bytes[1:position + 1]
    assert all(a + size == b for a, b in zip(later, sooner))
    forward, backward = split_lowered(lower_plan(moved), joint)
    assert "tangents_1" not in {n.name for n in forward.graph.find_nodes(op="placeholder")}
    assert "tangents_1" in {n.name for n in backward.graph.find_nodes(op="placeholder")}


# --- errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget, message", [
    ("half", "cannot read 'half' as a budget"),
    ("0%", "must be in (0, 100]"),
    ("150%", "must be in (0, 100]"),
    (-5, "at least one byte"),
])
def test_bad_budget_is_refused_when_the_backend_is_made(budget, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        hyperoffload.backend(budget=budget)


def test_budget_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="got float"):
        hyperoffload.backend(budget=2.5)


def test_unknown_hardware_and_policy_are_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown hardware 'h1000'.*h100-sxm"):
        hyperoffload.backend(hardware="h1000")
    with pytest.raises(ValueError, match="unknown policy 'fastest'.*hyperoffload"):
        hyperoffload.backend(policy="fastest")


def test_budget_below_what_the_planner_meets_fails_at_compile_time_with_the_smallest_budget():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    backend = hyperoffload.backend(budget="1KiB")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.raises(Exception, match="below the smallest this planner can meet") as error:
        compiled(torch.randn(8, 16)).sum().backward()
    assert isinstance(error.value, InfeasibleBudget) or isinstance(error.value.__cause__, InfeasibleBudget) or \
        "InfeasibleBudget" in str(error.value)
    with pytest.raises(LookupError, match="nothing has been compiled"):
        _ = backend.last


def test_dynamic_shapes_are_refused_with_the_fix():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    compiled = torch.compile(model, backend=hyperoffload.backend(budget="50%"), dynamic=True)
    with pytest.raises(Exception, match="compile with dynamic=False"):
        compiled(torch.randn(8, 16)).sum().backward()
