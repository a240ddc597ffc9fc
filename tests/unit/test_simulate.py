"""The simulator on hand-computed cases, on random valid plans, and on invalid plans."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan, PlanError, check_plan, plan_without_offload
from hyperoffload.simulate import simulate
from helpers import random_valid_order
from programs import op, program, random_programs, simple_hardware as hardware, value

GB = 10**9


C, O, P, W, R = Kind.COMPUTE, Kind.OFFLOAD, Kind.PREFETCH, Kind.WAIT, Kind.RELEASE


def plan_of(prog, steps, **kwargs) -> Plan:
    return Plan(program=prog, instructions=tuple(Instr(k, t) for k, t in steps), **kwargs)


def three_ops_and_a_remote_weight(weight_bytes):
    """x -> a -> b -> c = f(b, w); each op takes 1 s; the weight w starts in remote memory."""
    values = [value(0, 4, ValueKind.INPUT), value(1, weight_bytes, ValueKind.PARAMETER), value(2, 4), value(3, 4),
              value(4, 4)]
    ops = [op(0, [0], [2], flops=GB), op(1, [2], [3], flops=GB), op(2, [3, 1], [4], flops=GB)]
    return program(values, ops, [0, 1], [4])


@pytest.mark.parametrize("weight_gb, latency, step_s, stall_s", [
    (1.0, 0.0, 3.0, 0.0),    # 1 s copy under 2 s of compute before the reader: fully hidden
    (3.0, 0.0, 4.0, 1.0),    # 3 s copy: 2 s hidden, 1 s exposed
    (1.5, 0.25, 3.0, 0.0),   # latency counts: 0.25 + 1.5 = 1.75 s, still hidden
    (2.0, 0.5, 3.5, 0.5),    # 0.5 + 2 = 2.5 s: half a second exposed
])
def test_prefetch_hidden_or_not(weight_gb, latency, step_s, stall_s):
    prog = three_ops_and_a_remote_weight(int(weight_gb * GB))
    plan = plan_of(prog, [(P, 1), (C, 0), (C, 1), (W, 1), (C, 2)], initial_remote=frozenset({1}))
    timeline = simulate(plan, hardware(latency=latency))
    f = timeline.figures
    assert f.compute_s == pytest.approx(3.0)
    assert f.step_s == pytest.approx(step_s)
    assert f.exposed_s == pytest.approx(step_s - 3.0)
    assert f.stall_copy_s == pytest.approx(stall_s)
    assert f.stalls == (1 if stall_s else 0)
    assert f.h2d_bytes == int(weight_gb * GB) and f.d2h_bytes == 0


def test_prefetch_issued_at_its_reader_is_not_hidden():
    prog = three_ops_and_a_remote_weight(2 * GB)
    plan = plan_of(prog, [(C, 0), (C, 1), (P, 1), (W, 1), (C, 2)], initial_remote=frozenset({1}))
    f = simulate(plan, hardware()).figures
    # The copy is issued when the compute stream reaches it, as op 1 starts (t=1): it lands at t=3,
    # op 1 ends at 2, the wait stalls 1 s, op 2 runs 3..4.
    assert f.step_s == pytest.approx(4.0)
    assert f.stall_copy_s == pytest.approx(1.0)


def activation_round_trip(act_bytes):
    """x -> a (1 s); b = g(x) (1 s); c = g(b) (1 s); d = h(a, c) (1 s): a idles for two ops."""
    values = [value(0, 4, ValueKind.INPUT), value(1, act_bytes), value(2, 4), value(3, 4), value(4, 4)]
    ops = [op(0, [0], [1], flops=GB), op(1, [0], [2], flops=GB), op(2, [2], [3], flops=GB),
           op(3, [1, 3], [4], flops=GB)]
    return program(values, ops, [0], [4])


def round_trip_plan(prog, **kwargs):
    return plan_of(prog, [(C, 0), (O, 1), (R, 1), (C, 1), (W, 1), (P, 1), (C, 2), (W, 1), (C, 3)], **kwargs)


def test_offload_and_prefetch_fully_hidden():
    # offload a: 1.0 -> 1.5; the wait at t=2 costs nothing; prefetch 2.0 -> 2.5 under op 2 (2..3).
    timeline = simulate(round_trip_plan(activation_round_trip(GB // 2)), hardware())
    f = timeline.figures
    assert f.step_s == pytest.approx(4.0) and f.stalls == 0
    copies = {iv.stream: (iv.start, iv.end) for iv in timeline.intervals if iv.stream != "compute"}
    assert copies["d2h"] == pytest.approx((1.0, 1.5))
    assert copies["h2d"] == pytest.approx((2.0, 2.5))
    assert f.peak_bytes == 4 + 4 + 4 + GB // 2  # x, b, c with a back on the device for op 3
    assert f.d2h_bytes == f.h2d_bytes == GB // 2


def test_offload_and_prefetch_half_hidden():
    # offload 1.0 -> 2.5 (wait at 2.0 stalls 0.5); prefetch 2.5 -> 4.0; op 2 2.5..3.5; wait stalls to 4.0.
    f = simulate(round_trip_plan(activation_round_trip(3 * GB // 2)), hardware()).figures
    assert f.step_s == pytest.approx(5.0)
    assert f.stall_copy_s == pytest.approx(1.0) and f.stalls == 2


def test_a_release_that_waits_stops_compute_until_its_offload_lands():
    # The runtime on the CPU: the release right after the offload (1.0 -> 1.5) holds op 1 back to 1.5, so op 1
    # runs 1.5..2.5, the prefetch 2.5 -> 3.0 under op 2 (2.5..3.5), op 3 3.5..4.5: half a second later than a release
    # that lets compute run on.
    plan = round_trip_plan(activation_round_trip(GB // 2))
    f = simulate(plan, hardware(), release_waits=True).figures
    assert f.step_s == pytest.approx(4.5)
    assert f.stall_copy_s == pytest.approx(0.5) and f.stalls == 1
    assert simulate(plan, hardware()).figures.step_s == pytest.approx(4.0)
    waited = plan_of(plan.program, [(C, 0), (O, 1), (C, 1), (W, 1), (R, 1), (P, 1), (C, 2), (W, 1), (C, 3)])
    assert simulate(waited, hardware(), release_waits=True).figures.step_s == pytest.approx(
        simulate(waited, hardware()).figures.step_s)  # landed by its release: nothing to stop for


def test_both_lanes_busy_share_bandwidth():
    """Prefetch of w (2 GB) from t=0 and offload of a (0.5 GB) from t=1, duplex share 0.5:
    w moves 1 GB alone by t=1; both then run at 0.5 GB/s; a lands at t=2 with 0.5 GB of w left,
    which then moves at full speed: w lands at t=2.5."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 2 * GB, ValueKind.PARAMETER), value(2, GB // 2), value(3, 4),
              value(4, 4), value(5, 4)]
    ops = [op(0, [0], [2], flops=GB), op(1, [0], [3], flops=GB), op(2, [3], [4], flops=GB),
           op(3, [1, 2, 4], [5], flops=GB)]
    prog = program(values, ops, [0, 1], [5])
    plan = plan_of(prog, [(P, 1), (C, 0), (O, 2), (C, 1), (C, 2), (W, 2), (W, 1), (C, 3)],
                   initial_remote=frozenset({1}))
    timeline = simulate(plan, hardware(duplex=0.5))
    copies = {iv.stream: (iv.start, iv.end) for iv in timeline.intervals if iv.stream != "compute"}
    assert copies["h2d"] == pytest.approx((0.0, 2.5))
    assert copies["d2h"] == pytest.approx((1.0, 2.0))
    assert timeline.figures.step_s == pytest.approx(4.0)
    # Without contention each copy takes bytes / bandwidth.
    copies = {iv.stream: (iv.start, iv.end) for iv in simulate(plan, hardware()).intervals if iv.stream != "compute"}
    assert copies["h2d"] == pytest.approx((0.0, 2.0)) and copies["d2h"] == pytest.approx((1.0, 1.5))


