"""Device-byte accounting of a running step: what the device tier holds, measured from the tensors.

Device bytes are the distinct storages (by address) that the device tier references, plus device storages an
unfinished transfer still holds. The count is kept incrementally, so measuring after every instruction costs
nothing; a step that measures more than its plan's budget fails with ``BudgetExceeded``.
"""

from __future__ import annotations

import torch


class BudgetExceeded(RuntimeError):
    """The executor measured more device bytes than the plan's budget: the budget promise is broken."""


class _DeviceBytes:
    """Bytes of the distinct storages the device tier holds, counted by address as references come and go.

    Every holder (a value in the environment, an unfinished transfer) takes a reference on the storage it
    holds; a storage's bytes count while any reference is left. This is what ``live_storage_bytes`` would
    measure over the holders' tensors, kept up to date in O(1) per change.
    """

    __slots__ = ("_refs", "total")

    def __init__(self) -> None:
        self._refs: dict[int, list[int]] = {}  # data_ptr -> [nbytes, references]
        self.total = 0

    def hold(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if not nbytes:
            return
        entry = self._refs.get(storage.data_ptr())
        if entry is None:
            self._refs[storage.data_ptr()] = [nbytes, 1]
            self.total += nbytes
        else:
            entry[1] += 1

    def let_go(self, storage: torch.UntypedStorage) -> bool:
        """Drop one reference; return whether that was the storage's last (its bytes stop counting)."""
        if not storage.nbytes():
            return False
        entry = self._refs[storage.data_ptr()]
        entry[1] -= 1
        if entry[1] == 0:
            del self._refs[storage.data_ptr()]
            self.total -= entry[0]
            return True
        return False

    def references(self, storage: torch.UntypedStorage) -> int:
        """How many holders reference ``storage`` (0 for an empty one)."""
        entry = self._refs.get(storage.data_ptr()) if storage.nbytes() else None
        return entry[1] if entry else 0
