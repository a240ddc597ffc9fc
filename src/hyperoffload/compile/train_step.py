"""``hyperoffload.train_step``: the user's whole training step, optimizer included, planned under a budget and
compiled by Inductor.

``step = train_step(model, optimizer, loss_fn, example_batch, budget="50%", hardware="h100-sxm")`` then
``loss = step(batch)`` in the user's own loop. Making the step:

1. create the optimizer's state where it has none yet, as its first ``step()`` would
   (``whole_step.init_optimizer_state``);
2. trace forward, ``loss_fn(model, batch)``, backward and ``optimizer.step()`` into one graph
   (``whole_step.trace_whole_step``);
3. hand it to Inductor (``inductor.compile_planned``); on the functional graph Inductor is about to
   compile, move each parameter's and state's write-back to just after its update
   (``whole_step.write_back_early``), restore the phases (``whole_step.mark_phases``), convert it to a
   Program and plan parameters, gradients, optimizer state and activations jointly under the budget
   (``hyperoffload.plan``), lower the plan with the cache operators (``lower.lower_plan``), and let
   Inductor compile that.

Each call reads the learning rates from the optimizer's groups (a scheduler's changes count), runs the
compiled step on the model's and the optimizer's own tensors, which it updates in place, with the cache
operators copying on an emulated link's engines (a model on the CPU) or on CUDA side streams (a model on a GPU,
``runtime.cuda_copies``), and records what it measured in ``last``. State the plan keeps in remote memory
between steps is the model's (or optimizer's) own tensor, which holds it between calls (in page-locked host
memory on a GPU: ``placement``), so ``state_dict()`` and checkpoints read it as usual. A batch of other shapes, or a
changed optimizer setting other than the learning rate, makes the step trace and plan again, with a
warning saying why.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from hyperoffload import cache_ops
from hyperoffload.analysis import memory_profile
from hyperoffload.budgets import parse_budget
from hyperoffload.capture.graph_to_program import CaptureError, program_from_graph
from hyperoffload.capture.steps import _own_storages
from hyperoffload.compile.backend import check_budget_text
from hyperoffload.compile.gathered_waits import gathered_waits
from hyperoffload.compile.held_inputs import HELD_INPUT_PASSES
from hyperoffload.compile.inductor import PLANNED_GRAPH_CONFIG, KeepPlanOrder, compile_planned
from hyperoffload.compile.optimizers import hyperparameters, learning_rate, rule_for
from hyperoffload.compile.placement import input_devices, place_inputs, step_device
from hyperoffload.compile.step_guard import Snapshot, deferred_interrupts
from hyperoffload.compile.whole_step import (StepInputs, describe_inputs, flatten_batch, init_optimizer_state,
                                             is_tensor_leaf, mark_phases, read_written_back, trace_whole_step,
                                             write_back_early)
from hyperoffload.hardware import Hardware, as_hardware
from hyperoffload.ir import Program
from hyperoffload.lower import lower_plan
from hyperoffload.planning import plan_checked
from hyperoffload.instructions import COPIES_OUT
from hyperoffload.plans import Plan, check_plan, plan_without_offload
from hyperoffload.policies import InfeasibleBudget, get_policy
from hyperoffload.runtime import native_kernels
from hyperoffload.runtime.cuda_copies import CudaCopyStreams
from hyperoffload.runtime.device_peak import cuda_peak, device_peak
from hyperoffload.runtime.emulated_link import EmulatedLink
from hyperoffload.runtime.native_link import HOST_LINKS, NativeLink, host_link
from hyperoffload.simulate import Figures, simulate
from hyperoffload.units import format_bytes


WHOLE_STEP_CONFIG = MappingProxyType({**PLANNED_GRAPH_CONFIG, "pattern_matcher": False,
                                      "cpp.enable_loop_tail_vec": False})
"""``torch._inductor.config`` for a whole step, planned or not (``offload=False``), so that a plan's transfers do not
change what a kernel computes: the planned graphs' settings, and

* no pattern rewrites: they fuse a matrix product with the addition after it (``mm`` + ``add`` into ``addmm``,
  which rounds differently) depending on what else reads the product;
