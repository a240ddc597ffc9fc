"""The cache operators' C++ kernels (``hyperoffload.runtime.native_kernels``): with an ``AsyncCopies`` over a
``NativeLink`` they move the same bytes and keep the same counts as the Python kernels; every other use of the
operators still runs the Python kernels; copies that move no bytes are issued and counted all the same; and a
machine that cannot build them says so and runs the Python kernels."""

from __future__ import annotations

import warnings

import pytest
import torch

from hyperoffload import cache_ops
from hyperoffload.runtime import native_kernels
from hyperoffload.runtime.native_link import NativeLink

ops = torch.ops.hyperoffload

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="no C++ compiler to build the kernels")


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """Offload ``x``, release it, prefetch it back: what a plan does to a storage it keeps remote for a while."""
    remote = ops.wait(ops.offload(x))
    ops.release(x)
    return ops.wait(ops.prefetch(remote))


@pytest.mark.parametrize("native", [True, False], ids=["cpp-kernels", "python-kernels"])
def test_both_kernels_move_the_whole_storage_and_count_alike(native):
    x = torch.arange(24.0).view(4, 6).t()  # a view: the whole storage travels
    with NativeLink(h2d_bw=1e9, d2h_bw=1e9, h2d_latency_s=1e-5, d2h_latency_s=1e-5) as link:
        copies = cache_ops.AsyncCopies(client=link.client(), release_waits=True, native_kernels=native)
        assert (copies.native is not None) == native
        state = torch.zeros(6, 4)
        with cache_ops.copies_on(copies):
            back = round_trip(x)
            remote = torch.full((24,), 7.0)  # overwritten whole by the copy
            ops.offload.into(state, remote)
            ops.wait(remote)
        copies.drain()
        assert torch.equal(back, torch.arange(24.0)) and torch.equal(remote, torch.zeros(24))
        nbytes = x.untyped_storage().nbytes()
        assert (copies.waits, copies.h2d_bytes, copies.d2h_bytes) == (3, nbytes, 2 * nbytes)


def test_outside_copies_on_and_inside_copies_on_none_the_operators_copy_synchronously():
    x = torch.arange(8.0)
    with NativeLink(h2d_bw=1e9, d2h_bw=1e9) as link:
        copies = cache_ops.AsyncCopies(client=link.client(), release_waits=True)
        assert copies.native is not None
        with cache_ops.copies_on(copies):
            with cache_ops.copies_on(None):  # the C++ kernels hand these to the Python ones
                assert torch.equal(round_trip(x), x)
            assert copies.native.stats().waits == 0  # nothing went through the native state
            assert torch.equal(round_trip(x), x)
        assert copies.waits == 2
    assert torch.equal(round_trip(x), x)


def test_a_prefetch_of_a_buffer_whose_offload_is_in_flight_reads_it_once_that_copy_has_moved_it():
    x = torch.arange(100_000.0)
    with NativeLink(h2d_bw=1e8, d2h_bw=1e8) as link:  # 4 ms a copy: the prefetch is issued long before it lands
        copies = cache_ops.AsyncCopies(client=link.client(), release_waits=True)
        with cache_ops.copies_on(copies):
            back = ops.wait(ops.prefetch(ops.offload(x)))
        assert torch.equal(back, x)


def test_copies_that_move_no_bytes_are_issued_and_counted_but_leave_the_buffers_alone():
    x = torch.arange(16.0)
    with NativeLink(h2d_bw=1e12, d2h_bw=1e12) as link:
        copies = cache_ops.AsyncCopies(client=link.client(), release_waits=True, move_bytes=False)
        remote = torch.full((16,), -1.0)
        with cache_ops.copies_on(copies):
            ops.offload.into(x, remote)
            ops.wait(remote)
        assert torch.equal(remote, torch.full((16,), -1.0))
        assert copies.waits == 1 and copies.d2h_bytes == x.untyped_storage().nbytes()
        with pytest.raises(ValueError, match="move_bytes=False.*needs the C\\+\\+ kernels"):
            cache_ops.AsyncCopies(client=link.client(), native_kernels=False, move_bytes=False)


