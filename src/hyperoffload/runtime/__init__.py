"""Executors of captured steps and plans."""

from hyperoffload.runtime.plan_executor import PlanRun, run_plan
from hyperoffload.runtime.reference import EagerComparison, ReferenceRun, compare_with_eager, run_reference

__all__ = ["EagerComparison", "PlanRun", "ReferenceRun", "compare_with_eager", "run_plan", "run_reference"]
