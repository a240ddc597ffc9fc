"""The project's IR: a captured step as an immutable list of ops over values.

A ``Program`` is what every pass reads. Values are tensors; ops are the aten calls
of the captured ``torch.fx`` graph in a valid execution order. Memory belongs to
*storages*: a value either owns its storage (``storage == id``) or aliases the
storage of another value (views, in-place results). Only owners carry
``alloc_bytes``; live-byte accounting sums owners.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hyperoffload.memo import per_program

if TYPE_CHECKING:
    from hyperoffload.variants import RemoteKvForms


class ValueKind(str, Enum):
    """What a tensor is for. Decides what a plan may do with it."""

    PARAMETER = "parameter"
    """Model weights, and module buffers (model state without a gradient, such as RoPE tables)."""
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    """Produced in the forward pass and read again in the backward pass (saved for backward)."""
    KV_CACHE = "kv_cache"
    INPUT = "input"
    """A step input that is neither model state nor KV cache (tokens, targets, positions)."""
    TEMPORARY = "temporary"
    """Any other intermediate."""


class Phase(str, Enum):
    """Which part of the step an op belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True, slots=True, kw_only=True)
class Value:
    """One tensor of the step."""

    id: int
    """Index in ``Program.values``."""
    name: str
    """The fx node name that produced it (or the placeholder's name)."""
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""
    nbytes: int
    """Bytes of this tensor's elements (numel x element size)."""
    kind: ValueKind
    storage: int
    """Id of the value owning the storage this value lives in (its own id if it owns it)."""
    alloc_bytes: int
    """Bytes of the storage allocation if this value owns it, else 0."""
    remote: bool = False
    """True for a storage that lives in remote memory for the whole step (a step input such as a
    remote KV cache, or what a lane op makes there: the host copy of a gradient, a host op's result), and for
    views of one: it takes no device memory (``alloc_bytes`` is 0) and only lane ops read its data (a view of
    it on the compute stream reads none)."""

    @property
    def owns_storage(self) -> bool:
        return self.storage == self.id


LANES = ("h2d", "d2h", "host")
"""What ``Op.lane`` may be (besides None): the two copy lanes, and the host CPU."""
HOST_LANE = "host"
"""``Op.lane`` of an op that runs on the host CPU over host memory."""


