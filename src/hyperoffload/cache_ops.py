"""The cache operators: offload, prefetch, wait and release, as ``torch.library`` operators.

A lowered plan (``hyperoffload.lower``) is an ordinary ``torch.fx`` graph in which data movement
is spelled as calls of these four operators, so the graph can be printed, traced and run like any
other. They mirror the cache operators MindSpore inserts for HyperOffload:

====================================  ==========================  ==================================
operator                              MindSpore                   plan instruction (``plan.Kind``)
====================================  ==========================  ==================================
``hyperoffload::offload(x)``          ``UpdateToRemote``          ``OFFLOAD``: device -> remote copy
``hyperoffload::prefetch(remote)``    ``UpdateToDevice``          ``PREFETCH``: remote -> device copy
``hyperoffload::wait(x)``             stream/event sync           ``WAIT``: a transfer has finished
``hyperoffload::release(x)``          ``Free``                    ``RELEASE``: drop the device copy
``hyperoffload::prefetch_blocks``     indexed ``UpdateToDevice``  none: chosen at run time (NSA)
====================================  ==========================  ==================================

``prefetch_blocks(remote, block_ids, block_size)`` is the indexed prefetch of a remote KV cache
(``workloads.deepseek_remote``): it copies only the cache blocks whose indices a decode step
computes at run time (NSA's ``nsa_select``), so no plan instruction names it; the step itself calls it.

The first four are the smallest set that lets a plan say everything it needs: a copy in each direction, a
point where the compute stream depends on a copy (so copies can be issued early and overlap
compute), and a point where device memory is given back (separate from the copy, so a tensor
can be offloaded early and still be read until its last use).

The unit of transfer is a whole *storage*, not a tensor: ``offload`` and ``prefetch`` return a
flat, one-dimensional buffer holding every element of the storage, so that every view sharing
that storage (a transpose, a reshape, the result of an in-place op) can be rebuilt on the copy
with ``aten.as_strided`` using its original size, stride and storage offset. The buffer has the
dtype of the tensor passed in and ``storage bytes // element size`` elements; a lowered plan
always passes the storage owner's tensor, or a flat buffer of it, so buffers have the owner's dtype.

Kernels copy synchronously and exist for CPU tensors, where "remote memory" is simply another
host allocation; the graph still says where a real transfer would start and where its result is
first needed. A CUDA kernel must put the remote buffer in pinned host memory. Every operator has
a fake (meta) implementation, so graphs using them trace under ``make_fx`` and ``FakeTensorMode``
without touching data, and all four are marked side-effectful so dead-code elimination keeps them.
"""

from __future__ import annotations

import torch
import torch.fx

NAMESPACE = "hyperoffload"


def _storage_elements(x: torch.Tensor) -> int:
    """Elements of ``x``'s dtype that fit in its whole storage."""
    return x.untyped_storage().nbytes() // x.element_size()


def _flat_storage(x: torch.Tensor) -> torch.Tensor:
    """A one-dimensional view of ``x``'s whole storage, from storage offset 0, in ``x``'s dtype."""
    return x.as_strided((_storage_elements(x),), (1,), 0)


@torch.library.custom_op(f"{NAMESPACE}::offload", mutates_args=(), device_types="cpu")
def offload(x: torch.Tensor) -> torch.Tensor:
    """Copy the whole storage of ``x`` to remote memory; return the remote buffer.

    The result is a new one-dimensional tensor of ``x``'s dtype with ``storage bytes // element
    size`` elements and a storage of its own, holding the storage contents from offset 0 (not just
    the elements ``x`` views). ``x`` is neither changed nor freed: dropping the device copy is
    ``release``'s job. Call ``wait`` on the result before reading it.
    """
    return _flat_storage(x).clone()


@offload.register_fake
def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((_storage_elements(x),))


@torch.library.custom_op(f"{NAMESPACE}::prefetch", mutates_args=(), device_types="cpu")
def prefetch(remote: torch.Tensor) -> torch.Tensor:
    """Copy the whole storage of the remote buffer ``remote`` to the device; return the device copy.

    The result is a new one-dimensional tensor, laid out exactly like ``offload``'s result, with a
    storage of its own: views of the offloaded storage are rebuilt on it with ``aten.as_strided``.
    Call ``wait`` on the result before reading it.
    """
    return _flat_storage(remote).clone()


@prefetch.register_fake
def _prefetch_fake(remote: torch.Tensor) -> torch.Tensor:
    return remote.new_empty((_storage_elements(remote),))


# ``wait`` returns its argument's storage, which ``custom_op`` does not allow (its results must be
# fresh tensors), so it is defined from a schema whose alias annotation says so: the result is an
# alias of ``x``, and tracing and functionalization treat it like a view.
torch.library.define(f"{NAMESPACE}::wait", "(Tensor(a) x) -> Tensor(a)")


@torch.library.impl(f"{NAMESPACE}::wait", "CompositeExplicitAutograd")
def wait(x: torch.Tensor) -> torch.Tensor:
    """Complete the transfer that produced ``x`` (an ``offload`` or ``prefetch`` result).

    Copies here are synchronous, so there is nothing left to wait for. The result is an alias of
    ``x`` (``aten.alias``: the same storage, size, stride and offset); it is a new tensor object
    rather than ``x`` itself because a kernel whose schema says ``Tensor(a) -> Tensor(a)`` must
    return a view, as ``aten.alias`` does. Readers of the transferred data read the result, which
    is what orders them after the wait.
    """
    return torch.ops.aten.alias.default(x)


torch.library.define(f"{NAMESPACE}::release", "(Tensor x) -> ()")


@torch.library.impl(f"{NAMESPACE}::release", "CompositeExplicitAutograd")
def release(x: torch.Tensor) -> None:
    """Mark the point where the device copy of ``x``'s storage is dropped.

    The kernel does nothing: in a lowered graph no node after the release reads ``x`` or any
    alias of its storage, so the graph's own reference is its last and the memory is returned
    when the executor lets go of it (``torch.fx`` code drops a value after its last use).
    """


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


for _op in (torch.ops.hyperoffload.offload.default, torch.ops.hyperoffload.prefetch.default,
            torch.ops.hyperoffload.wait.default, torch.ops.hyperoffload.release.default,
            torch.ops.hyperoffload.prefetch_blocks.default):
    # Transfers and frees are the point of the schedule even when nothing reads their result.
    torch.fx.node.has_side_effect(_op)
del _op

OFFLOAD = torch.ops.hyperoffload.offload.default
PREFETCH = torch.ops.hyperoffload.prefetch.default
WAIT = torch.ops.hyperoffload.wait.default
RELEASE = torch.ops.hyperoffload.release.default
PREFETCH_BLOCKS = torch.ops.hyperoffload.prefetch_blocks.default

__all__ = ["NAMESPACE", "OFFLOAD", "PREFETCH", "PREFETCH_BLOCKS", "RELEASE", "WAIT", "offload", "prefetch",
           "prefetch_blocks", "release", "wait"]