* no vectorized loop tails: a value a release makes Inductor store on its own (``release.live``) can leave a
  kernel's short inner loop (a loss over 8 classes, say) free of the integer ops that kept it scalar, and a
  vectorized ``exp`` rounds differently from ``std::exp``; with scalar tails such a loop runs scalar either way."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrialRuns:
    """How a planned step is made to stay within its budget as compiled: each plan is compiled and run once on
    copies of the state, measured, and planned again for less where Inductor's buffers held more than the plan
    counted (``train_step(..., trials=TrialRuns(...))``)."""

    max_plans: int = 4
    """Plans of one form of the step at most, each measured in a trial run; the k-th trial that holds more than the
    budget (but the last) is followed by planning again for k times that excess less (a plan for less room can
    have more of Inductor's own excess, so taking the excess off once each time need not converge; docs/compile.md
    has the case). After the last, a step still over its budget warns."""
    headroom_bytes: int = 4096
    """Bytes every plan leaves free under the budget, at most: one call of a compiled step was seen to hold a few
    hundred bytes more than its trial run, on a plan that met the budget to the byte (the cause is not found)."""
    headroom_share: float = 1 / 256
    """... and at most this share of the budget, so that a small budget keeps most of its room."""

    def __post_init__(self) -> None:
        if self.max_plans < 1:
            raise ValueError(f"TrialRuns.max_plans must be at least 1, got {self.max_plans}")
        if self.headroom_bytes < 0 or not 0 <= self.headroom_share < 1:
            raise ValueError(f"TrialRuns: headroom_bytes must be >= 0 and headroom_share in [0, 1), got "
                             f"{self.headroom_bytes} and {self.headroom_share}")

    def headroom(self, budget: int) -> int:
        """Bytes a plan for ``budget`` bytes leaves free under it."""
        return min(self.headroom_bytes, int(budget * self.headroom_share))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFigures:
    """What one call of a ``TrainStep`` measured (bytes, seconds)."""

    peak_bytes: int | None
    """Device-tier bytes held at the call's peak: the inputs resident on the device when it began plus the most
    bytes allocated at once during it. None when the step was made with ``measure=False``."""
    budget_bytes: int
    h2d_bytes: int
    """Bytes the call's prefetches copied to the device."""
    d2h_bytes: int
    """Bytes the call's offloads copied to remote memory."""
    wall_s: float
    """Wall time of the call (seconds)."""

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True, kw_only=True)
class _Compiled:
    """One traced, planned and compiled form of the step (a batch shape and the optimizer's settings)."""

    inputs: StepInputs
    hyperparameters: tuple[dict, ...]
    program: Program
    plan: Plan
    graph: torch.fx.GraphModule
    """The lowered graph Inductor compiled: the step in plan order with the cache operators."""
    run: Callable[..., Any]
    resident_bytes: int
    """Bytes of the input storages that start the step on the device (bytes)."""
    devices: tuple[torch.device, ...]
    """Where each flat input must be when the step is called (``placement.input_devices``)."""
    budget_bytes: int
    """The user's budget, resolved for this step (bytes)."""
    slack: int = 0
    """How much less than ``budget_bytes`` the plan was made for, after trial runs held more (bytes)."""
    trials: tuple[int, ...] = ()
    """Device bytes each trial run held at its peak, in order (the last is of this plan)."""


