"""How the executor rebuilds a tensor as a view into another copy of its storage.

A storage that moves between the tiers (a prefetch, an arena slot, the caller's storage at the end of a step)
is a new ``UntypedStorage``; every value aliasing it is rebuilt on it from the dtype, size, stride and offset
it had, so views keep their own layout wherever their bytes live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class _ViewMeta:
    """What it takes to rebuild a tensor as a view into a new copy of its storage."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    """In elements of ``dtype``."""

    @staticmethod
    def of(tensor: torch.Tensor) -> _ViewMeta:
        return _ViewMeta(tensor.dtype, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

    def view_into(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.storage_offset, self.size, self.stride)
