"""``NativeLink``: the emulated link's copies on one C thread. Bytes arrive, each direction keeps its own ideal
clock (a copy never completes before ``latency + bytes / bandwidth`` after its ideal start; copies of one
direction queue, the two directions overlap), a prefetch of a buffer whose offload is in flight starts after it,
buffers live until their copy has moved them, and a link that cannot be built says why. Timing is checked on
the ideal clock, which is computed, not measured."""

from __future__ import annotations

import gc
import os
import threading
import warnings

import pytest
import torch

from hyperoffload import cache_ops
from hyperoffload.hardware import get_hardware
from hyperoffload.runtime import EmulatedLink
from hyperoffload.runtime import native_kernels, native_link
from hyperoffload.runtime.host_buffers import HostBuffers
from hyperoffload.runtime.native_link import NativeLink, NativeLinkUnavailable, host_link


def storage_of(values: torch.Tensor) -> torch.UntypedStorage:
    return values.untyped_storage()


def test_copies_move_the_bytes_and_never_complete_before_latency_plus_bytes_over_bandwidth():
    with NativeLink(h2d_bw=1e9, d2h_bw=5e8, h2d_latency_s=1e-4, d2h_latency_s=2e-4) as link:
        sources = [storage_of(torch.randn(4096 * (k + 1))) for k in range(3)] + [torch.UntypedStorage(0)]
        remotes = [torch.UntypedStorage(s.nbytes()) for s in sources]
        offloads = [link.offload(f"x{k}", s, r) for k, (s, r) in enumerate(zip(sources, remotes))]
        device = torch.UntypedStorage(sources[2].nbytes())
        back = link.prefetch("x2", remotes[2], device, offloads[2])
        back.wait()
        assert back.done()
        for t in offloads:
            t.wait()
            assert t.done() and t.error is None
            assert t.end_s - t.start_s >= 2e-4 + t.nbytes / 5e8 - 1e-9
        assert back.end_s - back.start_s >= 1e-4 + back.nbytes / 1e9 - 1e-9
        for first, second in zip(offloads, offloads[1:]):  # one direction's copies queue
            assert second.start_s >= first.end_s
        assert back.start_s >= offloads[2].end_s  # the prefetch reads what the offload wrote
        assert all(bytes(r) == bytes(s) for r, s in zip(remotes, sources))
        assert bytes(device) == bytes(sources[2])
        assert link.in_flight() == 0


def test_the_two_directions_overlap_on_their_own_clocks():
    # 10 kB/s: each 1000-byte copy takes 100 ms on its direction's clock, far longer than its memmove or a pause of
    # this thread between issuing the two directions' copies on a loaded machine.
    with NativeLink(h2d_bw=1e4, d2h_bw=1e4) as link:
        data = [storage_of(torch.zeros(250)) for _ in range(4)]
        out = [torch.UntypedStorage(1000) for _ in range(4)]
        d2h = [link.offload("a", data[0], out[0]), link.offload("b", data[1], out[1])]
        h2d = [link.prefetch("c", data[2], out[2], None), link.prefetch("d", data[3], out[3], None)]
        for t in d2h + h2d:
            t.wait()
        assert d2h[1].start_s >= d2h[0].end_s and h2d[1].start_s >= h2d[0].end_s
        # Issued together, the first copy of each direction starts before the other direction's first has ended.
        assert h2d[0].start_s < d2h[0].end_s and d2h[0].start_s < h2d[0].end_s


def test_a_copy_of_one_direction_does_not_queue_behind_the_other_directions_later_copies():
    """One thread moves both directions' bytes, taking next the copy an ideal duplex link would start first: a small
    device -> remote copy issued after four large remote -> device ones moves after the first of them (which started
    before it), not after all four, whose direction's clock starts the others seconds later."""
    with NativeLink(h2d_bw=32e6, d2h_bw=32e6) as link:  # 1 s a 32 MB copy on its clock: the later ones start later
        big = [storage_of(torch.zeros(8 << 20)) for _ in range(4)]
        prefetches = [link.prefetch(f"p{k}", b, torch.UntypedStorage(b.nbytes()), None) for k, b in enumerate(big)]
        offload = link.offload("small", storage_of(torch.zeros(256)), torch.UntypedStorage(1024))
        offload.join()  # its bytes have moved
        assert not all(p.settled() for p in prefetches[1:]), "the offload waited behind every prefetch"
        link.drain()


