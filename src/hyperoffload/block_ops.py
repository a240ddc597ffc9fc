"""The NSA block operators: lane ops that move KV-cache blocks or rows inside a decode step.

``prefetch_blocks(remote, block_ids, block_size)`` is the indexed prefetch of a remote KV cache
(``workloads.deepseek_remote``): it copies only the cache blocks whose indices a decode step computes at
run time (NSA's ``nsa_select``), so no plan instruction names it; the step itself calls it.
``fetch_blocks_pooled`` does the same through a device block pool with a block table, so blocks still
resident are not moved again; ``fetch_missing_blocks`` completes a speculative prefetch of the previous
step's selection with the blocks it missed; and ``store_rows`` writes a step's new rows to the remote
cache. The capture marks these four as *lane ops* (``ir.Op.lane``): data movement that is part of the
step itself, which the simulator runs on a copy lane.

``LANE_OP_RULES`` states, once per operator, its lane and how its bytes are counted: by the capture
(``capture.graph_to_program``: the ``Op.transfer_bytes`` the simulator charges) and by the executor
(``runtime.lane_ops``: the bytes a run really moved). A new block operator is registered here and
nowhere else. Like the cache operators (``cache_ops``), every one has a fake implementation and is
marked side-effectful.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

NAMESPACE = "hyperoffload"
"""The ``torch.library`` namespace of the block operators and of the cache operators (``cache_ops``)."""


def _check_blocks(remote: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> int:
    """Check the shapes ``prefetch_blocks`` takes; return the number of blocks in ``remote``."""
    if block_size <= 0:
        raise ValueError(f"prefetch_blocks: block_size must be positive, got {block_size}")
    if remote.dim() < 2:
        raise ValueError(f"prefetch_blocks: remote must be (..., slots, dim), got shape {tuple(remote.shape)}")
    if remote.shape[-2] % block_size:
        raise ValueError(f"prefetch_blocks: remote has {remote.shape[-2]} slots, not a whole number of blocks of "
                         f"{block_size}; allocate the cache in whole blocks (deepseek_attention.cache_shapes)")
    if block_ids.dtype != torch.int64 or block_ids.dim() != remote.dim() - 1 \
            or tuple(block_ids.shape[:-1]) != tuple(remote.shape[:-2]):
        raise ValueError(f"prefetch_blocks: block_ids must be int64 of shape (*{tuple(remote.shape[:-2])}, n) for a "
                         f"remote cache of shape {tuple(remote.shape)}, got {block_ids.dtype} "
                         f"{tuple(block_ids.shape)}")
    return remote.shape[-2] // block_size


@torch.library.custom_op(f"{NAMESPACE}::prefetch_blocks", mutates_args=(), device_types="cpu")
def prefetch_blocks(remote: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Copy the blocks ``block_ids`` of the remote cache ``remote`` to the device; return the device copy.

    ``remote`` (*lead, slots, dim) with ``slots`` a multiple of ``block_size`` (tokens): block ``j``
    is rows ``j * block_size ... (j + 1) * block_size - 1`` of the slot axis. ``block_ids`` (*lead, n)
    int64: for each leading index (a sequence of the batch), the blocks to copy, in any order and
    possibly repeated. The result (*lead, n, block_size, dim) is a new tensor: entry ``[..., i, :, :]``
    is block ``block_ids[..., i]``. Exactly ``n * block_size * dim`` elements per leading index are
    copied. An index outside ``0 ... slots // block_size - 1`` raises ``IndexError``.
    """
    blocks = _check_blocks(remote, block_ids, block_size)
    if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= blocks):
        bad = block_ids[(block_ids < 0) | (block_ids >= blocks)][0]
        raise IndexError(f"prefetch_blocks: block id {int(bad)} is out of range for a remote cache of {blocks} "
                         f"blocks of {block_size} slots (valid ids 0 ... {blocks - 1})")
    lead = remote.shape[:-2]
    by_block = remote.reshape(*lead, blocks, block_size * remote.shape[-1])
    out = torch.gather(by_block, -2, block_ids[..., None].expand(*block_ids.shape, by_block.shape[-1]))
    return out.view(*block_ids.shape, block_size, remote.shape[-1])


