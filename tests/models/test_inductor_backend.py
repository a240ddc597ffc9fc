"""The backend with ``compiler="inductor"``: planned graphs compiled by Inductor train bit for bit like plain
Inductor (``torch.compile(model)``, nothing offloaded), the code Inductor runs keeps every cache operator
where the plan put it, and on an emulated link the copies run asynchronously and overlap."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from backend_checks import check_cache_op_order, graph_counts, train_side_by_side
from torch import nn
from torch._inductor.utils import run_and_get_code

import hyperoffload
from hyperoffload import cache_ops
from hyperoffload.compile import Backend
from hyperoffload.runtime.emulated_link import EmulatedLink
from hyperoffload.runtime.transfers import TransferError
from hyperoffload.workloads import Llama, get_workload


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own model; a clean cache keeps earlier tests' graphs and recompile limits out."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def deterministic_kernels():
    """One compute thread: Inductor's parallel CPU kernels accumulate some gradients (an embedding's) with
    atomic adds, whose order, and so the float result, varies from run to run with several threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_llama() -> tuple[nn.Module, list]:
    """tiny-llama's architecture, narrowed to two small layers so Inductor compiles it in seconds."""
    config = replace(get_workload("tiny-llama").config, vocab_size=128, hidden=64, ffn=96, layers=2)
    torch.manual_seed(0)
    model = Llama(config)
    batches = [(torch.randint(0, config.vocab_size, (2, 32)), torch.randint(0, config.vocab_size, (2, 32)))
               for _ in range(2)]
    return model, batches


def llama_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, -2), targets.flatten())


def mlp() -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    return model, [torch.randn(16, 32) for _ in range(2)]


def mlp_loss(model, x):
    return model(x).square().sum()


def train_like_plain_inductor(model: nn.Module, backend: Backend, batches, loss_of, steps: int = 2) -> None:
    """Train ``model`` compiled with ``backend`` side by side with a copy compiled by plain Inductor, bit for bit."""
    train_side_by_side(model, backend, batches, loss_of, steps, against="plain Inductor",
                       reference=lambda m: torch.compile(m, dynamic=False))


def assert_offloads_in_both_graphs(backend: Backend) -> None:
    record = backend.last
    assert record.mode == "train" and record.feasible and record.budget_bytes < record.unplanned_peak_bytes
    counts = record.cache_op_counts()
    assert counts["offload"] > 0 and counts["prefetch"] > 0 and counts["release"] > 0
    assert any(n.target is cache_ops.OFFLOAD for n in record.forward.graph.nodes)
    assert any(n.target is cache_ops.PREFETCH for n in record.backward.graph.nodes)


def test_inductor_code_keeps_every_cache_operator_where_the_plan_needs_it():
    """The wrapper code Inductor generates for the planned forward and backward calls every cache operator
    of the lowered graphs, every wait before the first reader of its transfer's result and every release
    after the last reader of its storage, and reuses no buffer (a copy may still be reading it)."""
    model, batches = small_llama()
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm", compiler="inductor")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    _, codes = run_and_get_code(lambda: llama_loss(compiled, batches[0]).backward())
    assert len(codes) == 2, "expected Inductor to compile one forward and one backward"
    assert_offloads_in_both_graphs(backend)
    record = backend.last
    for code, gm in zip(codes, (record.forward, record.backward)):
        assert check_cache_op_order(code) == graph_counts(gm)
        assert "# reuse" not in code
        assert "cpp_fused_" in code  # the compute runs as Inductor's fused C++ kernels


