"""What one selection pass and its post-passes share: the op times it plans against, where each chosen span's
instructions go, and the context that holds both with what they are planned for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.policies.hyperoffload.config import PlannerConfig, PositionBudget
from hyperoffload.policies.spans import Span


@dataclass(frozen=True, slots=True)
class StepProfile:
    """What a pass plans against, per position of the order planned: when each op starts and ends and how long it
    takes (seconds), and the device bytes live there without offload (bytes)."""

    start: np.ndarray
    end: np.ndarray
    times: np.ndarray
    live: np.ndarray


def back_to_back(times: np.ndarray, live: np.ndarray) -> StepProfile:
    """The step with each op right after the one before, taking ``times`` (seconds)."""
    end = np.cumsum(times)
    return StepProfile(start=end - times, end=end, times=times, live=live)


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a chosen span's instructions go (positions: before the op at that position; ``n`` is
    after the step's last op)."""

    offload: int
    """Position of its OFFLOAD, or -1 when a remote copy is still current."""
    release: int
    prefetch: int
    resumes: int = 0
    """Cyclic spans: first position of the step at which the storage is no longer on the device (an
    offload still landing from the previous step holds it until then)."""
    offload_begin: float = -1.0
    """When the offload's lane reservation begins (seconds) if not at its position's start."""

    def freed(self, n: int) -> list[tuple[int, int]]:
        """Positions [lo, hi) during which the storage is off the device."""
        if self.prefetch >= self.release:
            return [(self.release, self.prefetch)]
        return [(self.release, n), (self.resumes, self.prefetch)]  # cyclic: wraps past the step's end

    def covered(self, over: np.ndarray, n: int) -> float:
        """Over-budget compute time (seconds) the storage is off the device for; ``over[k]`` is that time before
        position k."""
        return sum(over[hi] - over[lo] for lo, hi in self.freed(n) if hi > lo)


@dataclass(frozen=True, slots=True, kw_only=True)
class PassContext:
    """What one selection pass plans from, in one execution order, for one bandwidth margin and start; the
    selection and the post-passes read it and change none of it."""

    program: Program
    hardware: Hardware
    budget: PositionBudget
    step: StepProfile
    """Op times (seconds) and no-offload live bytes the pass plans against, per position of ``order``."""
    spans: Sequence[Span]
    """The candidate spans; a choice is keyed by its index here."""
    writes: Mapping[int, list[int]]
    """Storage -> positions that write it, ascending."""
    order: Sequence[int]
    margin: float
    """Share of the link bandwidth the schedule assumes."""
    config: PlannerConfig
    state_first: bool = False
    """Whether cyclic spans win near-ties in the selection (``PlannerConfig.state_first``)."""
    turn: bool = False
    """Whether the selection first keeps state read on both sides of the turn from forward to backward away across
    it (``PlannerConfig.state_first_turn``; with ``state_first``)."""

    @property
    def positions(self) -> int:
        """Ops in the step; position ``positions`` is after its last op."""
        return self.step.live.size
