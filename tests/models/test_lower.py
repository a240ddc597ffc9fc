"""Lowering plans onto fx graphs with the cache operators: the graph runs and matches the unplanned step."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hyperoffload import cache_ops
from hyperoffload.capture import program_from_graph
from hyperoffload.ir import ValueKind
from hyperoffload.lower import LoweringError, lower_plan, plan_code
from hyperoffload.plans import Instr, Kind, Plan, PlanError, check_plan, plan_without_offload
from hyperoffload.runtime import EmulatedLink, run_reference
from hyperoffload.workloads import capture_workload, get_workload

from helpers import random_valid_order
from programs import op, program, value

CACHE_KINDS = {operator: kind for kind, operator in cache_ops.KIND_OPERATORS.items()}


# --- the operators ----------------------------------------------------------------------------------

def test_cache_ops_are_registered_with_their_schemas():
    ops = torch.ops.hyperoffload
    assert str(ops.offload.default._schema) == "hyperoffload::offload(Tensor x) -> Tensor"
    assert str(ops.prefetch.default._schema) == "hyperoffload::prefetch(Tensor remote, Device? device=None) -> Tensor"
    assert str(ops.wait.default._schema) == "hyperoffload::wait(Tensor(a) x) -> Tensor(a)"
    assert str(ops.release.default._schema) == "hyperoffload::release(Tensor x) -> ()"


def test_offload_and_prefetch_copy_whole_storages_on_cpu():
    ops = torch.ops.hyperoffload
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()[1:]  # strided, with a storage offset
    remote = ops.wait(ops.offload(view))
    assert remote.shape == (24,) and remote.dtype == view.dtype
    assert remote.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert torch.equal(remote, base.flatten())

    device = ops.wait(ops.prefetch(remote))
    assert device.untyped_storage().data_ptr() not in (remote.untyped_storage().data_ptr(),
                                                       base.untyped_storage().data_ptr())
    rebuilt = torch.ops.aten.as_strided.default(device, view.size(), view.stride(), view.storage_offset())
    assert torch.equal(rebuilt, view)

    waited = ops.wait(device)
    assert waited.untyped_storage().data_ptr() == device.untyped_storage().data_ptr()
    assert ops.release(device) is None
    assert torch.equal(base, torch.arange(24, dtype=torch.float32).reshape(4, 6))  # the source is untouched


def test_cache_ops_trace_with_fake_tensors_and_survive_dead_code_elimination():
    ops = torch.ops.hyperoffload

    def step(x):
        remote = ops.wait(ops.offload(x[1:]))
        ops.release(x)
        back = ops.wait(ops.prefetch(remote))
        return back * 2

    gm = make_fx(step, tracing_mode="fake")(torch.randn(4, 3))
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes if n.target in CACHE_KINDS]
    assert targets == [cache_ops.OFFLOAD, cache_ops.WAIT, cache_ops.RELEASE, cache_ops.PREFETCH, cache_ops.WAIT]
    offloaded = next(n for n in gm.graph.nodes if n.target is cache_ops.OFFLOAD)
    assert offloaded.meta["val"].shape == (12,)  # the whole storage, not the 9 elements viewed
    x = torch.randn(4, 3)
    assert torch.equal(gm(x), x.flatten() * 2)


# --- helpers --------------------------------------------------------------------------------------

def round_trips(program, order, storages):
    """Instructions running ``order``, where each storage in ``storages`` is offloaded and released right
    after one device use and prefetched right before the next one (the longest such idle gap)."""
    gaps = idle_gaps(program, order)
    after: dict[int, list[Instr]] = {}
    before: dict[int, list[Instr]] = {}
    for s in storages:
        _, first, second = gaps[s]
        after.setdefault(first, []).extend([Instr(Kind.OFFLOAD, s), Instr(Kind.RELEASE, s)])
        before.setdefault(second, []).extend([Instr(Kind.WAIT, s), Instr(Kind.PREFETCH, s), Instr(Kind.WAIT, s)])
    instructions = []
    for position, op_id in enumerate(order):
        instructions += before.get(position, [])
        instructions.append(Instr(Kind.COMPUTE, op_id))
        instructions += after.get(position, [])
    return tuple(instructions)


def idle_gaps(program, order):
    """For each storage, its longest gap between two consecutive device uses: (length, first, second)
    as positions in ``order``. Consecutive uses mean nothing reads or writes it in between."""
    uses: dict[int, list[int]] = {}
    for position, op_id in enumerate(order):
        op_ = program.ops[op_id]
        for s in {program.values[v].storage for v in (*op_.inputs, *op_.outputs)}:
            uses.setdefault(s, []).append(position)
    return {s: max((b - a, a, b) for a, b in zip(u, u[1:])) for s, u in uses.items() if len(u) > 1}


def run_both(plan, inputs, **lowering):
    """Run ``plan`` lowered (with ``lowering``'s options) and the program's reference executor on separate clones of
    ``inputs``."""
    reference_inputs = [t.clone() for t in inputs]
    lowered_inputs = [t.clone() for t in inputs]
    reference = run_reference(plan.program, reference_inputs)
    with torch.no_grad():
        result = lower_plan(plan, **lowering)(*lowered_inputs)
    outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    return reference.outputs, outputs, reference_inputs, lowered_inputs


def assert_identical(expected, got, names):
    assert len(expected) == len(got)
    for name, want, have in zip(names, expected, got):
        assert have.shape == want.shape and have.dtype == want.dtype, name
        assert torch.equal(have, want), f"{name} differs"


def cache_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in CACHE_KINDS]


def assert_follows_plan(gm, plan):
    """Compute nodes keep their names and run in plan order; cache calls follow the cache instructions."""
    program = plan.program
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    op_names = {op_.name for op_ in program.ops}
    assert [n.name for n in nodes if n.name in op_names] == [
        program.ops[i.target].name for i in plan.instructions if i.kind is Kind.COMPUTE]
    expected = [(i.kind, f"{i.kind.value}_" if i.kind is not Kind.WAIT else "wait_", program.values[i.target].name)
                for i in plan.instructions if i.kind is not Kind.COMPUTE]
    found = cache_nodes(gm)
    assert [CACHE_KINDS[n.target] for n in found] == [kind for kind, _, _ in expected]
    for node, (_, prefix, name) in zip(found, expected):
        assert node.name.startswith(prefix) and name.replace(".", "_").replace(":", "_") in node.name
    assert list(gm.graph.nodes)[-1].op == "output"
    for n in nodes:  # each getitem right after the op it unpacks (or after a sibling getitem)
        if n.target is operator.getitem:
            previous = n.prev
            while previous.target is operator.getitem:
                previous = previous.prev
            assert previous is n.args[0]


# --- tiny-llama training step -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_train():
    return capture_workload(get_workload("tiny-llama"), "train", fake=False)


def tiny_plan(program, order=None):
    order = list(range(len(program.ops))) if order is None else order
    gaps = idle_gaps(program, order)

    def longest(kind, count):
        candidates = [s for s in gaps if program.values[s].kind is kind]
        return sorted(candidates, key=lambda s: (-gaps[s][0] * program.values[s].alloc_bytes, s))[:count]

    storages = [*longest(ValueKind.PARAMETER, 3), *longest(ValueKind.ACTIVATION, 3),
                *longest(ValueKind.OPTIMIZER_STATE, 1)]
    return Plan(program=program, instructions=round_trips(program, order, storages), policy="test-round-trips")


def test_tiny_llama_lowered_plan_matches_reference_bit_for_bit(tiny_train):
    program = tiny_train.program
    original_code = program.graph.code
    plan = tiny_plan(program)
    check_plan(plan)
    expected, got, reference_inputs, lowered_inputs = run_both(plan, tiny_train.inputs)
    assert_identical(expected, got, [f"output {i}" for i in range(len(expected))])
    assert_identical(reference_inputs, lowered_inputs, [program.values[v].name for v in program.inputs])
    assert program.graph.code == original_code  # lowering built a new graph

    gm = lower_plan(plan)
    assert_follows_plan(gm, plan)
    names = {n.name: n for n in gm.graph.nodes}
    rebuilt = [n for n in gm.graph.nodes if n.name.startswith("reload_")]
    aliases = {program.node_values[n.name.removeprefix("reload_")] for n in rebuilt}
    assert any(not program.values[v].owns_storage for v in aliases), "some view of a prefetched storage was rebuilt"
    # Parameters updated by the optimizer after their prefetch are copied back into the caller's tensor.
    prefetched_params = {i.target for i in plan.instructions if i.kind is Kind.PREFETCH
                         and program.values[i.target].kind is ValueKind.PARAMETER}
    copied = {n.name for n in names.values() if n.name.startswith("copy_back_")}
    assert copied == {"copy_back_" + program.values[s].name.replace(".", "_") for s in prefetched_params}


def test_tiny_llama_reordered_plan_matches_reference(tiny_train):
    program = tiny_train.program
    order = random_valid_order(program, seed=3)
    assert order != sorted(order)
    plan = tiny_plan(program, order)
    check_plan(plan)
    expected, got, reference_inputs, lowered_inputs = run_both(plan, tiny_train.inputs)
    assert_identical(expected, got, ["loss"])
    assert_identical(reference_inputs, lowered_inputs, [program.values[v].name for v in program.inputs])
    assert_follows_plan(lower_plan(plan), plan)


def test_tiny_llama_code_calls_the_cache_ops_in_plan_order(tiny_train):
    plan = tiny_plan(tiny_train.program)
    code = plan_code(plan)
    calls = [line.split(" = ")[1].split("(")[0] for line in code.splitlines() if "torch.ops.hyperoffload." in line]
    expected = [f"torch.ops.hyperoffload.{i.kind.value}.default"
                for i in plan.instructions if i.kind is not Kind.COMPUTE]
    assert calls == expected
    assert code == lower_plan(plan).code


def test_plan_without_offload_lowers_to_the_captured_graph(tiny_train):
    program = tiny_train.program
    plan = plan_without_offload(program)
    gm = lower_plan(plan)
    assert not cache_nodes(gm)
    assert [n.name for n in gm.graph.nodes] == [n.name for n in program.graph.graph.nodes]
    expected, got, reference_inputs, lowered_inputs = run_both(plan, tiny_train.inputs)
    assert_identical(expected, got, ["loss"])
    assert_identical(reference_inputs, lowered_inputs, [program.values[v].name for v in program.inputs])


# --- a small synthetic step ---------------------------------------------------------------------

def synthetic_step(w, x, state):
    wt = w.t()  # a view of an input, read again after the input is prefetched back
    h = torch.mm(x, wt)
    bits = h.view(torch.int32)  # an alias of another dtype
    top, index = torch.max(h, dim=1)  # a multi-output op
    y = torch.relu(h)
    state.add_(y.sum())  # an in-place update of a step input
    out = (wt * 3).sum() + top.sum() + (bits & 1).sum() + index.sum() + state.sum()
    return out, y


@pytest.fixture(scope="module")
def synthetic():
    inputs = (torch.randn(6, 4), torch.randn(5, 4), torch.randn(3))
    gm = make_fx(synthetic_step, tracing_mode="fake")(*inputs)
    program = program_from_graph(gm, [ValueKind.PARAMETER, ValueKind.INPUT, ValueKind.OPTIMIZER_STATE],
                                 name="synthetic", mode="train")
    return program, inputs


def synthetic_plan(program):
    ops = {op_.name: op_.id for op_ in program.ops}
    storage = {name: program.values[program.node_values[name]].storage for name in ("w_1", "state_1", "mm", "relu")}
    w, state, h, y = storage["w_1"], storage["state_1"], storage["mm"], storage["relu"]
    C = lambda *names: [Instr(Kind.COMPUTE, ops[n]) for n in names]  # noqa: E731
    I = lambda kind, *targets: [Instr(kind, t) for t in targets]  # noqa: E731
    instructions = [
        *I(Kind.PREFETCH, w), *I(Kind.WAIT, w),  # w starts in remote memory
        *C("t", "mm"), *I(Kind.OFFLOAD, w), *I(Kind.RELEASE, w),
        *C("max_1", "view", "detach", "relu"),  # max_1 moved ahead of the captured order
        *I(Kind.OFFLOAD, h), *I(Kind.RELEASE, h),
        *C("sum_1"), *I(Kind.OFFLOAD, y), *I(Kind.WAIT, y), *I(Kind.RELEASE, y),  # y is returned from remote memory
        *I(Kind.PREFETCH, state), *I(Kind.WAIT, state), *C("add_"),
        *I(Kind.WAIT, w), *I(Kind.PREFETCH, w), *I(Kind.WAIT, w), *C("mul", "sum_2", "sum_3", "add"),
        *I(Kind.WAIT, h), *I(Kind.PREFETCH, h), *I(Kind.WAIT, h),
        *C("bitwise_and", "sum_4", "add_1", "sum_5", "add_2", "sum_6", "add_3"),
    ]
    return Plan(program=program, instructions=tuple(instructions), policy="test",
                initial_remote=frozenset({w, state}))


def test_synthetic_plan_with_views_dtype_aliases_and_remote_outputs(synthetic):
    program, inputs = synthetic
    plan = synthetic_plan(program)
    check_plan(plan)
    expected, got, reference_inputs, lowered_inputs = run_both(plan, inputs)
    assert_identical(expected, got, ["out", "y"])
    assert_identical(reference_inputs, lowered_inputs, ["w", "x", "state"])
    assert not torch.equal(lowered_inputs[2], inputs[2])  # the in-place update reached the caller's tensor

    gm = lower_plan(plan)
    assert_follows_plan(gm, plan)
    nodes = {n.name: n for n in gm.graph.nodes}
    # The transposed view of w is rebuilt on the second prefetch of w, the int32 alias of mm through a dtype view.
    assert nodes["reload_t"].args[0].name.startswith("wait_prefetch_w_1")
    assert nodes["reload_t"].args[1:] == ([4, 6], [1, 4], 0)
    assert nodes["reload_detach"].args[0].target is torch.ops.aten.view.dtype
    assert nodes["copy_back_state_1"].target is torch.ops.aten.copy_.default
    assert "copy_back_w_1" not in nodes  # w is read, never written, after its prefetch
    returned = list(gm.graph.nodes)[-1].args[0]
    assert returned[1].args[0].name.startswith("wait_offload_relu")


def test_state_updated_on_the_device_goes_home_on_the_copy_engines(synthetic):
    """With ``send_home``, the in-place update of ``state`` (which starts remote) goes back into the caller's tensor
    by ``offload.into`` right after its last write, waited for at the end, instead of a copy at the end."""
    program, inputs = synthetic
    plan = synthetic_plan(program)
    expected, got, reference_inputs, lowered_inputs = run_both(plan, inputs, send_home=True)
    assert_identical(expected, got, ["out", "y"])
    assert_identical(reference_inputs, lowered_inputs, ["w", "x", "state"])
    link = EmulatedLink(h2d_bw=1e9, d2h_bw=1e9)
    copies = cache_ops.AsyncCopies(client=link.client())
    async_inputs = [t.clone() for t in inputs]
    try:
        with cache_ops.copies_on(copies), torch.no_grad():
            lower_plan(plan, send_home=True)(*async_inputs)
    finally:
        link.close()
    assert_identical(reference_inputs, async_inputs, ["w", "x", "state"])  # landed before the step returned

    order = [n.name for n in lower_plan(plan, send_home=True).graph.nodes]
    assert "copy_back_state_1" not in order and "copy_back_state_1" in [n.name for n in lower_plan(plan).graph.nodes]
    assert order.index("send_home_state_1") == order.index("add_") + 1
    assert order.index("wait_home_state_1") > order.index("add_3")
    # The device copy the send home reads is released once the step stops using it (right after sum_6, its last
    # reader: the plan has no release after that): never left for the copy to let go of whenever the link finishes,
    # which would change what the step holds from run to run.
    assert order.index("release_home_state_1") == order.index("sum_6") + 1


def test_lowered_graph_traces_with_fake_tensors(synthetic):
    program, inputs = synthetic
    gm = make_fx(lower_plan(synthetic_plan(program)), tracing_mode="fake")(*inputs)
    assert [CACHE_KINDS[n.target] for n in cache_nodes(gm)] == [
        i.kind for i in synthetic_plan(program).instructions if i.kind is not Kind.COMPUTE]


# --- errors -----------------------------------------------------------------------------------------

def test_program_without_graph_cannot_be_lowered():
    values = [value(0, 16, ValueKind.INPUT), value(1, 16)]
    prog = program(values, [op(0, [0], [1])], inputs=[0], outputs=[1])
    with pytest.raises(LoweringError, match="no fx graph"):
        lower_plan(plan_without_offload(prog))


def test_invalid_plan_is_rejected_before_lowering(synthetic):
    program, _ = synthetic
    w = program.node_values["w_1"]
    plan = Plan(program=program, instructions=(Instr(Kind.RELEASE, w),
                                               *(Instr(Kind.COMPUTE, i) for i in range(len(program.ops)))))
    with pytest.raises(PlanError):
        lower_plan(plan)
