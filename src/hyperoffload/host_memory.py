"""The remote tier's capacity: host memory a node has, shared by the ranks on it.

A plan keeps its remote copies in host memory, copies of one size that are never live at once in one buffer, and
the storages that start the step remote (``remote_layout.remote_bytes``). The ranks of a node each run the same
plan, so a node holds ``remote_bytes x ranks_per_node``; the profile states one node's host memory (``host_memory_bytes``, 0: not stated; ``--host-memory`` overrides it). ``host_memory_need``
says what a plan needs against it, and ``check_host_memory`` refuses a plan that needs more, naming what would
fit and the least any plan under the same device budget needs (``least_host_bytes``: the bytes some op forces off
the device in every order, ``analysis.link_bound.least_off_device``). The hyperoffload planner prefers, of the
plans it tries, those that fit a rank's share of the node (``host_bytes_per_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperoffload.analysis.link_bound import least_off_device
from hyperoffload.cost import host_ranks as ranks_per_node
from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Plan
from hyperoffload.remote_layout import remote_bytes
from hyperoffload.units import format_bytes


class HostMemoryExceeded(ValueError):
    """A plan keeps more in host memory than a node has; ``need`` says how much."""

    def __init__(self, message: str, need: HostMemoryNeed) -> None:
        super().__init__(message)
        self.need = need


@dataclass(frozen=True, slots=True, kw_only=True)
class HostMemoryNeed:
    """What a plan keeps in host memory, per rank and per node, against a node's host memory (bytes)."""

    per_rank: int
    ranks_per_node: int
    """Ranks of the step's world on one node: ``min(world, devices_per_node)``."""
    host_memory_bytes: int
    """One node's host memory (0: not stated, no limit)."""
    least_per_rank: int = 0
    """What every plan of the step under the plan's device budget keeps in host memory per rank, at least (0 where
    the plan has no budget or nothing must leave)."""

    @property
    def per_node(self) -> int:
        return self.per_rank * self.ranks_per_node

    @property
    def fits(self) -> bool:
        return self.host_memory_bytes == 0 or self.per_node <= self.host_memory_bytes


def host_bytes_per_rank(program: Program, hardware: Hardware) -> int:
    """One rank's share of a node's host memory (bytes); 0 where the profile states none (no limit)."""
    return hardware.host_memory_bytes // ranks_per_node(program, hardware)


def least_host_bytes(program: Program, budget_bytes: int) -> int:
    """Bytes every plan of ``program`` under ``budget_bytes`` keeps in host memory per rank, at least: what some op
    forces off the device in every order (``analysis.link_bound.least_off_device``)."""
    return least_off_device(program, budget_bytes)[0]


def host_memory_need(plan: Plan, hardware: Hardware) -> HostMemoryNeed:
    """What ``plan`` keeps in host memory on ``hardware``'s nodes (the step's world from ``program.meta``)."""
    least = least_host_bytes(plan.program, plan.budget_bytes) if plan.budget_bytes is not None else 0
    return HostMemoryNeed(per_rank=remote_bytes(plan), ranks_per_node=ranks_per_node(plan.program, hardware),
                          host_memory_bytes=hardware.host_memory_bytes, least_per_rank=least)


def check_host_memory(plan: Plan, hardware: Hardware) -> HostMemoryNeed:
    """``host_memory_need(plan, hardware)``, or ``HostMemoryExceeded`` when a node cannot hold it."""
    need = host_memory_need(plan, hardware)
    if need.fits:
        return need
    ranks = f"the {need.ranks_per_node} ranks of a node" if need.ranks_per_node > 1 else "its node"
    least = need.least_per_rank * need.ranks_per_node
    if least > need.host_memory_bytes:
        floor = (f"; no plan under this device budget keeps less than {format_bytes(need.least_per_rank)} per rank "
                 f"({format_bytes(least)} a node): that much must be off the device at one point of the step in "
                 f"every order, so a node needs at least --host-memory {least} whatever the plan")
    else:
        floor = (f"; the least any plan under this device budget keeps is {format_bytes(need.least_per_rank)} per "
                 f"rank, which a node holds, but the planner found no plan that keeps so little")
    raise HostMemoryExceeded(
        f"the plan keeps {format_bytes(need.per_rank)} of the step in host memory per rank, "
        f"{format_bytes(need.per_node)} for {ranks}, more than a node's {format_bytes(need.host_memory_bytes)} "
        f"of host memory on {hardware.name}{floor}. Give a node at least {format_bytes(need.per_node)} (--host-memory "
        f"{need.per_node}, in bytes, or host_memory in the profile), or a larger device budget, whose plans keep "
        f"less in host memory", need)


__all__ = ["HostMemoryExceeded", "HostMemoryNeed", "check_host_memory", "host_bytes_per_rank", "host_memory_need",
           "least_host_bytes", "ranks_per_node"]
