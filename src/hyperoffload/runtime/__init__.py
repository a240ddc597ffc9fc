"""Executors of captured steps and plans."""

from hyperoffload.runtime.arena import ArenaOverlap
from hyperoffload.runtime.async_executor import AsyncExecutor, run_async
from hyperoffload.runtime.device_bytes import BudgetExceeded
from hyperoffload.runtime.emulated_link import EmulatedLink, Transfer
from hyperoffload.runtime.interpreter import execute_plan, run_plan
from hyperoffload.runtime.native_link import NativeLink
from hyperoffload.runtime.reference import EagerComparison, ReferenceRun, compare_with_eager, run_reference
from hyperoffload.runtime.step_results import PlanRun
from hyperoffload.runtime.transfers import TransferError

__all__ = ["ArenaOverlap", "AsyncExecutor", "BudgetExceeded", "EagerComparison", "EmulatedLink", "NativeLink", "PlanRun",
           "ReferenceRun", "Transfer", "TransferError", "compare_with_eager", "execute_plan", "run_async", "run_plan",
           "run_reference"]
