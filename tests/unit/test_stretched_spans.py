"""Where nothing hides, the selection stretches a span it has already chosen over the position, with the copies that
span has booked, before it takes a new span unhidden (``selection._Selection._stretched``). Hand-built passes with
hand-computed positions, and a sharded step where the stretch makes the plan faster."""

from __future__ import annotations

import numpy as np
from programs import op, program, simple_hardware, value

from hyperoffload.hardware import get_hardware
from hyperoffload.planning import plan_checked
from hyperoffload.policies.hyperoffload import selection
from hyperoffload.policies.hyperoffload.config import PlannerConfig, PositionBudget
from hyperoffload.policies.hyperoffload.context import Choice, PassContext, back_to_back
from hyperoffload.policies.hyperoffload.minimum import minimum_budget
from hyperoffload.policies.spans import Span
from hyperoffload.workloads import capture_workload, get_workload

SECOND = 10**9
"""FLOPs of a one-second op on ``simple_hardware``."""


def _pass(live: list[int], budget: int, spans: list[Span]) -> selection._Selection:
    """A selection pass over six one-second ops (a chain) with ``live`` bytes at each position, on a link of 1000
    bytes a second each way."""
    values = [value(0, 64)] + [value(i, 1000) for i in range(1, 7)]
    ops = [op(i, [i], [i + 1], flops=SECOND) for i in range(6)]
    prog = program(values, ops, [0], [6])
    ctx = PassContext(program=prog, hardware=simple_hardware(bw=1000.0), budget=PositionBudget.uniform(budget, 6),
                      step=back_to_back(np.ones(6), np.asarray(live, dtype=np.int64)), spans=spans, writes={},
                      order=tuple(range(6)), margin=1.0, config=PlannerConfig())
    return selection._Selection(ctx)


def test_a_chosen_span_whose_offload_lands_late_is_released_where_the_budget_needs_it():
    # Storage 1 (1000 bytes) idles from position 0 to 5; its offload is booked at 1 and lands at 3, so it was
    # released at 3. Positions 2 and 3 are over the budget by 500: released at 2 instead, it covers both, with the
    # same offload and prefetch (the compute stream waits at 2 for the copy that lands at 3).
    sel = _pass([1000, 1000, 2500, 2500, 1000, 1000], 2000, [Span(1, 0, 5, 1000)])
    sel._take(0, Choice(1, 3, 5))
    assert sel.excess.tolist() == [-1000, -1000, 500, -500, -2000, -1000]
    i, choice = sel._stretched(2, 500.0)
    assert (i, choice) == (0, Choice(1, 2, 5))
    sel._replace(i, choice)
    assert sel.excess.tolist() == [-1000, -1000, -500, -500, -2000, -1000]


def test_an_offload_booked_after_the_position_goes_right_after_the_use_before_the_span():
    sel = _pass([1000, 1000, 2500, 2500, 1000, 1000], 2000, [Span(1, 0, 5, 1000)])
    sel._take(0, Choice(3, 4, 5))
    assert sel._stretched(2, 500.0) == (0, Choice(1, 2, 5))


def test_a_chosen_span_back_too_early_is_prefetched_after_the_whole_over_budget_stretch():
    # Storage 1 idles from 0 to 5 and was booked back at 2; positions 2 and 3 are over the budget. The prefetch
    # moves to 4, after the stretch (the latest that lands in time, the lanes aside, is 4: 1 s before position 5).
    sel = _pass([1000, 1000, 2500, 2500, 1000, 1000], 2000, [Span(1, 0, 5, 1000)])
    sel._take(0, Choice(1, 1, 2))
    assert sel._stretched(2, 500.0) == (0, Choice(1, 1, 4))


def test_of_the_stretches_the_one_with_the_least_wait_is_taken():
    # Two chosen spans cover position 2 with their idle time: the first lands at 4 (waits 2 s there), the second
    # at 3 (waits 1 s). The second is stretched although the first would relieve as much.
    spans = [Span(1, 0, 5, 1000), Span(2, 1, 5, 1000)]
    sel = _pass([1000, 2000, 3500, 3500, 3500, 1000], 3000, spans)
    sel._take(0, Choice(1, 4, 5))
    sel._take(1, Choice(2, 3, 5))
    assert sel._stretched(2, 500.0) == (1, Choice(2, 2, 5))


def test_nothing_to_stretch_where_no_chosen_span_idles_over_the_position():
    sel = _pass([1000, 1000, 2500, 2500, 1000, 1000], 2000, [Span(1, 3, 5, 1000)])
    sel._take(0, Choice(4, 4, 5))
    assert sel._stretched(2, 500.0) is None


def test_a_span_kept_remote_between_steps_is_released_where_the_budget_needs_it():
    # Storage 1 is read last at 4 and first at 1 (of the next step): its cyclic span. Its offload was booked after
    # the step, so it left only at the step's end, and position 5 is over the budget by 500. The offload goes right
    # after its last use instead, and it is released there.
    sel = _pass([1000, 1000, 1000, 1000, 1000, 2500], 2000, [Span(1, 4, 1, 1000)])
    sel._take(0, Choice(6, 6, 1, 0, offload_begin=6.0))
    assert sel._stretched(5, 500.0) == (0, Choice(5, 5, 1, 0))


def test_a_span_kept_remote_between_steps_and_back_early_is_stretched_last():
    # Position 2 is over the budget. Storage 1 (cyclic: read last at 4, first at 3) was booked back at 2; storage 2
    # leaves after its use at 1 and was released at 3. Either stretch waits 1 s; the cyclic one would relieve more,
    # but a kept-remote storage's prefetch is stretched only where nothing else can be.
    spans = [Span(1, 4, 3, 1000), Span(2, 1, 5, 500)]
    sel = _pass([1000, 2000, 3500, 2000, 1000, 1000], 2000, spans)
    sel._take(0, Choice(-1, 5, 2, 0))
    sel._take(1, Choice(2, 3, 5))
    assert sel._stretched(2, 1500.0) == (1, Choice(2, 2, 5))
    alone = _pass([1000, 2000, 3500, 2000, 1000, 1000], 2000, spans[:1])
    alone._take(0, Choice(-1, 5, 2, 0))
    assert alone._stretched(2, 1500.0) == (0, Choice(-1, 5, 3, 0))


def test_stretching_chosen_spans_makes_a_sharded_step_at_its_smallest_budget_faster():
    """tiny-llama on 2 ranks of dgx-h100 at the smallest budget: the forward pass's saved activations leave slower
    than it computes, and without the stretch the selection sends short-lived gathered parameters on a round trip
    over that link."""
    prog = capture_workload(get_workload("tiny-llama"), "train", world=2).program
    hardware = get_hardware("dgx-h100")
    budget = minimum_budget(prog)[0]
    stretched = plan_checked(prog, hardware, budget).timeline.step_s
    unstretched = plan_checked(prog, hardware, budget, config=PlannerConfig(stretch_chosen=False)).timeline.step_s
    assert stretched < 0.98 * unstretched