@prefetch_blocks.register_fake
def _prefetch_blocks_fake(remote: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    _check_blocks(remote, block_ids, block_size)
    return remote.new_empty((*block_ids.shape, block_size, remote.shape[-1]))


def _check_pool(remote: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor,
                block_size: int) -> int:
    """Check the shapes ``fetch_blocks_pooled`` takes; return the number of blocks in ``remote``."""
    blocks = _check_blocks(remote, block_ids, block_size)
    batch, _, dim = remote.shape
    if pool.dim() != 4 or (pool.shape[0], pool.shape[2], pool.shape[3]) != (batch, block_size, dim) \
            or pool.dtype != remote.dtype:
        raise ValueError(f"fetch_blocks_pooled: pool must be {remote.dtype} of shape ({batch}, pool_blocks, "
                         f"{block_size}, {dim}), got {pool.dtype} {tuple(pool.shape)}")
    if slots.dtype != torch.int64 or tuple(slots.shape) != (batch, pool.shape[1], 2):
        raise ValueError(f"fetch_blocks_pooled: slots must be int64 of shape ({batch}, {pool.shape[1]}, 2), got "
                         f"{slots.dtype} {tuple(slots.shape)}")
    if block_ids.shape[-1] > pool.shape[1]:
        raise ValueError(f"fetch_blocks_pooled: {block_ids.shape[-1]} blocks per sequence do not fit a pool of "
                         f"{pool.shape[1]}; a pool holds at least the blocks one step reads")
    return blocks


@torch.library.custom_op(f"{NAMESPACE}::store_rows", mutates_args=("remote",), device_types="cpu")
def store_rows(remote: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
    """Write ``rows`` (batch, seq, dim) into the remote cache ``remote`` (batch, slots, dim) at the slot
    indices ``positions`` (seq,): the device -> remote copy of a step's new KV rows."""
    remote.index_copy_(1, positions, rows)


@store_rows.register_fake
def _store_rows_fake(remote: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
    if rows.dim() != 3 or rows.shape[0] != remote.shape[0] or rows.shape[2] != remote.shape[2]:
        raise ValueError(f"store_rows: rows must be ({remote.shape[0]}, seq, {remote.shape[2]}), got {tuple(rows.shape)}")


@torch.library.custom_op(f"{NAMESPACE}::fetch_blocks_pooled", mutates_args=("pool", "slots"), device_types="cpu")
def fetch_blocks_pooled(remote: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor,
                        positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The blocks ``block_ids`` (batch, n) of ``remote`` (batch, slots, dim), through a device block pool.

    ``pool`` (batch, pool_blocks, block_size, dim) holds resident blocks; ``slots`` (batch, pool_blocks, 2)
    int64 is its block table: per pool slot, the block it holds (-1: free) and when it was last read (a
    counter). Blocks not resident are copied from ``remote`` (``prefetch_blocks``'s copy) into a free slot,
    the lowest first, or else into the least recently read slot whose block this step does not read; every
    block read becomes the most recently read, in ``block_ids`` order. The row at ``positions`` (one
    element: the step's own token, just written to ``remote`` by ``store_rows``) is refreshed in its block
    if that block was resident, so the pool never serves stale rows. Returns (batch, n, block_size, dim),
    a new tensor. An index outside the cache raises ``IndexError``.
    """
    blocks = _check_pool(remote, pool, slots, block_ids, block_size)
    if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= blocks):
        raise IndexError(f"fetch_blocks_pooled: block ids must be in 0 ... {blocks - 1}")
    position = int(positions[0])
    own, row = divmod(position, block_size)
    slot_of = torch.empty_like(block_ids)
    for b, ids in enumerate(block_ids.tolist()):
        held = {int(blk): k for k, blk in enumerate(slots[b, :, 0].tolist()) if blk >= 0}
        if own in held:
            pool[b, held[own], row] = remote[b, position]
        clock = int(slots[b, :, 1].max()) + 1
        wanted = set(ids)
        missing = list(dict.fromkeys(i for i in ids if i not in held))
        free = [k for k in range(pool.shape[1]) if int(slots[b, k, 0]) < 0]
        for index in missing:
            if free:
                k = free.pop(0)
            else:  # evict the least recently read block this step does not read
                k = min((k for blk, k in held.items() if blk not in wanted), key=lambda k: int(slots[b, k, 1]))
                del held[int(slots[b, k, 0])]
            held[index] = k
            slots[b, k, 0] = index
        if missing:
            pool[b, [held[i] for i in missing]] = prefetch_blocks(remote[b], torch.tensor(missing), block_size)
        for j, index in enumerate(ids):
            slots[b, held[index], 1] = clock + j
            slot_of[b, j] = held[index]
    return pool[torch.arange(pool.shape[0])[:, None], slot_of]


@fetch_blocks_pooled.register_fake
def _fetch_blocks_pooled_fake(remote, pool, slots, block_ids, positions, block_size):
    _check_pool(remote, pool, slots, block_ids, block_size)
    return pool.new_empty((*block_ids.shape, block_size, remote.shape[-1]))


@torch.library.custom_op(f"{NAMESPACE}::fetch_missing_blocks", mutates_args=("spec_ids",), device_types="cpu")
def fetch_missing_blocks(remote: torch.Tensor, spec_blocks: torch.Tensor, spec_ids: torch.Tensor,
                         block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The blocks ``block_ids`` (batch, n) of ``remote`` (batch, slots, dim), given a speculative prefetch.

    ``spec_blocks`` (batch, m, block_size, dim) are the blocks ``spec_ids`` (batch, m) fetched before the
    step's selection was known (``prefetch_blocks`` of the previous step's selection). A selected block
    found there is taken from it; the others are copied from ``remote``. The row at ``positions`` (one
    element: the step's own token, written to ``remote`` after the speculative prefetch read its block) is
    refreshed from ``remote`` where its block came from the speculation. ``spec_ids`` becomes
    ``block_ids``: the speculation of the next step. Returns (batch, n, block_size, dim), a new tensor.
    """
    blocks = _check_blocks(remote, block_ids, block_size)
    _check_blocks(remote, spec_ids, block_size)
    if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= blocks):
        raise IndexError(f"fetch_missing_blocks: block ids must be in 0 ... {blocks - 1}")
    if spec_ids.shape != block_ids.shape:
        raise ValueError(f"fetch_missing_blocks: spec_ids {tuple(spec_ids.shape)} and block_ids "
                         f"{tuple(block_ids.shape)} must have one shape: each step speculates on the last selection")
    position = int(positions[0])
    own, row = divmod(position, block_size)
    out = remote.new_empty((*block_ids.shape, block_size, remote.shape[-1]))
    for b, (ids, spec) in enumerate(zip(block_ids.tolist(), spec_ids.tolist())):
        where = {blk: k for k, blk in enumerate(spec)}
        missing = [j for j, blk in enumerate(ids) if blk not in where]
        for j, blk in enumerate(ids):
            if blk in where:
                out[b, j] = spec_blocks[b, where[blk]]
                if blk == own:
                    out[b, j, row] = remote[b, position]
        if missing:
            out[b, missing] = prefetch_blocks(remote[b], block_ids[b, missing], block_size)
    spec_ids.copy_(block_ids)
    return out


@fetch_missing_blocks.register_fake
def _fetch_missing_blocks_fake(remote, spec_blocks, spec_ids, block_ids, positions, block_size):
    _check_blocks(remote, block_ids, block_size)
    return remote.new_empty((*block_ids.shape, block_size, remote.shape[-1]))


def _output_bytes(args: Sequence[Any], outputs: Sequence[torch.Tensor], before: Any) -> int:
    """Bytes of the blocks copied in: the whole output."""
    return sum(t.nbytes for t in outputs)


def _row_bytes(args: Sequence[Any], outputs: Sequence[torch.Tensor], before: Any) -> int | None:
    """Bytes of the rows written (``store_rows``' second argument)."""
    return args[1].nbytes if len(args) >= 2 else None


def _pool_table(args: Sequence[Any], kwargs: dict) -> torch.Tensor | None:
    """The block table before a pooled fetch (what was resident), when its arguments are all positional."""
    return args[2][..., 0].clone() if len(args) >= 6 and not kwargs else None


def _pooled_bytes(args: Sequence[Any], outputs: Sequence[torch.Tensor], held: torch.Tensor | None) -> int | None:
    """Bytes a pooled fetch moved: every block brought in (it takes a slot holding another block), and its own
    row where the block holding it is resident."""
    if held is None:
        return None
    remote, _, slots, _, positions, block_size = args[:6]
    row = remote.shape[-1] * remote.element_size()
    fetched = int((slots[..., 0] != held).sum())
    refreshed = int((held == int(positions[0]) // block_size).any(-1).sum())
    return fetched * block_size * row + refreshed * row


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneOpRule:
    """How one block operator moves data (``LANE_OP_RULES``)."""

    lane: str
    """The copy lane it runs on: ``"h2d"`` (remote -> device) or ``"d2h"``."""
    scales_with_fetch_fraction: bool = False
    """Whether its captured bytes (its outputs' bytes, for an h2d op) are scaled by the step's expected share of
    blocks not already on the device (``Program.meta``'s fetch fraction: a pool's misses, a guess's misses)."""
    before: Callable[[Sequence[Any], dict], Any] | None = None
    """What ``moved`` needs from the arguments before the kernel runs (the kernel may update them in place)."""
    moved: Callable[[Sequence[Any], Sequence[torch.Tensor], Any], int | None] | None = None
    """Bytes a run moved, from its arguments, outputs and ``before``; None (or no function): the op's stated
    ``transfer_bytes``."""


LANE_OP_RULES: dict[str, LaneOpRule] = {
    "hyperoffload.prefetch_blocks.default": LaneOpRule(lane="h2d", moved=_output_bytes),
    "hyperoffload.fetch_blocks_pooled.default": LaneOpRule(lane="h2d", scales_with_fetch_fraction=True,
                                                           before=_pool_table, moved=_pooled_bytes),
    "hyperoffload.fetch_missing_blocks.default": LaneOpRule(lane="h2d", scales_with_fetch_fraction=True),
    "hyperoffload.store_rows.default": LaneOpRule(lane="d2h", moved=_row_bytes),
}
"""Per operator (``str`` of its overload), its lane and byte counts (``LaneOpRule``)."""

LANE_OPS = {name: rule.lane for name, rule in LANE_OP_RULES.items()}
"""Operators that move data between remote memory and the device inside a step: the capture marks
them as lane ops (``Op.lane``) and the simulator runs them on that copy lane."""

PREFETCH_BLOCKS = torch.ops.hyperoffload.prefetch_blocks.default
STORE_ROWS = torch.ops.hyperoffload.store_rows.default
FETCH_BLOCKS_POOLED = torch.ops.hyperoffload.fetch_blocks_pooled.default
FETCH_MISSING_BLOCKS = torch.ops.hyperoffload.fetch_missing_blocks.default

for _op in (PREFETCH_BLOCKS, STORE_ROWS, FETCH_BLOCKS_POOLED, FETCH_MISSING_BLOCKS):
    # Transfers are the point of the step even when nothing reads their result.
    torch.fx.node.has_side_effect(_op)
del _op

__all__ = ["FETCH_BLOCKS_POOLED", "FETCH_MISSING_BLOCKS", "LANE_OPS", "LANE_OP_RULES", "LaneOpRule", "NAMESPACE",
           "PREFETCH_BLOCKS", "STORE_ROWS", "fetch_blocks_pooled", "fetch_missing_blocks", "prefetch_blocks",
           "store_rows"]
