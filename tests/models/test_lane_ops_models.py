"""Lane ops on captured DeepSeek decode steps: the remote-KV form of the step, the smallest budget counted over
its forms, and the decode policies (``paged``, ``hyperoffload``) that use the lane ops."""

from __future__ import annotations

import pytest

from hyperoffload.analysis import memory_profile
from hyperoffload.budgets import hideable_budget
from hyperoffload.hardware import get_hardware
from hyperoffload.plans import plan_without_offload
from hyperoffload.policies import POLICIES, InfeasibleBudget, minimum_budget, plan_hyperoffload, policies_for
from hyperoffload.policies.hyperoffload import candidate_orders
from hyperoffload.simulate import simulate
from hyperoffload.variants import has_remote_kv, largest_pool_variant
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload


@pytest.fixture(scope="module")
def v2_lite_decode():
    """deepseek-v2-lite decode, batch 16, context 32768, fake tensors: the KV cache is a third of the peak."""
    return capture_workload(get_workload("deepseek-v2-lite"), "decode", batch=16, context=32768).program


def test_remote_kv_form_captures_lane_ops_and_no_cache_bytes(v2_lite_decode):
    assert has_remote_kv(v2_lite_decode) and "paged" in policies_for(v2_lite_decode)
    peak = memory_profile(v2_lite_decode).peak_bytes
    form = largest_pool_variant(v2_lite_decode, int(peak * 0.8))
    cfg = get_workload("deepseek-v2-lite").config
    assert memory_profile(form).peak_bytes <= peak * 0.8
    fetches = [o for o in form.ops if o.lane == "h2d"]
    stores = [o for o in form.ops if o.lane == "d2h"]
    assert len(fetches) == len(stores) == cfg.layers
    assert sum(v.remote for v in form.values) == cfg.layers
    selected = 16 * cfg.nsa_top_n * cfg.nsa_sel_block * cfg.kv_dim * 2  # bf16
    fraction = form.meta["pool_fetch_fraction"]
    assert 0 < fraction < 0.25 and fetches[0].transfer_bytes == round(selected * fraction)
    assert stores[0].transfer_bytes == 16 * cfg.kv_dim * 2  # one token's latent per sequence
    # A budget no pool fits takes the form without a pool; one nothing fits, None.
    bare = largest_pool_variant(v2_lite_decode, memory_profile(form).peak_bytes - form.meta["pool_block_bytes"]
                                * (form.meta["pool_blocks"] - cfg.nsa_top_n) - 1)
    assert bare.meta["pool_blocks"] is None
    assert largest_pool_variant(v2_lite_decode, 10**6) is None


def test_smallest_budget_counts_the_remote_kv_forms():
    """A long cache makes the captured step's gather of it the largest working set; the planner plans the step with
    the cache remote below that, so the smallest budget it can meet, and its errors, come from that form."""
    step = capture_workload(get_workload("tiny-deepseek"), "decode", context=4096).program
    captured = min(minimum_budget(step, order=order)[0] for order in candidate_orders(step))
    least, why = minimum_budget(step)
    assert least < captured / 2 and why.startswith("in the step's form with the KV cache in remote memory")
    hw = get_hardware("h100-sxm")
    plan = plan_hyperoffload(step, hw, least)
    assert has_remote_kv(step) and plan.program is not step
    assert verify(plan, hw).figures.peak_bytes <= least
    with pytest.raises(InfeasibleBudget, match="below the smallest this planner can meet") as error:
        plan_hyperoffload(step, hw, least - 1)
    assert error.value.min_budget_bytes == least and why in str(error.value)
    assert hideable_budget(step, get_hardware("gh200")) >= least


@pytest.mark.parametrize("hardware", ["h200", "ascend-910c"])
def test_decode_policies_on_a_remote_cache(v2_lite_decode, hardware):
    hw = get_hardware(hardware)
    peak = memory_profile(v2_lite_decode).peak_bytes
    budget = int(peak * 0.74)
    results = {}
    for name in ("hyperoffload", "paged", "kv-naive"):
        plan = POLICIES[name](v2_lite_decode, hw, budget)
        assert plan.budget_bytes == budget, name
        results[name] = verify(plan, hw).figures
    ours = results["hyperoffload"]
    assert ours.peak_bytes <= 0.74 * peak
    assert ours.step_s < results["paged"].step_s and ours.step_s < results["kv-naive"].step_s
    assert ours.step_s <= 1.05 * ours.bound_s


def test_with_room_for_everything_hyperoffload_is_no_slower_than_none(v2_lite_decode):
    hw = get_hardware("h200")
    peak = memory_profile(v2_lite_decode).peak_bytes
    ours = simulate(POLICIES["hyperoffload"](v2_lite_decode, hw, peak), hw).figures
    none = simulate(POLICIES["none"](v2_lite_decode, hw, peak), hw).figures
    assert ours.step_s <= none.step_s and ours.peak_bytes <= none.peak_bytes


def test_speculative_prefetch_hides_the_fetch(v2_lite_decode):
    """Prefetching each layer's previous selection a layer ahead leaves only the blocks the guess missed to
    fetch after selection: in the refined order the step runs at compute, with no block pool at all."""
    from hyperoffload.policies.reorder import overlap_lane_ops
    from hyperoffload.variants import remote_kv_variant, speculative_variant

    hw = get_hardware("h200")
    spec = speculative_variant(v2_lite_decode)
    order = overlap_lane_ops(spec)
    figures = simulate(plan_without_offload(spec, order=order), hw).figures
    assert figures.step_s == pytest.approx(figures.compute_s) and figures.stalls == 0
    bare = remote_kv_variant(v2_lite_decode, None)
    without = simulate(plan_without_offload(bare, order=overlap_lane_ops(bare)), hw).figures
    assert without.stall_copy_s > 0 and figures.h2d_bytes > without.h2d_bytes  # it moves more, but hidden
    # hyperoffload at the speculative form's peak: within budget and bound, ahead of paged.
    budget = memory_profile(spec, order).peak_bytes
    ours = verify(POLICIES["hyperoffload"](v2_lite_decode, hw, budget), hw).figures
    assert ours.peak_bytes <= budget and ours.step_s <= 1.05 * ours.bound_s
    assert ours.step_s < simulate(POLICIES["paged"](v2_lite_decode, hw, budget), hw).figures.step_s