def test_memory_wait_under_a_budget():
    """a (100 B) is offloaded at 50 B/s and released; b (100 B) fits only once a's memory is back,
    at t = 1 + 2: op 1 waits 2 s on memory."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 100), value(2, 100), value(3, 4)]
    ops = [op(0, [0], [1], flops=GB), op(1, [0], [2], flops=GB), op(2, [2], [3], flops=GB)]
    prog = program(values, ops, [0], [1, 3])
    plan = plan_of(prog, [(C, 0), (O, 1), (R, 1), (C, 1), (C, 2)], budget_bytes=108)
    f = simulate(plan, hardware(bw=50)).figures
    assert f.stall_memory_s == pytest.approx(2.0) and f.stalls == 1
    assert f.step_s == pytest.approx(5.0)
    assert f.peak_bytes <= 108


def test_a_release_after_waiting_for_its_offload_frees_once_the_copy_has_landed():
    """a (100 B) goes out at 50 B/s from t = 1 and lands at t = 3; the WAIT blocks compute until then, and the
    release after it must not give a's bytes back at t = 1, when its last reader finished."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 100), value(2, 100), value(3, 4)]
    ops = [op(0, [0], [1], flops=GB), op(1, [0], [2], flops=GB), op(2, [2], [3], flops=GB)]
    prog = program(values, ops, [0], [1, 3])
    plan = plan_of(prog, [(C, 0), (O, 1), (W, 1), (R, 1), (C, 1), (C, 2)], budget_bytes=108)
    timeline = simulate(plan, hardware(bw=50))
    assert _usage_at(timeline.memory, 2.0) == 104  # x and a, still being copied out
    assert _usage_at(timeline.memory, 3.5) == 104  # x and b: a's bytes came back at t = 3
    assert min(usage for _, usage in timeline.memory) >= 0
    assert timeline.figures.step_s == pytest.approx(5.0)


