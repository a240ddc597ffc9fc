"""Lower a Plan onto its program's ``torch.fx`` graph as calls of the cache operators.

``lower_plan`` builds a new GraphModule (the program's own graph is never touched) whose nodes
run in the plan's order: each COMPUTE instruction copies its fx node (and the ``getitem`` nodes
that unpack a multi-output op, right after it), and each cache instruction becomes a call of the
operator its kind's rule names (``instructions.RULES``, resolved in ``cache_ops.KIND_OPERATORS``) on the
storage's tensor, emitted by one method per kind (named as ``Kind``'s values and dispatched on it, as
``torch.fx.Interpreter.run_node`` dispatches on a node's op):

* ``OFFLOAD s``  -> ``offload_<s> = hyperoffload.offload(<a tensor of s>)``, a flat remote copy
  of the whole storage.
* ``WAIT s``     -> ``wait_offload_<s> = hyperoffload.wait(offload_<s>)`` or
  ``wait_prefetch_<s> = hyperoffload.wait(prefetch_<s>)``, whichever transfer is in flight.
* ``PREFETCH s`` -> ``prefetch_<s> = hyperoffload.prefetch(wait_offload_<s>)``, or of
  ``offload_<s>`` itself while that offload is in flight (the copy engines start the copy back once it has
  landed; the graph does not stop for it), or of the step input itself, for a storage in
  ``plan.initial_remote``; on a GPU, ``prefetch(..., device)`` names the device
  the storage is computed on, since remote buffers live in host memory.
* ``RELEASE s``  -> ``hyperoffload.release(<the device tensor of s>)``.

Aliasing. A prefetch gives the storage a new device copy, while the graph's later readers name
the tensors of the old one: views (``t``, ``view``, ``detach``), in-place results, the storage
owner itself. Each such tensor that is read after the prefetch is rebuilt on the prefetched flat
buffer as ``aten.as_strided(buffer, size, stride, storage_offset)`` from its fake tensor in
``node.meta["val"]`` (through ``aten.view.dtype`` first when it views the storage with another
dtype), once, right before its first reader, and every later reader reads the rebuilt node.
Tensors created after the prefetch derive from rebuilt ones and need nothing. A step output whose
storage ends the step in remote memory is returned as the same kind of view of the remote buffer.

Step inputs updated in place. The caller's tensors are the step's state (parameters, optimizer
state, KV cache), and the unplanned step updates them in place. Once an input's storage has been
prefetched, its in-place updates land in the prefetched copy, so the lowered graph copies the
final contents back into the caller's tensor (``copy_back_<s> = aten.copy_(flat_<s>, latest)``,
from the device copy, or from the remote buffer if the storage ends the step there) just before
returning, for every input storage written after its first prefetch. The caller therefore sees
exactly the unplanned step's in-place semantics; outputs aliasing such an input are returned as
views of the caller's tensor, as before. Constants (fx ``get_attr`` tensors) get the same rule. With
``send_home=True``, an input that starts the step in remote memory and is written on the device is instead sent
back into the caller's tensor on the copy engines right after its last write (``send_home_<s> =
offload.into(device copy, flat_<s>)``), and waited for at the end (``wait_home_<s>``): no ``copy_back`` for it.

Copied nodes keep their fx names and ``meta``, so names still map to ``Program.node_values``.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

from hyperoffload import cache_ops
from hyperoffload.instructions import COPIES_OUT, RULES
from hyperoffload.plans import Instr, Kind, Plan, check_plan, op_storages


class LoweringError(ValueError):
    """A plan cannot be lowered onto its program's graph; the message says why."""


def lower_plan(plan: Plan, *, send_home: bool = False) -> torch.fx.GraphModule:
    """A new GraphModule running ``plan``: its compute ops in plan order, with the cache operators.

    Called like the captured graph, with the step's inputs in ``program.inputs`` order, it returns
    the same outputs and leaves the same in-place updates in the inputs. An input whose storage the
    plan moves must lie in its storage as the captured one did (the same storage offset and storage
    size): its views are rebuilt on the transferred copy from the captured fake tensors
    (``hyperoffload.compile.layouts`` sees to it for compiled graphs). The plan is checked with
    ``check_plan`` first (``PlanError`` if it breaks a rule); the program must carry its fx graph.

    ``send_home``: an input that starts the step in remote memory and is updated on the device goes back to the
    caller's tensor on the copy engines (``offload.into``), issued right after its last write and waited for at the
    end of the step, rather than copied there by the graph's own thread at the end.
    """
    program = plan.program
    if program.graph is None:
        raise LoweringError(f"program {program.name} has no fx graph to lower onto; build it with a capture function")
    check_plan(plan)
    lowering = _Lowering.start(plan, send_home=send_home)
    for index, instr in enumerate(plan.instructions):
        lowering.emit(index, instr)
    lowering.finish()
    gm = torch.fx.GraphModule(program.graph, lowering.graph, class_name=f"Planned{type(program.graph).__name__}")
    gm.graph.lint()
    return gm


