"""``hyperoffload.train_step`` against eager PyTorch and ``torch.compile`` on whole training steps (CPU only).

For each model (LLaMA-style decoders built from ``LlamaConfig`` with random weights: ``tiny-llama``, and
``llama-h256``, 4 layers of width 256), trained with ``torch.optim.AdamW`` on one batch shape and a few
different random batches, all measured in this one run:

* ``eager_s``: median step of eager PyTorch (``loss = loss_fn(model, batch); loss.backward();
  optimizer.step(); optimizer.zero_grad()``);
* ``inductor_s``: the same loop with the model under plain ``torch.compile`` (Inductor), the optimizer eager;
* ``train_step_100_s``: median call of ``train_step(..., budget="100%", measure=False)``;
* ``train_step_50_s``: median call of ``train_step(..., budget="50%", measure=False)`` planned on the
  ``cpu-emulated`` profile with its link at half the rate the link's one copy thread moved bytes at while a first
  50% plan's step ran in the calibration rounds (``copy_rate_in_step``; ``link_bw``): the copies of both
  directions move on the one thread of a ``NativeLink``, so that is the fastest duplex link it keeps the timing of
  when both directions are busy (half of ``copy_bw``, the rate the host copies memory at by the profile's
  calibration, plans that first step; ``--isolated-issue`` keeps it); its copies on a ``NativeLink`` of that
  profile (same bandwidth and
  latency), so simulator and link agree; each copy on it costs a GPU's per-copy latency (``GPU_LINK``'s
  ``h2d_latency_s``; ``--latency``). The simulator's copy stalls at that speed (``stall_copy_50_s``) say whether it
  hides the copies: the compute stream never waits for one when they are 0 (``--link`` gives the speed instead).
  The profile is fitted to the compiled step before planning (``calibrated_profile``): the external kernels
  Inductor calls (matrix products, attention) are charged what PyTorch's profiler measured them at in the
  unplanned compiled step (``extern_op_costs``), and every other op's one-op-at-a-time cost is scaled
  (``compute_scale``) so that the unplanned step simulates at its median time, measured in interleaved rounds
  with the eager and ``torch.compile`` loops as the timed rounds run it. Its ``issue_s`` is what one cache
  instruction costs a compiled step (``calibrated_in_rounds``: a first 50% plan's graph with copies that move
  nothing, less the unplanned step, per cache instruction, in those rounds, and never less than what one operator
  call costs alone, ``cache_op_issue_s``, reported as ``isolated_issue_s``; ``--isolated-issue``: that alone),
  which the simulator charges
  the compute stream per cache instruction and the planner weighs;
* ``sim_50_s``: that step's plan simulated on the profile fitted again, the same way, to the unplanned step's
  median in the timed rounds (``compute_scale_timed``; the machine's speed drifts from one set of rounds to the
  next), ``exposed_50_s`` the part of it that is not compute (copy stalls and the cache instructions' ``issue_s``),
  ``stall_copy_50_s`` the compute stream's waits for copies; ``sim_50_planned_s``: the step's own figure
  (``step.figures``, on the profile it was planned with);
* ``interpreter_50_s``: the same plan run by the project's plan interpreter (``AsyncExecutor.run``, one op at
  a time, in place on copies of the step's inputs) on an emulated link of the same speed; null, with
  ``interpreter_error`` saying why, if it cannot run;
* ``measured_peak_bytes``: device-tier bytes of one call of the 50% step with its peak measured (the profiler
  is on for that call only), against ``budget_bytes``;
* ``max_abs_diff``: the largest absolute difference of parameters between the 50% step and
  ``train_step(..., offload=False)`` after the same calls on the same batches from the same initial weights
  (``max_abs_diff_state``: the same over the optimizer's state);
* ``breakdown_s``: the same compiled 50% step run five more ways on copies of its inputs (``BREAKDOWN``), in rounds
  of their own with the unplanned step (``breakdown_train_step_100_s``), so that the headline variants run in the
  company the profile was fitted in: with
  cache operators that move nothing, with the cache operators' Python kernels instead of their C++ ones, with every
  copy synchronous on the step's thread, on a 10 TB/s ``NativeLink`` and on an ``EmulatedLink`` (Python copy
  threads) of the link's speed;
* ``in_step_issue_s``: what one cache instruction of the 50% step's own plan costs it (``same_plan_no_copies``
  less ``train_step_100`` in the breakdown's rounds, per cache instruction), and ``sim_50_in_step_issue_s`` /
  ``sim_error_in_step_issue``: the plan simulated with that ``issue_s`` and its error against the measured step
  (the targets use the ``issue_s`` the plan was made with);
* ``blocked_50_s``: the median seconds per call the 50% step's thread spent blocked in ``wait`` (``waits``) and in
  ``release`` waiting for the offload still reading the storage (``releases``), over the timed rounds;
* ``page_faults``: the median minor page faults of the process during one step of each variant (new pages touched,
  on any thread). The run first calls ``hyperoffload.keep_freed_host_memory()`` (``--default-malloc``: not), so
  that freed buffers are handed out again rather than faulted in anew each step, for every variant alike;
* the ratios ``train_step_100_s / inductor_s`` (target <= 1.05), ``train_step_50_s / inductor_s`` (<= 1.10),
  ``train_step_50_s / sim_50_s`` (``sim_error = |sim - wall| / wall`` <= 0.15), peak <= budget and diff 0.

Steps run in interleaved rounds (one step of each variant per round: the eager, ``torch.compile`` and
``train_step`` variants in one set of rounds, the interpreter and the breakdown's in another), so load from other
work on a shared machine falls on every variant of a set alike; each median is over ``--steps`` rounds after ``--warmup``. Compile
times (``compile_s``) are the first call or construction of each variant. ``load_avg`` (1-minute load average)
is read after each model's timed rounds; wall times move with it.

``--json`` prints one object instead of the table::

    {"config": {"steps", "warmup", "threads", "budget", "policy", "batches", "link_bw", "link_latency_s",
                "keep_freed_memory", "in_step_issue"},
     "load_avg": [1-, 5-, 15-minute load average at the end],
     "models": {name: {"batch", "seq", "parameters", "eager_s", "inductor_s", "train_step_100_s",
                       "train_step_50_s", "sim_50_s", "exposed_50_s", "stall_copy_50_s", "compute_50_s",
                       "interpreter_50_s",
                       "interpreter_error", "link_bw", "link_latency_s", "copy_bw", "compute_scale", "issue_s",
                       "isolated_issue_s", "extern_op_signatures", "copy_rate_in_step", "measured_peak_bytes", "budget_bytes",
                       "unplanned_peak_bytes", "h2d_bytes", "d2h_bytes", "max_abs_diff", "max_abs_diff_state",
                       "load_avg", "compile_s": {variant: s}, "breakdown_s": {variant: s}, "breakdown_train_step_100_s", "cache_instructions",
                       "in_step_issue_s", "sim_50_in_step_issue_s", "sim_error_in_step_issue",
                       "page_faults": {variant: faults}, "blocked_50_s": {"waits", "releases"},
                       "ratios": {name: x},
                       "targets": {name: bool}}}}

Times in seconds, bytes in bytes, ``link_bw`` in bytes/s. Progress goes to stderr. Usage:
``.venv/bin/python bench/native.py [--quick] [--steps 15] [--warmup 2] [--threads 1] [--json]``
(``--quick``: ``tiny-llama`` only, 3 steps after 1 warm-up).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import hyperoffload
from hyperoffload import cache_ops
from hyperoffload.commands import cpu_cache_path
from hyperoffload.compile.optimizers import learning_rate
from hyperoffload.compile.train_step import TrainStep
from hyperoffload.compile.gathered_waits import EXTERN_OPS
from hyperoffload.compile.whole_step import flatten_batch
from hyperoffload.cost import op_signature, op_times, with_measured_op_costs
from hyperoffload.hardware import Hardware, get_hardware
from hyperoffload.plans import Kind
from hyperoffload.runtime import AsyncExecutor, EmulatedLink
from hyperoffload.runtime.emulated_link import D2H, H2D
from hyperoffload.runtime.native_link import NativeLink
from hyperoffload.simulate import simulate
from hyperoffload.units import format_bandwidth, format_bytes, parse_bandwidth, parse_duration
from hyperoffload.workloads import Llama, LlamaConfig, get_workload


BREAKDOWN = {
    "same_plan_no_copies": "cache operators that move nothing (results wrong): the graph, the calls, their buffers",
    "same_plan_python_kernels": "the cache operators' Python kernels, on the 10 TB/s NativeLink below",
    "same_plan_sync_copies": "every copy on the step's own thread when issued (no link)",
    "same_plan_fast_link": "a NativeLink at 10 TB/s: copies as fast as the copy thread can move them",
    "same_plan_python_link": "an EmulatedLink of the same speed: copies on two Python threads",
}
"""The 50% step's compiled graph (the same plan) run other ways, on copies of its inputs, in the same rounds: where
its time goes beyond the unplanned step's."""

