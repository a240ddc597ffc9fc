"""The remote tier's capacity: host memory a node has, shared by the ranks on it.

A plan keeps a copy in host memory of every storage it offloads or starts remote (``plans.remote_bytes``). The
ranks of a node each run the same plan, so a node holds ``remote_bytes x ranks_per_node``; the profile states one
node's host memory (``host_memory_bytes``, 0: not stated; ``--host-memory`` overrides it). ``host_memory_need``
says what a plan needs against it, and ``check_host_memory`` refuses a plan that needs more, naming what would
fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperoffload.hardware import Hardware
from hyperoffload.plans import Plan, remote_bytes
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

    @property
    def per_node(self) -> int:
        return self.per_rank * self.ranks_per_node

    @property
    def fits(self) -> bool:
        return self.host_memory_bytes == 0 or self.per_node <= self.host_memory_bytes


def host_memory_need(plan: Plan, hardware: Hardware) -> HostMemoryNeed:
    """What ``plan`` keeps in host memory on ``hardware``'s nodes (the step's world from ``program.meta``)."""
    world = plan.program.meta.get("world", 1)
    return HostMemoryNeed(per_rank=remote_bytes(plan), ranks_per_node=max(1, min(world, hardware.devices_per_node)),
                          host_memory_bytes=hardware.host_memory_bytes)


def check_host_memory(plan: Plan, hardware: Hardware) -> HostMemoryNeed:
    """``host_memory_need(plan, hardware)``, or ``HostMemoryExceeded`` when a node cannot hold it."""
    need = host_memory_need(plan, hardware)
    if need.fits:
        return need
    ranks = f"the {need.ranks_per_node} ranks of a node" if need.ranks_per_node > 1 else "its node"
    raise HostMemoryExceeded(
        f"the plan keeps {format_bytes(need.per_rank)} of the step in host memory per rank, "
        f"{format_bytes(need.per_node)} for {ranks}, more than a node's {format_bytes(need.host_memory_bytes)} "
        f"of host memory on {hardware.name}; give a node at least that much (--host-memory {need.per_node}, in "
        f"bytes, or host_memory in the profile), or a larger device budget, whose plans keep less in host memory",
        need)


__all__ = ["HostMemoryExceeded", "HostMemoryNeed", "check_host_memory", "host_memory_need"]