class TrainStep:
    """A user's training step planned under a budget; call it with a batch, get the loss. See ``train_step``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[nn.Module, Any], Any],
                 example_batch: Any, *, budget: int | str, hardware: Hardware | str, policy: str = "hyperoffload",
                 link: NativeLink | EmulatedLink | None = None, offload: bool = True, measure: bool = True,
                 rollback: bool = False, progress: Callable[[str], None] | None = None,
                 trials: TrialRuns | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch) -> loss, got {type(loss_fn).__name__}")
        rule_for(optimizer)
        check_budget_text(budget)
        get_policy(policy)
        self.hardware = as_hardware(hardware)
        if link is not None and not isinstance(link, HOST_LINKS):
            raise TypeError(f"link must be a NativeLink or an EmulatedLink, got {type(link).__name__}")
        self.device = step_device(model, flatten_batch(example_batch)[0], self.hardware)
        """The device the step computes on: the CPU (copies on an emulated link) or a CUDA GPU."""
        if link is not None and self.device.type != "cpu":
            raise ValueError(f"link= emulates a link between two pools of host memory for a step on the CPU; the "
                             f"model is on {self.device}, whose copies run over its own link: leave link out")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.budget, self.policy, self.offload, self.measure = budget, policy, offload, measure
        self.rollback = rollback
        self.trials = trials if trials is not None else TrialRuns()
        self._progress = progress if progress is not None else (lambda text: None)
        if self.device.type == "cpu":
            if (link is None or isinstance(link, NativeLink)) and not native_kernels.built():
                self._progress("building the native copy thread and the cache operators' C++ kernels (once per "
                               "machine and PyTorch version, a few seconds)")
            self.link: NativeLink | EmulatedLink | None = link if link is not None else host_link(self.hardware)
            client = self.link.client()
        else:
            self.link, client = None, CudaCopyStreams(self.device)
        self.copies = cache_ops.AsyncCopies(client=client, release_waits=True)
        self.last: StepFigures | None = None
        """What the latest call measured; None before the first call."""
        self._forms: dict[str, _Compiled] = {}
        self._current = self._compile(example_batch)

    # --- what was planned ---------------------------------------------------------------------------
    @property
    def program(self) -> Program:
        """The whole step as planned (the graph Inductor compiles, before the cache operators)."""
        return self._current.program

    @property
    def plan(self) -> Plan:
        """The verified plan of the latest form of the step."""
        return self._current.plan

    @property
    def graph(self) -> torch.fx.GraphModule:
        """The lowered graph Inductor compiled (the step in plan order, with the cache operators)."""
        return self._current.graph

    @property
    def figures(self) -> Figures:
        """The plan simulated on the hardware profile (seconds, bytes), with releases that stop the step until their
        offload has landed where its copies' runtime does so (on the CPU)."""
        return simulate(self.plan, self.hardware, release_waits=self.copies.release_waits and self.link is not None
                        ).figures

    @property
    def budget_bytes(self) -> int:
        """The budget (bytes; a percentage resolved against ``unplanned_peak_bytes``)."""
        return self._current.budget_bytes

    @property
    def unplanned_peak_bytes(self) -> int:
        """Device bytes the step needs with nothing offloaded (what a percentage budget is of)."""
        return memory_profile(self.program).peak_bytes

    def remote(self) -> dict[str, list[str]]:
        """Names of the values the plan keeps in remote memory between steps or sends there, by kind."""
        values = self.program.values
        storages = set(self.plan.initial_remote) | {i.target for i in self.plan.instructions if i.kind in COPIES_OUT}
        by_kind: dict[str, list[str]] = {}
        for s in sorted(storages):
            by_kind.setdefault(values[s].kind.value, []).append(values[s].name)
        return by_kind

    def report(self) -> str:
        """A few lines: the budget, the planned and unplanned peaks, what lives remote and the simulated step."""
        f = self.figures
        planned = check_plan(self.plan).peak_bytes
        lines = [f"train_step of {type(self.model).__name__} with {type(self.optimizer).__name__} on "
                 f"{self.hardware.name} ({self.plan.policy} policy)",
                 f"  budget {format_bytes(self.budget_bytes)}: planned peak {format_bytes(planned)}, "
                 f"{format_bytes(self.unplanned_peak_bytes)} with nothing offloaded",
                 f"  simulated step {f.step_s * 1e3:.3f} ms (compute {f.compute_s * 1e3:.3f} ms), "
                 f"{format_bytes(f.h2d_bytes)} to the device and {format_bytes(f.d2h_bytes)} to remote memory"]
        if self._current.slack:
            lines.append(f"  planned for {format_bytes(self.budget_bytes - self._current.slack)}: a trial run of the "
                         f"compiled step held {format_bytes(self._current.trials[0])}")
        initial = self.plan.initial_remote
        values = self.program.values
        kept = sum(values[s].alloc_bytes for s in initial)
        lines.append(f"  kept in remote memory between steps: {format_bytes(kept)} in {len(initial)} tensors")
        for kind, names in self.remote().items():
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            lines.append(f"  remote {kind}: {len(names)} ({shown})")
        if self.last is not None:
            peak = "not measured" if self.last.peak_bytes is None else format_bytes(self.last.peak_bytes)
            lines.append(f"  last call: {self.last.wall_s * 1e3:.1f} ms, device peak {peak}, "
                         f"{format_bytes(self.last.h2d_bytes)} in, {format_bytes(self.last.d2h_bytes)} out")
        return "\n".join(lines)

    # --- calling ------------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> torch.Tensor:
        """Run one training step on ``batch`` (shaped like the example); returns the loss (a detached tensor)."""
        tensors, spec, leaves = flatten_batch(batch)
        self._check_batch(tensors)
        compiled = self._form_for(batch, spec, leaves)
        flat = self._inputs(compiled, tensors)
        copies = self.copies
        h2d, d2h = copies.h2d_bytes, copies.d2h_bytes
        start = time.perf_counter()
        snapshot = Snapshot(flat[:compiled.inputs.state_tensors]) if self.rollback else None
        try:
            with deferred_interrupts():
                out, peak = self._run(compiled, flat, measure=self.measure)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the call's wall time covers its kernels and copies
        except BaseException as error:
            copies.drain()  # no copy touches the state any more
            if snapshot is not None:
                snapshot.restore()
                error.add_note("train_step: the step failed; the model and optimizer hold the state of the last "
                               "completed step again (rollback=True)")
            else:
                error.add_note("train_step: the step failed while running, so the model and optimizer may hold a "
                               "partly updated step; load the last checkpoint, or make the step with rollback=True "
                               "to have the state of the last completed step put back on failure")
            raise
        wall = time.perf_counter() - start
        self.last = StepFigures(peak_bytes=peak, budget_bytes=self.budget_bytes, h2d_bytes=copies.h2d_bytes - h2d,
                                d2h_bytes=copies.d2h_bytes - d2h, wall_s=wall)
        return out[0] if isinstance(out, (tuple, list)) else out

    def _run(self, compiled: _Compiled, flat: Sequence[torch.Tensor], *, measure: bool) -> tuple[Any, int | None]:
        """Call ``compiled`` on ``flat`` with the copies on this step's link; with ``measure``, also the device bytes
        held at its peak (the inputs resident at the start plus the most allocated at once), else None."""

        def call() -> Any:
            with cache_ops.copies_on(self.copies), torch.no_grad():
                return compiled.run(*flat)

        if not measure:
            return call(), None
        if self.link is None:
            out, held = cuda_peak(call, self.device)
            return out, compiled.resident_bytes + held
        with self.link.device_frees() as frees:
            out, peak = device_peak(call, extra_frees=frees)
        return out, compiled.resident_bytes + peak.peak_bytes

    def _check_batch(self, tensors: Sequence[torch.Tensor]) -> None:
        wrong = sorted({str(t.device) for t in tensors if t.device != self.device})
        if wrong:
            raise ValueError(f"the batch has tensors on {', '.join(wrong)}, but the step runs on {self.device}, "
                             f"where the model is: move the batch there")

    def _inputs(self, compiled: _Compiled, batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The flat inputs of one call of ``compiled``, each where the plan expects it (state kept in remote memory
        on a GPU is moved to host memory once, and stays there)."""
        flat = compiled.inputs.flat(self.optimizer, self._learning_rates(), _own_storages(batch))
        return place_inputs(compiled.inputs, self.optimizer, flat, compiled.devices)

    def _learning_rates(self) -> list[torch.Tensor]:
        """Each parameter group's learning rate now, as the step's 0-d float64 inputs."""
        return [torch.tensor(learning_rate(g), dtype=torch.float64, device=self.device)
                for g in self.optimizer.param_groups]

    # --- making the compiled step --------------------------------------------------------------------
    def _key(self, spec: Any, leaves: Sequence[Any]) -> str:
        """What a compiled form is traced for: the batch's structure and tensors, and the optimizer's settings."""
        return repr((spec, list(leaves), [hyperparameters(g) for g in self.optimizer.param_groups]))

    def _form_for(self, batch: Any, spec: Any, leaves: Sequence[Any]) -> _Compiled:
        """The compiled form for ``batch`` (flattened to ``spec`` and ``leaves``), made with a warning saying why
        when none fits."""
        key = self._key(spec, leaves)
        if key in self._forms:
            self._current = self._forms[key]
            return self._current
        same_batch = [f for f in self._forms.values() if f.inputs.batch_leaves == tuple(leaves)]
        if not same_batch:
            example = next(iter(self._forms.values()))
            why = (f"the batch's tensors are {_leaves_text(leaves)}, the example's were "
                   f"{_leaves_text(example.inputs.batch_leaves)}")
        else:
            settings = [hyperparameters(g) for g in self.optimizer.param_groups]
            old_settings = same_batch[-1].hyperparameters
            changed = sorted({k for new, old in zip(settings, old_settings) for k in new if new.get(k) != old.get(k)})
            why = f"the optimizer's {', '.join(changed) or 'parameter groups'} changed"
        warnings.warn(f"train_step: {why}; tracing and planning the step again for it", stacklevel=3)
        self._current = self._compile(batch)
        return self._current

    def _compile(self, batch: Any) -> _Compiled:
        """Trace, plan and compile the step for ``batch``'s shapes and the optimizer's settings.

        Planned steps are then run once on copies of the state, measured: where Inductor's buffers hold more than
        the plan counts (it materializes some values the plan treats as views, and lays out a few kernels'
        workspaces itself), the step is planned again for a budget smaller by the excess, up to
        ``self.trials.max_plans`` times in all, so that what runs stays within the budget."""
        init_optimizer_state(self.optimizer, rule_for(self.optimizer))
        inputs = describe_inputs(self.model, self.optimizer, batch)
        tensors, spec, leaves = flatten_batch(batch)
        flat = inputs.flat(self.optimizer, self._learning_rates(), _own_storages(tensors))
        # The step is traced with everything on its device (state an earlier plan kept in host memory comes back).
        flat = place_inputs(inputs, self.optimizer, flat, (self.device,) * len(flat))
        self._progress("tracing the step (forward, loss, backward, optimizer)")
        gm = trace_whole_step(self.model, self.optimizer, self.loss_fn, inputs, flat)
        compiled = self._compile_planned(gm, inputs, flat, slack=0, trials=())
        while self.offload:
            self._progress("a trial run, measuring the device bytes it holds (the state is put back after)")
            trial = self._inputs(compiled, tensors)
            snapshot = Snapshot(trial[:inputs.state_tensors])
            try:
                _, peak = self._run(compiled, trial, measure=True)
            finally:
                self.copies.drain()
                snapshot.restore()
            compiled = dataclasses.replace(compiled, trials=(*compiled.trials, peak))
            excess = peak - compiled.budget_bytes
            if excess <= 0:
                self._progress(f"the trial held {format_bytes(peak)} of {format_bytes(compiled.budget_bytes)}")
                break
            held = (f"the compiled step held {format_bytes(peak)} on the device, {format_bytes(excess)} over the "
                    f"budget of {format_bytes(compiled.budget_bytes)}")
            if len(compiled.trials) == self.trials.max_plans:
                warnings.warn(f"train_step: {held} after {self.trials.max_plans} plans; give a larger budget",
                              stacklevel=4)
                break
            self._progress(f"the trial held {format_bytes(peak)}, {format_bytes(excess)} over the budget: planning "
                           f"again for {'that' if len(compiled.trials) == 1 else f'{len(compiled.trials)} times that'} "
                           f"much less")
            try:
                # Each plan's own excess differs: take the k-th excess off k times, so the loop converges.
                compiled = self._compile_planned(gm, inputs, flat, slack=compiled.slack + excess * len(compiled.trials),
                                                 trials=compiled.trials)
            except InfeasibleBudget:
                warnings.warn(f"train_step: {held}, and no plan with that much less room exists; give a larger "
                              f"budget", stacklevel=4)
                break
        self._forms[self._key(spec, leaves)] = compiled
        return compiled

    def _compile_planned(self, gm: torch.fx.GraphModule, inputs: StepInputs, flat: Sequence[torch.Tensor], *,
                         slack: int, trials: tuple[int, ...]) -> _Compiled:
        planned: dict[str, Any] = {}

        def plan_graph(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
            program = self._program(graph, inputs)
            budget = parse_budget(self.budget, program, self.hardware)
            if self.offload and budget - slack < 1:
                raise InfeasibleBudget(f"a budget of {budget - slack} bytes leaves no room",
                                       memory_profile(program).peak_bytes)
            room = budget - slack - self.trials.headroom(budget)
            self._progress(f"planning {len(program.ops)} ops for {format_bytes(room)} on {self.hardware.name}"
                           if self.offload else f"{len(program.ops)} ops, nothing planned (offload=False)")
            if not self.offload:
                plan = plan_without_offload(program)
            else:
                try:
                    plan = self._plan(program, room)
                except InfeasibleBudget:  # the headroom is what makes it infeasible: the budget itself may not be
                    plan = self._plan(program, budget - slack)
            planned.update(program=program, plan=plan, graph=lower_plan(plan, send_home=True), budget=budget)
            self._progress("compiling with Inductor")
            return planned["graph"]

        run = compile_planned(gm, flat, partition=_never_partitioned, plan_inference=plan_graph,
                              finish=lambda graph, compiled: compiled, settings=WHOLE_STEP_CONFIG,
                              choices=lambda graph: KeepPlanOrder())
        program, plan = planned["program"], planned["plan"]
        values = program.values
        inputs_storages = {values[v].storage for v in program.inputs}
        resident = sum(values[s].alloc_bytes for s in inputs_storages - set(plan.initial_remote))
        settings = tuple(hyperparameters(g) for g in self.optimizer.param_groups)
        return _Compiled(inputs=inputs, hyperparameters=settings, program=program, plan=plan, graph=planned["graph"],
                         run=run, resident_bytes=resident, devices=input_devices(program, plan, self.device),
                         budget_bytes=planned["budget"], slack=slack, trials=trials)

    def _program(self, graph: torch.fx.GraphModule, inputs: StepInputs) -> Program:
        graph = mark_phases(read_written_back(write_back_early(graph)))
        placeholders = graph.graph.find_nodes(op="placeholder")
        if len(placeholders) != len(inputs.kinds):
            raise CaptureError(f"Inductor's graph of the step has {len(placeholders)} inputs where the step has "
                               f"{len(inputs.kinds)}; the step cannot be planned")
        return program_from_graph(graph, inputs.kinds, name=type(self.model).__name__, mode="train",
                                  input_names=inputs.names,
                                  meta={"mode": "train", "optimizer": type(self.optimizer).__name__.lower()})

    def _plan(self, program: Program, budget: int) -> Plan:
        return plan_checked(program, self.hardware, budget, policy=self.policy,
                            passes=(*HELD_INPUT_PASSES, gathered_waits), simulate=False).plan


def _never_partitioned(*args, **kwargs):
    raise AssertionError("a whole training step has no autograd left for Inductor to partition")


def _leaves_text(leaves: Sequence[Any]) -> str:
    return ", ".join(f"{dtype}{list(shape)}" for shape, dtype, _ in filter(is_tensor_leaf, leaves))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[nn.Module, Any], Any],
               example_batch: Any, *, budget: int | str = "50%", hardware: Hardware | str = "h100-sxm",
               policy: str = "hyperoffload", link: NativeLink | EmulatedLink | None = None, offload: bool = True,
               measure: bool = True, rollback: bool = False,
               progress: Callable[[str], None] | None = None, trials: TrialRuns | None = None) -> TrainStep:
    """The user's whole training step, planned under ``budget`` and compiled by Inductor.

    ``loss_fn(model, batch)`` returns the loss; ``example_batch`` is any tree of tensors the step will be called
    with (``step(batch)``); ``optimizer`` a ``torch.optim`` AdamW, Adam or SGD over the model's parameters.
    ``budget``: bytes, ``"40GiB"``, ``"50%"`` of the step's no-offload peak, or ``"hideable"``; ``hardware``: the
    profile planned for, whose link the copies are emulated at for a model on the CPU (``link=`` to give another;
    a model on a CUDA GPU copies over its own link, on side streams). ``offload=False``
    compiles the same step with nothing planned (plain Inductor), to compare against. ``measure`` records each
    call's device peak in ``step.last`` (on the CPU through PyTorch's profiler: turn it off to time steps; on a GPU
    from the caching allocator's counters). A Ctrl-C during a call takes effect once the call has completed; a call that fails while running (a failed copy, memory running
    out) leaves the state partly updated unless ``rollback=True``, which copies the state the step writes before
    each call (that many bytes more copying per step) and puts it back on failure. ``progress(text)``
    hears what making the step is doing (tracing, planning, compiling, trial runs; ``print`` will do), which takes
    tens of seconds on a small model, and again when a new batch shape or setting makes it plan again. ``trials``
    (a ``TrialRuns``) says how many plans a step may take to fit its budget as compiled, and what room each leaves.
    """
    return TrainStep(model, optimizer, loss_fn, example_batch, budget=budget, hardware=hardware, policy=policy,
                     link=link, offload=offload, measure=measure, rollback=rollback, progress=progress,
                     trials=trials)


__all__ = ["StepFigures", "TrainStep", "TrialRuns", "train_step"]
