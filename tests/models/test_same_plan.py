"""``check_same_plan`` on two real ranks (gloo, two processes): the same plan passes on both with its digest; plans
for different budgets are refused on both ranks, naming the rank that differs; without a process group it says
what to do."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from hyperoffload import PlanMismatch, check_same_plan
from hyperoffload.plans import Instr, Kind, Plan, plan_digest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared test helpers, in the spawned ranks too
from programs import op, program, value  # noqa: E402


def _plan(budget: int) -> Plan:
    step = program([value(0, 400), value(1, 400)], [op(0, [0], [1])], [0], [1])
    return Plan(program=step, policy="test", budget_bytes=budget, instructions=(Instr(Kind.COMPUTE, 0),))


def _rank(rank: int, world: int, store: str, budgets: tuple[int, ...], results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results.put((rank, "ok", check_same_plan(_plan(budgets[rank]))))
    except PlanMismatch as error:
        results.put((rank, "mismatch", str(error)))
    finally:
        dist.destroy_process_group()


def _run(tmp_path, budgets: tuple[int, ...]) -> dict[int, tuple[str, str]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    store = str(tmp_path / "store")
    procs = [context.Process(target=_rank, args=(r, len(budgets), store, budgets, results)) for r in range(len(budgets))]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, kind, text = results.get(timeout=120)
        out[rank] = (kind, text)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def test_the_same_plan_passes_on_every_rank(tmp_path):
    out = _run(tmp_path, (1000, 1000))
    assert out[0] == out[1] == ("ok", plan_digest(_plan(1000)))


def test_different_plans_are_refused_on_every_rank_naming_the_rank(tmp_path):
    out = _run(tmp_path, (1000, 2000))
    for kind, text in out.values():
        assert kind == "mismatch"
        assert "rank 1 planned the step differently from rank 0" in text and "same step" in text


def test_without_a_process_group_it_says_so():
    with pytest.raises(RuntimeError, match="init_process_group"):
        check_same_plan(_plan(1000))
