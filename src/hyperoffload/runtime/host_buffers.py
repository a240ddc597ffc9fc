"""Remote buffers in host memory, reused across steps: ``HostBuffers``.

A step on the CPU offloads the same storages every step, each into a new remote buffer. Allocated afresh, a
buffer of more than a few hundred KiB is new pages from the operating system each time (the C allocator maps
large blocks and unmaps them when they are freed), and the copy into it pays a page fault per 4 KiB page: on a
virtual machine that costs the step more than the copy itself. ``HostBuffers`` keeps every buffer it handed out
and hands it out again once nothing else refers to it, as PyTorch's caching host allocator does for the
page-locked buffers of a GPU's copies.

A buffer is free when the pool holds its only reference: every tensor viewing it, a copy still reading or
writing it (its handle holds the storage until the bytes have moved) and every pending ``wait`` of it keep it
taken. Both kinds of reference are counted: tensors and C++ holders through the storage's own use count, and
Python holders through the Python object's reference count, since PyTorch hands out one Python object per
storage (``x.untyped_storage()`` of any tensor on the buffer is the pool's own object, whose holders add no use
count). The pool grows to the most remote bytes a step holds at once per buffer size; ``clear`` gives them back.
"""

from __future__ import annotations

import sys

import torch


def _refs_of_a_listed_item() -> int:
    """``sys.getrefcount`` of an object referred to only by a list and one local name, as ``HostBuffers.take``
    sees a free buffer (measured, since the count differs between Python versions)."""
    for item in [object()]:
        return sys.getrefcount(item)
    raise AssertionError("unreachable")


_FREE_REFS = _refs_of_a_listed_item()


class HostBuffers:
    """A pool of host-memory storages by size (bytes), each handed out again once only the pool refers to it."""

    __slots__ = ("_by_size", "_next")

    def __init__(self) -> None:
        self._by_size: dict[int, list[torch.UntypedStorage]] = {}
        self._next: dict[int, int] = {}
        """Per size, where the next search starts: after the buffer taken last. A step lets go of its remote
        buffers in about the order it took them, so the buffer there is usually free."""

    def take(self, nbytes: int) -> torch.UntypedStorage:
        """A storage of ``nbytes`` that nothing else refers to (its old contents left as they are)."""
        kept = self._by_size.setdefault(nbytes, [])
        start = self._next.get(nbytes, 0)
        for k in range(len(kept)):
            i = (start + k) % len(kept)
            storage = kept[i]
            if sys.getrefcount(storage) <= _FREE_REFS and torch._C._storage_Use_Count(storage._cdata) == 1:
                self._next[nbytes] = i + 1
                return storage
        storage = torch.UntypedStorage(nbytes)
        kept.append(storage)
        self._next[nbytes] = len(kept)
        return storage

    def tensor(self, elements: int, dtype: torch.dtype) -> torch.Tensor:
        """A one-dimensional tensor of ``elements`` of ``dtype`` on a storage taken from the pool."""
        storage = self.take(elements * dtype.itemsize)
        return torch.empty(0, dtype=dtype).set_(storage, 0, (elements,), (1,))

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds, taken or free."""
        return sum(size * len(kept) for size, kept in self._by_size.items())

    def clear(self) -> None:
        """Forget every buffer (those still taken live on with whatever refers to them)."""
        self._by_size.clear()
        self._next.clear()


__all__ = ["HostBuffers"]
