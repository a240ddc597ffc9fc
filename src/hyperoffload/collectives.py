"""What a collective costs on a hardware profile: all-gather, reduce-scatter and all-reduce of one tensor over a
group of ranks, by the ring algorithm, hierarchical where the group spans nodes.

``nbytes`` is always the full, unsharded tensor's size in bytes (nccl-tests' *S*): the output of an all-gather,
the input of a reduce-scatter, the tensor an all-reduce sums. Each rank holds ``nbytes / group_size`` of it as
its shard. Times are seconds.

One ring of ``N`` ranks over a link of bandwidth ``bw`` (bytes/s, one direction, per rank) and a fixed cost of
``latency`` seconds per step moves, in an all-gather or a reduce-scatter, ``(N-1)/N * nbytes`` through each rank's
outgoing link in ``N-1`` steps::

    t = (N-1)/N * nbytes / bw + (N-1) * latency

and an all-reduce is a reduce-scatter followed by an all-gather, twice that. These are the ring formulas behind
NCCL's bus bandwidth (nccl-tests, doc/PERFORMANCE.md: reduce-scatter and all-gather ``t = S*(n-1)/(B*n)``,
all-reduce ``t = 2*S*(n-1)/(B*n)``, *B* the bandwidth of each rank to the others); the per-step latency is how
NCCL's own tuning model charges a ring (``nsteps * latency``, src/graph/tuning.cc). A group of one rank moves
nothing and costs 0.

A group that spans nodes runs hierarchically, with ``k`` ranks in each of ``n`` nodes (``group_size = k * n``):

- a reduce-scatter first reduces inside each node (a ring of ``k`` over the whole tensor on ``intra_node_bw``,
  leaving each rank ``nbytes / k`` reduced over its node), then across nodes (``k`` rings of ``n`` ranks in
  parallel, one per local rank index, each over ``nbytes / k`` on ``inter_node_bw``);
- an all-gather runs the same two rings in the other order (across nodes, then inside each node);
- the two stages run one after the other, so their times add.

The inter-node stage is the bottleneck wherever the network is slower than the links inside a node (one 50 GB/s
NIC per GPU against 450 GB/s of NVLink on a DGX H100): it moves only ``1/k`` of the tensor, through every rank's
own inter-node link at once, so the bandwidth it sees is ``inter_node_bw`` per rank, ``k * inter_node_bw`` per node.
The whole traffic per rank is still ``(N-1)/N * nbytes``, split between the two links, so no collective is faster
than ``(N-1)/N * nbytes`` over the faster link. NCCL itself pipelines the two levels through flat rings, so on
real hardware the stages may overlap: the sum here is the time without that overlap, at the links' nominal rates
(measured bus bandwidth is lower, and the profile's bandwidths may be set to measured figures instead).

Where the group's ranks sit: by default packed, filling whole nodes (``min(group_size, devices_per_node)`` ranks
per node); ``ranks_per_node`` places them otherwise (1 for a group of one rank per node, as the replicate
dimension of a hybrid-sharded mesh is).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from hyperoffload.hardware.profile import Hardware
from hyperoffload.ir import CollectiveKind


class CollectiveError(ValueError):
    """A collective that the profile cannot run as asked; the message says what to change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RingStage:
    """One ring of a collective: ``ranks`` ranks pass ``nbytes`` (the full tensor of this ring, bytes) around over
    links of ``bw`` bytes/s each way per rank, paying ``latency_s`` seconds per step."""

    ranks: int
    nbytes: float
    bw: float
    latency_s: float

    def seconds(self) -> float:
        """One all-gather or reduce-scatter on this ring: ``(N-1)/N * nbytes / bw + (N-1) * latency_s``."""
        steps = self.ranks - 1
        return steps / self.ranks * self.nbytes / self.bw + steps * self.latency_s


