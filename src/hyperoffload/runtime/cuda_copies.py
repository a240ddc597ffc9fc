"""Asynchronous copies for the cache operators inside compiled graphs on a GPU: a side stream per direction.

``CudaCopyStreams`` is the ``client`` of a ``cache_ops.AsyncCopies`` when a compiled step runs on a CUDA
device (``hyperoffload.train_step`` on a GPU model). The cache operators allocate the destination of each copy
(a device buffer on the compute stream for a prefetch; page-locked host memory from PyTorch's caching host
allocator for an offload) and hand the copy here. The rules follow CUDA's stream semantics (the CUDA C
Programming Guide, "Streams" and "Events") and PyTorch's "CUDA semantics" note; unlike the interpreter's
backend (``cuda_streams``) nothing is marked with ``record_stream``, which makes the caching allocator hold a
block until some later point of its own choosing (the interpreter's step on a GPU reserved well above its
budget that way: docs/results.md, "Measured on an H200"):

* **Ordering.** Each copy is issued on its direction's stream after that stream waits (``wait_stream``) for
  everything issued so far on the compute stream: the op that last wrote an offload's source, and any queued op
  still reading the memory a prefetch's new block was just freed from (the allocator hands a freed block to the
  same stream at once). A prefetch of a remote buffer whose offload is still in flight waits for its event too.
  Both directions run at once, each on its own copy engine.
* **Waits.** ``CudaCopy.wait`` makes the copy's destination readable where it lives: for a prefetch, the
  compute stream waits for the copy's event (the host does not block); for an offload, whose destination is host
  memory that host code may read (a step's state copied back, an output), the host waits for the event.
* **Device memory given back once the copy has completed.** ``AsyncCopies`` holds an offload's source storage
  until its release; the release calls ``CudaCopy.free_after``: the compute stream waits for the offload's event,
  and only then does the graph let go of the storage, so when the caching allocator hands the block to a later
  op of the compute stream, the copy reading it has finished. A prefetch's destination is allocated on the
  compute stream and read only after its wait, so freeing it needs nothing more.
* **Pinned host memory, pooled.** Remote buffers are page-locked, from PyTorch's caching host allocator: a freed
  block is cached and reused by a later offload of the same size once the copies that used it have completed
  (the allocator records an event on the stream of every asynchronous copy of a pinned block), so after the
  first step no offload pays for ``cudaHostAlloc``.
* **Errors.** CUDA reports a failed copy when its event is synchronized: the host waits raise it as
  ``TransferError``. ``drain`` waits for both side streams and never raises.

Importing this module never touches CUDA; making a ``CudaCopyStreams`` without a GPU raises a clear error.
"""

from __future__ import annotations

import torch

from hyperoffload.runtime.transfers import TransferError


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A one-dimensional uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def cuda_device(device: torch.device | int | str | None, user: str) -> torch.device:
    """``device`` (an index, a name, None: the current one) as a CUDA device with its index; a clear error naming
    ``user`` without a GPU, or for a device that is not a CUDA one."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{user} copies on CUDA streams and needs a CUDA GPU and a CUDA build of torch; on this "
                           f"machine use the emulated link (hyperoffload.runtime.EmulatedLink)")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    if device.type != "cuda":
        raise ValueError(f"{user} runs on a CUDA device, not {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class CudaCopy:
    """One copy on a side stream: its completion event, and the host buffer a DMA must not outlive."""

    __slots__ = ("_host", "compute", "direction", "event", "label", "nbytes")
    error = None
    """A CUDA copy's failure surfaces when its event is synchronized (``wait`` of an offload raises it)."""

    def __init__(self, label: str, direction: str, nbytes: int, event: torch.cuda.Event,
                 compute: torch.cuda.Stream, host: torch.UntypedStorage) -> None:
        self.label, self.direction, self.nbytes, self.event, self.compute = label, direction, nbytes, event, compute
        self._host = host

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        """The destination is readable where it lives: on the compute stream (prefetch) or on the host (offload)."""
        if self.direction == "h2d":
            self.compute.wait_event(self.event)
            return
        try:
            self.event.synchronize()
        except RuntimeError as error:
            raise TransferError(f"d2h copy of {self.label} ({self.nbytes} bytes) failed: {error}") from error

    def free_after(self) -> None:
        """Order the compute stream after the copy, so the memory it reads can be handed out again."""
        self.compute.wait_event(self.event)

    def __repr__(self) -> str:
        return f"CudaCopy({self.direction} {self.label}, {self.nbytes} bytes)"


class CudaCopyStreams:
    """Copies between one CUDA device and page-locked host memory on two side streams, for ``AsyncCopies``."""

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        self.device = cuda_device(device, "CudaCopyStreams")
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)

    def _issue(self, label: str, direction: str, src: torch.UntypedStorage, dst: torch.UntypedStorage,
               after: CudaCopy | None = None) -> CudaCopy:
        stream = self.h2d if direction == "h2d" else self.d2h
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        if after is not None:
            stream.wait_event(after.event)
        with torch.cuda.stream(stream):
            storage_bytes(dst).copy_(storage_bytes(src), non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return CudaCopy(label, direction, src.nbytes(), event, compute, src if direction == "h2d" else dst)

    def offload(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage) -> CudaCopy:
        return self._issue(label, "d2h", src, dst)

    def prefetch(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage,
                 after: CudaCopy | None) -> CudaCopy:
        return self._issue(label, "h2d", src, dst, after)

    def drain(self) -> None:
        """Block until both side streams have finished what was queued on them (never raises)."""
        for stream in (self.h2d, self.d2h):
            try:
                stream.synchronize()
            except RuntimeError:
                pass


__all__ = ["CudaCopy", "CudaCopyStreams", "cuda_device", "storage_bytes"]
