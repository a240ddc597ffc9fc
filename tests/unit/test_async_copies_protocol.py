"""``AsyncCopies`` with a copy client whose handles order frees on a device stream (``free_after``, as
``runtime.cuda_copies`` does): a release orders the free after the offload instead of blocking, whatever
``release_waits`` says, and waits make results readable where they live."""

import torch

from hyperoffload import cache_ops


class Handle:
    def __init__(self, log, name):
        self.log, self.name, self.finished = log, name, False

    def done(self):
        return self.finished

    def wait(self):
        self.log.append(("wait", self.name))

    def free_after(self):
        self.log.append(("free_after", self.name))


class Client:
    def __init__(self):
        self.log = []

    def offload(self, label, src, dst):
        _bytes(dst).copy_(_bytes(src))
        return Handle(self.log, "offload")

    def prefetch(self, label, src, dst, after):
        self.log.append(("prefetch after", None if after is None else after.name))
        _bytes(dst).copy_(_bytes(src))
        return Handle(self.log, "prefetch")


def _bytes(storage):
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def test_a_release_orders_the_free_after_the_offload_and_waits_wait_for_their_copy():
    for release_waits in (False, True):
        client = Client()
        copies = cache_ops.AsyncCopies(client=client, release_waits=release_waits)
        x = torch.arange(8.0)
        with cache_ops.copies_on(copies):
            remote = torch.ops.hyperoffload.offload(x)
            back = torch.ops.hyperoffload.prefetch(remote)  # reads the remote buffer once its offload lands
            torch.ops.hyperoffload.release(x)
            torch.ops.hyperoffload.wait(back)
        assert client.log == [("prefetch after", "offload"), ("free_after", "offload"), ("wait", "prefetch")]
        assert torch.equal(back, x) and copies.release_stalls == 1
        assert copies.d2h_bytes == copies.h2d_bytes == x.untyped_storage().nbytes()


def test_prefetch_takes_the_device_it_copies_to():
    x = torch.arange(6.0).view(2, 3).t()  # a strided view: the whole storage moves
    remote = torch.ops.hyperoffload.offload(x)
    assert remote.device == cache_ops.REMOTE_DEVICE and remote.shape == (6,)
    back = torch.ops.hyperoffload.prefetch(remote, torch.device("cpu"))
    assert torch.equal(back, torch.arange(6.0)) and back.untyped_storage().data_ptr() != remote.data_ptr()