def test_a_prefetched_storage_released_unread_frees_after_its_copy_lands():
    """w (100 B) starts remote, comes in at 50 B/s (t = 0 .. 2) and is released without being read: its bytes
    are on the device until the copy lands, and the device's usage never goes below zero."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 100, ValueKind.PARAMETER), value(2, 4)]
    prog = program(values, [op(0, [0], [2], flops=GB)], [0, 1], [2])
    plan = plan_of(prog, [(P, 1), (W, 1), (R, 1), (C, 0)], initial_remote=frozenset({1}))
    memory = simulate(plan, hardware(bw=50)).memory
    assert min(usage for _, usage in memory) >= 0
    assert _usage_at(memory, 1.0) == 104
    # (Timed in steady state: the second step's prefetch of w starts at t = 2, when the first step's ends.)
    assert min(t for t, usage in memory if usage < 104 and t > 0) == pytest.approx(2.0)


def test_an_offload_that_is_the_last_use_frees_only_after_the_last_reader():
    """t (100 B) is written by op 0 (0 .. 1) and read last by op 1 (1 .. 4), then sent out; the offload waits
    only for op 0, so it runs 1 .. 2 while op 1 still reads t. Its bytes come back when op 1 ends (t = 4), not
    when the copy lands: the prefetch of w (100 B), which fits only without t, is issued at 4 and lands at 5."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 100), value(2, 4), value(3, 100, ValueKind.PARAMETER),
              value(4, 4)]
    ops = [op(0, [0], [1], flops=GB), op(1, [1], [2], flops=3 * GB), op(2, [2, 3], [4], flops=GB)]
    prog = program(values, ops, [0, 3], [4])
    plan = plan_of(prog, [(C, 0), (C, 1), (O, 1), (P, 3), (W, 3), (C, 2)], budget_bytes=112,
                   initial_remote=frozenset({3}))
    timeline = simulate(check_then(plan), hardware(bw=100))
    assert _usage_at(timeline.memory, 3.0) == 108  # x, t and op 1's output while op 1 runs
    h2d = next(iv for iv in timeline.intervals if iv.stream == "h2d")
    assert (h2d.start, h2d.end) == pytest.approx((4.0, 5.0))


