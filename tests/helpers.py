"""Shared checks for tests: end-to-end capture, and every policy's plans against a lower bound."""

from __future__ import annotations

import heapq
import random

from hyperoffload.capture import Captured
from hyperoffload.runtime import compare_with_eager


def assert_matches_eager(captured: Captured, order=None) -> None:
    """The captured graph and the eager step, run on identical copies of the inputs, give bit-identical
    outputs and inputs (optimizer state, parameters and caches are updated in place), and the executor's
    measured live bytes equal the analysis at every op."""
    result = compare_with_eager(captured, order)
    assert result.identical, f"differs from eager: {result.mismatched} (max abs diff {result.max_abs_diff})"
    assert result.max_abs_diff == 0.0
    assert result.live_bytes_agree
    assert result.measured_peak_bytes == result.analysed_peak_bytes


def random_valid_order(program, seed: int) -> list[int]:
    """A random execution order that respects ``program.dependencies()`` (Kahn's algorithm)."""
    rng = random.Random(seed)
    deps = program.dependencies()
    users: list[list[int]] = [[] for _ in program.ops]
    waiting = [len(d) for d in deps]
    for op_id, ds in enumerate(deps):
        for d in ds:
            users[d].append(op_id)
    ready = [(rng.random(), i) for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, op_id = heapq.heappop(ready)
        order.append(op_id)
        for u in users[op_id]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (rng.random(), u))
    return order



def assert_no_plan_beats(bound_s, prog, hardware, budget: int) -> None:
    """Every policy's plan of ``prog`` that meets ``budget`` simulates no faster than ``bound_s(order)`` (seconds,
    a lower bound for plans in that compute order); ``bound_s`` may assert more of its own."""
    from hyperoffload.host_optimizer import NotShardedTraining
    from hyperoffload.policies import POLICIES, InfeasibleBudget
    from hyperoffload.simulate import _keeps_state_remote, simulate

    for name, policy in POLICIES.items():
        try:
            plan = policy(prog, hardware, budget)
        except (InfeasibleBudget, NotShardedTraining):  # a policy of sharded training steps refuses other steps
            continue
        if plan.program is not prog:
            continue  # a plan of another form of the step: the bound is of ``prog``'s op orders
        figures = simulate(plan, hardware).figures
        if figures.peak_bytes > budget:
            continue  # the policy did not meet the budget: the bound is about plans that do
        # A plan that starts state remote ends it there, so it can run step after step (and is timed so): the
        # bounds assume it, since a plan that left such state on the device would have sent it out in no step.
        assert not plan.initial_remote or _keeps_state_remote(plan), name
        seconds = bound_s(plan.compute_order())
        assert seconds <= figures.step_s * (1 + 1e-9) + 1e-12, (name, seconds, figures.step_s)


def assert_no_plan_beats_order_bound(bound_of, prog, hardware, budget: int) -> None:
    """``assert_no_plan_beats`` for a bound of one op order: ``bound_of(order)`` gives a figure with ``seconds`` (the
    bound) and ``compute_s``, which must be what the unplanned step in that order simulates to, and no more than
    the bound."""
    import pytest

    from hyperoffload.plans import plan_without_offload
    from hyperoffload.simulate import simulate

    def seconds(order):
        bound = bound_of(order)
        unplanned = simulate(plan_without_offload(prog, order), hardware).figures.compute_s
        assert bound.compute_s == pytest.approx(unplanned, rel=1e-9, abs=1e-15)
        assert bound.seconds >= bound.compute_s
        return bound.seconds

    assert_no_plan_beats(seconds, prog, hardware, budget)


def load_bench_script(name: str):
    """``bench/<name>.py`` as a module (the bench folder is not a package), registered under ``name`` in
    ``sys.modules``: dataclasses, and a script importing its sibling, look their module up there."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def results_of(monkeypatch, module, name: str) -> list:
    """What every call of ``module.name`` returns while the test runs, in call order: the function is wrapped (with
    ``monkeypatch``, so it is restored after the test) and still does its work."""
    results = []
    real = getattr(module, name)

    def recorded(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(module, name, recorded)
    return results
