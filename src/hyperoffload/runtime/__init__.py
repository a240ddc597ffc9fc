"""Executors of captured steps."""

from hyperoffload.runtime.reference import ReferenceRun, run_reference

__all__ = ["ReferenceRun", "run_reference"]
