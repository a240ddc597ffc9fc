"""Measured costs of custom operators: ``cost.with_measured_op_costs`` charges the targets it names what they were
measured to take, on that profile only, and ``runtime.measure.for_executor`` measures the step's ops outside
the ``aten`` namespace (``custom_op_costs``) and charges them so, leaving aten ops' costs as they were."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from programs import op, program, simple_hardware, value
from torch import nn

from hyperoffload.capture import capture_prefill_step
from hyperoffload.cost import lane_op_time, measured_op_costs, op_signature, op_time, op_times, with_measured_op_costs
from hyperoffload.ir import Op, Phase, ValueKind
from hyperoffload.plans import plan_without_offload
from hyperoffload.runtime import measure
from hyperoffload.runtime.measure import custom_op_costs, executor_op_costs, for_executor
from hyperoffload.simulate import simulate

GB = 10**9


@torch.library.custom_op("hyperoffload_test::loop_scale", mutates_args=())
def loop_scale(x: torch.Tensor, rounds: int) -> torch.Tensor:
    """Many small aten calls from a Python loop: what a roofline of its FLOPs and bytes underestimates."""
    out = x.clone()
    for _ in range(rounds):
        out = out * 1.0001 + 0.0
    return out


@loop_scale.register_fake
def _(x: torch.Tensor, rounds: int) -> torch.Tensor:
    return torch.empty_like(x)


class WithCustomOp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x) * 2.0
        return torch.ops.hyperoffload_test.loop_scale(y, 20) + x


CUSTOM = "hyperoffload_test.loop_scale.default"


def custom_step():
    return capture_prefill_step(WithCustomOp(), (torch.ones(8),), name="custom")


def two_op_step():
    """op0 (1 GFLOP, "test.op"), then op1 ("test.custom", 1 GFLOP) reading its output."""
    values = [value(0, 64, ValueKind.INPUT), value(1, 64), value(2, 64)]
    custom = dataclasses.replace(op(1, [1], [2], flops=GB), target="test.custom")
    return program(values, [op(0, [0], [1], flops=GB), custom], [0], [2])


def test_a_measured_cost_replaces_the_roofline_of_its_target_only():
    prog = two_op_step()
    hw = simple_hardware()
    measured = with_measured_op_costs(hw, {"test.custom": 0.25})
    assert measured.name != hw.name
    assert op_time(prog.ops[1], prog, measured) == 0.25
    assert op_time(prog.ops[0], prog, measured) == op_time(prog.ops[0], prog, hw) == pytest.approx(1.0)
    assert measured_op_costs(measured) == {"test.custom": 0.25}
    assert simulate(plan_without_offload(prog), measured).figures.step_s == pytest.approx(1.25)


def test_a_profile_without_measured_costs_is_unchanged():
    prog = two_op_step()
    hw = simple_hardware()
    assert with_measured_op_costs(hw, {}) is hw
    assert measured_op_costs(hw) == {}
    assert op_times(prog, hw) == (pytest.approx(1.0), pytest.approx(1.0))


def test_measured_costs_do_not_leak_between_profiles():
    prog = two_op_step()
    hw = simple_hardware()
    first = with_measured_op_costs(hw, {"test.custom": 0.25})
    second = with_measured_op_costs(hw, {"test.custom": 0.5})
    assert first.name != second.name
    assert op_time(prog.ops[1], prog, first) == 0.25 and op_time(prog.ops[1], prog, second) == 0.5
    # The profile measured from is untouched, and so is one that shares the measured profile's name but not its
    # costs (they are part of the profile, not looked up by name).
    assert op_time(prog.ops[1], prog, hw) == pytest.approx(1.0)
    other = dataclasses.replace(hw, name=first.name)
    assert op_time(prog.ops[1], prog, other) == pytest.approx(1.0)
    # A profile derived from a measured one (``replace`` keeps the name) keeps its costs; measuring it again
    # adds to them, on a profile of its own.
    assert op_time(prog.ops[1], prog, first.replace(launch_s=0.0)) == 0.25
    again = with_measured_op_costs(first, {"test.op": 2.0})
    assert measured_op_costs(again) == {"test.custom": 0.25, "test.op": 2.0}
    assert measured_op_costs(first) == {"test.custom": 0.25}


def test_measured_costs_must_be_seconds():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="test.custom"):
            with_measured_op_costs(simple_hardware(), {"test.custom": bad})


def test_a_lane_op_takes_the_longer_of_its_link_time_and_its_measured_kernel_time():
    lane = Op(id=0, name="lane0", target="test.lane", inputs=(0,), outputs=(1,), phase=Phase.FORWARD, lane="h2d",
              transfer_bytes=GB)
    hw = simple_hardware(bw=GB, latency=0.5)
    assert lane_op_time(lane, hw) == pytest.approx(1.5)
    assert lane_op_time(lane, with_measured_op_costs(hw, {"test.lane": 0.25})) == pytest.approx(1.5)
    assert lane_op_time(lane, with_measured_op_costs(hw, {"test.lane": 4.0})) == pytest.approx(4.0)


def test_custom_op_costs_measures_the_ops_outside_aten_on_real_inputs():
    captured = custom_step()
    inputs = [t.clone() for t in captured.inputs]
    costs = custom_op_costs(captured.program, captured.inputs, repeats=2)
    assert set(costs) == {CUSTOM} and costs[CUSTOM] > 0
    assert all(torch.equal(a, b) for a, b in zip(captured.inputs, inputs))  # the inputs are never changed
    fake = capture_prefill_step(WithCustomOp(), (torch.ones(8),), name="custom")
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_inputs = [mode.from_tensor(t) for t in fake.inputs]
    assert custom_op_costs(fake.program, fake_inputs) == {}


def test_for_executor_charges_every_measured_op_shape_its_time_through_the_executor(monkeypatch):
    # Keep what the two measurements returned, to check what the profile charges against them.
    kernels: dict[str, float] = {}
    timed: dict[str, float] = {}

    def recording(real, into):
        def run(*args, **kwargs):
            costs = real(*args, **kwargs)
            into.update(costs)
            return costs
        return run

    monkeypatch.setattr(measure, "custom_op_costs", recording(custom_op_costs, kernels))
    monkeypatch.setattr(measure, "executor_op_costs", recording(executor_op_costs, timed))
    captured = custom_step()
    prog = captured.program
    hw = simple_hardware()
    before = for_executor(hw, prog, dispatch_s=1e-5, issue_s=2e-5)
    assert measured_op_costs(before) == {} and not kernels and not timed  # nothing measured without inputs
    after = for_executor(hw, prog, dispatch_s=1e-5, issue_s=2e-5, inputs=captured.inputs)
    measured = measured_op_costs(after)
    assert (after.launch_s, after.issue_s) == (before.launch_s, before.issue_s)
    # The profile charges exactly what was measured: the custom op's target its kernel alone (custom_op_costs)
    # plus the executor's dispatch (launch_s), for shapes the executor did not time; every timed signature
    # its time through the executor (executor_op_costs), which includes the dispatch.
    assert set(kernels) == {CUSTOM}
    assert measured == {CUSTOM: kernels[CUSTOM] + after.launch_s, **timed}
    # Every op but the step's first (which also pays for starting the step) is timed through the executor,
    # views included, which the roofline charges nothing.
    for o in prog.ops[1:]:
        assert op_time(o, prog, after) == timed[op_signature(o, prog)] > 0
    # The custom op's own signature was timed, and that figure, not its target's, is what it is charged.
    custom = next(o for o in prog.ops if o.target == CUSTOM)
    assert op_signature(custom, prog) in timed and custom is not prog.ops[0]
    assert op_time(custom, prog, after) == timed[op_signature(custom, prog)]


class WithViews(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0).view(2, 4).t().sum(0) + 1.0


def test_views_cost_their_dispatch_once_measured():
    captured = capture_prefill_step(WithViews(), (torch.ones(8),), name="views")
    prog = captured.program
    hw = simple_hardware()
    before = for_executor(hw, prog, dispatch_s=1e-5)
    after = for_executor(hw, prog, dispatch_s=1e-5, inputs=captured.inputs)
    views = [o for o in prog.ops[1:] if o.is_view]
    assert views
    for o in views:  # the roofline launches nothing for a view; the executor still looks it up and records it
        assert op_time(o, prog, before) == 0 < op_time(o, prog, after)


def test_a_signature_cost_charges_only_ops_of_those_shapes():
    values = [value(0, 64, ValueKind.INPUT), value(1, 64), value(2, 128)]
    prog = program(values, [op(0, [0], [1], flops=GB), op(1, [1], [2], flops=GB)], [0], [2])
    hw = simple_hardware()
    first, second = prog.ops
    assert first.target == second.target and op_signature(first, prog) != op_signature(second, prog)
    measured = with_measured_op_costs(hw, {op_signature(second, prog): 0.125})
    assert op_time(second, prog, measured) == 0.125
    assert op_time(first, prog, measured) == op_time(first, prog, hw)
    # A signature beats a cost measured for the whole target.
    both = with_measured_op_costs(hw, {second.target: 0.5, op_signature(second, prog): 0.125})
    assert (op_time(first, prog, both), op_time(second, prog, both)) == (0.5, 0.125)


def test_executor_op_costs_times_each_compute_op_shape():
    captured = custom_step()
    inputs = [t.clone() for t in captured.inputs]
    costs = executor_op_costs(captured.program, captured.inputs, repeats=2)
    shapes = {op_signature(o, captured.program) for o in captured.program.ops[1:] if o.lane is None}
    assert shapes <= set(costs) and all(c > 0 for c in costs.values())
    assert all(torch.equal(a, b) for a, b in zip(captured.inputs, inputs))  # the inputs are never changed