def test_a_remote_buffer_of_another_size_is_refused_by_name():
    with NativeLink(h2d_bw=1e9, d2h_bw=1e9) as link:
        copies = cache_ops.AsyncCopies(client=link.client())
        with cache_ops.copies_on(copies), pytest.raises(ValueError, match="device storage has 32 bytes, the remote "
                                                                          "buffer 16"):
            ops.offload.into(torch.zeros(8), torch.zeros(4))


def test_a_closed_link_is_refused_before_any_copy():
    link = NativeLink(h2d_bw=1e9, d2h_bw=1e9)
    copies = cache_ops.AsyncCopies(client=link.client())
    link.close()
    with pytest.raises(RuntimeError, match="NativeLink is closed"), cache_ops.copies_on(copies):
        pass
    copies.drain()  # nothing to wait for on a closed link


def test_without_a_compiler_a_step_says_why_and_runs_the_python_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cache_ops, "_WARNED", [])
    native_kernels.load.cache_clear()
    try:
        with NativeLink(h2d_bw=1e9, d2h_bw=1e9) as link:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                copies = cache_ops.AsyncCopies(client=link.client(), release_waits=True)
            assert copies.native is None
            message = str(caught[0].message)
            assert "C++ compiler" in message and "'no-such-compiler-here' was not found" in message
            assert "Python kernels" in message
            x = torch.arange(8.0)
            with cache_ops.copies_on(copies):
                assert torch.equal(round_trip(x), x)
            assert copies.waits == 2
    finally:
        native_kernels.load.cache_clear()


def test_built_says_whether_loading_would_compile(monkeypatch, tmp_path):
    native_kernels.load()
    assert native_kernels.built()  # loaded in this process
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native_kernels.load.cache_clear()
    try:
        assert not native_kernels.built()  # an empty cache: both libraries would be compiled
    finally:
        native_kernels.load.cache_clear()
    monkeypatch.undo()
    assert native_kernels.built()  # in the usual cache, from the build above



def test_a_release_lets_go_of_its_storage_while_a_copy_the_other_way_is_still_moving():
    """The copy thread moves each direction's copies in order, but not the two directions in issue order: an offload
    issued after a prefetch can move first. Its storage must be let go of at its release all the same (the plan counts
    it free there), not once the earlier prefetch has moved too. The thread is kept busy moving a 100 MB prefetch
    while the release runs; on a loaded machine it may have finished first, so the scenario is tried a few times."""
    arose = 0
    for _ in range(5):
        with NativeLink(h2d_bw=1e10, d2h_bw=1e12, h2d_latency_s=0.2) as link:
            copies = cache_ops.AsyncCopies(client=link.client(), release_waits=True)
            with cache_ops.copies_on(copies):
                first = ops.prefetch(torch.zeros(10))  # the remote-to-device clock now stands 0.2 s ahead
                remote = ops.offload(torch.zeros(25_000_000))  # 100 MB: the thread is busy moving it a while
                back = ops.prefetch(remote)  # ideal start 0.2 s from now: the thread moves x before it, then it
                x = torch.arange(1000.0)
                own = torch._C._storage_Use_Count(x.untyped_storage()._cdata)  # x's, and the storage object's
                ops.wait(ops.offload(x))
                ops.release(x)
                if copies.native.stats().moving:  # the 100 MB prefetch is still moving
                    arose += 1
                    assert torch._C._storage_Use_Count(x.untyped_storage()._cdata) == own  # the kernels hold none
                ops.wait(first), ops.wait(back)
        if arose:
            return
    pytest.skip("the copy thread moved the 100 MB prefetch before the release ran, five times: the machine is too "
                "loaded for this scenario")
