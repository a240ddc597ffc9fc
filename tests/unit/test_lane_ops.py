"""Lane ops: a step's own transfers (a decode step's block fetches and remote writes) in the IR, the
simulator, the order refinement, and the decode policies that use them (``paged``, ``hyperoffload``)."""

from __future__ import annotations

import dataclasses

import pytest

from hyperoffload.analysis import memory_profile
from hyperoffload.cli import main
from hyperoffload.hardware import get_hardware
from hyperoffload.ir import Op, Phase, ValueKind
from hyperoffload.plans import PlanError, plan_without_offload
from hyperoffload.budgets import hideable_budget
from hyperoffload.policies import POLICIES, InfeasibleBudget, minimum_budget, plan_hyperoffload, policies_for
from hyperoffload.policies.hyperoffload import candidate_orders
from hyperoffload.policies.reorder import fetch_on_demand, overlap_lane_ops
from hyperoffload.simulate import simulate
from hyperoffload.variants import has_remote_kv, largest_pool_variant
from hyperoffload.verify import verify
from hyperoffload.workloads import capture_workload, get_workload
from hyperoffload.workloads.deepseek_remote import expected_fetch_fraction
from programs import op, program, simple_hardware, value

GB = 10**9


def lane(oid, inputs, outputs, direction, nbytes):
    return Op(id=oid, name=f"lane{oid}", target="test.lane", inputs=tuple(inputs), outputs=tuple(outputs),
              phase=Phase.FORWARD, lane=direction, transfer_bytes=nbytes)


def fetch_step(fetch_bytes: int):
    """op0: 1 s -> x; a fetch of ``fetch_bytes`` from the remote cache, indexed by x; op2 reads the blocks
    (1 s); op3 (1 s) needs only x. Values: 0 remote cache, 1 weights, 2 x, 3 blocks, 4 y, 5 z."""
    remote = dataclasses.replace(value(0, 4 * GB, ValueKind.KV_CACHE), alloc_bytes=0, remote=True)
    values = [remote, value(1, 64, ValueKind.PARAMETER), value(2, 64), value(3, 1024), value(4, 64), value(5, 64)]
    ops = [op(0, [1], [2], flops=GB), lane(1, [0, 2], [3], "h2d", fetch_bytes), op(2, [3], [4], flops=GB),
           op(3, [2], [5], flops=GB)]
    return program(values, ops, [0, 1], [4, 5])