GPU_LINK = "h100-sxm"
"""The profile whose per-copy latency the 50% step's link has by default (an asynchronous copy's fixed cost on a
GPU, with its source in the profile)."""

TARGETS = {"train_step_100 / inductor": 1.05, "train_step_50 / inductor": 1.10, "sim_error": 0.15}
"""Upper bounds of the ratios (``sim_error = |sim_50_s - train_step_50_s| / train_step_50_s``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model of the benchmark and the batch shape it is trained on."""

    name: str
    config: LlamaConfig
    batch: int
    """Sequences per step."""
    seq: int
    """Tokens per sequence."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """How the benchmark runs."""

    steps: int
    """Timed rounds (one step of every variant each) after warm-up."""
    warmup: int
    """Untimed rounds first."""
    threads: int
    """Compute threads (the rest of the cores are left to the emulated link's copy threads)."""
    budget: str = "50%"
    policy: str = "hyperoffload"
    batches: int = 4
    """Different random batches, used in turn."""
    link_bw: float | None = None
    """Link speed of the 50% step (bytes/s each way); None: ``link_share`` of the rate the copy thread moves bytes at
    inside a planned step (``copy_rate_in_step``; ``copy_bw`` with ``in_step_issue`` off)."""
    link_share: float = 0.5
    """The share of that rate each direction of the 50% step's link gets: both directions' copies move on the one
    thread, so 0.5 is the fastest duplex link it keeps the timing of on average, and bursts of copies in both
    directions at once find it late by up to a copy's ``memmove``."""
    link_latency_s: float | None = None
    """Fixed cost of each copy on that link before its bytes move (seconds); None: a GPU's (``GPU_LINK``'s), where
    ``cpu-emulated``'s default (a Python thread's hand-off) is several times what the native copy thread costs."""
    keep_freed_memory: bool = True
    """Whether the run calls ``hyperoffload.keep_freed_host_memory()`` first (every variant runs in this process, so
    all get the same malloc settings)."""
    in_step_issue: bool = True
    """Whether the 50% step is planned with ``issue_s`` priced in a step (``cache_instruction_cost_in_step``, on a
    first plan made with the isolated price) rather than alone (``cache_op_issue_s``)."""


def model_specs() -> dict[str, ModelSpec]:
    tiny = get_workload("tiny-llama")
    wide = LlamaConfig(vocab_size=tiny.config.vocab_size, hidden=256, ffn=704, layers=4, heads=8, kv_heads=4)
    return {"tiny-llama": ModelSpec(name="tiny-llama", config=tiny.config, batch=tiny.batch, seq=tiny.seq),
            "llama-h256": ModelSpec(name="llama-h256", config=wide, batch=tiny.batch, seq=tiny.seq)}


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {text}", file=sys.stderr, flush=True)


# --- the user's side: model, loss, batches, the eager loop ------------------------------------------------------
def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross entropy over every position."""
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, -2), targets.flatten())


def random_batches(spec: ModelSpec, count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (spec.batch, spec.seq)
    vocab = spec.config.vocab_size
    return [(torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen))
            for _ in range(count)]


def with_adamw(model: nn.Module) -> tuple[nn.Module, torch.optim.AdamW]:
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def eager_loop_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    loss = lm_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


# --- calibrating the profile to the compiled step -------------------------------------------------------------------
def extern_op_costs(full: TrainStep, batches: list, calls: int = 3) -> dict[str, float]:
    """Seconds per call of each external kernel of the unplanned compiled step (``full``), by op signature
    (``cost.op_signature``): the ops of its program that Inductor runs as library calls (``EXTERN_OPS``: matrix
    products, attention), timed by PyTorch's profiler over ``calls`` steps and matched to the program's ops by
    name and input shapes. Inductor fuses every other op into kernels of its own, which have no one op's time."""
    for i in range(2):  # warm: the first calls after compiling fault in memory
        full(batches[i % len(batches)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(calls):
            full(batches[i % len(batches)])
    seconds: dict[tuple[str, tuple], float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key.startswith("aten::"):
            shapes = tuple(tuple(shape) for shape in event.input_shapes if shape)
            seconds[(event.key, shapes)] = event.cpu_time_total / 1e6 / event.count
    program = full.plan.program
    costs: dict[str, float] = {}
    for op in program.ops:
        if not op.target.startswith(EXTERN_OPS):
            continue
        name = "aten::" + op.target.split(".")[1]
        inputs = tuple(tuple(program.values[v].shape) for v in op.inputs)
        for (key, shapes), per_call in seconds.items():
            if key == name and shapes[:len(inputs)] == inputs:
                costs[op_signature(op, program)] = per_call
                break
    return costs


def calibrated_profile(base: Hardware, full: TrainStep, extern_costs: dict[str, float],
                       full_s: float) -> tuple[Hardware, float]:
    """``base`` fitted to the compiled step, and the factor its other ops were scaled by: each external kernel
    charged its measured time (``extern_op_costs``, as ``with_measured_op_costs``), and every other op scaled
    (``scaled_compute``) so that the unplanned step (``full``) simulates at its measured ``full_s``. One factor
    for the whole step would charge Inductor's fused elementwise kernels as the one-op-at-a-time model prices
    them, far more than they take beside the matrix products, and place the plan's transfers against the wrong
    stretches of compute."""
    program = full.plan.program
    signatures = [op_signature(op, program) for op in program.ops]
    extern = sum(extern_costs.get(sig, 0.0) for sig in signatures)
    rest = sum(t for sig, t in zip(signatures, op_times(program, base)) if sig not in extern_costs)
    scale = max(full_s - extern, 0.1 * full_s) / rest
    return with_measured_op_costs(scaled_compute(base, scale), extern_costs), scale


def median_step_s(step: TrainStep, batches: list, warmup: int = 3, calls: int = 9) -> float:
    """Median seconds of ``calls`` calls of ``step`` after ``warmup`` uncounted ones (a freshly compiled step's first
    calls fault in new memory and run measurably slower than the steady state the benchmark times)."""
    walls = []
    for i in range(warmup + calls):
        start = time.perf_counter()
        step(batches[i % len(batches)])
        walls.append(time.perf_counter() - start)
    return statistics.median(walls[warmup:])


@dataclass(frozen=True, slots=True, kw_only=True)
class InStep:
    """What ``calibrated_in_rounds`` measured."""

    full_s: float
    """Median seconds of the unplanned compiled step."""
    issue_s: float
    """Seconds one cache instruction costs a compiled step."""
    copy_rate: float
    """Bytes per second the link's copy thread moved while a planned step ran (bytes over the seconds its
    ``memmove`` calls took, both directions together)."""


def calibrated_in_rounds(full: TrainStep, planned: TrainStep, others: dict[str, Callable], batches: list,
                         warmup: int = 2, calls: int = 7) -> InStep:
    """The compiled steps measured as the benchmark times them: in interleaved rounds with the other variants
    (``others``), which leave the caches as the timed rounds will. ``full_s`` is the median of ``full`` (the
    unplanned compiled step); ``issue_s`` is what one cache instruction costs a compiled step: ``planned``'s
    compiled graph run with copies that move nothing (``no_copies``), less ``full``, per cache instruction of
    ``planned``'s plan. Beyond the operator call itself (``cache_op_issue_s``), that holds what the step pays
    around it: the generated code's checks, the buffers the copies write, and the fused kernels a wait or a
    release splits. ``copy_rate`` is how fast ``planned``'s own ``NativeLink`` moved bytes while it ran in those
    rounds: its copy thread shares the machine's memory system with the step's compute."""
    nothing_moved = fast_link()
    variants = {**others, "full": full, "no_copies": SamePlan(planned, no_copies(nothing_moved), batches[0]),
                "planned": planned}
    link, copies = planned.link, planned.copies

    def moved() -> tuple[int, float]:
        return (copies.h2d_bytes + copies.d2h_bytes, link.moving_s(H2D) + link.moving_s(D2H))

    before = moved()
    walls, _ = run_rounds(variants, batches, BenchConfig(steps=calls, warmup=warmup, threads=1), [])
    copies.drain()
    nothing_moved.close()
    after = moved()
    full_s = statistics.median(walls["full"])
    return InStep(full_s=full_s, issue_s=per_cache_instruction(statistics.median(walls["no_copies"]), full_s, planned),
                  copy_rate=(after[0] - before[0]) / max(after[1] - before[1], 1e-9))


def cache_instructions(step: TrainStep) -> int:
    """The cache instructions (every kind but compute) of ``step``'s plan."""
    return sum(1 for i in step.plan.instructions if i.kind is not Kind.COMPUTE)


def per_cache_instruction(no_copies_s: float, full_s: float, planned: TrainStep) -> float:
    """Seconds ``planned``'s graph with copies that move nothing takes over the unplanned step's ``full_s``, per
    cache instruction of its plan (0 when the rounds find it no slower)."""
    return max(0.0, no_copies_s - full_s) / max(cache_instructions(planned), 1)


def cache_op_issue_s(calls: int = 200, repeats: int = 5) -> float:
    """Seconds one cache operator call costs the thread that runs the compiled step (the Python call, issuing the
    copy to an engine thread, the bookkeeping): offload, wait, release, prefetch and wait of a 4 KiB tensor on a
    1 TB/s emulated link, where each copy has landed by its wait; per call, the best of ``repeats``."""
    ops = torch.ops.hyperoffload
    link = NativeLink(h2d_bw=1e12, d2h_bw=1e12)
    copies = step_copies(link.client())
    x = torch.ones(1024)
    best = float("inf")
    with cache_ops.copies_on(copies), torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                remote = ops.wait.default(ops.offload.default(x))
                ops.release.default(x)
                ops.wait.default(ops.prefetch.default(remote))
            best = min(best, (time.perf_counter() - start) / (5 * calls))
    link.close()
    return best


def scaled_compute(hardware: Hardware, scale: float) -> Hardware:
    """``hardware`` whose every op takes ``scale`` times as long (FLOP rates and memory bandwidth divided by it,
    launch overhead multiplied), its link unchanged."""
    return hardware.replace(peak_flops={k: v / scale for k, v in hardware.peak_flops.items()},
                            hbm_bw=hardware.hbm_bw / scale, launch_s=hardware.launch_s * scale)


# --- the 50% step's plan run other ways: the interpreter, and the compiled graph on other copy clients -------------
class OwnInputs:
    """Copies of a step's flat inputs (``program.inputs`` order: ``step._current.inputs.flat(optimizer, lrs, batch
    tensors)``), so that running its plan another way leaves the step's own state alone; the batch's slots are
    refilled each call."""

    def __init__(self, step: TrainStep, batch) -> None:
        tensors, _, _ = flatten_batch(batch)
        self.batch_count = len(tensors)
        lrs = [torch.tensor(learning_rate(g), dtype=torch.float64) for g in step.optimizer.param_groups]
        self.flat = [t.detach().clone() for t in step._current.inputs.flat(step.optimizer, lrs, tensors)]

    def with_batch(self, batch) -> list[torch.Tensor]:
        tensors, _, _ = flatten_batch(batch)
        self.flat[len(self.flat) - self.batch_count:] = tensors
        return self.flat


class InterpretedStep:
    """``step.plan`` run by ``AsyncExecutor`` on its own copies of the step's inputs (``program.inputs`` order:
    ``step._current.inputs.flat(optimizer, lrs, batch tensors)``), each call on the next batch.

    Each call runs in place (``AsyncExecutor.run``), as ``train_step`` runs its compiled step on the model's own
    tensors: the plan leaves some state in another tier than it starts in (what it keeps remote between steps is
    written back to the caller's tensor), so donated steps (``AsyncExecutor.step``) refuse it."""

    def __init__(self, step: TrainStep, link: NativeLink, batch) -> None:
        self.plan = step.plan
        self.executor = AsyncExecutor(link)
        self.inputs = OwnInputs(step, batch)

    def __call__(self, batch) -> None:
        self.executor.run(self.plan, self.inputs.with_batch(batch))

    def close(self) -> None:
        self.executor.close()


def fast_link() -> NativeLink:
    """A link so fast that a copy takes what the copy thread's ``memmove`` takes (10 TB/s, no latency)."""
    return NativeLink(h2d_bw=1e13, d2h_bw=1e13)


def step_copies(client, **options) -> cache_ops.AsyncCopies:
    """Cache operators on ``client`` as a step runs them (releases wait for their offloads), with ``options``."""
    return cache_ops.AsyncCopies(client=client, release_waits=True, **options)


def no_copies(link: NativeLink) -> cache_ops.AsyncCopies:
    """Cache operators on ``link`` that issue and time every copy but move no bytes (``move_bytes=False``). Results
    are wrong; the time of a step run on them is everything but the bytes moving (the compiled graph, the cache
    operators' calls, the buffers they allocate)."""
    return step_copies(link.client(), move_bytes=False)


class BlockedPerCall:
    """``step`` (a planned ``TrainStep``) called as it is, recording per call the seconds its thread spent blocked in
    ``wait`` and in ``release`` (for an offload still reading the storage)."""

    def __init__(self, step: TrainStep) -> None:
        self.step = step
        self.calls: list[tuple[float, float]] = []

    def __call__(self, batch):
        copies = self.step.copies
        before = (copies.wait_s, copies.release_wait_s)
        out = self.step(batch)
        self.calls.append((copies.wait_s - before[0], copies.release_wait_s - before[1]))
        return out

    def medians(self, skip: int) -> dict[str, float]:
        """The median seconds per call blocked in waits and in releases, over the calls after the first ``skip``."""
        timed = self.calls[skip:]
        return {"waits": statistics.median(c[0] for c in timed), "releases": statistics.median(c[1] for c in timed)}


class SamePlan:
    """The 50% step's compiled graph run on copies of its inputs (so the step's own state is not touched), with its
    cache operators on ``copies`` (None: synchronous copies on the step's thread), each call on the next batch."""

    def __init__(self, step: TrainStep, copies: cache_ops.AsyncCopies | None, batch) -> None:
        self.run = step._current.run
        self.copies = copies
        self.inputs = OwnInputs(step, batch)

    def __call__(self, batch) -> None:
        inputs = self.inputs.with_batch(batch)
        with cache_ops.copies_on(self.copies), torch.no_grad():
            self.run(*inputs)


def breakdown_variants(half: TrainStep, hardware: Hardware, example) -> tuple[dict[str, SamePlan], list]:
    """The 50% step's plan run five more ways (``BREAKDOWN``); returns them and the links to close afterwards."""
    links = [fast_link(), EmulatedLink.for_hardware(hardware)]
    variants = {"same_plan_no_copies": SamePlan(half, no_copies(links[0]), example),
                "same_plan_python_kernels": SamePlan(half, step_copies(links[0].client(), native_kernels=False),
                                                     example),
                "same_plan_sync_copies": SamePlan(half, None, example),
                "same_plan_fast_link": SamePlan(half, step_copies(links[0].client()), example),
                "same_plan_python_link": SamePlan(half, step_copies(links[1].client()), example)}
    return variants, links


# --- measuring -----------------------------------------------------------------------------------------------------
def timed_first(make: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    made = make()
    return made, time.perf_counter() - start


def run_rounds(variants: dict[str, Callable[[object], object]], batches: list, cfg: BenchConfig,
               order: list[int]) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Interleaved rounds: each round one step of every variant on the same batch; returns the timed walls and the
    minor page faults of the process during each timed step (new pages the step touched, on any thread)."""
    walls: dict[str, list[float]] = {name: [] for name in variants}
    faults: dict[str, list[int]] = {name: [] for name in variants}
    gc.collect()
    gc.freeze()  # long-lived graphs and plans: the cyclic collector would rescan them during the steps
    try:
        for k in range(cfg.warmup + cfg.steps):
            batch = batches[k % len(batches)]
            order.append(k % len(batches))
            for name, call in variants.items():
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                call(batch)
                wall = time.perf_counter() - start
                if k >= cfg.warmup:
                    walls[name].append(wall)
                    faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    finally:
        gc.unfreeze()
    return walls, faults


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x.detach().double() - y.detach().double()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


def max_state_diff(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> float:
    worst = 0.0
    params_a = (p for g in a.param_groups for p in g["params"])
    params_b = (p for g in b.param_groups for p in g["params"])
    for pa, pb in zip(params_a, params_b):
        for key, value in a.state[pa].items():
            if isinstance(value, torch.Tensor):
                worst = max(worst, (value.double() - b.state[pb][key].double()).abs().max().item())
    return worst


def bench_model(spec: ModelSpec, cfg: BenchConfig, base: Hardware) -> dict:
    torch.manual_seed(0)
    initial = Llama(spec.config)
    batches = random_batches(spec, cfg.batches)
    example = batches[0]
    compile_s: dict[str, float] = {}

    def stage(text: str) -> None:
        progress(f"{spec.name}:   {text}")

    eager_model, eager_opt = with_adamw(copy.deepcopy(initial))
    compiled_model, compiled_opt = with_adamw(copy.deepcopy(initial))
    compiled_forward = torch.compile(compiled_model)
    progress(f"{spec.name}: torch.compile(model) (first step compiles)")
    _, compile_s["inductor"] = timed_first(lambda: eager_loop_step(compiled_forward, compiled_opt, example))

    progress(f"{spec.name}: train_step at 100%")
    full, compile_s["train_step_100"] = timed_first(lambda: hyperoffload.train_step(
        *with_adamw(copy.deepcopy(initial)), lm_loss, example, budget="100%", hardware=base, policy=cfg.policy,
        measure=False, progress=stage))
    copy_bw = base.hbm_bw / 2  # an engine's copy reads and writes every byte: the fastest link it can emulate
    extern_costs = extern_op_costs(full, batches)
    base_unfitted = base
    base, scale = calibrated_profile(base_unfitted, full, extern_costs, median_step_s(full, batches))
    isolated_issue = cache_op_issue_s()
    copy_rate = copy_bw
    progress(f"{spec.name}: {len(extern_costs)} external kernels charged their measured times, the other ops "
             f"{1 / scale:.2f}x as fast as the profile's per-op model: planning on that")
    progress(f"{spec.name}: a cache operator call costs the step's thread {isolated_issue * 1e6:.1f} us alone")
    bw = cfg.link_bw if cfg.link_bw is not None else copy_bw * cfg.link_share  # both directions share the thread
    latency = cfg.link_latency_s if cfg.link_latency_s is not None else get_hardware(GPU_LINK).h2d_latency_s
    link = {"h2d_bw": bw, "d2h_bw": bw, "h2d_latency_s": latency, "d2h_latency_s": latency}
    hardware = base.replace(issue_s=isolated_issue, **link)

    def planned(on: Hardware) -> TrainStep:
        return hyperoffload.train_step(*with_adamw(copy.deepcopy(initial)), lm_loss, example, budget=cfg.budget,
                                       hardware=on, policy=cfg.policy, link=NativeLink.for_hardware(on),
                                       measure=False, progress=stage)

    issue = isolated_issue
    if cfg.in_step_issue:
        progress(f"{spec.name}: train_step at {cfg.budget}, planned with that, to price a cache instruction in a step")
        calibration, compile_s["calibration_50"] = timed_first(lambda: planned(hardware))
        others = {"eager": lambda b: eager_loop_step(eager_model, eager_opt, b),
                  "inductor": lambda b: eager_loop_step(compiled_forward, compiled_opt, b)}
        measured = calibrated_in_rounds(full, calibration, others, batches)
        calibration.link.close()
        del calibration
        base, scale = calibrated_profile(base_unfitted, full, extern_costs, measured.full_s)
        # No less than the call alone: on a noisy machine the rounds can find the planned graph no slower.
        issue, copy_rate = max(measured.issue_s, isolated_issue), measured.copy_rate
        if cfg.link_bw is None:  # the fastest duplex link the copy thread keeps the timing of, as fast as it copies here
            bw = copy_rate * cfg.link_share
            link.update(h2d_bw=bw, d2h_bw=bw)
        hardware = base.replace(issue_s=issue, **link)
        progress(f"{spec.name}: in rounds with the other variants, the other ops run {1 / scale:.2f}x as fast as the "
                 f"per-op model, a cache instruction costs the step {issue * 1e6:.1f} us and the copy thread moves "
                 f"{format_bandwidth(copy_rate)}: the profile from here on")
    progress(f"{spec.name}: train_step at {cfg.budget}, link {format_bandwidth(bw)} each way, {hardware.h2d_latency_s * 1e6:.0f} us a copy")
    half, compile_s["train_step_50"] = timed_first(lambda: planned(hardware))

    interpreter, interpreter_error = None, None
    interpreter_link = NativeLink.for_hardware(hardware)
    try:
        interpreter, compile_s["interpreter_50"] = timed_first(lambda: InterpretedStep(half, interpreter_link, example))
        interpreter(example)  # a failure shows here, before the timed rounds
    except Exception as error:  # noqa: BLE001 - reported, and the benchmark goes on without it
        interpreter_error = f"{type(error).__name__}: {error}"
        progress(f"{spec.name}: the interpreter cannot run the plan ({interpreter_error})")
        interpreter = None

    variants: dict[str, Callable] = {
        "eager": lambda b: eager_loop_step(eager_model, eager_opt, b),
        "inductor": lambda b: eager_loop_step(compiled_forward, compiled_opt, b),
        "train_step_100": full,
        "train_step_50": (blocked_calls := BlockedPerCall(half)),
    }
    progress(f"{spec.name}: {cfg.warmup} + {cfg.steps} interleaved rounds of {', '.join(variants)}")
    order: list[int] = []
    walls, faults = run_rounds(variants, batches, cfg, order)
    blocked = blocked_calls.medians(skip=cfg.warmup)
    load = os.getloadavg()[0]
    median = {name: statistics.median(w) for name, w in walls.items()}

    # The same plan run other ways, in rounds of their own with the unplanned step for reference, so that the
    # headline variants above run in the same company as the calibration rounds.
    detail: dict[str, Callable] = {"train_step_100": full}
    if interpreter is not None:
        detail["interpreter_50"] = interpreter
    breakdown, breakdown_links = breakdown_variants(half, hardware, example)
    detail.update(breakdown)
    progress(f"{spec.name}: {cfg.warmup} + {cfg.steps} interleaved rounds of {', '.join(detail)}")
    detail_walls, detail_faults = run_rounds(detail, batches, cfg, [])
    detail_median = {name: statistics.median(w) for name, w in detail_walls.items()}
    page_faults = {name: statistics.median(f) for name, f in {**detail_faults, **faults}.items()}
    if interpreter is not None:
        interpreter.close()
    interpreter_link.close()
    for breakdown_link in breakdown_links:
        breakdown_link.close()

    progress(f"{spec.name}: one call with the device peak measured")
    half.measure = True  # the profiler for this one call only
    batch_index = len(order) % len(batches)
    half(batches[batch_index])
    order.append(batch_index)
    half.measure = False
    peak = half.last

    progress(f"{spec.name}: train_step(offload=False) on the same {len(order)} batches, for exactness")
    ref_model, ref_opt = with_adamw(copy.deepcopy(initial))
    reference, compile_s["offload_false"] = timed_first(lambda: hyperoffload.train_step(
        ref_model, ref_opt, lm_loss, example, hardware=hardware, policy=cfg.policy, offload=False, measure=False,
        progress=stage))
    for k in order:
        reference(batches[k])
    half.link.close()
    # The plan simulated on the profile fitted again to the unplanned step as the timed rounds ran it: the machine's
    # speed drifts from one set of rounds to the next (the calibration rounds have timed the same unplanned step up to
    # 11% faster), and what is predicted is the planned step in the timed rounds.
    timed_profile, timed_scale = calibrated_profile(base_unfitted, full, extern_costs, median["train_step_100"])
    timed_hardware = timed_profile.replace(issue_s=issue, **link)
    figures = simulate(half.plan, timed_hardware, release_waits=True).figures
    record = finish_record(spec, cfg, initial, median, detail_median, figures, peak, half, bw, load, compile_s,
                           max_param_diff(half.model, ref_model), max_state_diff(half.optimizer, ref_opt),
                           interpreter_error)
    record["compute_scale"] = scale
    record["compute_scale_timed"] = timed_scale
    record["sim_50_planned_s"] = half.figures.step_s
    record["copy_bw"] = copy_bw
    record["copy_rate_in_step"] = copy_rate
    record["link_latency_s"] = hardware.h2d_latency_s
    record["issue_s"] = issue
    record["isolated_issue_s"] = isolated_issue
    record["extern_op_signatures"] = len(extern_costs)
    record["page_faults"] = page_faults
    record["blocked_50_s"] = blocked
    record.update(in_step_issue(half, timed_hardware, median, detail_median))
    return record


def in_step_issue(half: TrainStep, hardware: Hardware, median: dict[str, float], detail: dict[str, float]) -> dict:
    """What one cache instruction costs the step's thread inside the 50% step: the time its graph takes with copies
    that move nothing above the unplanned step's, per cache instruction (``in_step_issue_s``), and the plan
    simulated with that ``issue_s`` instead of the isolated one (``sim_50_in_step_issue_s``): how far the
    simulator's transfers are from the measured step once the calls are priced as they run."""
    per = per_cache_instruction(detail["same_plan_no_copies"], detail["train_step_100"], half)
    sim = simulate(half.plan, hardware.replace(issue_s=per), release_waits=True).figures.step_s
    return {"cache_instructions": cache_instructions(half), "in_step_issue_s": per, "sim_50_in_step_issue_s": sim,
            "sim_error_in_step_issue": abs(sim - median["train_step_50"]) / median["train_step_50"]}


def finish_record(spec, cfg, initial, median, detail, figures, peak, half, bw, load, compile_s, diff, state_diff,
                  interpreter_error) -> dict:
    record = {
        "batch": spec.batch, "seq": spec.seq, "parameters": sum(p.numel() for p in initial.parameters()),
        "eager_s": median["eager"], "inductor_s": median["inductor"],
        "train_step_100_s": median["train_step_100"], "train_step_50_s": median["train_step_50"],
        "sim_50_s": figures.step_s, "exposed_50_s": figures.exposed_s,
        "stall_copy_50_s": figures.stall_copy_s, "compute_50_s": figures.compute_s,
        "interpreter_50_s": detail.get("interpreter_50"), "interpreter_error": interpreter_error,
        "link_bw": bw, "measured_peak_bytes": peak.peak_bytes, "budget_bytes": half.budget_bytes,
        "unplanned_peak_bytes": half.unplanned_peak_bytes, "h2d_bytes": peak.h2d_bytes, "d2h_bytes": peak.d2h_bytes,
        "max_abs_diff": diff, "max_abs_diff_state": state_diff, "load_avg": load, "compile_s": compile_s,
        "breakdown_s": {name: detail[name] for name in BREAKDOWN}, "breakdown_train_step_100_s": detail["train_step_100"],
    }
    ratios = {"train_step_100 / inductor": record["train_step_100_s"] / record["inductor_s"],
              "train_step_50 / inductor": record["train_step_50_s"] / record["inductor_s"],
              "train_step_50 / sim_50": record["train_step_50_s"] / record["sim_50_s"],
              "sim_error": abs(record["sim_50_s"] - record["train_step_50_s"]) / record["train_step_50_s"],
              "inductor / eager": record["inductor_s"] / record["eager_s"]}
    if record["interpreter_50_s"] is not None:
        ratios["interpreter_50 / train_step_50"] = record["interpreter_50_s"] / record["train_step_50_s"]
    record["ratios"] = ratios
    record["targets"] = {**{name: ratios[name] <= bound for name, bound in TARGETS.items()},
                         "peak <= budget": record["measured_peak_bytes"] <= record["budget_bytes"],
                         "max_abs_diff == 0": diff == 0}
    return record


# --- output ----------------------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def print_table(results: dict, cfg: BenchConfig) -> None:
    print(f"train_step against eager and torch.compile, AdamW, {cfg.threads} compute thread(s), {cfg.budget} "
          f"budget ({cfg.policy}); medians of {cfg.steps} interleaved rounds after {cfg.warmup}")
    for name, r in results["models"].items():
        ratios, targets = r["ratios"], r["targets"]
        print(f"\n{name}: {r['parameters']:,} parameters, batch {r['batch']} x {r['seq']} tokens; link "
              f"{format_bandwidth(r['link_bw'])} each way (simulated copy stalls {r['stall_copy_50_s'] * 1e3:.2f} ms, "
              f"exposed {r['exposed_50_s'] * 1e3:.2f} ms); "
              f"load average {r['load_avg']:.2f}")
        interp = ("-" if r["interpreter_50_s"] is None else f"{r['interpreter_50_s'] * 1e3:8.1f}")
        rows = [
            ("eager", f"{r['eager_s'] * 1e3:8.1f}", f"x{ratios['inductor / eager']:.2f} inductor/eager", ""),
            ("torch.compile", f"{r['inductor_s'] * 1e3:8.1f}", "", ""),
            ("train_step 100%", f"{r['train_step_100_s'] * 1e3:8.1f}",
             f"x{ratios['train_step_100 / inductor']:.3f} of torch.compile",
             f"<= 1.05 {verdict(targets['train_step_100 / inductor'])}"),
            (f"train_step {cfg.budget}", f"{r['train_step_50_s'] * 1e3:8.1f}",
             f"x{ratios['train_step_50 / inductor']:.3f} of torch.compile",
             f"<= 1.10 {verdict(targets['train_step_50 / inductor'])}"),
            (f"simulated {cfg.budget}", f"{r['sim_50_s'] * 1e3:8.1f}",
             f"wall/sim {ratios['train_step_50 / sim_50']:.3f}, sim_error {ratios['sim_error']:.3f}",
             f"<= 0.15 {verdict(targets['sim_error'])}"),
            (f"interpreter {cfg.budget}", interp,
             f"x{ratios['interpreter_50 / train_step_50']:.2f} of train_step" if r["interpreter_50_s"] else
             (r["interpreter_error"] or ""), ""),
        ]
        print(f"  {'variant':<18} {'step ms':>8}  {'ratio':<40} target")
        for label, ms, ratio, target in rows:
            print(f"  {label:<18} {ms:>8}  {ratio:<40} {target}")
        print(f"  measured peak {format_bytes(r['measured_peak_bytes'])} of budget {format_bytes(r['budget_bytes'])} "
              f"({format_bytes(r['unplanned_peak_bytes'])} unplanned): {verdict(targets['peak <= budget'])}")
        print(f"  max_abs_diff against offload=False {r['max_abs_diff']:g} (optimizer state "
              f"{r['max_abs_diff_state']:g}): {verdict(targets['max_abs_diff == 0'])}")
        print(f"  a cache instruction costs this plan's step {r['in_step_issue_s'] * 1e6:.1f} us (planned with "
              f"{r['issue_s'] * 1e6:.1f} us; {r['isolated_issue_s'] * 1e6:.1f} us alone); simulated with that: "
              f"{r['sim_50_in_step_issue_s'] * 1e3:.1f} ms, sim_error {r['sim_error_in_step_issue']:.3f}")
        print(f"  the {cfg.budget} step's plan run other ways, in rounds of their own (ms; x of train_step 100% in "
              f"those rounds, {r['breakdown_train_step_100_s'] * 1e3:.1f} ms):")
        for name, seconds in r["breakdown_s"].items():
            print(f"    {name:<24} {seconds * 1e3:8.1f}  x{seconds / r['breakdown_train_step_100_s']:.2f}  {BREAKDOWN[name]}")
        print(f"  the {cfg.budget} step's thread blocked per call: {r['blocked_50_s']['waits'] * 1e3:.2f} ms in waits, "
              f"{r['blocked_50_s']['releases'] * 1e3:.2f} ms in releases (for offloads still running)")
        print("  minor page faults per step: " + ", ".join(f"{k} {v:g}" for k, v in r["page_faults"].items()))
        print("  compile s: " + ", ".join(f"{k} {v:.1f}" for k, v in r["compile_s"].items()))
    load = results["load_avg"]
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(model_specs()), default=None)
    parser.add_argument("--quick", action="store_true", help="tiny-llama only, 3 steps after 1 warm-up")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 15, 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 2, 1 with --quick)")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--policy", default="hyperoffload")
    parser.add_argument("--link", type=parse_bandwidth, default=None,
                        help="link speed of the 50%% step each way (e.g. 8GB/s); default: --link-share of the rate "
                             "the copy thread moves bytes at inside a planned step (both directions share it)")
    parser.add_argument("--link-share", type=float, default=0.5,
                        help="the share of the copy thread's in-step rate each direction of the link gets "
                             "(default 0.5)")
    parser.add_argument("--latency", type=parse_duration, default=None,
                        help=f"per-copy latency of that link (e.g. 50us); default: {GPU_LINK}'s")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--isolated-issue", action="store_true",
                        help="plan with a cache operator's cost measured alone (default: priced inside a first "
                             "planned step, the cost the step pays)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc settings as they are (default: keep_freed_host_memory() first)")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if steps < 1 or warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if not 0 < args.link_share <= 1:
        parser.error(f"--link-share must be in (0, 1], got {args.link_share}")
    cfg = BenchConfig(steps=steps, warmup=warmup, threads=args.threads, budget=args.budget, policy=args.policy,
                      link_bw=args.link, link_latency_s=args.latency, keep_freed_memory=not args.default_malloc,
                      in_step_issue=not args.isolated_issue, link_share=args.link_share)
    names = args.models or (["tiny-llama"] if args.quick else list(model_specs()))
    torch.set_num_threads(cfg.threads)
    if cfg.keep_freed_memory and not hyperoffload.keep_freed_host_memory():
        progress("malloc is not glibc's: its settings are left as they are")
    progress(f"cpu-emulated profile ({cfg.threads} thread(s))")
    base = get_hardware("cpu-emulated", cpu_cache=cpu_cache_path().with_name(
        f"cpu-calibration-{cfg.threads}-threads.json"))
    specs = model_specs()
    results = {"config": asdict(cfg), "models": {}}
    for name in names:
        results["models"][name] = bench_model(specs[name], cfg, base)
    results["load_avg"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
