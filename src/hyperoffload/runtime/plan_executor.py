"""Run a Plan on real tensors: one interpreter loop, with the copies done by a swappable transfer backend.

There are two tiers. The *device* tier is an environment of live tensors, as in
``run_reference``; the *remote* tier maps a storage id to a buffer holding a copy of that
storage's bytes. Instructions act on them in plan order:

* ``COMPUTE op`` runs the op's fx node on the caller's thread. Storages are freed after their last
  device use exactly as ``check_plan(plan).frees_after`` says, by dropping every value aliasing
  them at once.
* ``OFFLOAD s`` starts a copy of the whole untyped storage of ``s`` into a remote buffer, so any
  view into it can be rebuilt.
* ``RELEASE s`` drops every value aliasing ``s`` from the device tier and remembers the view
  metadata of those read again later or returned.
* ``PREFETCH s`` allocates a new device storage and starts a copy of the remote buffer into it.
* ``WAIT s`` waits for the latest transfer of ``s``; only then are the remembered views rebuilt on
  a prefetched storage, so no op can read a copy that has not landed.
* ``COMPUTE op`` of a *lane op* (``Op.lane``: an indexed fetch of KV blocks, a write of rows to a remote
  cache) hands the op's kernel, with the input tensors it reads, to the transfer backend's lane of that
  direction (``Transfers.lane_op``), as the simulator runs it: after the lane ops it depends on
  (``Program.dependencies()``) have finished, in FIFO order with that lane's copies. The interpreter goes
  on; the first instruction that depends on the lane op (reads its outputs, or touches a storage it writes
  or writes one it reads), or an ``OFFLOAD`` of a storage it writes, waits for it first (counted in
  ``copy_wait_s``), and every lane op has finished when the step returns. Its outputs join the device tier
  once the step sees it finished; the device storages it reads stay counted until then, even if the plan
  frees them meanwhile. A lane op that fails raises ``TransferError``.

*Remote* values (``Value.remote``: a step input living in remote memory for the whole step, such as a
remote KV cache) are in the environment so lane ops can read and write them, but their storages are never
device bytes: they are neither counted nor dropped, and only lane ops touch them.

How copies run is the transfer backend's business (``Transfers``): ``SyncTransfers`` copies at
once on the caller's thread (``run_plan``, the reference, which runs lane ops inline too);
``hyperoffload.runtime.emulated_link`` runs them, lane ops included, on throttled copy threads and
``hyperoffload.runtime.cuda_streams`` on CUDA side streams.

Device bytes are measured from the tensors themselves: the distinct storages (by address) that the
device tier references, plus device storages an unfinished transfer still holds (a prefetch not yet
waited for, or an offload still reading a storage the plan has already released or freed). The
count is kept incrementally, so measuring after every instruction costs nothing. With a budget,
an allocation that would not fit while a released storage is still being copied out waits for that
copy (as the simulator's memory stall does); if the measured bytes exceed the budget anyway the
step fails with ``BudgetExceeded``. The caller's own references to its input tensors are not part
of the device tier: once the plan releases an input's storage, that memory counts as remote.

**Running from one arena** (``arena=True``, ``run_plan(plan, inputs, arena=True)``): every device
storage lives in its slot ``[offset, offset + nbytes)`` of one byte buffer of ``layout.arena_bytes``,
allocated once at the start of the step on the device tier, where ``layout`` is ``plan.layout`` (from
``PlannerConfig(static_layout=True)``), a ``Layout`` passed in, or ``assign_offsets(plan)``. Step inputs
on the device are copied into their slots first (in place, the caller's tensors still get the final
state back); a prefetch copies from remote memory straight into its slot; each op's outputs that own a
storage are copied into their slot right after the op, and every value aliasing such a storage is
rebound as a view of the slot with its own size, stride and offset, so in-place ops write into the
arena. That costs each such output one extra copy and a transient allocation outside the arena: ops
allocate their outputs through PyTorch (routing them into the arena directly would take a pluggable
allocator / ``MemPool`` or ``out=`` variants). A slot is reused only once the offload reading its previous
occupant has finished: before the slot is written again, later compute is made to wait for that offload
(``Transfers.wait``), and a prefetch into the slot starts only after the compute issued before it (the
backend's ``prefetch`` contract), so the ops reading the previous occupant have finished too. At every
allocation the executor checks, from the slot tensors' addresses, that the live storages' byte ranges are
inside the arena and pairwise disjoint, and raises ``ArenaOverlap`` naming both storages and the instruction
otherwise. Outputs that do not alias an input are returned as copies, so the arena is freed when the
step returns. With ``donate=True`` the state lives in the arena; given ``kept_arena`` (as ``AsyncExecutor.step``
does), the next donated step of the plan runs from that same arena, moving each state storage from where the
step left it to its start slot (``move_order``), so a training loop holds one arena rather than two while
the state is copied from one into the next.

The arena is the same code on every device: the buffer is allocated where the backend puts device storages
(``Transfers.arena_storage``, else ``Transfers.device_storage``) and must be on the device of the step's
device-tier inputs; slots are byte ranges of it (``UntypedStorage`` slices, which share its memory) and
values are views of them with their own dtype, size, stride and offset. On CPU the waits above block the
caller's thread (ops run on it). On CUDA (``cuda_streams.CudaStreams``) every copy into a slot (``_fill``)
runs on the compute stream after the op that produced it; a reused slot's wait is an event wait of the
compute stream, so the host does not block; a prefetch's side stream waits for the compute stream first; and
the arena is marked as used by both side streams, so a copy of a slot still queued when the arena is freed
(a carried offload) keeps its block from being reused. This CUDA path ran on an H200 bit-identically
(``tests/gpu/test_cuda_runtime.py`` and ``make gpu-check`` run it where there is a GPU).

An op that makes one new storage and has an ``out=`` overload with the same arguments (``mm.out`` for
``mm``, ``mul.out`` for ``mul.Tensor``) writes straight into its slot, as a view with the size and strides
the capture recorded; other ops allocate through PyTorch and their result is copied into the slot (a
transient allocation outside the arena, and one copy). ``PlanRun.arena_copied_bytes`` counts those copies.

Inputs that start the step in remote memory (``plan.initial_remote``) are their own remote copy:
prefetches read the caller's storage, and an offload of such a storage writes back into it.

What the step leaves behind depends on ``donate``:

* ``donate=False`` (in place, like the unplanned step): caller tensors (step inputs and graph
  constants) whose storage the plan released are no longer the tensors the step updates, so the
  final bytes of every such storage are copied back into the caller's storage at the end, from the
  device tier or, if the plan leaves it in remote memory, from its remote copy; returned values
  aliasing such a storage are returned as views of the caller's storage. This copy-back emulates
  the caller's tensors living wherever the plan left them and is not counted as a transfer.
* ``donate=True`` (a training loop that hands its state to the executor): the executor takes the
  input tensors out of the list it is given (so it holds the only references and released memory
  is really given back) and returns the state where the plan left it, in ``PlanRun.state``, to be
  passed to the next step. Nothing is copied back. The plan must leave every input where it found
  it, so that it can run again on its own result.

The code lives in one module per concern, and this module re-exports what callers use
(names outside ``__all__`` are imported as themselves, ``x as x``, to mark them re-exported):

* ``interpreter``: ``execute_plan``, ``run_plan`` and the step, one method per instruction kind;
* ``prepared_plan``: ``PreparedPlan``, ``prepare_plan`` (what every step of a plan shares);
* ``transfers``: the ``Transfers`` protocol, ``SyncTransfers``, ``TransferError``, and the step's transfer records;
* ``device_bytes``: the device-byte count and ``BudgetExceeded``;
* ``arena`` and ``arena_step``: ``ArenaSlots``, ``ArenaOverlap``, and how a step runs from its arena;
* ``out_variants``: ``out_variant``, the ``out=`` overloads that write into arena slots;
* ``lane_ops``: lane ops on the copy lanes;
* ``placement``: ``place_state``, ``move_order`` (where a step's state starts);
* ``step_results``: ``PlanRun``, and how a step completes its transfers and builds its results;
* ``views``: rebuilding a tensor as a view of another copy of its storage.
"""

from hyperoffload.runtime.arena import ArenaOverlap, ArenaSlots, arena_slots, with_arena
from hyperoffload.runtime.device_bytes import BudgetExceeded
from hyperoffload.runtime.interpreter import execute_plan, run_plan
from hyperoffload.runtime.out_variants import _WRITTEN_INTO_OUT as _WRITTEN_INTO_OUT
from hyperoffload.runtime.out_variants import _copy_into as _copy_into
from hyperoffload.runtime.out_variants import out_variant as out_variant
from hyperoffload.runtime.placement import move_order as move_order
from hyperoffload.runtime.placement import place_state as place_state
from hyperoffload.runtime.prepared_plan import PreparedPlan, prepare_plan
from hyperoffload.runtime.step_results import PlanRun
from hyperoffload.runtime.transfers import SyncTransfers, TransferError, Transfers, run_lane_inline
from hyperoffload.runtime.views import _ViewMeta as _ViewMeta

__all__ = ["ArenaOverlap", "ArenaSlots", "BudgetExceeded", "PlanRun", "PreparedPlan", "SyncTransfers", "TransferError",
           "Transfers", "arena_slots", "execute_plan", "prepare_plan", "run_lane_inline", "run_plan", "with_arena"]