def check_then(plan: Plan) -> Plan:
    check_plan(plan)
    return plan


def _usage_at(memory, t: float) -> int:
    """Device bytes in use at time ``t`` (seconds) by a timeline's memory trace (the last entry at or before)."""
    return [usage for when, usage in memory if when <= t][-1]


# --- invalid plans -------------------------------------------------------------------------------

@pytest.mark.parametrize("steps, message", [
    ([(C, 0), (O, 1), (R, 1), (C, 1), (C, 2), (C, 3)], r"#5: compute op3 .* reads v1, which is not on the device "
                                                       r"\(released by #2"),
    ([(C, 0), (O, 1), (R, 1), (C, 1), (W, 1), (P, 1), (C, 2), (C, 3)], r"#7: .* reads v1, .*prefetched by #5 but "
                                                                       r"not waited for"),
    ([(C, 0), (R, 1), (C, 1), (C, 2), (C, 3)], r"#1: release of v1 loses its data: .* used again by #4"),
    ([(C, 0), (C, 1), (C, 2), (C, 3), (C, 3)], r"#4: .* runs a second time"),
    ([(C, 3), (C, 0), (C, 1), (C, 2)], r"#0: .* runs before op0"),
    ([(C, 0), (W, 1), (C, 1), (C, 2), (C, 3)], r"#1: wait for v1: no transfer of it is in flight"),
    ([(C, 0), (O, 1), (W, 1), (P, 1), (C, 1), (C, 2), (C, 3)], r"#3: prefetch of v1: it is already on the device"),
    ([(C, 0), (C, 1), (C, 2)], r"never computes op3"),
])
def test_invalid_plans_name_the_instruction(steps, message):
    prog = activation_round_trip(8)
    with pytest.raises(PlanError, match=message):
        simulate(plan_of(prog, steps), hardware())


def test_budget_below_the_plan_is_rejected_statically():
    prog = activation_round_trip(100)
    with pytest.raises(PlanError, match=r"#0: compute op0 .* over the budget of 50"):
        check_plan(plan_without_offload(prog, budget_bytes=50))


def test_overwrite_during_offload_is_rejected():
    values = [value(0, 8, ValueKind.PARAMETER), value(1, 8, storage=0), value(2, 4)]
    ops = [op(0, [0], [1], mutates=[0]), op(1, [1], [2])]
    prog = program(values, ops, [0], [2])
    with pytest.raises(PlanError, match=r"#1: .* overwrites v0 while its offload #0"):
        check_plan(plan_of(prog, [(O, 0), (C, 0), (W, 0), (C, 1)]))


# --- random valid plans --------------------------------------------------------------------------

@st.composite
def random_plans(draw):
    """A random program, a random valid order, and round trips to remote memory over random idle gaps."""
    prog = draw(random_programs())
    order = random_valid_order(prog, draw(st.integers(0, 10**6)))
    values = prog.values
    uses: dict[int, list[int]] = {}
    for position, op_id in enumerate(order):
        for v in {values[x].storage for x in (*prog.ops[op_id].inputs, *prog.ops[op_id].outputs)}:
            uses.setdefault(v, []).append(position)
    before: dict[int, list[tuple[Kind, int]]] = {}
    after: dict[int, list[tuple[Kind, int]]] = {}
    for s, positions in uses.items():
        gaps = [(a, b) for a, b in zip(positions, positions[1:]) if b > a + 1]
        if not gaps or not draw(st.booleans()):
            continue
        a, b = draw(st.sampled_from(gaps))
        issue = draw(st.integers(a + 1, b))  # where the prefetch goes, inside the gap
        after.setdefault(a, []).extend([(O, s), (R, s)])
        before.setdefault(issue, []).extend([(W, s), (P, s)])
        before.setdefault(b, []).append((W, s))
    steps = []
    for position, op_id in enumerate(order):
        steps.extend(before.get(position, []))
        steps.append((C, op_id))
        steps.extend(after.get(position, []))
    return plan_of(prog, steps)


