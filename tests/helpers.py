"""Shared checks for end-to-end capture tests."""

from __future__ import annotations

import heapq
import random

import torch

from hyperoffload.analysis import memory_profile
from hyperoffload.capture import Captured
from hyperoffload.runtime import run_reference


def clones(tensors):
    return [t.clone() for t in tensors]


def assert_matches_eager(captured: Captured, order=None) -> None:
    """Run the captured graph and the eager step on identical copies of the inputs: outputs and every
    input (optimizer state, parameters and caches are updated in place) must be bit-identical, and the
    executor's measured live bytes must equal the analysis at every op."""
    graph_inputs, eager_inputs = clones(captured.inputs), clones(captured.inputs)
    run = run_reference(captured.program, graph_inputs, order)
    eager = captured.step(*eager_inputs)
    eager = eager if isinstance(eager, (tuple, list)) else (eager,)
    assert len(run.outputs) == len(eager)
    for got, want in zip(run.outputs, eager):
        assert torch.equal(got, want)
    for i, (got, want) in enumerate(zip(graph_inputs, eager_inputs)):
        assert torch.equal(got, want), f"input {captured.program.values[captured.program.inputs[i]].name} differs"
    profile = memory_profile(captured.program, order)
    assert run.live_bytes == profile.live_bytes
    assert run.peak_bytes == profile.peak_bytes


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
