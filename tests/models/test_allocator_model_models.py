"""The caching allocator model replaying plans of a captured tiny-llama training step: what fragmentation costs,
and frees that wait for the offloads still reading their blocks."""

from programs import simple_hardware

from hyperoffload.allocator_model import fragmentation_figures, replay_caching_allocator
from hyperoffload.analysis import memory_profile
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import plan_hyperoffload
from hyperoffload.workloads import capture_workload, get_workload


def test_replaying_plans_counts_what_fragmentation_costs():
    prog = capture_workload(get_workload("tiny-llama"), "train").program
    peak = memory_profile(prog).peak_bytes
    unlimited = replay_caching_allocator(plan_without_offload(prog))
    assert unlimited.limit_bytes is None and unlimited.stalls == unlimited.failures == 0
    assert unlimited.live_peak_bytes == peak
    assert unlimited.reserved_peak_bytes >= peak
    hardware = simple_hardware(bw=1e8)
    plan = plan_hyperoffload(prog, hardware, int(peak * 0.5))
    figures = fragmentation_figures(plan)
    assert figures["arena_stalls"] == 0
    assert figures["arena_bytes"] >= replay_caching_allocator(plan).live_peak_bytes
    # At a budget the live bytes just fit, the caching allocator's 2 and 20 MiB segments do not.
    assert figures["allocator_stalls"] >= 1 and figures["allocator_failures"] >= 1


def test_stream_ordered_frees_of_a_plan_wait_for_every_offload_to_land():
    """On a slow link, every storage ``layerwise`` offloads and releases is reusable no earlier than its
    offload lands in the simulation, and the live bytes the allocator sees are never fewer than in
    instruction order."""
    from hyperoffload.allocator_model import stream_ordered_frees
    from hyperoffload.layout import residencies
    from hyperoffload.plans import Kind
    from hyperoffload.policies import get_policy
    from hyperoffload.simulate import simulate

    prog = capture_workload(get_workload("tiny-llama"), "train").program
    hardware = simple_hardware(bw=1e8)
    plan = get_policy("layerwise")(prog, hardware, memory_profile(prog).peak_bytes)
    timeline = simulate(plan, hardware)
    found = residencies(plan)
    times = stream_ordered_frees(timeline, found)
    landed = {iv.instruction: iv.end for iv in timeline.intervals if iv.stream == "d2h"}
    offload = {}
    delayed = 0
    for i, ins in enumerate(plan.instructions):
        if ins.kind is Kind.OFFLOAD:
            offload[ins.target] = i
        elif ins.kind is Kind.RELEASE:
            (k,) = [k for k, r in enumerate(found) if r.storage == ins.target and r.end == i + 1]
            assert times[k][1] >= landed[offload[ins.target]]
            delayed += times[k][1] == landed[offload[ins.target]]
    assert delayed > 0
    ordered = replay_caching_allocator(plan)
    streamed = replay_caching_allocator(plan, timeline=timeline)
    assert streamed.live_peak_bytes >= ordered.live_peak_bytes
