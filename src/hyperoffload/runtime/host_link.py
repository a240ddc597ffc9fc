"""What the two emulated links between pools of host memory share: ``HostLink``, the ``Transfers`` protocol
answered through the link's own client (``EmulatedLink`` and ``NativeLink``), and ``RemoteBuffers``, each client's
remote buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyperoffload.hardware import Hardware


class RemoteBuffers:
    """The remote buffers that steps copy into, one per size asked for (``remote_arena``), reused step after step:
    an executor returns copies, never these buffers. Each client of a link has its own, so executors sharing a link
    never write each other's."""

    def __init__(self) -> None:
        self._remote: dict[int, torch.UntypedStorage] = {}

    def remote_arena(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        buffer = self._remote.get(nbytes)
        if buffer is None:
            buffer = self._remote[nbytes] = torch.UntypedStorage(nbytes)
        return buffer

    @property
    def remote_nbytes(self) -> int:
        """Bytes of the remote buffers held (what the steps run through this client keep in host memory)."""
        return sum(buffer.nbytes() for buffer in self._remote.values())


class HostLink:
    """A link's own ``Transfers`` methods: those of ``self._own``, the client it issues copies through when used
    directly (for one user at a time); both tiers are host memory."""

    _own: Any

    @classmethod
    def for_hardware(cls, hardware: Hardware, **kwargs):
        """A link with ``hardware``'s bandwidths and latencies (``duplex_share`` is not emulated: the two
        directions never slow each other down beyond what the memory system does)."""
        return cls(h2d_bw=hardware.h2d_bw, d2h_bw=hardware.d2h_bw, h2d_latency_s=hardware.h2d_latency_s,
                   d2h_latency_s=hardware.d2h_latency_s, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def device_storage(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        return torch.UntypedStorage(nbytes)

    def remote_arena(self, nbytes: int, like: torch.UntypedStorage) -> torch.UntypedStorage:
        return self._own.remote_arena(nbytes, like)

    def offload(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage) -> Any:
        return self._own.offload(label, src, dst)

    def prefetch(self, label: str, src: torch.UntypedStorage, dst: torch.UntypedStorage, after: Any | None) -> Any:
        return self._own.prefetch(label, src, dst, after)

    def wait(self, handle: Any) -> None:
        handle.wait()

    def is_done(self, handle: Any) -> bool:
        return handle.done()

    def synchronize(self, handle: Any) -> None:
        handle.wait()

    def abort(self, handles: Sequence[Any]) -> None:
        """Stop or finish ``handles`` and every other copy handed the link's own client; see its ``abort``."""
        self._own.abort(handles)

    def drain(self) -> None:
        """See the client's ``drain``."""
        self._own.drain()


__all__ = ["HostLink", "RemoteBuffers"]