@settings(max_examples=200, deadline=None)
@given(random_plans(), st.floats(0.5, 4.0), st.floats(0.0, 0.5), st.floats(0.3, 1.0), st.booleans())
def test_random_valid_plans(plan, bandwidth, latency, duplex, with_budget):
    check = check_plan(plan)
    if with_budget:
        plan = Plan(program=plan.program, instructions=plan.instructions, budget_bytes=check.peak_bytes)
    hw = hardware(bw=bandwidth * 100, latency=latency, duplex=duplex)
    timeline = simulate(plan, hw)
    f = timeline.figures
    busy = {s: sum(iv.end - iv.start for iv in timeline.intervals if iv.stream == s) for s in ("compute", "h2d", "d2h")}
    for stream, seconds in busy.items():
        assert f.step_s >= seconds - 1e-9, stream
    assert busy["compute"] == pytest.approx(f.compute_s)
    assert all(bytes_ >= 0 for _, bytes_ in timeline.memory)
    assert max(b for _, b in timeline.memory) == f.peak_bytes
    if with_budget:  # under a budget, timing never needs more memory than the plan's own accounting
        assert f.peak_bytes <= check.peak_bytes
    assert f.exposed_s == pytest.approx(f.step_s - f.compute_s)
    assert f.lower_bound_s <= f.step_s + 1e-9
    assert f.stalls == len(timeline.stalls)
    assert f.stall_copy_s + f.stall_memory_s <= f.exposed_s + 1e-9
    assert f.h2d_bytes == sum(plan.program.values[i.target].alloc_bytes for i in plan.instructions if i.kind is P)
    assert simulate(plan, hw).figures == f  # deterministic


def test_state_kept_in_remote_memory_is_timed_in_steady_state():
    """w lives in remote memory between steps: prefetched before op 2, written by op 2, sent back after
    (0.5 s each way). Alone, a step ends when the offload lands (t = 3.5); run back to back, that
    offload and the next prefetch overlap the next step's first ops and the period is the 3 s of
    compute. With 1.5 s copies the cycle op 2 -> offload -> prefetch -> op 2 sets the period: 4 s."""
    values = [value(0, 4, ValueKind.INPUT), value(1, GB, ValueKind.OPTIMIZER_STATE), value(2, 4), value(3, 4),
              value(4, 4, storage=1)]
    ops = [op(0, [0], [2], flops=GB), op(1, [2], [3], flops=GB), op(2, [3, 1], [4], mutates=[1], flops=GB)]
    prog = program(values, ops, [0, 1], [3])
    plan = plan_of(prog, [(P, 1), (C, 0), (C, 1), (W, 1), (C, 2), (O, 1), (R, 1)], initial_remote=frozenset({1}))
    f = simulate(plan, hardware(bw=GB / 0.5)).figures
    assert f.steady_state
    assert f.step_s == pytest.approx(3.0)
    assert simulate(plan, hardware(bw=GB / 1.5)).figures.step_s == pytest.approx(4.0)
    assert f.h2d_bytes == f.d2h_bytes == GB  # per step, not per simulated pair of steps
    from hyperoffload.repeat import repeat_plan

    doubled, starts = repeat_plan(plan, 2)
    assert starts == (0, 7) and len(doubled.program.ops) == 6
    assert doubled.instructions[7] == Instr(P, 1)  # the lanes, not the compute stream, order it after the offload


def _state_program():
    """As above, and op 1's output (value 3) is the step's output."""
    values = [value(0, 4, ValueKind.INPUT), value(1, GB, ValueKind.OPTIMIZER_STATE), value(2, 4), value(3, 4),
              value(4, 4, storage=1)]
    ops = [op(0, [0], [2], flops=GB), op(1, [2], [3], flops=GB), op(2, [3, 1], [4], mutates=[1], flops=GB)]
    return program(values, ops, [0, 1], [3])


