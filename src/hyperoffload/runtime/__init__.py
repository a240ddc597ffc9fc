"""Executors of captured steps."""

from hyperoffload.runtime.reference import EagerComparison, ReferenceRun, compare_with_eager, run_reference

__all__ = ["EagerComparison", "ReferenceRun", "compare_with_eager", "run_reference"]