def test_a_copy_keeps_its_buffers_alive_until_it_has_moved_them():
    with NativeLink(h2d_bw=1e10, d2h_bw=1e10) as link:
        # A large copy queued first keeps the thread busy, so the small one moves its bytes after the caller has let
        # go of its source and the allocator has handed that memory out again (filled with other values).
        ahead = torch.UntypedStorage(64 << 20)
        link.offload("ahead", ahead, torch.UntypedStorage(ahead.nbytes()))
        expected = torch.arange(1 << 16, dtype=torch.float32)
        remote = torch.UntypedStorage(expected.untyped_storage().nbytes())
        handle = link.offload("x", expected.clone().untyped_storage(), remote)  # the source's only reference
        gc.collect()
        others = [torch.full_like(expected, -1.0) for _ in range(4)]
        handle.wait()
        assert torch.equal(torch.empty(0).set_(remote), expected) and all(bool((o == -1).all()) for o in others)


def test_drain_close_and_bad_parameters():
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        NativeLink(h2d_bw=0, d2h_bw=1e9)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        NativeLink(h2d_bw=1e9, d2h_bw=1e9, d2h_latency_s=-1)
    link = NativeLink(h2d_bw=1e8, d2h_bw=1e8)
    with pytest.raises(ValueError, match="source has 8 bytes, destination 4"):
        link.offload("x", torch.UntypedStorage(8), torch.UntypedStorage(4))
    client = link.client()
    handles = [client.offload("x", torch.UntypedStorage(1 << 16), torch.UntypedStorage(1 << 16)) for _ in range(8)]
    client.drain()
    assert client.in_flight() == 0 and all(h.settled() for h in handles)
    unmoved = client.offload("y", torch.UntypedStorage(1 << 20), torch.UntypedStorage(1 << 20))
    link.close()  # moves what was issued first
    for h in [*handles, unmoved]:
        h.wait()  # on a closed link: returns
        assert h.settled() and h.done()
    with pytest.raises(RuntimeError, match="closed"):
        client.offload("x", torch.UntypedStorage(8), torch.UntypedStorage(8))
    link.close()  # twice is fine