def test_steady_state_with_an_output_sent_to_remote_memory_after_its_last_use():
    """The output is offloaded and released after its last reader; in the first of the two simulated
    steps it is not held past that reader, so its release there is already done by the automatic free."""
    plan = plan_of(_state_program(), [(P, 1), (C, 0), (C, 1), (W, 1), (C, 2), (O, 3), (R, 3), (O, 1), (R, 1)],
                   initial_remote=frozenset({1}))
    f = simulate(plan, hardware(bw=GB / 0.5)).figures
    assert f.steady_state and f.step_s == pytest.approx(3.0)


def test_a_plan_that_leaves_an_input_elsewhere_is_timed_as_one_step():
    """State w starts and ends in remote memory, but input x starts on the device and ends remote: the
    step cannot repeat as it stands, so it is simulated once (ending when the last copy lands)."""
    plan = plan_of(_state_program(), [(P, 1), (C, 0), (O, 0), (C, 1), (W, 1), (C, 2), (O, 1), (R, 1), (R, 0)],
                   initial_remote=frozenset({1}))
    f = simulate(plan, hardware(bw=GB / 0.5)).figures
    assert not f.steady_state
    assert f.step_s == pytest.approx(3.5)  # the last offload lands 0.5 s after the compute


def test_prefetch_right_after_an_offload_waits_on_the_lane_not_on_compute():
    # a goes out 1.0 -> 2.0 and comes straight back 2.0 -> 3.0 while ops 1 and 2 run (1..3): no stall.
    timeline = simulate(plan_of(activation_round_trip(GB), [(C, 0), (O, 1), (R, 1), (P, 1), (C, 1), (C, 2), (W, 1),
                                                            (C, 3)]), hardware())
    copies = {iv.stream: (iv.start, iv.end) for iv in timeline.intervals if iv.stream != "compute"}
    assert copies == {"d2h": pytest.approx((1.0, 2.0)), "h2d": pytest.approx((2.0, 3.0))}
    assert timeline.figures.step_s == pytest.approx(4.0) and timeline.figures.stalls == 0


def test_verify_checks_the_timeline_it_is_given():
    """verify re-checks ordering on the timeline itself: a timeline whose prefetch starts before the
    offload landed (here edited by hand) is rejected, and a steady-state timeline is read against the
    two-step plan it was simulated from."""
    from dataclasses import replace as with_

    from hyperoffload.simulate import Interval
    from hyperoffload.verify import VerificationError, _check_timeline

    plan = round_trip_plan(activation_round_trip(GB // 2))
    timeline = simulate(plan, hardware())
    _check_timeline(plan, timeline)
    broken = tuple(iv._replace(start=0.5) if iv.stream == "h2d" else iv for iv in timeline.intervals)
    assert any(isinstance(iv, Interval) and iv.stream == "h2d" for iv in broken)
    with pytest.raises(VerificationError, match="before the offload it reads from has landed"):
        _check_timeline(plan, with_(timeline, intervals=broken))


def test_issuing_cache_instructions_costs_compute_time_where_the_profile_says_so():
    """Two cache instructions (a prefetch and its wait) are issued before op 2: with issue_s = 0.1 s op 2
    runs 0.2 s longer, and so does the step."""
    prog = three_ops_and_a_remote_weight(GB)
    steps = [(C, 0), (C, 1), (P, 1), (W, 1), (C, 2)]
    plan = plan_of(prog, steps, initial_remote=frozenset({1}))
    fast = simulate(plan, hardware(bw=100 * GB)).figures
    slow = simulate(plan, hardware(bw=100 * GB).replace(issue_s=0.1)).figures
    assert slow.step_s == pytest.approx(fast.step_s + 0.2)
    assert slow.compute_s == fast.compute_s  # the ops cost the same; the overhead is the plan's
