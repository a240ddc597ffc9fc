"""``hyperoffload.backend(...)``: a ``torch.compile`` backend that plans offloads under a budget.

For each graph TorchDynamo hands it, the backend runs aot_autograd, which traces the forward and
the backward and partitions them (``default_partition``: the backward reads exactly what eager
autograd would have saved, nothing is recomputed; with ``compiler="inductor"``, Inductor's own
``min_cut_rematerialization_partition``, which recomputes cheap ops in the backward, so the kernels
are those of plain Inductor). Then, inside aot_autograd's ``partition_fn``:

1. join the forward and backward graphs into one step (``join_graphs``): saved activations are
   values produced in the forward and read in the backward;
2. convert it to a Program and plan it with the chosen policy under the budget, on the chosen
   hardware profile (a percentage is of this joint step's no-offload peak);
3. keep prefetches of the tangents out of the forward (``keep_backward_inputs_in_backward``);
4. lower the plan onto the joint graph with the cache operators (``lower_plan``);
5. cut the lowered graph back into a forward and a backward (``split_lowered``): an offloaded
   saved activation crosses as its remote buffer and is prefetched in the backward;
6. simulate the plan on the hardware profile and record it (``Backend.compiled``).

aot_autograd then runs the two graphs as the compiled function's forward and backward, so
``loss.backward()`` and the optimizer work as usual. TorchDynamo and aot_autograd fix the size and
stride of a graph's inputs, not where they lie in their storages: the joint graph plans each
tangent as aot_autograd makes it, and an input whose storage the plan moves runs as a copy laid
out as planned when the caller's tensor lies otherwise (``hyperoffload.compile.layouts``). Graphs
run without gradients (``no_grad``, inference) are planned alone.

How the planned graphs run (``compiler``): ``"eager"`` runs them op by op, and the results are
bit-identical to eager; ``"inductor"`` compiles them with Inductor by the route ``torch.compile(model)``
takes, with this partition (``hyperoffload.compile.inductor``), so compute runs as fused kernels and
the results are bit-identical to plain Inductor's with nothing offloaded. The cache operators run on
CPU tensors (``hyperoffload.cache_ops``): asynchronously on a link (by default a ``NativeLink`` of the profile's
speed, or ``link``), or synchronously with ``link=False``: each call of a compiled graph runs inside
``cache_ops.copies_on(backend.copies)``, so offloads and prefetches overlap the compute and waits block
until their copy has completed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from hyperoffload import cache_ops
from hyperoffload.analysis import memory_profile
from hyperoffload.budgets import check_budget_text
from hyperoffload.capture.graph_to_program import program_from_graph
from hyperoffload.compile.inductor import KeepPlanOrder, compile_planned
from hyperoffload.compile.joint import JointGraph, input_kinds, join_graphs
from hyperoffload.compile.layouts import planned_layouts, with_planned_layouts
from hyperoffload.compile.split import keep_backward_inputs_in_backward, split_lowered
from hyperoffload.hardware import Hardware, get_hardware
from hyperoffload.instructions import COPIES_OUT
from hyperoffload.ir import Program, ValueKind
from hyperoffload.lower import lower_plan
from hyperoffload.planning import plan_checked
from hyperoffload.plans import Plan, check_plan
from hyperoffload.policies import get_policy
from hyperoffload.runtime.emulated_link import EmulatedLink
from hyperoffload.runtime.native_link import HOST_LINKS, NativeLink, host_link
from hyperoffload.simulate import Figures, simulate

COMPILERS = ("eager", "inductor")
"""How a backend runs its planned graphs: op by op, or compiled by Inductor."""

CACHE_OPERATORS = {op: kind for kind, op in cache_ops.KIND_OPERATORS.items()}
"""The instruction kind each cache operator of a lowered graph stands for (the operators ``instructions.RULES``
names)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledGraph:
    """One graph ``torch.compile`` handed to the backend, as planned and lowered."""

    index: int
    """Which graph of this backend it is (0 for the first; a graph break makes several)."""
    mode: str
    """``"train"``: forward and backward planned as one step; ``"inference"``: a graph run without gradients."""
    program: Program
    """The planned step (for ``"train"``, the joint forward + backward)."""
    plan: Plan
    figures: Figures
    """The plan simulated on the backend's hardware profile (seconds, bytes)."""
    budget_bytes: int
    """The budget the graph was planned for (bytes; a percentage resolved against ``unplanned_peak_bytes``)."""
    unplanned_peak_bytes: int
    """Device bytes the step needs with nothing offloaded (what a percentage budget is of)."""
    planned_peak_bytes: int
    """Device bytes at the plan's peak, in plan order (``check_plan``); never above ``plan.budget_bytes``."""
    plan_s: float
    """Wall time planning, lowering and splitting took (seconds)."""
    forward: torch.fx.GraphModule
    """The graph that runs as the forward (or the whole inference graph), cache operators included."""
    backward: torch.fx.GraphModule | None
    """The graph that runs as the backward; None for an inference graph."""
    input_names: tuple[str, ...] = ()
    """Readable names of the step's inputs (TorchDynamo's, where they line up), in ``program.inputs`` order."""
    joint: JointGraph | None = None
    """For ``"train"``: the joint graph the program was made from (where the forward ends, which inputs are
    tangents)."""

    @property
    def feasible(self) -> bool:
        """Whether the plan stays within the budget (the ``none`` policy does not when the step needs more)."""
        return self.planned_peak_bytes <= self.budget_bytes

    def cache_op_counts(self) -> dict[str, int]:
        """How many calls of each cache operator the compiled graphs make (offload, prefetch, wait, release)."""
        counts = {kind.value: 0 for kind in CACHE_OPERATORS.values()}
        for gm in (self.forward, self.backward):
            if gm is None:
                continue
            for n in gm.graph.nodes:
                if n.op == "call_function" and n.target in CACHE_OPERATORS:
                    counts[CACHE_OPERATORS[n.target].value] += 1
        return counts

    def offloaded(self) -> list[str]:
        """Names of the values the plan sends to remote memory (or keeps there at the start), in plan order."""
        values = self.program.values
        names = [values[s].name for s in sorted(self.plan.initial_remote)]
        names += [values[i.target].name for i in self.plan.instructions if i.kind in COPIES_OUT]
        return list(dict.fromkeys(names))


