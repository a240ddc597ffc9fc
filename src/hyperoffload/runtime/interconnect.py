"""The link between the ranks of a process group, measured with all-gathers, as a profile's interconnect fields.

The simulator charges a collective by the ring model (``hyperoffload.collectives``): an all-gather of a tensor
of ``S`` bytes over ``N`` ranks takes ``(N-1)/N * S / bw + (N-1) * latency``. ``measure_interconnect`` times
all-gathers of a small and of a large tensor on the group (every rank takes part; each size is gathered a few times
after a warm-up and each rank keeps its fastest time) and solves that formula for ``bw`` and ``latency`` from the
two sizes: the difference between them gives the bandwidth, the small one what is left for the latency. Every rank
gets the same figures (the slowest rank's time at each size, agreed by an all-reduce), so that ranks which plan
with them plan alike. ``Interconnect.on(hardware)`` puts them on a profile as one node of ``N`` devices
(``devices_per_node``, ``intra_node_bw``, ``intra_node_latency_s``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hyperoffload.hardware import Hardware


@dataclass(frozen=True, slots=True, kw_only=True)
class InterconnectProbe:
    """The all-gathers ``measure_interconnect`` times."""

    small_bytes: int = 4 * 1024
    """The whole (gathered) tensor of the all-gather that sets the latency (bytes)."""
    large_bytes: int = 8 * 1024 * 1024
    """The whole (gathered) tensor of the all-gather that sets the bandwidth (bytes)."""
    repeats: int = 5
    """Timed all-gathers of each size, after two untimed ones."""

    def __post_init__(self) -> None:
        if not 0 < self.small_bytes < self.large_bytes:
            raise ValueError(f"the probe needs 0 < small_bytes < large_bytes, got {self.small_bytes} and "
                             f"{self.large_bytes}")
        if self.repeats < 1:
            raise ValueError(f"the probe needs at least 1 timed repeat, got {self.repeats}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Interconnect:
    """The link between the ranks of one group, as the ring model reads it."""

    ranks: int
    """Ranks in the group."""
    bw: float
    """Bandwidth from one rank to the others, one direction (bytes/s)."""
    latency_s: float
    """Fixed cost of one ring step (seconds)."""
    small_s: float
    """The measured all-gather of ``probe.small_bytes`` (seconds; the slowest rank's fastest)."""
    large_s: float
    """The measured all-gather of ``probe.large_bytes`` (seconds; the slowest rank's fastest)."""
    probe: InterconnectProbe = InterconnectProbe()
    """The all-gathers that were timed."""

    def on(self, hardware: Hardware) -> Hardware:
        """``hardware`` as one node of ``ranks`` devices joined by this link."""
        return hardware.replace(devices_per_node=self.ranks, intra_node_bw=self.bw, intra_node_latency_s=self.latency_s)

    def as_dict(self) -> dict:
        return {"intra_node_bw": self.bw, "intra_node_latency_s": self.latency_s,
                "all_gather_small_s": self.small_s, "all_gather_small_bytes": self.probe.small_bytes,
                "all_gather_large_s": self.large_s, "all_gather_large_bytes": self.probe.large_bytes}


def measure_interconnect(group=None, probe: InterconnectProbe = InterconnectProbe()) -> Interconnect:
    """The interconnect of ``group`` (torch.distributed's default group when None; it must be initialized and
    have at least 2 ranks), measured with the all-gathers of float32 tensors ``probe`` names (the module docstring
    says how). Every rank of the group must call it at the same point of its program, with the same ``probe``."""
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    if ranks < 2:
        raise ValueError(f"an interconnect joins 2 ranks or more; the group has {ranks}")
    small, large = probe.small_bytes, probe.large_bytes
    times = torch.tensor([_fastest_all_gather(size, ranks, group, probe.repeats) for size in (small, large)],
                         dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # the same figures on every rank
    small_s, large_s = (float(t) for t in times)
    share = (ranks - 1) / ranks
    # A large gather no slower than a small one (a machine too noisy to tell): charge the large one's rate.
    bw = share * (large - small) / (large_s - small_s) if large_s > small_s else share * large / large_s
    latency_s = max(0.0, (small_s - share * small / bw) / (ranks - 1))
    return Interconnect(ranks=ranks, bw=bw, latency_s=latency_s, small_s=small_s, large_s=large_s, probe=probe)


def _fastest_all_gather(nbytes: int, ranks: int, group, repeats: int) -> float:
    """The fastest of ``repeats`` all-gathers of a tensor of ``nbytes`` (whole) on ``group``, after two untimed
    ones (seconds)."""
    import torch.distributed as dist

    # all_gather_into_tensor's newer name where this torch has it (the old one warns that it is deprecated).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    shard = torch.ones(max(1, nbytes // 4 // ranks), dtype=torch.float32)
    whole = torch.empty(shard.numel() * ranks, dtype=torch.float32)
    best = float("inf")
    for k in range(repeats + 2):
        start = time.perf_counter()
        gather(whole, shard, group=group)
        if k >= 2:
            best = min(best, time.perf_counter() - start)
    return best


__all__ = ["Interconnect", "InterconnectProbe", "measure_interconnect"]
