"""Shared checks of the torch.compile backend's tests (tests/models): compiled training side by side with a
reference, the plan really offloading, and the cache operators' order in Inductor's code and in FX graphs."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import torch
from torch import nn

from hyperoffload import cache_ops
from hyperoffload.compile import Backend
from hyperoffload.ir import Phase, ValueKind
from hyperoffload.plans import Kind


def train_side_by_side(model: nn.Module, backend: Backend, batches, loss_of, steps: int = 2, *,
                       reference: Callable[[nn.Module], nn.Module] = lambda m: m, against: str = "eager") -> None:
    """Train ``model`` compiled with ``backend`` and a copy (run as ``reference(copy)``: eager by default) with
    AdamW for ``steps`` steps; loss, every gradient, every parameter and every buffer must be bit-identical
    after each step. ``against`` names the reference in messages."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    run_reference = reference(eager)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    named_e = dict(eager.named_parameters())
    for step in range(steps):
        batch = batches[step % len(batches)]
        loss_c = loss_of(compiled, batch)
        loss_c.backward()
        loss_e = loss_of(run_reference, batch)
        loss_e.backward()
        assert torch.equal(loss_c, loss_e), f"step {step}: loss {loss_c.item()} != {against} {loss_e.item()}"
        for name, p in model.named_parameters():
            assert p.grad is not None, f"step {step}: no gradient for {name}"
            assert torch.equal(p.grad, named_e[name].grad), f"step {step}: gradient of {name} differs from {against}"
        opt_c.step()
        opt_e.step()
        opt_c.zero_grad()
        opt_e.zero_grad()
        for name, p in model.named_parameters():
            assert torch.equal(p, named_e[name]), f"step {step}: {name} differs from {against} after the update"
        for (name, b), e in zip(model.named_buffers(), eager.buffers()):
            assert torch.equal(b, e), f"step {step}: buffer {name} differs from {against}"


def assert_really_offloads(backend: Backend) -> None:
    """The last training graph's plan meets its budget, sends saved activations to remote memory in the
    forward and brings them back in the backward, with the cache operators in both compiled graphs."""
    record = backend.last
    assert record.mode == "train" and record.backward is not None
    assert record.budget_bytes < record.unplanned_peak_bytes
    assert record.planned_peak_bytes <= record.budget_bytes and record.feasible
    assert record.figures.peak_bytes <= record.budget_bytes
    counts = record.cache_op_counts()
    assert counts["offload"] > 0 and counts["prefetch"] > 0 and counts["release"] > 0
    # Every prefetch is waited for; an offload is not where a prefetch reads it in flight (the engines order them).
    assert counts["prefetch"] <= counts["wait"] <= counts["offload"] + counts["prefetch"]

    program, plan = record.program, record.plan
    offloaded = [i.target for i in plan.instructions if i.kind is Kind.OFFLOAD]
    activations = [s for s in offloaded if program.values[s].kind is ValueKind.ACTIVATION]
    assert activations, "the plan offloads no saved activation"
    # Saved activations cross from the forward to the backward as remote buffers ...
    crossing = next(iter(record.forward.graph.find_nodes(op="output"))).args[0]
    remote = [n for n in crossing if isinstance(n, torch.fx.Node) and n.target in (cache_ops.OFFLOAD, cache_ops.WAIT)]
    assert remote, "no remote buffer crosses from the forward to the backward"
    # ... which the backward prefetches.
    placeholders = {n.name for n in record.backward.graph.find_nodes(op="placeholder")}
    prefetched = [n for n in record.backward.graph.nodes if n.target is cache_ops.PREFETCH]
    assert any(_root(n.args[0]).name in placeholders for n in prefetched)
    # The forward runs only forward ops, the backward only backward ones.
    forward_ops = {n.name for n in record.forward.graph.nodes if n.op == "call_function"}
    for op in program.ops:
        if op.phase is Phase.BACKWARD:
            assert op.name not in forward_ops, f"backward op {op.name} runs in the forward graph"


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The node a chain of ``wait`` calls starts from."""
    while node.target is cache_ops.WAIT:
        node = node.args[0]
    return node


# --- what Inductor runs ---------------------------------------------------------------------------

_CALL = re.compile(r"^(?:(\w+) = )?torch\.ops\.hyperoffload\.(offload|prefetch|wait|release)\.(default|live|into)"
                   r"\((\w+)(?:, \[.*\]|, (\w+))?\)$")
"""A cache operator's call in Inductor's wrapper code: ``buf2 = torch.ops.hyperoffload.wait.default(buf1)``, a
release naming the values computed before it, ``torch.ops.hyperoffload.release.live(buf3, [buf5, buf7])``, or an
offload into a given remote buffer, ``torch.ops.hyperoffload.offload.into(buf4, arg0_1)``."""
_ALIAS = re.compile(r"^(\w+) = (?:reinterpret_tensor\()?(\w+)\b")


def call_body(code: str) -> list[str]:
    """The statements of the ``call`` function of Inductor's wrapper code, in the order they run (comments,
    ``del`` and layout asserts left out)."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "def call(self, args):")
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        text = line.strip()
        if not text or text.startswith(("#", "del ", "assert_size_stride(", "assert_alignment(", "args.clear(")) \
                or text.endswith(" = args"):  # the inputs, unpacked
            continue
        body.append(text)
    return body


