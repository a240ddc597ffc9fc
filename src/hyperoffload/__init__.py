"""HyperOffload for PyTorch: compiler-planned offloading of a step's tensors to remote memory."""

from hyperoffload.analysis import LiveRange, MemoryProfile, live_ranges, memory_profile, storage_ranges
from hyperoffload.capture import (AdamW, CaptureError, Captured, capture_decode_step, capture_prefill_step,
                                  capture_train_step, fake_build)
from hyperoffload.ir import Op, Phase, Program, Value, ValueKind, verify_program

from hyperoffload.budgets import hideable_budget, parse_budget
from hyperoffload.hardware import Hardware, HardwareError, as_hardware, get_hardware
from hyperoffload.policies import InfeasibleBudget, PlannerConfig, plan_hyperoffload
from hyperoffload.simulate import Timeline, simulate
from hyperoffload.verify import VerificationError, verify
from hyperoffload.compile import Backend, CompiledGraph, backend
from hyperoffload.compile.train_step import StepFigures, TrainStep, train_step
from hyperoffload.compare import PolicyResult, compare, sweep
from hyperoffload.runtime import AsyncExecutor, EmulatedLink, run_async

__version__ = "0.1.0"

__all__ = ["StepFigures", "TrainStep", "train_step", "AsyncExecutor", "EmulatedLink", "run_async", "PolicyResult", "compare", "sweep", "Backend", "CompiledGraph", "backend", "Hardware", "HardwareError", "InfeasibleBudget", "PlannerConfig", "Timeline", "VerificationError", "get_hardware",
           "hideable_budget", "parse_budget", "plan", "plan_hyperoffload", "simulate", "verify", "AdamW", "CaptureError", "Captured", "LiveRange", "MemoryProfile", "Op", "Phase", "Program", "Value",
           "ValueKind", "capture_decode_step", "capture_prefill_step", "capture_train_step", "fake_build",
           "live_ranges", "memory_profile", "storage_ranges", "verify_program"]


def plan(program: Program, hardware: Hardware | str, budget: int | str, *, policy: str = "hyperoffload"):
    """Plan ``program`` on ``hardware`` (a profile or its name) under ``budget`` (bytes, or text such as
    ``"40GiB"``, ``"50%"``, ``"hideable"``) with ``policy``; returns a verified ``hyperoffload.plans.Plan``."""
    from hyperoffload.policies import get_policy

    hardware = as_hardware(hardware)
    budget_bytes = parse_budget(budget, program, hardware)
    result = get_policy(policy)(program, hardware, budget_bytes)
    verify(result)
    return result