class CollectiveKind(str, Enum):
    """What a collective does across the ranks of its group."""

    ALL_GATHER = "all_gather"
    """Each rank contributes its shard; every rank receives the whole tensor (FSDP's parameter gather)."""
    REDUCE_SCATTER = "reduce_scatter"
    """Every rank contributes a whole tensor; each receives its shard of the sum (FSDP's gradient reduction)."""
    ALL_REDUCE = "all_reduce"
    """Every rank contributes a whole tensor and receives the whole sum."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """The communication an op does with the other ranks of a sharded step."""

    kind: CollectiveKind
    full_bytes: int
    """Bytes of the whole (unsharded) tensor: an all-gather's output, a reduce-scatter's input, an all-reduce's
    tensor."""
    group_size: int
    """Ranks in the group the collective runs over (>= 1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One aten call of the step."""

    id: int
    """Index in ``Program.ops``; the captured order is a valid execution order."""
    name: str
    """The fx node name."""
    target: str
    """The aten overload, e.g. ``"aten.mm.default"``."""
    inputs: tuple[int, ...]
    """Ids of the tensor values read, without repeats, in argument order."""
    outputs: tuple[int, ...]
    """Ids of the tensor values produced."""
    mutates: tuple[int, ...] = ()
    """Ids of input values whose storage this op writes in place."""
    phase: Phase = Phase.FORWARD
    flops: int = 0
    """Floating-point operations (a multiply-add counts 2)."""
    bytes_read: int = 0
    """Bytes of tensor data read (device memory traffic)."""
    bytes_written: int = 0
    """Bytes of tensor data written."""
    lane: str | None = None
    """``"h2d"`` or ``"d2h"`` for a *lane op*: an op that moves data between remote memory and the
    device (an indexed prefetch of KV blocks, a write of new rows to a remote cache). It runs on that
    copy lane, not on the compute stream, once the ops it depends on have finished. ``"host"`` (``HOST_LANE``)
    for a lane op that computes on the host CPU over host (remote) memory only, such as an optimizer step
    over host state: it runs on the host lane (``cost.host_op_time``). None for compute."""
    transfer_bytes: int = 0
    """For a lane op, the bytes it moves over the link per step (for a data-dependent fetch, the
    expected bytes under the capture's stated statistics); 0 for compute ops."""
    collective: Collective | None = None
    """For an op that communicates with other ranks (an FSDP all-gather or reduce-scatter), what it sends and
    receives; None for every other op."""
    random: bool = False
    """True for an op that draws from the global random generator (dropout: ``bernoulli_``,
    ``native_dropout``, an attention kernel with a dropout probability): such ops keep their
    captured order among themselves (``Program.dependencies``)."""

    @property
    def is_view(self) -> bool:
        """True for ops that only make aliases: they move no data and cost nothing."""
        return (self.flops == 0 and self.bytes_read == 0 and self.bytes_written == 0 and not self.mutates
                and self.lane is None and self.collective is None)

    @property
    def stream(self) -> str:
        """Where the op runs: its lane (``"h2d"``, ``"d2h"``, ``"host"``) for a lane op, the network (``"net"``) for
        a collective, the compute stream (``"compute"``) for every other op (``instructions.STREAMS``)."""
        if self.lane is not None:
            return self.lane
        return "compute" if self.collective is None else "net"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, weakref_slot=True)
class Program:
    """A captured step: values, ops in a valid order, the step's inputs and outputs.

    ``graph`` is the ``torch.fx.GraphModule`` the program was captured from (None for
    programs built directly in the IR); ``node_values`` maps each fx node name that
    yields a tensor to its value id, so the graph can be executed against the IR.
    """

    name: str
    mode: str
    values: tuple[Value, ...]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    """Value ids of the step's inputs, in call order. The caller holds them for the whole step."""
    outputs: tuple[int, ...]
    """Value ids the step returns; they stay live to the end of the step."""
    constants: tuple[int, ...] = ()
    """Value ids of tensors held by the graph itself (fx ``get_attr``); live for the whole step."""
    graph: Any = None
    node_values: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    meta: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Free-form facts about the capture (workload, batch, dtype policy) for reports."""
    remote_kv: RemoteKvForms | None = field(default=None, repr=False)
    """For a decode step that can also be captured with its KV cache in remote memory (a DeepSeek-style
    workload's), how to capture those forms and the ones captured so far (``hyperoffload.variants``); the
    policies that plan such a form (``paged``, ``hyperoffload``) read it here. None for every other step."""

    def __post_init__(self) -> None:
        verify_program(self)

    # --- derived views -------------------------------------------------------------
    def producers(self) -> tuple[int, ...]:
        """For each value id, the id of the op producing it, or -1 for step inputs."""
        producer = [-1] * len(self.values)
        for op in self.ops:
            for v in op.outputs:
                producer[v] = op.id
        return tuple(producer)

    def storage_owners(self) -> tuple[int, ...]:
        """Ids of the values that own a storage, in id order."""
        return tuple(v.id for v in self.values if v.owns_storage)

    @per_program
    def dependencies(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the ops that must run before it.

        Data dependencies (producer before reader) plus storage hazards: an op that
        writes a storage keeps its captured order relative to every other op touching
        that storage, so a reorder never reads a half-updated tensor or a stale one.
        Ops that draw random numbers (``Op.random``) keep their captured order among
        themselves, so every order draws the same numbers for the same op.
        Computed once per program (every plan check needs it; the program never changes).
        """
        return self._dependencies()

    @per_program
    def dependents(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the ops that depend on it directly (``dependencies()`` inverted), cached likewise."""
        after: list[list[int]] = [[] for _ in self.ops]
        for op_id, before in enumerate(self.dependencies()):
            for d in before:
                after[d].append(op_id)
        return tuple(tuple(a) for a in after)

    def has_lane_ops(self) -> bool:
        """Whether the step moves data itself (``Op.lane``)."""
        return any(op.lane is not None for op in self.ops)

    @per_program
    def has_host_ops(self) -> bool:
        """Whether some ops run on the host CPU (``Op.lane`` ``"host"``): such a step can be simulated, not run
        (the runtime has no host lane). Found once per program (every simulation asks)."""
        return any(op.lane == HOST_LANE for op in self.ops)

    def has_side_ops(self) -> bool:
        """Whether some ops run beside the compute stream: lane ops on the copy lanes, collectives on the network
        (``Op.stream``)."""
        return any(op.stream != "compute" for op in self.ops)

    def _dependencies(self) -> tuple[tuple[int, ...], ...]:
        producer = self.producers()
        deps: list[set[int]] = [set() for _ in self.ops]
        for op in self.ops:
            deps[op.id].update(producer[v] for v in op.inputs if producer[v] >= 0)
        touches: dict[int, list[tuple[int, bool]]] = {}
        for op in self.ops:
            written = {self.values[v].storage for v in op.mutates}
            for s in {self.values[v].storage for v in (*op.inputs, *op.outputs)} | written:
                touches.setdefault(s, []).append((op.id, s in written))
        for events in touches.values():
            if not any(w for _, w in events):
                continue
            last_write = -1
            reads_since_write: list[int] = []
            for op_id, writes in events:
                if last_write >= 0:
                    deps[op_id].add(last_write)
                if writes:
                    deps[op_id].update(reads_since_write)
                    last_write, reads_since_write = op_id, []
                else:
                    reads_since_write.append(op_id)
        # Reordered, a random op would draw another's numbers, and a planned step would no longer be bit for bit
        # the unplanned one.
        random_ops = [op.id for op in self.ops if op.random]
        for before, after in zip(random_ops, random_ops[1:]):
            deps[after].add(before)
        for op in self.ops:
            deps[op.id].discard(op.id)
        return tuple(tuple(sorted(d)) for d in deps)

    def check_order(self, order: Sequence[int]) -> None:
        """Raise ``ValueError`` unless ``order`` runs every op once and respects ``dependencies()``."""
        if sorted(order) != list(range(len(self.ops))):
            raise ValueError(f"an execution order must list each of the {len(self.ops)} op ids exactly once")
        position = {op_id: i for i, op_id in enumerate(order)}
        for op, deps in zip(self.ops, self.dependencies()):
            for d in deps:
                if position[d] > position[op.id]:
                    raise ValueError(
                        f"order runs {op.name} ({op.target}) before {self.ops[d].name}, which it depends on")


def verify_program(program: Program) -> None:
    """Check the IR's structural invariants; raise ``ValueError`` naming the first broken one."""
    values, ops = program.values, program.ops
    for i, v in enumerate(values):
        if v.id != i:
            raise ValueError(f"value {v.name} has id {v.id} at index {i}")
        if not 0 <= v.storage < len(values) or not values[v.storage].owns_storage:
            raise ValueError(f"value {v.name} aliases {v.storage}, which is not a storage owner")
        if v.alloc_bytes < 0 or v.nbytes < 0 or (not v.owns_storage and v.alloc_bytes):
            raise ValueError(f"value {v.name} has inconsistent byte counts")
        if v.remote and (v.alloc_bytes or not values[v.storage].remote):
            raise ValueError(f"remote value {v.name} must take no device memory and alias only remote storage")
        if not v.remote and values[v.storage].remote:
            raise ValueError(f"value {v.name} aliases remote storage {values[v.storage].name}: mark it remote too")
    defined = [False] * len(values)
    for i in (*program.inputs, *program.constants):
        defined[i] = True
    for i, op in enumerate(ops):
        if op.id != i:
            raise ValueError(f"op {op.name} has id {op.id} at index {i}")
        for v in op.inputs:
            if not defined[v]:
                raise ValueError(f"op {op.name} reads {values[v].name} before it is produced")
        if not set(op.mutates) <= set(op.inputs):
            raise ValueError(f"op {op.name} mutates a value it does not read")
        if op.lane is not None and op.lane not in LANES:
            raise ValueError(f"op {op.name} has lane {op.lane!r}; a lane is 'h2d', 'd2h', 'host' or None")
        if op.collective is not None and (op.collective.group_size < 1 or op.collective.full_bytes < 0):
            raise ValueError(f"op {op.name} has a collective over {op.collective.group_size} ranks of "
                             f"{op.collective.full_bytes} bytes; a group has >= 1 rank and bytes are >= 0")
        _check_remote_access(op, values)
        for v in op.outputs:
            if defined[v]:
                raise ValueError(f"value {values[v].name} is produced twice (again by {op.name})")
            defined[v] = True
    made_remote = {v for op in ops if op.lane is not None for v in op.outputs}
    held = set(program.inputs) | set(program.constants)
    stray = [v.name for v in values if v.remote and v.owns_storage and v.id not in held and v.id not in made_remote]
    if stray:
        raise ValueError(f"remote storages must be step inputs or made by lane ops, not {stray[:5]}")
    missing = [values[v].name for v in program.outputs if not defined[v]]
    if missing:
        raise ValueError(f"step outputs never produced: {missing}")
    undefined = [v.name for v, d in zip(values, defined) if not d]
    if undefined:
        raise ValueError(f"values neither step inputs nor produced by an op: {undefined[:5]}")


def _check_remote_access(op: Op, values: Sequence[Value]) -> None:
    """Only lane ops touch remote data: an op on the compute stream (or the network) reads no remote value but
    through a view (which reads no data) and makes no remote storage; a host op (``HOST_LANE``) reads and writes
    host memory only."""
    if op.lane == HOST_LANE:
        device = [values[v].name for v in (*op.inputs, *op.outputs) if not values[v].remote]
        if device:
            raise ValueError(f"host op {op.name} ({op.target}) touches device values {device[:3]}; a host op reads "
                             f"and writes host (remote) memory only: copy them over a copy lane first")
        return
    if op.lane is not None or op.is_view:
        return
    if any(values[v].remote for v in op.inputs):
        raise ValueError(f"op {op.name} ({op.target}) reads a remote value on the compute stream; only lane "
                         f"ops (an indexed prefetch, a remote write, a host op) may touch remote memory")
    made = [values[v].name for v in op.outputs if values[v].remote and values[v].owns_storage]
    if made:
        raise ValueError(f"op {op.name} ({op.target}) makes remote storage {made[:3]} on the compute stream; only "
                         f"lane ops make storages in remote memory")


def kind_bytes(program: Program, kinds: Iterable[ValueKind]) -> int:
    """Total allocated bytes of the storages whose owner is of one of ``kinds``."""
    wanted = set(kinds)
    return sum(v.alloc_bytes for v in program.values if v.owns_storage and v.kind in wanted)