class _Aliases:
    """Buffer names of the wrapper code that share one storage (``b = a``, ``reinterpret_tensor(a, ...)``, a
    wait's result and its argument)."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        while self.parent.get(name, name) != name:
            name = self.parent[name]
        return name

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def check_cache_op_order(code: str) -> dict[str, int]:
    """Check, on Inductor's wrapper code, that every wait comes before any statement that reads its transfer's
    result (other than the wait) and every release after every statement that reads the released storage;
    return how many calls of each cache operator the code makes."""
    body = call_body(code)
    aliases = _Aliases()
    calls: list[tuple[int, str, str]] = []  # (statement, operator, argument)
    transfer_of: dict[str, int] = {}  # result buffer of an offload or prefetch -> its statement
    for i, text in enumerate(body):
        call = _CALL.match(text)
        if call:
            out, op, overload, arg, into = call.groups()
            if overload == "into":  # its transfer's result is the remote buffer it writes
                op, out = "offload_into", into
            calls.append((i, op, arg if op != "offload_into" else into))
            if op == "wait":
                aliases.join(out, arg)
            elif op in ("offload", "prefetch", "offload_into"):
                transfer_of[out] = i
            continue
        alias = _ALIAS.match(text)
        if alias and (text == f"{alias[1]} = {alias[2]}" or text.startswith(f"{alias[1]} = reinterpret_tensor(")):
            aliases.join(alias[1], alias[2])
    names = [set(re.findall(r"\b[A-Za-z_]\w*\b", text)) for text in body]

    def readers(name: str) -> list[int]:
        """Statements that read the storage ``name`` names (alias statements and the transfer making it aside)."""
        root = aliases.find(name)
        made_by = {i for n, i in transfer_of.items() if aliases.find(n) == root}
        return [i for i, used in enumerate(names)
                if i not in made_by and not _is_alias(body[i]) and any(aliases.find(n) == root for n in used)]

    for i, op, arg in calls:
        if op == "wait":
            root = aliases.find(arg)  # a buffer an ``offload.into`` writes is read before it too (it existed)
            since = max((t for n, t in transfer_of.items() if aliases.find(n) == root and t < i), default=-1)
            early = [j for j in readers(arg) if since < j < i]
            assert not early, f"{body[early[0]]!r} reads the result of a transfer before {body[i]!r}"
        elif op == "release":
            late = [j for j in readers(arg) if j > i]
            assert not late, f"{body[late[0]]!r} reads a storage after {body[i]!r}"
    counts = {op: 0 for op in ("offload", "prefetch", "wait", "release", "offload_into")}
    for _, op, _ in calls:
        counts[op] += 1
    return counts


def _is_alias(text: str) -> bool:
    alias = _ALIAS.match(text)
    return bool(alias) and (text == f"{alias[1]} = {alias[2]}" or text.startswith(f"{alias[1]} = reinterpret_tensor("))


def graph_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    kinds = {cache_ops.OFFLOAD: "offload", cache_ops.PREFETCH: "prefetch", cache_ops.WAIT: "wait",
             cache_ops.RELEASE: "release", cache_ops.OFFLOAD_INTO: "offload_into"}
    counts = {op: 0 for op in kinds.values()}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in kinds:
            counts[kinds[n.target]] += 1
    return counts