def test_order_check_catches_a_release_before_a_reader_and_a_read_before_the_wait():
    """The order check itself: it refuses code that reads a prefetched buffer before its wait, or reads a
    storage after its release."""
    good = """
    def call(self, args):
        x, w = args
        buf0 = torch.ops.hyperoffload.prefetch.default(w)
        buf1 = buf0
        buf2 = torch.ops.hyperoffload.wait.default(buf1)
        buf3 = buf2
        extern_kernels.mm(x, reinterpret_tensor(buf3, (4, 4), (4, 1), 0), out=buf4)
        torch.ops.hyperoffload.release.default(buf3)
        return (buf4, )
"""
    assert check_cache_op_order(good) == {"offload": 0, "prefetch": 1, "wait": 1, "release": 1, "offload_into": 0}
    read_early = good.replace("        extern_kernels.mm(x, reinterpret_tensor(buf3", "        cpp_fused(buf1)\n"
                              "        extern_kernels.mm(x, reinterpret_tensor(buf3")
    read_early = read_early.replace("        buf2 = torch.ops.hyperoffload.wait", "        cpp_fused(buf1)\n"
                                    "        buf2 = torch.ops.hyperoffload.wait")
    with pytest.raises(AssertionError, match="before"):
        check_cache_op_order(read_early)
    released_early = good.replace("        torch.ops.hyperoffload.release.default(buf3)\n", "").replace(
        "        extern_kernels.mm", "        torch.ops.hyperoffload.release.default(buf3)\n        extern_kernels.mm")
    with pytest.raises(AssertionError, match="after"):
        check_cache_op_order(released_early)
    # The caller's tensor ``w`` is read (prefetched) before an ``offload.into`` writes it back, and not again
    # before the wait for that copy.
    sent_home = good.replace("        torch.ops.hyperoffload.release.default(buf3)\n",
                             "        torch.ops.hyperoffload.offload.into(buf3, w)\n"
                             "        torch.ops.hyperoffload.release.default(buf3)\n"
                             "        buf5 = torch.ops.hyperoffload.wait.default(w)\n")
    assert check_cache_op_order(sent_home) == {"offload": 0, "prefetch": 1, "wait": 2, "release": 1,
                                               "offload_into": 1}
    with pytest.raises(AssertionError, match="before"):
        check_cache_op_order(sent_home.replace("        buf5 = torch.ops", "        cpp_fused(w)\n        buf5 = "
                                                                            "torch.ops"))


def test_a_release_names_the_values_computed_from_its_storage_and_read_after_it():
    """``realize_before_releases``: a weight released right after an embedding gathers from it, while the
    embedding is read after the release, is released by ``release.live`` naming the embedding (and nothing
    read only before the release); the graph computes the same."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hyperoffload.compile.inductor import realize_before_releases

    def step(weight, tokens):
        embedded = torch.ops.aten.embedding.default(weight, tokens)
        scaled = embedded * 3  # read only before the release
        total = scaled.sum()
        cache_ops.RELEASE(weight)
        return embedded + total

    weight, tokens = torch.randn(5, 3), torch.tensor([4, 0, 4])
    gm = make_fx(step)(weight, tokens)
    realized = realize_before_releases(gm)
    (release,) = realized.graph.find_nodes(op="call_function", target=cache_ops.RELEASE_LIVE)
    assert [n.target for n in release.args[1]] == [torch.ops.aten.embedding.default, torch.ops.aten.sum.default]
    assert not realized.graph.find_nodes(op="call_function", target=cache_ops.RELEASE)
    assert gm.graph.find_nodes(op="call_function", target=cache_ops.RELEASE)  # the planned graph is left as it was
    assert torch.equal(realized(weight, tokens), step(weight, tokens))


def test_llama_trains_with_inductor_like_plain_inductor_at_half_its_peak():
    model, batches = small_llama()
    backend = hyperoffload.backend(budget="50%", hardware="h100-sxm", compiler="inductor")
    train_like_plain_inductor(model, backend, batches, llama_loss)
    assert len(backend.compiled) == 1  # one graph, reused by the second step
    assert_offloads_in_both_graphs(backend)


def test_inference_graph_with_inductor_is_planned_and_matches_plain_inductor():
    model, batches = mlp()
    backend = hyperoffload.backend(budget="80%", hardware="h100-sxm", compiler="inductor")
    plain = torch.compile(copy.deepcopy(model), dynamic=False)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        out, expected = compiled(batches[0]), plain(batches[0])
    assert torch.equal(out, expected)
    record = backend.last
    assert record.mode == "inference" and record.backward is None
    assert record.cache_op_counts()["offload"] + record.cache_op_counts()["prefetch"] > 0


# --- asynchronous copies ---------------------------------------------------------------------------

def slow_link() -> EmulatedLink:
    """A link so slow that every copy is still in flight well after it was issued (50 ms a copy)."""
    return EmulatedLink(h2d_bw=1e9, d2h_bw=1e9, h2d_latency_s=0.05, d2h_latency_s=0.05)


def test_inductor_with_an_emulated_link_overlaps_copies_and_trains_like_plain_inductor():
    """On the link's engines, offloads and prefetches start and return at once: waits find other copies of
    the step still in flight (synchronous copies never leave one), and the results stay plain Inductor's."""
    model, batches = mlp()
    with slow_link() as link:
        backend = hyperoffload.backend(budget="50%", hardware="h100-sxm", compiler="inductor", link=link)
        train_like_plain_inductor(model, backend, batches, mlp_loss)
        copies = backend.copies
        assert copies is not None and copies.waits > 0
        assert copies.overlapped_waits > 0, "no wait found another copy in flight"
        assert link.in_flight() == 0  # every copy the step started is through by its end
    assert_offloads_in_both_graphs(backend)


