"""What keeps a failed training step from leaving the model and optimizer half-updated.

A compiled step writes each parameter's and optimizer state's new value into the caller's tensor right after
its update (``whole_step.write_back_early``), so a step stopped during its optimizer phase would leave some
tensors at the new step and the rest at the old one. Two guards, used by ``TrainStep.__call__``:

* ``deferred_interrupts``: a ``KeyboardInterrupt`` (Ctrl-C) that arrives while the step runs is raised once the
  step has completed, so interrupting a training loop never splits a step. It costs nothing per step.
* ``Snapshot``: a copy of the state the step writes (parameters, buffers, optimizer state), taken before the
  step and copied back if it raises (a failed copy, running out of memory). It costs a copy of that state per
  step (its bytes are ``Snapshot.nbytes``), in remote memory, so it is what ``train_step(rollback=True)`` asks for.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence

import torch

from hyperoffload.cache_ops import REMOTE_DEVICE


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold back SIGINT for the duration of the block and raise ``KeyboardInterrupt`` after it, if one arrived.

    Only in the main thread and only while Python's default SIGINT handler is installed (a program with a handler
    of its own keeps it); elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    arrived: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if arrived:
        raise KeyboardInterrupt("interrupted during a training step; the step completed first, so the model and "
                                "optimizer hold its state")


class Snapshot:
    """Copies of ``tensors`` (the state a step writes) in host memory, to put back if the step fails."""

    __slots__ = ("_copies", "_tensors")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._copies = [t.detach().to(REMOTE_DEVICE, copy=True) for t in self._tensors]

    @property
    def nbytes(self) -> int:
        """Bytes the copies take (their storage sizes, in bytes)."""
        return sum(c.untyped_storage().nbytes() for c in self._copies)

    def restore(self) -> None:
        """Write the copies back into the tensors they were taken of."""
        with torch.no_grad():
            for tensor, copy in zip(self._tensors, self._copies):
                tensor.copy_(copy)


__all__ = ["Snapshot", "deferred_interrupts"]