def test_a_fetch_runs_on_its_lane_after_its_index_and_its_reader_waits():
    prog = fetch_step(2 * GB)  # 2 s at 1 GB/s
    hw = simple_hardware(bw=GB, latency=0.0)
    captured = simulate(plan_without_offload(prog), hw)
    # op0 [0, 1]; fetch [1, 3]; op2 waits, runs [3, 4]; op3 [4, 5].
    assert captured.figures.step_s == pytest.approx(5.0)
    assert captured.figures.stall_copy_s == pytest.approx(2.0)
    assert captured.figures.h2d_bytes == 2 * GB and captured.figures.compute_s == pytest.approx(3.0)
    fetch = next(iv for iv in captured.intervals if iv.stream == "h2d")
    assert (fetch.start, fetch.end) == (pytest.approx(1.0), pytest.approx(3.0))
    # Overlapped: op3 runs while the blocks arrive; op2 waits one second less.
    order = overlap_lane_ops(prog)
    assert order == (0, 1, 3, 2)
    overlapped = simulate(plan_without_offload(prog, order=order), hw)
    assert overlapped.figures.step_s == pytest.approx(4.0)
    # No order beats the chain op0 -> fetch -> op2: 1 + 2 + 1 s.
    assert overlapped.figures.dependency_bound_s == pytest.approx(4.0)
    assert simulate(plan_without_offload(fetch_step(GB // 2)), hw).figures.dependency_bound_s == pytest.approx(3.0)
    verify(plan_without_offload(prog, order=order), hw)
    # The device never holds the remote cache; the fetched blocks count from when the fetch is issued.
    assert captured.figures.peak_bytes == 64 * 3 + 1024


def test_bound_counts_the_bytes_a_step_must_fetch():
    prog = fetch_step(8 * GB)
    plan = dataclasses.replace(plan_without_offload(prog, order=overlap_lane_ops(prog)), budget_bytes=10**6)
    figures = simulate(plan, simple_hardware(bw=GB)).figures
    assert figures.bound_s == pytest.approx(8.0)  # the fetch's 8 GB at 1 GB/s, not compute's 3 s
    assert figures.step_s == pytest.approx(1 + 8 + 1)


def test_fetch_on_demand_moves_a_fetch_to_its_reader():
    prog = fetch_step(GB)
    assert fetch_on_demand(prog, (0, 1, 3, 2)) == (0, 3, 1, 2)
    assert fetch_on_demand(prog) == (0, 1, 2, 3)


def test_remote_values_only_move_through_lane_ops():
    prog = fetch_step(GB)
    bad = list(prog.ops)
    bad[2] = op(2, [0, 3], [4], flops=GB)  # a compute op reading the remote cache
    with pytest.raises(ValueError, match="reads a remote value on the compute stream"):
        program(prog.values, bad, [0, 1], [4, 5])
    heavy = [dataclasses.replace(prog.values[0], alloc_bytes=8), *prog.values[1:]]
    with pytest.raises(ValueError, match="must take no device memory"):
        program(heavy, prog.ops, [0, 1], [4, 5])
    from hyperoffload.plans import Instr, Kind, Plan
    plan = plan_without_offload(prog)
    offload = Plan(program=prog, instructions=(Instr(Kind.OFFLOAD, 0), *plan.instructions))
    with pytest.raises(PlanError, match="lives in remote memory"):
        simulate(offload, simple_hardware())


@pytest.mark.parametrize("pool, valid, expected", [(None, 100, 1.0), (16, 100, 0.25), (58, 100, 0.125),
                                                   (100, 100, 0.0), (16, 10, 0.0)])
def test_expected_fetch_fraction(pool, valid, expected):
    assert expected_fetch_fraction(pool, 16, valid, reselection=0.75) == pytest.approx(expected)


def test_expected_fetch_fraction_rejects_bad_input():
    with pytest.raises(ValueError, match="at least nsa_top_n"):
        expected_fetch_fraction(8, 16, 100)
    with pytest.raises(ValueError, match="share between 0 and 1"):
        expected_fetch_fraction(16, 16, 100, reselection=1.5)


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


def test_sweep_over_nsa_block_sizes(capsys):
    code = main(["sweep", "--workload", "tiny-deepseek", "--mode", "decode", "--batch", "2", "--context", "2000",
                 "--hardware", "h200", "--budget", "80%", "--vary", "nsa-block", "--values", "16,32",
                 "--policies", "hyperoffload,paged", "--json"])
    assert code == 0
    import json
    rows = json.loads(capsys.readouterr().out)
    assert {(r["value"], r["policy"]) for r in rows} == {(v, p) for v in ("16", "32") for p in ("hyperoffload", "paged")}
    assert all(r["feasible"] for r in rows)


def test_nsa_block_flag_errors_name_the_problem(capsys):
    assert main(["plan", "--workload", "tiny-llama", "--mode", "decode", "--hardware", "h200", "--budget", "80%",
                 "--nsa-block", "32"]) != 0
    assert "has no NSA" in " ".join(capsys.readouterr().err.split())


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


def test_dependency_bound_sums_the_compute_between_chained_fetches():
    """op0 -> fetch (2 s) -> {op3, op4} -> fetch (2 s) -> op7, and op1 and op6 independent of both
    fetches (every op 1 s). op3 and op4 are parallel branches, so the longest single path is 7 s; on one
    compute stream both run between the fetches: 1 + 2 + 2 + 2 + 1 = 8 s, and op1 and op6 hide in the
    fetches."""
    remote = dataclasses.replace(value(0, 4 * GB, ValueKind.KV_CACHE), alloc_bytes=0, remote=True)
    values = [remote, value(1, 64, ValueKind.PARAMETER), *(value(i, 64) for i in range(2, 10))]
    ops = [op(0, [1], [2], flops=GB), op(1, [1], [3], flops=GB), lane(2, [0, 2], [4], "h2d", 2 * GB),
           op(3, [4], [5], flops=GB), op(4, [4], [6], flops=GB),  # two branches between the fetches
           lane(5, [0, 5, 6], [7], "h2d", 2 * GB), op(6, [1], [8], flops=GB), op(7, [7], [9], flops=GB)]
    prog = program(values, ops, [0, 1], [3, 8, 9])
    hw = simple_hardware(bw=GB)
    from hyperoffload.analysis.dependency_bound import dependency_bound
    assert dependency_bound(prog, hw) == pytest.approx(8.0)
    best = simulate(plan_without_offload(prog, order=overlap_lane_ops(prog)), hw).figures
    assert best.step_s == pytest.approx(8.0) and best.compute_s == pytest.approx(6.0)


def test_plan_json_says_where_the_kv_cache_is(capsys):
    import json

    args = ["plan", "--workload", "tiny-deepseek", "--mode", "decode", "--batch", "4", "--context", "20000",
            "--hardware", "h200", "--budget", "40%", "--json"]  # the cache is most of the peak
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv"] == "remote" and out["pool_blocks"] >= 4 and out["feasible"]
    assert 0 < out["fetch_share"] < 1 and out["reselection"] == 0.75
    assert out["dependency_bound_s"] <= out["step_s"] * (1 + 1e-9)  # summed in another order
    assert main([*args[:-1], "--policy", "kv-naive", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"] == "device"


def test_plan_says_which_peak_the_excess_of_a_remote_kv_step_is_measured_from(capsys):
    """The figures of a plan that runs the remote-KV form are that form's: its excess is measured from its own
    peak (the cache is remote), which can leave excess_bytes at 0; the text says so and gives both peaks."""
    args = ["plan", "--workload", "tiny-deepseek", "--mode", "decode", "--batch", "4", "--context", "20000",
            "--hardware", "h200", "--budget", "40%"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())  # as one line, whatever the console's wrapping
    assert "excess_bytes and bound_s are measured from this form's no-offload peak" in out
    assert "with the KV cache on the device the step peaks at" in out
    # the link bound is of the form the plan runs: another form of the step can be faster than another's bound
    assert "no plan of this form of the step (its KV cache remote), in any order, can beat link_bound_s" in out