def test_eager_graphs_with_an_emulated_link_train_like_eager():
    model, batches = mlp()
    eager = copy.deepcopy(model)
    with slow_link() as link:
        backend = hyperoffload.backend(budget="75%", hardware="h100-sxm", compiler="eager", link=link)
        compiled = torch.compile(model, backend=backend, dynamic=False)
        for x in batches:
            loss_c, loss_e = mlp_loss(compiled, x), mlp_loss(eager, x)
            loss_c.backward()
            loss_e.backward()
            assert torch.equal(loss_c, loss_e)
            for p, q in zip(model.parameters(), eager.parameters()):
                assert torch.equal(p.grad, q.grad)
        assert backend.copies.overlapped_waits > 0


def test_async_kernels_start_copies_and_wait_for_them_on_the_link():
    """Inside ``copies_on``, offload and prefetch return buffers whose copies are queued on the engines; the
    wait is what completes them (on the engine's ideal clock), and the data arrive whole."""
    x = torch.arange(12, dtype=torch.float32).view(3, 4).t()  # a view: the whole storage travels
    with slow_link() as link:
        copies = cache_ops.AsyncCopies(client=link.client())
        with cache_ops.copies_on(copies):
            remote = cache_ops.OFFLOAD(x)
            handle = copies.pending[remote.untyped_storage().data_ptr()][0]
            issued_by = handle.issued_s
            landed = cache_ops.WAIT(remote)
            back = cache_ops.WAIT(cache_ops.PREFETCH(landed))
        assert handle.start_s >= issued_by and handle.end_s >= handle.start_s + 0.05
        assert torch.equal(back, torch.arange(12, dtype=torch.float32))
        assert copies.waits == 2 and not copies.pending and link.in_flight() == 0
    # Without ``copies_on`` the same operators copy synchronously.
    assert torch.equal(cache_ops.WAIT(cache_ops.OFFLOAD(x)), torch.arange(12, dtype=torch.float32))


def test_a_failed_async_copy_raises_at_its_wait():
    def fail(transfer):
        raise OSError("link down")

    with EmulatedLink(h2d_bw=1e9, d2h_bw=1e9, fault=fail) as link:
        copies = cache_ops.AsyncCopies(client=link.client())
        with cache_ops.copies_on(copies), pytest.raises(TransferError, match="link down"):
            cache_ops.WAIT(cache_ops.OFFLOAD(torch.ones(4)))


def test_unknown_compiler_and_a_link_of_the_wrong_type_are_refused():
    with pytest.raises(ValueError, match="eager, inductor"):
        hyperoffload.backend(compiler="tvm")
    with pytest.raises(TypeError, match="EmulatedLink"):
        hyperoffload.backend(link="pcie")