def ring_stages(hardware: Hardware, nbytes: float, group_size: int, *,
                ranks_per_node: int | None = None) -> tuple[RingStage, ...]:
    """The rings one all-gather or reduce-scatter of ``nbytes`` (the full tensor) runs over a group of
    ``group_size`` ranks on ``hardware``: none for a group of one, one ring inside a node, or a ring inside each
    node and rings across nodes (the module docstring says how). ``ranks_per_node`` places the group (default:
    packed into whole nodes)."""
    nbytes = _checked_bytes(nbytes)
    group_size = _checked_count("group_size", group_size)
    if group_size == 1:
        return ()
    per_node = _ranks_per_node(hardware, group_size, ranks_per_node)
    spanned = group_size // per_node
    stages = []
    if per_node > 1:
        stages.append(RingStage(ranks=per_node, nbytes=nbytes, bw=hardware.intra_node_bw,
                                latency_s=hardware.intra_node_latency_s))
    if spanned > 1:  # per_node rings in parallel, one per local rank, each over the 1/per_node its rank holds
        stages.append(RingStage(ranks=spanned, nbytes=nbytes / per_node, bw=hardware.inter_node_bw,
                                latency_s=hardware.inter_node_latency_s))
    return tuple(stages)


def collective_s(kind: CollectiveKind, hardware: Hardware, nbytes: float, group_size: int, *,
                 ranks_per_node: int | None = None) -> float:
    """Seconds for the collective ``kind`` of a tensor of ``nbytes`` (full, unsharded) over ``group_size`` ranks
    of ``hardware``, by the ring algorithm (hierarchical across nodes); 0 for a group of one."""
    if not isinstance(kind, CollectiveKind):
        raise CollectiveError(f"kind must be a CollectiveKind ({', '.join(c.name for c in CollectiveKind)}), got "
                              f"{kind!r}")
    one_pass = sum(stage.seconds() for stage in ring_stages(hardware, nbytes, group_size,
                                                            ranks_per_node=ranks_per_node))
    return 2 * one_pass if kind is CollectiveKind.ALL_REDUCE else one_pass


def all_gather_s(hardware: Hardware, nbytes: float, group_size: int, *, ranks_per_node: int | None = None) -> float:
    """Seconds to all-gather a tensor of ``nbytes`` (the gathered, full size) from ``group_size`` equal shards."""
    return collective_s(CollectiveKind.ALL_GATHER, hardware, nbytes, group_size, ranks_per_node=ranks_per_node)


def reduce_scatter_s(hardware: Hardware, nbytes: float, group_size: int, *,
                     ranks_per_node: int | None = None) -> float:
    """Seconds to reduce-scatter a tensor of ``nbytes`` (each rank's full input) into ``group_size`` shards."""
    return collective_s(CollectiveKind.REDUCE_SCATTER, hardware, nbytes, group_size, ranks_per_node=ranks_per_node)


def all_reduce_s(hardware: Hardware, nbytes: float, group_size: int, *, ranks_per_node: int | None = None) -> float:
    """Seconds to all-reduce a tensor of ``nbytes`` over ``group_size`` ranks: a reduce-scatter, then an
    all-gather."""
    return collective_s(CollectiveKind.ALL_REDUCE, hardware, nbytes, group_size, ranks_per_node=ranks_per_node)