def plan_code(plan: Plan) -> str:
    """The Python code of ``lower_plan(plan)`` (``GraphModule.code``), as written by ``--graph FILE``."""
    return lower_plan(plan).code


def _identifier(name: str) -> str:
    """``name`` made usable in an fx node name: ``layers.0.wq.weight`` -> ``layers_0_wq_weight``."""
    return re.sub(r"\W", "_", name)


def _dtype(name: str) -> torch.dtype:
    """The torch dtype of an IR dtype name (``"float32"``)."""
    return getattr(torch, name)


def _fake(node: torch.fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise LoweringError(f"fx node {node.name} has no tensor in meta['val'] to rebuild it from; "
                            f"lower graphs made by the capture functions")
    return val


def _on_remote_device(val: torch.Tensor) -> torch.Tensor:
    """A fake tensor like ``val`` (size, stride, offset, dtype, storage size) in host memory, the remote tier: what
    the caller passes for a device input that starts the step in remote memory."""
    mode = getattr(val, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        storage = torch.empty((val.untyped_storage().nbytes() // val.element_size(),), dtype=val.dtype,
                              device=cache_ops.REMOTE_DEVICE)
        return storage.as_strided(val.shape, val.stride(), val.storage_offset())


@dataclass
class _Lowering:
    """Mutable scratch state of one lowering; the GraphModule built from it is the result."""

    plan: Plan
    graph: torch.fx.Graph
    nodes: dict[str, torch.fx.Node]
    """Original fx nodes by name."""
    getitems: dict[str, list[torch.fx.Node]]
    """Original ``getitem`` nodes of each multi-output op, in graph order."""
    owner_node: dict[int, str]
    """Name of the original fx node of each value id (the first, if several name it)."""
    home: dict[int, torch.fx.Node] = field(default_factory=dict)
    """The caller's (or the graph's) tensor of each input or constant storage, in the new graph."""
    env: dict[str, torch.fx.Node] = field(default_factory=dict)
    """New node of each original node."""
    env_generation: dict[str, int] = field(default_factory=dict)
    """For tensor nodes: the generation of their storage that ``env``'s node belongs to."""
    generation: dict[int, int] = field(default_factory=dict)
    """How many device copies each storage has had after its original one (0: still the original)."""
    device_base: dict[int, torch.fx.Node] = field(default_factory=dict)
    """The flat device buffer of each storage's current copy (generation > 0 only)."""
    ready: dict[int, bool] = field(default_factory=dict)
    """Whether each storage has a device copy that may be read (produced, or prefetched and waited)."""
    remote: dict[int, torch.fx.Node] = field(default_factory=dict)
    """Latest remote buffer of each storage (an ``offload`` node until waited, then its ``wait``)."""
    in_flight: dict[int, tuple[Kind, torch.fx.Node]] = field(default_factory=dict)
    """The transfer of each storage not waited for yet: its kind and its node."""
    chained: dict[int, torch.fx.Node] = field(default_factory=dict)
    """The offload of each storage that a prefetch read before it was waited for (the copy engine orders the two)."""
    dirty: set[int] = field(default_factory=set)
    """Input and constant storages written in a copy other than the caller's tensor."""
    dtype_views: dict[tuple[str, torch.dtype], torch.fx.Node] = field(default_factory=dict)
    name_uses: dict[str, int] = field(default_factory=dict)
    home_after: dict[int, list[int]] = field(default_factory=dict)
    """Storages sent back to the caller's tensor on the copy engines (``send_home``), by the instruction after which
    they are (their last write; nothing of the plan transfers them later)."""
    sent_home: set[int] = field(default_factory=set)
    home_released_after: dict[int, list[int]] = field(default_factory=dict)
    """The storages of ``home_after`` by the instruction after which their device copy is released: the first
    release of the plan after their last use (or that use, where none follows). The send home reads the copy until
    it has landed; without a release the step would let go of it whenever the link happened to finish, so what the
    step holds would change from run to run. The plan's next release is where its lane model has the offloads
    issued before it landed (a link moves each direction in order), so the release seldom waits there."""
    emitters: dict[Kind, Callable[[int, int], None]] = field(init=False, repr=False)
    """The method that emits each kind's instructions (``emit``'s dispatch table)."""

    def __post_init__(self) -> None:
        self.emitters = {kind: getattr(self, kind.value) for kind in RULES}

    @classmethod
    def start(cls, plan: Plan, *, send_home: bool = False) -> _Lowering:
        program = plan.program
        source: torch.fx.Graph = program.graph.graph
        graph = torch.fx.Graph()
        # The calling convention (flat arguments, or a pytree of them) stays the captured one.
        graph._codegen = copy.deepcopy(source._codegen)
        nodes = {n.name: n for n in source.nodes}
        getitems: dict[str, list[torch.fx.Node]] = {}
        for n in source.nodes:
            if n.op == "call_function" and n.target is operator.getitem:
                getitems.setdefault(n.args[0].name, []).append(n)
        owner_node: dict[int, str] = {}
        for name, vid in program.node_values.items():
            owner_node.setdefault(vid, name)
        home_after = _sent_home_after(plan) if send_home else {}
        self = cls(plan=plan, graph=graph, nodes=nodes, getitems=getitems, owner_node=owner_node,
                   home_after=home_after,
                   home_released_after=_home_releases(plan, {s for sent in home_after.values() for s in sent}))
        remote_at_start = plan.initial_remote
        for n in source.nodes:
            if n.op not in ("placeholder", "get_attr"):
                continue
            new = graph.node_copy(n)
            vid = program.node_values.get(n.name)
            if vid is None:
                self.env[n.name] = new
                continue
            s = program.values[vid].storage
            self._bind(n, new)
            self.home.setdefault(s, new)
            self.ready[s] = s not in remote_at_start
            if not self.ready[s]:
                self.remote[s] = new  # the caller's tensor is the remote copy, in host memory
                val = n.meta.get("val")
                if isinstance(val, torch.Tensor) and val.device != cache_ops.REMOTE_DEVICE:
                    new.meta = {**n.meta, "val": _on_remote_device(val)}
        return self

    # --- storages and values ------------------------------------------------------------------
    def _storage(self, node: torch.fx.Node) -> int | None:
        vid = self.plan.program.node_values.get(node.name)
        return None if vid is None else self.plan.program.values[vid].storage

    def _name(self, s: int) -> str:
        return _identifier(self.plan.program.values[s].name)

    def _bind(self, original: torch.fx.Node, new: torch.fx.Node) -> None:
        self.env[original.name] = new
        s = self._storage(original)
        if s is not None:
            self.env_generation[original.name] = self.generation.get(s, 0)

    def _device_tensor(self, s: int) -> torch.fx.Node:
        """A node holding storage ``s``'s current device copy: the flat buffer of a prefetched copy, else
        the owner's own tensor. Either has the owner's dtype, which ``offload``'s flat buffer inherits."""
        if self.generation.get(s, 0):
            return self.device_base[s]
        if s not in self.owner_node:
            raise LoweringError(f"storage {self.plan.program.values[s].name} has no fx node to transfer "
                                f"(an unpacked output of a multi-output op)")
        return self.env[self.owner_node[s]]

    def _device_of(self, s: int) -> torch.device:
        """The device storage ``s`` is computed on (its owner's fake tensor says; the CPU without one)."""
        node = self.nodes.get(self.owner_node.get(s, ""))
        val = None if node is None else node.meta.get("val")
        return val.device if isinstance(val, torch.Tensor) else cache_ops.REMOTE_DEVICE

    def _elements(self, s: int) -> int:
        """Elements of the owner's dtype in storage ``s``: the length of its flat buffers."""
        owner = self.plan.program.values[s]
        return owner.alloc_bytes // _dtype(owner.dtype).itemsize

    def _call(self, target, args: tuple, name: str) -> torch.fx.Node:
        # fx would rename a repeat of ``prefetch_w_1`` to ``prefetch_w_2``, which reads as another
        # value; the k-th use of a name says so instead (``prefetch_w_1_r2`` for a second round trip).
        uses = self.name_uses[name] = self.name_uses.get(name, 0) + 1
        return self.graph.create_node("call_function", target, args, name=name if uses == 1 else f"{name}_r{uses}")

    def _view_of(self, original: torch.fx.Node, base: torch.fx.Node, s: int) -> torch.fx.Node:
        """``original``'s tensor rebuilt as a view of ``base``, a flat buffer of storage ``s``."""
        val = _fake(original)
        if val.dtype != _dtype(self.plan.program.values[s].dtype):
            key = (base.name, val.dtype)
            if key not in self.dtype_views:
                self.dtype_views[key] = self._call(torch.ops.aten.view.dtype, (base, val.dtype),
                                                   f"{base.name}_as_{str(val.dtype).removeprefix('torch.')}")
            base = self.dtype_views[key]
        shape = [int(d) for d in val.shape]
        stride = [int(d) for d in val.stride()]
        return self._call(torch.ops.aten.as_strided.default, (base, shape, stride, int(val.storage_offset())),
                          f"reload_{original.name}")

    def _read(self, original: torch.fx.Node, reader: str) -> torch.fx.Node:
        """The new node a reader of ``original`` reads, rebuilt on the current device copy if stale."""
        s = self._storage(original)
        if s is None:
            return self.env[original.name]
        if not self.ready.get(s, False):
            raise LoweringError(f"{reader} reads {original.name}, whose storage "
                                f"{self.plan.program.values[s].name} is not on the device")
        if self.env_generation[original.name] != self.generation.get(s, 0):
            self._bind(original, self._view_of(original, self.device_base[s], s))
        return self.env[original.name]

    # --- one method per instruction kind (``Kind``), named after its value and dispatched by ``emit`` -------
    def emit(self, index: int, instr: Instr) -> None:
        self.emitters[instr.kind](index, instr.target)
        for s in self.home_released_after.get(index, ()):
            self._release_home(s)

    def _cache_call(self, kind: Kind, s: int, args: tuple, name: str | None = None) -> torch.fx.Node:
        """A call of ``kind``'s cache operator on ``args``, named ``<kind>_<storage>`` unless ``name`` is given."""
        return self._call(cache_ops.KIND_OPERATORS[kind], args, name or f"{kind.value}_{self._name(s)}")

    def compute(self, index: int, op_id: int) -> None:
        program = self.plan.program
        op = program.ops[op_id]
        original = self.nodes[op.name]
        new = self.graph.node_copy(original, lambda n: self._read(n, op.name))
        self._bind(original, new)
        for item in self.getitems.get(original.name, ()):
            self._bind(item, self.graph.node_copy(item, lambda n: self.env[n.name]))
        for v in op.outputs:
            if program.values[v].owns_storage:
                self.ready[v] = True
        for v in op.mutates:
            s = program.values[v].storage
            if s in self.home and self.generation.get(s, 0):
                self.dirty.add(s)
        for s in self.home_after.get(index, ()):
            self._send_home(s)

    def offload(self, index: int, s: int) -> None:
        node = self._cache_call(Kind.OFFLOAD, s, (self._device_tensor(s),))
        self.in_flight[s] = (Kind.OFFLOAD, node)
        self.remote[s] = node

    def prefetch(self, index: int, s: int) -> None:
        # A prefetch of a copy out still in flight reads its buffer unwaited: the copy engines start the copy back
        # once it has landed (the prefetch waits on what fills its remote copy), and the graph does not stop for it.
        if self.in_flight.get(s, (None,))[0] in COPIES_OUT:
            self.chained[s] = self.in_flight.pop(s)[1]
        device = self._device_of(s)
        args = (self.remote[s],) if device == cache_ops.REMOTE_DEVICE else (self.remote[s], device)
        node = self._cache_call(Kind.PREFETCH, s, args)
        self.in_flight[s] = (Kind.PREFETCH, node)
        self.ready[s] = False

    def wait(self, index: int, s: int) -> None:
        self._wait(s)

    def release(self, index: int, s: int) -> None:
        self._cache_call(Kind.RELEASE, s, (self._device_tensor(s),))
        self.ready[s] = False

    def _send_home(self, s: int) -> None:
        """Start copying storage ``s``'s device copy back into the caller's tensor (its last write was just emitted)."""
        if s not in self.dirty:
            return  # the device copy is the caller's tensor, or it holds what the caller's tensor does
        self._call(cache_ops.OFFLOAD_INTO, (self.device_base[s], self.home[s]), f"send_home_{self._name(s)}")
        self.sent_home.add(s)
        self.dirty.discard(s)

    def _release_home(self, s: int) -> None:
        """Release the device copy of ``s``, sent home (``home_released_after``)."""
        if s in self.sent_home:
            self._cache_call(Kind.RELEASE, s, (self.device_base[s],), f"release_home_{self._name(s)}")
            self.ready[s] = False

    def _wait(self, s: int) -> None:
        """Wait for the transfer of ``s`` in flight: a copy out makes its remote buffer readable, a copy in gives
        ``s`` a new device copy, readable now."""
        kind, transfer = self.in_flight.pop(s)
        node = self._cache_call(Kind.WAIT, s, (transfer,), f"wait_{kind.value}_{self._name(s)}")
        if kind in COPIES_OUT:
            self.remote[s] = node
        else:
            self.generation[s] = self.generation.get(s, 0) + 1
            self.device_base[s] = node
            self.ready[s] = True

    def finish(self) -> None:
        """Copy updated inputs back into the caller's tensors, then return the step's outputs."""
        # A plan that keeps state in remote memory lets its last offloads overlap the next step; a
        # step run on its own completes them before handing the state back.
        for s, (kind, _) in sorted(self.in_flight.items()):
            if kind in COPIES_OUT:
                self._wait(s)
        for s, node in sorted(self.chained.items()):  # the step may read these remote buffers once it returns
            if self.remote.get(s) is node and not self.ready.get(s, False):
                self.in_flight[s] = (Kind.OFFLOAD, node)
                self._wait(s)
        for s in sorted(self.sent_home):  # the caller's tensors hold the step's result before it returns
            waited = self._cache_call(Kind.WAIT, s, (self.home[s],), f"wait_home_{self._name(s)}")
            self._rebase_on_home(s, waited)
        for s in sorted(self.dirty):
            if self.ready.get(s, False):
                latest = self.device_base[s]
            elif self._remote_valid(s):
                latest = self.remote[s]
            else:
                raise LoweringError(f"{self.plan.program.values[s].name} is updated in place but ends the step "
                                    f"with a transfer still in flight; wait for it before the step ends")
            flat = self._rebase_on_home(s, self.home[s])
            self._call(torch.ops.aten.copy_.default, (flat, latest), f"copy_back_{self._name(s)}")
        output = next(n for n in self.plan.program.graph.graph.nodes if n.op == "output")
        self.graph.node_copy(output, self._read_output)

    def _rebase_on_home(self, s: int, home: torch.fx.Node) -> torch.fx.Node:
        """Make ``home`` (the caller's tensor of storage ``s``, or an alias of it) the storage's current copy, as a
        flat buffer, so that outputs aliasing the input are views of the caller's tensor again, as unplanned."""
        flat = self._call(torch.ops.aten.as_strided.default, (home, [self._elements(s)], [1], 0),
                          f"flat_{self._name(s)}")
        self.generation[s] += 1
        self.device_base[s] = flat
        self.ready[s] = True
        return flat

    def _remote_valid(self, s: int) -> bool:
        """Whether ``remote[s]`` holds ``s``'s data: it exists and no offload into it is still in flight."""
        return s in self.remote and self.in_flight.get(s, (None,))[0] not in COPIES_OUT

    def _read_output(self, original: torch.fx.Node) -> torch.fx.Node:
        s = self._storage(original)
        if s is None or self.ready.get(s, False):
            return self._read(original, "the step's output")
        if self._remote_valid(s):
            return self._view_of(original, self.remote[s], s)
        raise LoweringError(f"the step returns {original.name}, whose storage {self.plan.program.values[s].name} "
                            f"ends the step neither on the device nor in remote memory")


def _sent_home_after(plan: Plan) -> dict[int, list[int]]:
    """The storages that start the step in remote memory (the caller's tensor is their home) and are written, by the
    instruction of their last write, where no cache instruction of the plan touches them afterwards (``send_home``)."""
    _, _, written = op_storages(plan.program)
    program = plan.program
    last_write: dict[int, int] = {}
    last_transfer: dict[int, int] = {}
    for i, ins in enumerate(plan.instructions):
        if ins.kind is Kind.COMPUTE:
            for s in written[ins.target]:
                if s in plan.initial_remote:
                    last_write[s] = i
        else:
            last_transfer[ins.target] = i
    after: dict[int, list[int]] = {}
    for s, i in last_write.items():
        value = program.values[s]
        if last_transfer.get(s, -1) < i and value.alloc_bytes % _dtype(value.dtype).itemsize == 0:  # whole elements
            after.setdefault(i, []).append(s)
    return after


def _home_releases(plan: Plan, storages: set[int]) -> dict[int, list[int]]:
    """``storages`` by the instruction after which a sent-home device copy is released (``home_released_after``)."""
    touched = op_storages(plan.program)[0]
    last: dict[int, int] = {}
    releases: list[int] = []
    for i, ins in enumerate(plan.instructions):
        if ins.kind is Kind.COMPUTE:
            for s in touched[ins.target] & storages:
                last[s] = i
        elif ins.kind is Kind.RELEASE:
            releases.append(i)
    after: dict[int, list[int]] = {}
    for s, i in sorted(last.items()):
        k = bisect.bisect_right(releases, i)
        after.setdefault(releases[k] if k < len(releases) else i, []).append(s)
    return after


__all__ = ["LoweringError", "lower_plan", "plan_code"]