@dataclass(eq=False)
class Backend:
    """A ``torch.compile`` backend planning every compiled graph under ``budget`` on ``hardware``.

    Use ``hyperoffload.backend(...)`` to make one. ``compiled`` lists every graph it planned, in the
    order they were compiled, and ``last`` is the latest: inspect the plan, its simulated figures and
    the graphs that run.
    """

    budget: int | str
    """Bytes, or text: ``"40GiB"``, ``"50%"`` (of each compiled step's no-offload peak), ``"hideable"``."""
    hardware: Hardware
    """The profile plans are made and simulated for."""
    policy: str = "hyperoffload"
    """A name in ``hyperoffload.policies.POLICIES``."""
    compiler: str = "eager"
    """A name in ``COMPILERS``: ``"eager"`` runs the planned graphs op by op, ``"inductor"`` compiles them."""
    copies: cache_ops.AsyncCopies | None = None
    """Where the cache operators copy (asynchronously, on a link's client) while a compiled graph runs; None:
    synchronous copies on the compute thread, or, with ``default_link``, the default link once a graph on the CPU
    is compiled."""
    default_link: bool = False
    """Whether the first graph compiled on the CPU sets ``copies`` to a client of ``host_link(hardware)`` (a
    ``NativeLink`` of the profile's speed) when ``copies`` is None."""
    compiled: list[CompiledGraph] = field(default_factory=list)
    __name__ = "hyperoffload"  # TorchDynamo names a backend by this attribute in its messages (not a field)

    @property
    def last(self) -> CompiledGraph:
        """The latest compiled graph; ``LookupError`` before anything was compiled."""
        if not self.compiled:
            raise LookupError("nothing has been compiled with this backend yet; call the compiled model first")
        return self.compiled[-1]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

        # Inductor's own partition for Inductor (it recomputes cheap ops in the backward, whose kernels
        # round as plain Inductor's do); for op-by-op graphs, the backward reads what eager saves.
        base = min_cut_rematerialization_partition if self.compiler == "inductor" else default_partition

        names = tuple(_readable_name(n) for n in gm.graph.find_nodes(op="placeholder"))
        index = len(self.compiled)
        self._default_copies(example_inputs)

        def partition(joint_module, joint_inputs, *, num_fwd_outputs: int, static_lifetime_input_indices=None,
                      **kwargs):
            forward, backward = base(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                     static_lifetime_input_indices=static_lifetime_input_indices, **kwargs)
            record = self._plan_training(index, forward, backward, num_fwd_outputs,
                                         static_lifetime_input_indices or (), names)
            return record.forward, record.backward

        def inference(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
            record = self._plan_inference(index, gm, names)
            return self._runner(record.forward, record.forward, record.plan)

        def run_as_is(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
            # Already planned and lowered by ``partition``; inputs are laid out as planned when they run.
            return self._runner(gm, gm, self._record_of(index).plan)

        if self.compiler == "inductor":
            def plan_inference(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
                return self._plan_inference(index, gm, names).forward

            def finish(gm: torch.fx.GraphModule, compiled: Callable) -> Callable:
                return self._runner(gm, compiled, self._record_of(index).plan)

            return compile_planned(gm, example_inputs, partition=partition, plan_inference=plan_inference,
                                   finish=finish, choices=lambda gm: KeepPlanOrder())
        return aot_autograd(fw_compiler=run_as_is, bw_compiler=run_as_is, inference_compiler=inference,
                            partition_fn=partition)(gm, example_inputs)

    def _default_copies(self, example_inputs: Sequence) -> None:
        """With ``default_link``, copies on a link of the profile's speed for a graph whose tensors are all on the
        CPU (a GPU graph's cache operators copy synchronously: the backend has no CUDA copy streams yet)."""
        if not self.default_link or self.copies is not None:
            return
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        if tensors and all(x.device.type == "cpu" for x in tensors):
            self.copies = cache_ops.AsyncCopies(client=host_link(self.hardware).client(), release_waits=True)

    def _record_of(self, index: int) -> CompiledGraph:
        """The latest record of graph ``index`` (planned by its partition, or as an inference graph)."""
        return next(r for r in reversed(self.compiled) if r.index == index)

    def _runner(self, gm: torch.fx.GraphModule, run: Callable, plan: Plan) -> Callable:
        """What aot_autograd calls for the planned graph ``gm``, run by ``run`` (``gm`` itself, or Inductor's
        compiled function): inputs laid out as planned, and the cache operators copying on ``self.copies`` for
        the duration of each call."""
        laid_out = with_planned_layouts(run, planned_layouts(gm, plan))
        copies = self.copies
        if copies is None:
            return laid_out

        def call(args: list) -> object:
            with cache_ops.copies_on(copies):
                return laid_out(args)

        call._boxed_call = True  # aot_autograd's calling convention: one list of inputs
        return call

    # --- planning ------------------------------------------------------------------------------------
    def _plan(self, program: Program) -> tuple[Plan, int]:
        planned = plan_checked(program, self.hardware, self.budget, policy=self.policy, simulate=False)
        plan, budget = planned.plan, planned.budget_bytes
        return plan, budget

    def _plan_training(self, index: int, forward: torch.fx.GraphModule, backward: torch.fx.GraphModule,
                       num_user_outputs: int, static_inputs: Sequence[int], names: Sequence[str]) -> CompiledGraph:
        start = time.perf_counter()
        joint = join_graphs(forward, backward, num_user_outputs)
        input_names = _input_names(joint, names)
        program = program_from_graph(joint.module, input_kinds(joint, static_inputs), name=f"graph {index}",
                                     mode="train", input_names=input_names, meta={"backend": "hyperoffload"})
        plan, budget = self._plan(program)
        plan = keep_backward_inputs_in_backward(plan, joint)
        forward_planned, backward_planned = split_lowered(lower_plan(plan), joint)
        return self._record(index=index, mode="train", program=program, plan=plan, budget=budget, start=start,
                            forward=forward_planned, backward=backward_planned, input_names=input_names, joint=joint)

    def _plan_inference(self, index: int, gm: torch.fx.GraphModule, names: Sequence[str]) -> CompiledGraph:
        start = time.perf_counter()
        placeholders = gm.graph.find_nodes(op="placeholder")
        static = set(_static_input_indices())
        kinds = [ValueKind.PARAMETER if i in static else ValueKind.INPUT for i in range(len(placeholders))]
        input_names = tuple(names) if len(names) == len(placeholders) else tuple(n.name for n in placeholders)
        program = program_from_graph(gm, kinds, name=f"graph {index}", mode="inference", input_names=input_names,
                                     meta={"backend": "hyperoffload"})
        plan, budget = self._plan(program)
        return self._record(index=index, mode="inference", program=program, plan=plan, budget=budget, start=start,
                            forward=lower_plan(plan), backward=None, input_names=input_names, joint=None)

    def _record(self, *, index: int, mode: str, program: Program, plan: Plan, budget: int, start: float,
                forward: torch.fx.GraphModule, backward: torch.fx.GraphModule | None, input_names: Sequence[str],
                joint: JointGraph | None) -> CompiledGraph:
        """Record a planned graph (``start``: ``time.perf_counter()`` when its planning began)."""
        plan_s = time.perf_counter() - start
        record = CompiledGraph(
            index=index, mode=mode, program=program, plan=plan, figures=simulate(plan, self.hardware).figures,
            budget_bytes=budget,
            unplanned_peak_bytes=memory_profile(program).peak_bytes, planned_peak_bytes=check_plan(plan).peak_bytes,
            plan_s=plan_s, forward=forward, backward=backward, input_names=tuple(input_names), joint=joint)
        self.compiled.append(record)
        return record


def _readable_name(placeholder: torch.fx.Node) -> str:
    """``layers.0.ffn.w2.weight`` for TorchDynamo's input from ``L['self']._modules['layers']._modules['0']...``,
    ``tokens`` for ``L['tokens']``; the placeholder's own name when TorchDynamo left no source."""
    source = getattr(placeholder.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    keys = [a or b for a, b in re.findall(r"\[(?:'([^']+)'|(\d+))\]", name)] if isinstance(name, str) else []
    if len(keys) > 1 and keys[0] in ("self", "fn"):  # the module itself (``fn`` when called through a wrapper)
        keys = keys[1:]
    return ".".join(keys) or placeholder.name


def _input_names(joint: JointGraph, names: Sequence[str]) -> list[str]:
    """TorchDynamo's placeholder names for the primals when they line up one to one, else aot's; tangents
    keep aot's names."""
    primals = list(names) if len(names) == len(joint.primals) else list(joint.primals)
    return [*primals, *joint.backward_inputs]


def _static_input_indices() -> list[int]:
    """Indices of the inputs aot_autograd knows to be parameters or buffers, for the graph being compiled."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    return list(getattr(metadata, "static_input_indices", None) or ())


def backend(budget: int | str = "50%", hardware: Hardware | str = "h100-sxm", policy: str = "hyperoffload", *,
            compiler: str = "eager", link: NativeLink | EmulatedLink | bool | None = None) -> Backend:
    """A ``torch.compile`` backend that plans offloads of each compiled step under ``budget``.

    ``torch.compile(model, backend=hyperoffload.backend(budget="50%", hardware="h100-sxm"))``: forward
    and backward are planned as one step (saved activations can leave the device after the forward
    and come back for the backward), the cache operators run inside the compiled graphs, and loss
    and gradients equal eager. ``budget`` is bytes, ``"40GiB"``, ``"50%"`` of the step's no-offload
    peak, or ``"hideable"``; ``hardware`` a profile or its name; ``policy`` a registered policy.
    ``compiler="inductor"`` compiles the planned graphs with Inductor (loss and gradients then equal
    ``torch.compile(model)``'s); ``"eager"`` runs them op by op. ``link`` (a ``NativeLink``, or an ``EmulatedLink``): the
    cache operators copy asynchronously on a client of it; by default (None) graphs on the CPU copy on a
    ``NativeLink`` of ``hardware``'s speed; ``link=False``: every copy synchronous on the compute thread (as graphs
    on a GPU copy for now).
    Bad values raise ``ValueError`` here (``TypeError`` for a budget that is neither an int nor text); a budget below what the policy can meet raises
    ``InfeasibleBudget`` when the graph is compiled (TorchDynamo wraps it in ``BackendCompilerFailed``).
    """
    check_budget_text(budget)
    get_policy(policy)
    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}; choose one of {', '.join(COMPILERS)}")
    synchronous = link is None or link is False
    if not synchronous and not isinstance(link, HOST_LINKS):
        raise TypeError(f"link must be a NativeLink or an EmulatedLink (hyperoffload.NativeLink.for_hardware(...)), "
                        f"False for synchronous copies, or None for the default; got {type(link).__name__}")
    copies = None if synchronous else cache_ops.AsyncCopies(client=link.client(), release_waits=True)
    return Backend(budget=budget, hardware=get_hardware(hardware) if isinstance(hardware, str) else hardware,
                   policy=policy, compiler=compiler, copies=copies, default_link=link is None)


__all__ = ["COMPILERS", "Backend", "CompiledGraph", "backend", "check_budget_text"]
