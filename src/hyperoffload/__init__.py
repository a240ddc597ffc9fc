"""HyperOffload for PyTorch: compiler-planned offloading of a step's tensors to remote memory."""

from hyperoffload.lazy import lazy_package

_WHERE = {
    "LiveRange": "hyperoffload.analysis",
    "MemoryProfile": "hyperoffload.analysis",
    "live_ranges": "hyperoffload.analysis",
    "memory_profile": "hyperoffload.analysis",
    "storage_ranges": "hyperoffload.analysis",
    "AdamW": "hyperoffload.capture",
    "CaptureError": "hyperoffload.capture",
    "Captured": "hyperoffload.capture",
    "capture_decode_step": "hyperoffload.capture",
    "capture_prefill_step": "hyperoffload.capture",
    "capture_train_step": "hyperoffload.capture",
    "fake_build": "hyperoffload.capture",
    "Op": "hyperoffload.ir",
    "Phase": "hyperoffload.ir",
    "Program": "hyperoffload.ir",
    "Value": "hyperoffload.ir",
    "ValueKind": "hyperoffload.ir",
    "verify_program": "hyperoffload.ir",
    "hideable_budget": "hyperoffload.budgets",
    "parse_budget": "hyperoffload.budgets",
    "Hardware": "hyperoffload.hardware",
    "HardwareError": "hyperoffload.hardware",
    "as_hardware": "hyperoffload.hardware",
    "get_hardware": "hyperoffload.hardware",
    "InfeasibleBudget": "hyperoffload.policies",
    "PlannerConfig": "hyperoffload.policies",
    "plan_hyperoffload": "hyperoffload.policies",
    "Timeline": "hyperoffload.simulate",
    "simulate": "hyperoffload.simulate",
    "VerificationError": "hyperoffload.verify",
    "verify": "hyperoffload.verify",
    "Backend": "hyperoffload.compile",
    "CompiledGraph": "hyperoffload.compile",
    "backend": "hyperoffload.compile",
    "StepFigures": "hyperoffload.compile.train_step",
    "TrainStep": "hyperoffload.compile.train_step",
    "TrialRuns": "hyperoffload.compile.train_step",
    "train_step": "hyperoffload.compile.train_step",
    "PolicyResult": "hyperoffload.compare",
    "compare": "hyperoffload.compare",
    "sweep": "hyperoffload.compare",
    "AsyncExecutor": "hyperoffload.runtime",
    "EmulatedLink": "hyperoffload.runtime",
    "NativeLink": "hyperoffload.runtime",
    "run_async": "hyperoffload.runtime",
    "keep_freed_host_memory": "hyperoffload.runtime.host_malloc",
    "Planned": "hyperoffload.planning",
    "plan": "hyperoffload.planning",
    "plan_checked": "hyperoffload.planning",
    "PlanMismatch": "hyperoffload.same_plan",
    "check_same_plan": "hyperoffload.same_plan",
}
"""Where each attribute of the package lives (imported on first use: ``import hyperoffload`` alone
imports neither torch nor the rest of the package)."""

lazy_package(__name__, _WHERE)

__version__ = "0.1.0"

__all__ = ["StepFigures", "TrainStep", "TrialRuns", "train_step", "AsyncExecutor", "EmulatedLink", "NativeLink", "run_async", "keep_freed_host_memory", "PolicyResult", "compare", "sweep", "Backend", "CompiledGraph", "backend", "Hardware", "HardwareError", "InfeasibleBudget", "PlannerConfig", "Timeline", "VerificationError", "get_hardware",
           "hideable_budget", "parse_budget", "plan", "plan_checked", "Planned", "plan_hyperoffload", "simulate", "verify", "AdamW", "CaptureError", "Captured", "LiveRange", "MemoryProfile", "Op", "Phase", "Program", "Value",
           "ValueKind", "capture_decode_step", "capture_prefill_step", "capture_train_step", "fake_build",
           "live_ranges", "memory_profile", "storage_ranges", "verify_program", "PlanMismatch", "check_same_plan"]