def check_world(hardware: Hardware, world: int) -> None:
    """Refuse a sharded step's world of ``world`` ranks that ``hardware`` cannot place, packed into whole nodes as
    FSDP2 over one mesh dimension places them (``CollectiveError`` naming ``--world`` and ``--hardware``): more
    ranks than its devices, a profile of one device, or more ranks than a node holds that do not fill whole nodes."""
    world = _checked_count("world", world)
    if world == 1:
        return
    per_node, devices = hardware.devices_per_node, hardware.device_count
    if devices == 1:
        raise CollectiveError(
            f"--world {world} shards the step over {world} ranks, but --hardware {hardware.name} describes one device "
            f"with no network between devices; choose a multi-device profile (dgx-h100, hgx-h200, gh200-nvl, "
            f"ascend-910c-superpod), or drop --world")
    if world > devices:
        raise CollectiveError(
            f"--world {world} is more ranks than the {devices} devices of --hardware {hardware.name} ({per_node} per "
            f"node x {hardware.nodes} nodes); give at most {devices} ranks")
    if world > per_node and world % per_node:
        fits = sorted({per_node * k for k in (world // per_node, world // per_node + 1) if per_node * k <= devices})
        raise CollectiveError(
            f"--world {world} ranks do not fill whole nodes of {per_node} devices of --hardware {hardware.name}: a "
            f"sharded step's ranks fill one node, or several whole ones; give --world at most {per_node} or a "
            f"multiple of it ({' or '.join(str(f) for f in fits)})")


def _checked_bytes(nbytes: float) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not math.isfinite(nbytes) or nbytes < 0:
        raise CollectiveError(f"nbytes must be a finite number of bytes >= 0 (the full, unsharded tensor's size), "
                              f"got {nbytes!r}")
    return float(nbytes)


def _checked_count(name: str, count: int) -> int:
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
        raise CollectiveError(f"{name} must be a whole number of ranks >= 1, got {count!r}")
    return int(count)


def _ranks_per_node(hardware: Hardware, group_size: int, ranks_per_node: int | None) -> int:
    """How many of the group's ranks share each node it spans, checked against the profile."""
    if hardware.device_count == 1:
        raise CollectiveError(
            f"{hardware.name} describes one device with no network, so a group of {group_size} ranks has nowhere to "
            f"run; use a multi-device profile (dgx-h100, hgx-h200, gh200-nvl, ascend-910c-superpod) or set "
            f"devices_per_node and intra_node_bw (nodes and inter_node_bw across nodes) on this one")
    if group_size > hardware.device_count:
        raise CollectiveError(
            f"a group of {group_size} ranks is more than the {hardware.device_count} devices of {hardware.name} "
            f"({hardware.devices_per_node} per node x {hardware.nodes} nodes); give at most {hardware.device_count} "
            f"ranks, or more nodes (hardware.replace(nodes=...))")
    per_node = hardware.devices_per_node
    if ranks_per_node is None:
        if group_size <= per_node:
            return group_size
        if group_size % per_node:
            raise CollectiveError(
                f"a group of {group_size} ranks does not fill whole nodes of {per_node} devices; give ranks_per_node, "
                f"a divisor of {group_size} of at most {per_node} (one of {_divisors(group_size, per_node)})")
        return per_node
    ranks_per_node = _checked_count("ranks_per_node", ranks_per_node)
    if ranks_per_node > per_node:
        raise CollectiveError(f"ranks_per_node = {ranks_per_node} is more than the {per_node} devices of a node of "
                              f"{hardware.name}; give at most {per_node}")
    if group_size % ranks_per_node:
        raise CollectiveError(f"a group of {group_size} ranks cannot put ranks_per_node = {ranks_per_node} on every "
                              f"node it spans; give a divisor of {group_size} (one of "
                              f"{_divisors(group_size, per_node)})")
    if group_size // ranks_per_node > hardware.nodes:
        raise CollectiveError(f"a group of {group_size} ranks at {ranks_per_node} per node spans "
                              f"{group_size // ranks_per_node} nodes, more than the {hardware.nodes} of "
                              f"{hardware.name}; put more ranks on each node or give more nodes")
    return ranks_per_node


def _divisors(number: int, most: int) -> list[int]:
    """The divisors of ``number`` of at most ``most``, for an error's suggestion."""
    return [d for d in range(1, min(number, most) + 1) if number % d == 0]


__all__ = ["CollectiveError", "RingStage", "all_gather_s", "all_reduce_s", "check_world", "collective_s",
           "reduce_scatter_s", "ring_stages"]