def test_the_copy_thread_spins_only_on_a_core_the_compute_threads_leave_free(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    try:
        torch.set_num_threads(2)
        assert native_link.default_spin_s() == 0.0
        with NativeLink(h2d_bw=1e9, d2h_bw=1e9) as link:
            assert link.spin_s == 0.0
        torch.set_num_threads(1)
        assert native_link.default_spin_s() == native_link.SPIN_S > 0
    finally:
        torch.set_num_threads(threads)


def test_clients_in_several_threads_issue_at_once():
    with NativeLink(h2d_bw=1e12, d2h_bw=1e12) as link:
        results: dict[int, bool] = {}

        def issue(k: int) -> None:
            client = link.client()
            pairs = [(storage_of(torch.full((64,), float(k * 1000 + i))), torch.UntypedStorage(256))
                     for i in range(200)]
            handles = [client.offload("x", src, dst) if i % 2 else client.prefetch("x", src, dst, None)
                       for i, (src, dst) in enumerate(pairs)]
            for h in handles:
                h.wait()
            results[k] = all(bytes(dst) == bytes(src) for src, dst in pairs) and client.in_flight() == 0

        threads = [threading.Thread(target=issue, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {0: True, 1: True, 2: True}


def test_a_forked_child_refuses_the_parents_link_and_the_parent_goes_on():
    with NativeLink(h2d_bw=1e9, d2h_bw=1e9) as link:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no copy thread here; it must say so, and exit without joining one
            try:
                link.offload("x", torch.UntypedStorage(8), torch.UntypedStorage(8))
                os.write(write, b"copied")
            except RuntimeError as error:
                os.write(write, str(error).encode())
            finally:
                link.close()
                os._exit(0)
        os.close(write)
        said = os.read(read, 4096).decode()
        os.waitpid(pid, 0)
        os.close(read)
        assert "made before the process forked" in said
        src = storage_of(torch.arange(8.0))
        dst = torch.UntypedStorage(src.nbytes())
        link.offload("x", src, dst).wait()
        assert bytes(dst) == bytes(src)


def pool_bytes(copies: cache_ops.AsyncCopies) -> int:
    """Bytes of the remote buffers ``copies`` keeps for reuse, in whichever kernels keep them."""
    return copies.remote_buffers.nbytes if copies.native is None else copies.native.stats().pool_bytes


def offloads_reading(copies: cache_ops.AsyncCopies) -> int:
    """Offloads whose device storage ``copies`` still holds (``reading``), in whichever kernels keep them."""
    return len(copies.reading) if copies.native is None else copies.native.stats().reading


KERNELS = pytest.mark.parametrize("cpp", [
    pytest.param(True, id="cpp-kernels", marks=pytest.mark.skipif(not native_kernels.available(),
                                                                  reason="no C++ compiler to build the kernels")),
    pytest.param(False, id="python-kernels")])


@KERNELS
def test_the_cache_operators_copy_on_it_and_reuse_remote_buffers_across_steps(cpp):
    with NativeLink(h2d_bw=1e9, d2h_bw=1e9) as link:
        copies = cache_ops.AsyncCopies(client=link.client(), release_waits=True, native_kernels=cpp)
        assert (copies.native is not None) == cpp
        x = torch.arange(4096.0)
        addresses = set()
        with cache_ops.copies_on(copies):
            for _ in range(3):  # a step each
                remote = torch.ops.hyperoffload.wait(torch.ops.hyperoffload.offload(x))
                torch.ops.hyperoffload.release(x)
                back = torch.ops.hyperoffload.wait(torch.ops.hyperoffload.prefetch(remote))
                assert torch.equal(back, x)
                addresses.add(remote.data_ptr())
                del remote, back
        assert len(addresses) == 1 and pool_bytes(copies) == x.untyped_storage().nbytes()
        assert copies.waits == 6 and copies.d2h_bytes == copies.h2d_bytes == 3 * x.untyped_storage().nbytes()


@KERNELS
def test_a_storage_whose_offload_is_its_last_use_is_let_go_of_once_the_copy_completes(cpp):
    """No release follows such an offload: the copy's record is what holds the storage, and the next cache operator
    lets go of it once the copy has completed (not at some later clean-up, which made the measured peak vary)."""
    with NativeLink(h2d_bw=1e12, d2h_bw=1e12) as link:
        copies = cache_ops.AsyncCopies(client=link.client(), release_waits=True, native_kernels=cpp)
        x, y = torch.arange(1024.0), torch.arange(8.0)
        with cache_ops.copies_on(copies):
            remote = torch.ops.hyperoffload.offload(x)
            assert offloads_reading(copies) == 1
            torch.ops.hyperoffload.wait(remote)  # completed: this wait already lets go of it
            assert offloads_reading(copies) == 0
            torch.ops.hyperoffload.wait(torch.ops.hyperoffload.offload(y))
            torch.ops.hyperoffload.offload(x)
            assert offloads_reading(copies) == 1  # y's went with this offload
            if not cpp:
                assert list(copies.reading) == [x.untyped_storage().data_ptr()]


def test_a_host_buffer_is_handed_out_again_only_once_nothing_refers_to_it():
    pool = HostBuffers()
    first = pool.tensor(16, torch.float32)
    view = first[4:]
    del first
    second = pool.tensor(16, torch.float32)  # the view still holds the first one
    assert second.data_ptr() != view.data_ptr() - 16 and pool.nbytes == 128
    address = second.data_ptr()
    del second
    third = pool.tensor(16, torch.float32)
    assert third.data_ptr() == address
    held = third.untyped_storage()  # PyTorch's one Python object of the storage: held with no tensor on it
    del third
    assert pool.tensor(16, torch.float32).data_ptr() not in (address, view.data_ptr() - 16)
    del held
    assert pool.tensor(16, torch.float32).data_ptr() == address
    assert pool.take(8).nbytes() == 8 and pool.nbytes == 3 * 64 + 8
    pool.clear()
    assert pool.nbytes == 0


def test_without_a_compiler_it_says_what_to_do_and_steps_fall_back_to_the_python_link(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native_link.library.cache_clear()
    try:
        with pytest.raises(NativeLinkUnavailable, match="needs a C compiler.*'no-such-compiler-here' was not found"):
            NativeLink(h2d_bw=1e9, d2h_bw=1e9)
        assert not native_link.available()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            link = host_link(get_hardware("cpu-emulated"))
        assert isinstance(link, EmulatedLink) and "falling back to EmulatedLink" in str(caught[0].message)
        link.close()
    finally:
        native_link.library.cache_clear()
