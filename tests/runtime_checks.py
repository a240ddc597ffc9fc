"""Shared pieces of the runtime tests (tests/models): hand-made round-trip plans on a captured step, a link slow
enough that copies are still in flight while later ops run, the planner's plan for it, and exact comparisons."""

from __future__ import annotations

import pytest
import torch

import hyperoffload
from hyperoffload.hardware.cpu import CpuCalibration, cpu_emulated
from hyperoffload.ir import ValueKind
from hyperoffload.plans import Instr, Kind, Plan

START = -1
"""A round trip leaving at START is offloaded before the first op runs."""
END = None
"""A round trip returning at END is never prefetched: the step leaves the storage in remote memory."""


def compute_uses(program, storage: int) -> list[int]:
    """Positions (captured order) of the ops that read or write ``storage``."""
    return [op.id for op in program.ops
            if storage in {program.values[v].storage for v in (*op.inputs, *op.outputs)}]


def longest_idle_gap(program, storage: int) -> tuple[int, int]:
    """The consecutive uses ``(a, b)`` of ``storage`` farthest apart. Nothing touches the storage strictly
    between them, so it is not mutated across the gap."""
    uses = compute_uses(program, storage)
    return max(zip(uses, uses[1:]), key=lambda ab: ab[1] - ab[0])


def idle_ops(program, storage: int) -> int:
    a, b = longest_idle_gap(program, storage)
    return b - a


def storage_named(program, name: str) -> int:
    value = next(v for v in program.values if v.name == name)
    assert value.owns_storage
    return value.id


def round_trip_plan(program, trips, initial_remote: dict[int, int] | None = None) -> Plan:
    """The captured order plus, for each ``(storage, after, before)``: offload, wait and release right after
    the op at ``after`` (or before any op, for START), and prefetch and wait right before the op at
    ``before`` (never, for END). ``initial_remote`` maps storages that start in remote memory to the op
    before which they are prefetched."""
    initial_remote = initial_remote or {}
    leave: dict[int, list[int]] = {}
    arrive: dict[int, list[int]] = {}
    for s, before in initial_remote.items():
        arrive.setdefault(before, []).append(s)
    for s, after, before in trips:
        leave.setdefault(after, []).append(s)
        if before is not END:
            arrive.setdefault(before, []).append(s)
    instrs: list[Instr] = []
    for s in leave.get(START, []):
        instrs += [Instr(Kind.OFFLOAD, s), Instr(Kind.WAIT, s), Instr(Kind.RELEASE, s)]
    for position in range(len(program.ops)):
        for s in arrive.get(position, []):
            instrs += [Instr(Kind.PREFETCH, s), Instr(Kind.WAIT, s)]
        instrs.append(Instr(Kind.COMPUTE, position))
        for s in leave.get(position, []):
            instrs += [Instr(Kind.OFFLOAD, s), Instr(Kind.WAIT, s), Instr(Kind.RELEASE, s)]
    return Plan(program=program, instructions=tuple(instrs), policy="hand", initial_remote=frozenset(initial_remote))


def offload_trips(program):
    """Round trips for several large storages across long idle gaps: parameters idle between their
    forward and backward / optimizer uses, optimizer state idle from the step's start to the optimizer
    (and one left in remote memory after its update), activations saved for the backward pass, and the
    returned loss, left in remote memory."""
    trips = []
    for name in ("embed.weight", "layers.0.attn.wq.weight", "output.weight"):
        param = storage_named(program, name)
        trips.append((param, *longest_idle_gap(program, param)))
    for name in ("exp_avg:embed.weight", "exp_avg_sq:embed.weight", "exp_avg:layers.0.ffn.w1.weight"):
        state = storage_named(program, name)
        trips.append((state, START, compute_uses(program, state)[0]))
    last_state = storage_named(program, "exp_avg_sq:output.weight")
    trips.append((last_state, compute_uses(program, last_state)[-1], END))
    loss = program.values[program.outputs[0]].storage
    trips.append((loss, compute_uses(program, loss)[-1], END))
    activations = [v.id for v in program.values
                   if v.owns_storage and v.kind is ValueKind.ACTIVATION and v.alloc_bytes >= 32768]
    activations.sort(key=lambda s: (-idle_ops(program, s), s))
    for s in activations[:6]:
        trips.append((s, *longest_idle_gap(program, s)))
    return trips


def plan_bytes(plan: Plan, kind: Kind) -> int:
    return sum(plan.program.values[i.target].alloc_bytes for i in plan.instructions if i.kind is kind)


def assert_identical(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


SLOW = dict(h2d_bw=200e6, d2h_bw=200e6, h2d_latency_s=20e-6, d2h_latency_s=20e-6)
"""A link slow enough that copies of tiny-llama's tensors are still in flight while later ops run."""


@pytest.fixture(scope="module")
def planned(captured):
    """The planner's plan at half the peak, for a profile whose link is the SLOW one (fixed numbers, so the
    test does not calibrate this machine)."""
    return hyperoffload.plan(captured.program, slow_hardware(), "50%")


def slow_hardware():
    """A ``cpu-emulated`` profile of fixed numbers whose link is the SLOW one."""
    calibration = CpuCalibration(key="test", matmul_flops={"float32": 50e9}, memory_bw=10e9, op_overhead_s=10e-6,
                                 memory_bytes=2**34)
    return cpu_emulated(calibration, h2d_bw=SLOW["h2d_bw"], d2h_bw=SLOW["d2h_bw"], latency_s=SLOW["h2d_latency_s"])


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (which pytest would treat as the user stopping the run)."""
