"""The CUDA transfer backend: a side stream per direction, an event per copy, pinned remote buffers.

Compute runs on the current CUDA stream as the interpreter issues ops (the host runs ahead of the
GPU). Copies run on two side streams, one per direction, so each direction has its own copy engine
and copies overlap kernels, as on the simulator's lanes. The rules that keep this correct follow
CUDA's stream semantics (the CUDA C Programming Guide, "Streams" and "Events"; PyTorch's "CUDA
semantics" note on streams and ``record_stream``):

* **Ordering.** An offload is issued on the D2H stream after it waits (``wait_stream``) for
  everything issued so far on the compute stream, which includes the op that last wrote the
  storage. A prefetch is issued on the H2D stream after it waits for the compute stream too (its
  new device block may have just been freed by an op still queued there: the caching allocator
  reuses a block for the *same* stream at once; from an arena, its slot's previous occupant may
  still be read by queued ops) and for the event of the offload that filled its source, if that is
  still in flight. A ``WAIT`` makes the compute stream wait for the copy's event
  (``Stream.wait_event``); the host does not block.
* **No block reused under a copy.** The device storage a copy reads or writes is marked with
  ``record_stream(side stream)``: when the interpreter lets go of it (a release right after an
  offload), the caching allocator does not hand the block out again until the copy has finished.
  The byte count still holds it until the copy's event has completed, and an allocation that would
  not fit under the budget waits for that event on the host (``Event.synchronize``).
* **Running from an arena** (``arena=True``; see ``arena_step``). The arena is one block of the
  caching allocator (``arena_storage``); slots are storages sliced from it, which the allocator does not
  track, so ``record_stream`` on a slot does nothing and the arena itself is marked as used by both side
  streams instead: when it is freed with a copy of a slot still queued (an offload carried into the next
  step), its block is not reused before that copy has finished. Copies into slots after ops run on the
  compute stream; before a slot is reused the executor calls ``wait`` on the offload still reading it (an
  event wait of the compute stream), and the prefetch rule above orders a prefetch into the slot after
  it. Run on an H200 (``make gpu-check``): bit-identical to the unplanned step, the arena the layout's size.
* **Pinned remote memory, allocated once.** Remote buffers are page-locked host buffers (so copies
  are truly asynchronous DMA), one per storage id and size, allocated on first use and reused by
  later offloads of that storage, in this step and the next. Reuse is safe because a storage's next
  offload is ordered after the compute stream has waited for its previous prefetch. Buffers never
  leave the backend: a step output left in remote memory is returned as a copy.
* **Lane ops run inline.** A lane op (an indexed fetch of KV blocks, a write of rows to a remote cache) is
  run at once on the current (compute) stream, as an ordinary op: ``lane_op`` returns no handle, so the
  executor treats it as finished and later ops are ordered after it by the stream. This is the simplest
  correct behaviour (its kernel reads pinned host memory from the compute stream), but it does not overlap
  the op with compute as the simulator's copy lanes do; running it on a side stream would need the
  compute stream's work on its inputs recorded before it and an event for its readers, as ``prefetch`` has.
* **Errors.** CUDA reports a failed copy when its event is synchronized; ``synchronize`` raises it
  as ``TransferError``. Copies cannot be cancelled, so ``abort`` waits for them, and then for both side
  streams: a step stopped after a copy was queued but before it kept the handle leaves nothing running.

Importing this module never touches CUDA; making a ``CudaStreams`` without a GPU raises a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyperoffload.runtime.cuda_copies import cuda_device, storage_bytes
from hyperoffload.runtime.placement import place_state
from hyperoffload.runtime.transfers import TransferError, run_lane_inline


class CudaTransfer:
    """One copy on a side stream: its completion event and the host buffer it must keep alive until then. The
    device side needs no reference: ``record_stream`` (or, for an arena's slots, the arena's own marking) keeps
    the allocator from reusing its block under the copy, and holding it here would keep its memory allocated
    after the executor has counted it free, until the step ends (seen on an H200: twice the budget allocated)."""

    __slots__ = ("_buffers", "direction", "event", "label", "nbytes")

    def __init__(self, label: str, direction: str, nbytes: int, event: torch.cuda.Event,
                 buffers: tuple[torch.UntypedStorage, ...]) -> None:
        self.label, self.direction, self.nbytes, self.event = label, direction, nbytes, event
        self._buffers = tuple(b for b in buffers if b.device.type != "cuda")  # the host side of a DMA must outlive it

    def __repr__(self) -> str:
        return f"CudaTransfer({self.direction} {self.label}, {self.nbytes} bytes)"


class CudaStreams:
    """Copies between CUDA device memory and pinned host memory on two side streams (a ``Transfers`` backend)."""

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        self.device = cuda_device(device, "the CUDA runtime (CudaStreams)")
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)
        self._pinned: dict[int, torch.UntypedStorage] = {}  # remote buffers by size
        self.pinned_bytes = 0
        """Bytes of pinned remote buffers allocated so far (each once)."""

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def device_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        # Allocated while the compute stream is current, so the block belongs to the compute stream's pool.
        return torch.UntypedStorage(nbytes, device=self.device)

    def arena_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        """The step's arena (``nbytes`` bytes) on this device, safe to free with copies of its slots queued."""
        arena = self.device_storage(nbytes, like)
        # Slots are sliced storages, outside the allocator's bookkeeping (their record_stream is a no-op): mark
        # the block itself, so that freeing it waits for whatever the side streams have queued by then.
        whole = storage_bytes(arena)
        whole.record_stream(self.h2d)
        whole.record_stream(self.d2h)
        return arena

    def input_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        """Pinned host memory for a step input that starts in remote memory (``place_state``): offloads and
        prefetches of it then run as asynchronous DMA."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()

    def remote_arena(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        buffer = self._pinned.get(nbytes)
        if buffer is None:
            buffer = self._pinned[nbytes] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
            self.pinned_bytes += nbytes
        return buffer

    def offload(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage) -> CudaTransfer:
        self.d2h.wait_stream(self._compute_stream())
        source = storage_bytes(src)
        with torch.cuda.stream(self.d2h):
            storage_bytes(dst).copy_(source, non_blocking=True)
        if source.is_cuda:
            source.record_stream(self.d2h)
        return self._done(label, "d2h", self.d2h, (src, dst))

    def prefetch(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage,
                 after: CudaTransfer | None) -> CudaTransfer:
        self.h2d.wait_stream(self._compute_stream())
        if after is not None:
            self.h2d.wait_event(after.event)
        target = storage_bytes(dst)
        with torch.cuda.stream(self.h2d):
            target.copy_(storage_bytes(src), non_blocking=True)
        if target.is_cuda:
            target.record_stream(self.h2d)
        return self._done(label, "h2d", self.h2d, (src, dst))

    def _done(self, label: str, direction: str, stream: torch.cuda.Stream,
              buffers: tuple[torch.UntypedStorage, ...]) -> CudaTransfer:
        event = torch.cuda.Event()
        event.record(stream)
        return CudaTransfer(label, direction, buffers[0].nbytes(), event, buffers)

    def lane_op(self, label: str, lane: str, nbytes: int, work, after: Sequence[CudaTransfer]) -> None:
        """Run a lane op's ``work`` inline on the current stream (see the module docstring); lane ops run
        here inline, so those in ``after`` were issued before it on the same stream and stream order covers them."""
        run_lane_inline(label, work)

    def wait(self, handle: CudaTransfer) -> None:
        self._compute_stream().wait_event(handle.event)

    def is_done(self, handle: CudaTransfer) -> bool:
        return handle.event.query()

    def synchronize(self, handle: CudaTransfer) -> None:
        try:
            handle.event.synchronize()
        except RuntimeError as error:
            raise TransferError(f"{handle.direction} copy of {handle.label} ({handle.nbytes} bytes) failed: "
                                f"{error}") from error

    def abort(self, handles: Sequence[CudaTransfer]) -> None:
        # Queued copies cannot be taken back; waiting for them is what makes their buffers safe to drop. Then both
        # side streams: a copy queued there whose handle the step never kept (it was stopped between ``offload``
        # or ``prefetch`` queuing the copy and keeping what it returned) has finished too.
        for handle in handles:
            try:
                handle.event.synchronize()
            except RuntimeError:
                pass
        for stream in (self.h2d, self.d2h):
            try:
                stream.synchronize()
            except RuntimeError:
                pass

    def close(self) -> None:
        """Wait for both side streams and let go of the pinned buffers."""
        self.h2d.synchronize()
        self.d2h.synchronize()
        self._pinned.clear()


def place_inputs(plan, inputs, device: torch.device | str = "cuda") -> list[torch.Tensor]:
    """Copies of a step's ``inputs`` where ``plan`` expects them: on ``device``, or, for inputs that start the
    step in remote memory (``plan.initial_remote``), in pinned host memory, which is then their remote copy.
    (``AsyncExecutor.place`` does the same on its own backend, and can place the state in an arena.)"""
    return place_state(plan, inputs, CudaStreams(device))[0]


__all__ = ["CudaStreams", "CudaTransfer", "place_inputs"]
