"""The ``hyperoffload`` commands: each maps its parsed flags (``hyperoffload.cli``) onto library calls and prints
the results; ``COMMANDS`` names them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from hyperoffload.capture import CaptureError
from hyperoffload.capture.hf_tasks import get_task, task_of_model
from hyperoffload.cli import _positive
from hyperoffload.collectives import check_world
from hyperoffload.hardware import Hardware, HardwareError, get_hardware
from hyperoffload.hardware.profile import field_problem
from hyperoffload.plans import PlanError
from hyperoffload.policies import InfeasibleBudget
from hyperoffload.units import format_bytes, parse_bandwidth
from hyperoffload.workloads import WORKLOADS, UnknownWorkload, capture_workload, get_workload, with_nsa_block

if TYPE_CHECKING:
    from hyperoffload.planning import Budget


def cpu_cache_path() -> Path:
    """Where the CPU calibration is cached: $XDG_CACHE_HOME/hyperoffload (or ~/.cache/hyperoffload). A relative
    $XDG_CACHE_HOME is ignored, as the XDG base directory spec says: it would put the cache wherever the command
    happens to run."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "hyperoffload" / "cpu-calibration.json"


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    """The profile named by ``--hardware`` with any command-line overrides applied."""
    hardware = get_hardware(args.hardware, cpu_cache=cpu_cache_path())
    overrides = {name: value for name, value in (
        ("h2d_bw", args.h2d_bw), ("d2h_bw", args.d2h_bw), ("h2d_latency_s", args.copy_latency),
        ("d2h_latency_s", args.copy_latency), ("memory_bytes", args.device_memory),
        ("host_memory_bytes", args.host_memory)) if value is not None}
    hardware = hardware.replace(**overrides) if overrides else hardware
    check_world(hardware, getattr(args, "world", 1))  # before a capture that would take minutes
    return hardware


def _planner_config(args: argparse.Namespace, without_layout: str):
    """The planner settings ``--policy`` and ``--static-layout`` ask for (None: the policy's own), checked before
    anything is captured; ``without_layout`` says what another policy than hyperoffload does without a static
    layout, for the error."""
    from hyperoffload.policies import get_policy

    get_policy(args.policy)  # an unknown name fails here, listing the valid ones
    if not args.static_layout:
        return None
    if args.policy != "hyperoffload":
        raise ValueError(f"--static-layout is a hyperoffload planner option; policy {args.policy!r} {without_layout}")
    from hyperoffload.policies import PlannerConfig

    return PlannerConfig(static_layout=True)


def _policy_names(args: argparse.Namespace) -> list[str] | None:
    from hyperoffload.policies import get_policy

    if args.policies is None:
        return None
    names = [name.strip() for name in args.policies.split(",") if name.strip()]
    # An empty list would otherwise mean "all of them": not what "--policies ," asked for.
    if not names:
        raise ValueError(f"--policies {args.policies!r} names no policy; give some, e.g. --policies "
                         f"hyperoffload,reactive, or drop the flag to compare all of them")
    for name in names:
        get_policy(name)  # an unknown name fails here, listing the valid ones
        if names.count(name) > 1:
            raise ValueError(f"--policies names {name!r} more than once; list each policy once")
    return names


HF_PREFIX = "hf:"


def _check_step_flags(args: argparse.Namespace) -> None:
    """Refuse a step flag that this step would ignore: the capture drops it without a word, and the figures
    would be those of a step the user did not ask for."""
    if args.context is not None and args.mode != "decode":
        raise ValueError(f"--context sets the KV cache of a decode step; a {args.mode} step has none: drop --context "
                         f"or use --mode decode")
    if args.seq is not None and args.mode == "decode":
        raise ValueError("--seq sets train and prefill steps; a decode step feeds one token per sequence: drop --seq "
                         "(--context sets the tokens already cached)")
    if args.master_weights and args.mode != "train":
        raise ValueError(f"--master-weights applies to train steps, not {args.mode}: drop it or use --mode train")
    if getattr(args, "reselection", None) is not None and not _deepseek_decode(args):
        raise ValueError("--reselection applies to decode steps of DeepSeek-style workloads (tiny-deepseek, "
                         "deepseek-v2-lite, deepseek-v3): drop it")


def _deepseek_decode(args: argparse.Namespace) -> bool:
    from hyperoffload.workloads import DeepSeekConfig

    if args.mode != "decode" or args.workload.startswith(HF_PREFIX):
        return False
    return isinstance(get_workload(args.workload).config, DeepSeekConfig)


@contextlib.contextmanager
def _capture_progress(console: Console, message: str, quiet_s: float = 2.0):
    """A ``progress(phase, done, total)`` callback for a capture: ``message`` and a bar on a terminal; on a pipe or
    a log (where rich shows neither spinner nor bar), a line at each tenth of the layers once the phase has run
    ``quiet_s`` seconds, so that a long capture shows it is moving and a short one prints nothing."""
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      console=console, transient=True) as bar:
            bar.add_task(message, total=None)
            tasks: dict[str, int] = {}

            def report(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=total)
                bar.update(tasks[phase], completed=done)

            yield report
        return
    shown: set[tuple[str, int]] = set()
    started: dict[str, float] = {}

    def report(phase: str, done: int, total: int) -> None:
        tenth = done * 10 // total
        if time.monotonic() - started.setdefault(phase, time.monotonic()) < quiet_s or (phase, tenth) in shown:
            return
        if done == total or (done * 10) % total < 10:
            shown.add((phase, tenth))
            console.print(f"{phase}: {done} of {total}", highlight=False)

    yield report


def _capture(args: argparse.Namespace, console: Console, *, fake: bool = True):
    """Capture the step the flags describe: a built-in workload, or a Hugging Face config (``hf:PATH``)."""
    kind = "fake" if fake else "real"
    _check_step_flags(args)
    if args.workload.startswith(HF_PREFIX):
        from hyperoffload.capture.hf import build_hf_model, capture_hf

        if args.master_weights:
            raise ValueError("--master-weights applies to the built-in workloads only")
        if getattr(args, "world", 1) > 1:
            raise ValueError("--world shards the built-in workloads only for now, not a Hugging Face model: drop it "
                             "or give --workload NAME")
        if getattr(args, "nsa_block", None) is not None:
            raise ValueError("--nsa-block applies to the built-in DeepSeek-style workloads (NSA), not a Hugging Face "
                             "model: drop it")
        path = args.workload.removeprefix(HF_PREFIX)
        with _capture_progress(console, f"Capturing the {args.mode} step of {path} on {kind} tensors...") as progress:
            model = build_hf_model(path, fake=fake, task=args.hf_task, trust_remote_code=args.trust_remote_code)
            task = get_task(args.hf_task) if args.hf_task else task_of_model(model)
            torch.manual_seed(0)  # the example batch
            if args.mode == "decode":
                return capture_hf(model, "decode", batch=args.batch or 1, context=128 if args.context is None
                                  else args.context, name=args.workload, task=task.name, progress=progress)
            seq = (args.seq or 128) if task.takes_seq else args.seq
            return capture_hf(model, args.mode, batch=args.batch or 1, seq=seq, name=args.workload, task=task.name,
                              progress=progress)
    for flag, given in (("--hf-task", getattr(args, "hf_task", None)),
                        ("--trust-remote-code", getattr(args, "trust_remote_code", False))):
        if given:
            raise ValueError(f"{flag} applies to Hugging Face models (--workload hf:PATH), not {args.workload}: "
                             f"drop it")
    workload = get_workload(args.workload)
    workload = with_nsa_block(workload, getattr(args, "nsa_block", None))
    with console.status(f"Capturing the {args.mode} step of {workload.name} on {kind} tensors..."):
        return capture_workload(workload, args.mode, batch=args.batch, seq=args.seq, context=args.context,
                                master_weights=args.master_weights, fake=fake,
                                reselection=getattr(args, "reselection", None), world=getattr(args, "world", 1))


def _inspect(args: argparse.Namespace, out: Console, err: Console) -> int:
    from hyperoffload.report.inspect import inspect_step, inspect_tables

    if args.verify and args.world > 1:
        raise ValueError("--verify runs the step on this machine's CPU, and a step sharded over ranks (--world) has "
                         "collectives that need the other ranks: drop --verify or --world")
    inspection = inspect_step(_capture(args, err), top=args.top)
    if args.verify:
        inspection = inspection.verified(_verify(args, inspection.peak_bytes, err))
    if args.json:
        print(json.dumps(inspection.as_dict()))
    else:
        out.print(inspect_tables(inspection))
    if inspection.verify_failure:
        err.print(f"[red]verification failed:[/red] {inspection.verify_failure}", highlight=False, soft_wrap=True)
        return 1
    return 0


def _verify(args: argparse.Namespace, peak_bytes: int, err: Console) -> dict:
    """The step executed with real weights against eager and the analysis (``report.inspect.verify_figures``),
    once this machine has room for it."""
    from hyperoffload.report.inspect import verify_figures
    from hyperoffload.runtime import compare_with_eager

    # The check holds the inputs three times (original, graph run, eager run) plus each run's peak.
    _check_host_room(3 * peak_bytes, "--verify", "verify")
    captured = _capture(args, err, fake=False)
    with err.status("Executing the step with real weights and comparing..."):
        return verify_figures(compare_with_eager(captured))


def _workloads(args: argparse.Namespace, out: Console, err: Console) -> int:
    from rich.table import Table

    table = Table(title="Built-in workloads", title_justify="left")
    for column in ("name", "layers", "hidden", "dtype", "default step", "description", "source"):
        table.add_column(column)
    for w in WORKLOADS.values():
        table.add_row(w.name, str(w.config.layers), str(w.config.hidden), str(w.dtype).removeprefix("torch."),
                      f"batch {w.batch}, seq {w.seq}, context {w.context}", w.description, w.source)
    out.print(table)
    return 0


def _simulate(args: argparse.Namespace, out: Console, err: Console) -> int:
    from hyperoffload.plans import plan_without_offload
    from hyperoffload.report.figures import no_offload_dict, no_offload_summary, step_title
    from hyperoffload.simulate import simulate

    hardware = hardware_from_args(args)
    program = _capture(args, err).program
    with err.status(f"Simulating {len(program.ops):,} ops on {hardware.name}..."):
        timeline = simulate(plan_without_offload(program), hardware)
    _write_outputs(args, timeline, title=f"{step_title(program)} on {hardware.name}, no offload",
                   limit_bytes=hardware.memory_bytes, err=err, limit_label=f"{hardware.name} memory")
    if args.json:
        print(json.dumps(no_offload_dict(program, hardware, timeline.figures)))
    else:
        out.print(no_offload_summary(program, hardware, timeline.figures))
    return 0


def _note_policies(names, program, err: Console) -> None:
    """Say so (on stderr) when a policy named by the user does not apply to the step (``kv-naive`` and ``paged``
    move only a decode step's KV cache): it then plans as ``none``, which a table alone would not explain."""
    from hyperoffload.policies import KV_ONLY, policies_for

    # (A policy of sharded training steps on another step refuses it, saying why: no note for it here.)
    idle = [name for name in names if name in KV_ONLY and name not in policies_for(program)]
    if idle:
        err.print(f"[yellow]note: {', '.join(idle)} {'moves' if len(idle) == 1 else 'move'} only a decode step's KV "
                  f"cache (paged: its remote-KV form); this {program.mode} step has none, so "
                  f"{'it plans' if len(idle) == 1 else 'they plan'} as none[/yellow]", highlight=False, soft_wrap=True)


def _resolved_budget(args: argparse.Namespace, program, hardware: Hardware, err: Console) -> Budget:
    """``--budget`` resolved on the step and profile (a ``planning.Budget``), with notes on stderr (so ``--json``
    output stays one object): when "hideable" is the smallest feasible budget instead, and when the budget is more
    than the device has."""
    from hyperoffload.planning import resolve_budget

    budget = resolve_budget(args.budget, program, hardware)
    if budget.hideable_note:
        err.print(f"[yellow]note: {budget.hideable_note}[/yellow]", highlight=False, soft_wrap=True)
    _note_over_device(budget, hardware, err)
    return budget


def _note_over_device(budget: Budget, hardware: Hardware, err: Console) -> None:
    """Say so when ``budget`` (a ``planning.Budget``) is more than the device has: the figures are then a what-if
    (the tables of budgets as shares of the no-offload peak go there on purpose)."""
    if budget.over_device:
        err.print(f"[yellow]note: the budget, {format_bytes(budget.budget_bytes)}, is more than {hardware.name}'s "
                  f"{format_bytes(hardware.memory_bytes)} of device memory: a plan for it does not fit that device. "
                  f"Give at most {format_bytes(hardware.memory_bytes)}, or --device-memory for a larger "
                  f"device[/yellow]", highlight=False, soft_wrap=True)


def _plan(args: argparse.Namespace, out: Console, err: Console) -> int:
    from hyperoffload.report.plan_report import plan_report, plan_summary

    hardware = hardware_from_args(args)
    config = _planner_config(args, "leaves addresses to the allocator (its arena and allocator figures are "
                                   "reported anyway)")
    program = _capture(args, err).program
    budget = _resolved_budget(args, program, hardware, err)
    _note_policies([args.policy], program, err)
    with err.status("Planning...") as status:
        report = plan_report(program, hardware, budget.budget_bytes, policy=args.policy, config=config,
                             stage=status.update)
    _write_outputs(args, report.timeline, title=report.title, limit_bytes=budget.budget_bytes, err=err)
    if args.graph:
        from hyperoffload.lower import plan_code

        with _writing("--graph", args.graph):
            Path(args.graph).write_text(plan_code(report.plan))
        err.print(f"planned graph written to {args.graph}")
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        out.print(plan_summary(report))
    return 0


def _compare(args: argparse.Namespace, out: Console, err: Console) -> int:
    from hyperoffload.compare import compare
    from hyperoffload.report.compare import compare_table, plot_compare, verdict
    from hyperoffload.report.figures import step_title

    hardware = hardware_from_args(args)
    names = _policy_names(args)
    program = _capture(args, err).program
    budget = _resolved_budget(args, program, hardware, err)
    if names is not None:
        _note_policies(names, program, err)
    with err.status(f"Planning {len(program.ops):,} ops for {format_bytes(budget.budget_bytes)} on {hardware.name} "
                    f"with every policy..."):
        results = compare(program, hardware, budget.budget_bytes, names)
    title = f"{step_title(program)} on {hardware.name}, budget {format_bytes(budget.budget_bytes)} ({args.budget})"
    if args.plot:
        with _writing("--plot", args.plot):
            plot_compare(results, args.plot, title=title)
        err.print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps([r.as_dict() for r in results]))
        return 0
    out.print(compare_table(results, title=title))
    out.print(verdict(results))
    return 0


def _sweep(args: argparse.Namespace, out: Console, err: Console) -> int:
    from hyperoffload.compare import sweep
    from hyperoffload.planning import resolve_budget
    from hyperoffload.report.compare import plot_sweep, sweep_table
    from hyperoffload.report.figures import step_title

    hardware = hardware_from_args(args)
    names = _policy_names(args)
    values = [v for v in args.values.split(",") if v.strip()]
    _check_sweep_values(args, values)
    program = _capture(args, err).program
    if names is not None:
        _note_policies(names, program, err)
    if args.vary in ("h2d-bw", "d2h-bw") and args.budget is not None:
        # Only the device-memory note: the hideable budget changes with the bandwidth swept, and over NSA
        # block sizes the step itself changes.
        _note_over_device(resolve_budget(args.budget, program, hardware), hardware, err)

    def recapture(value: str):
        args.nsa_block = int(value)  # checked by _check_sweep_values
        return _capture(args, err).program

    with err.status(f"Comparing every policy at {len(values)} values of {args.vary}..."):
        points = sweep(program, hardware, vary=args.vary, values=values, budget=args.budget, policies=names,
                       recapture=recapture)
    budget = f", budget {args.budget}" if args.vary != "budget" else ""
    title = f"{step_title(program)} on {hardware.name}{budget}: simulated step time against {args.vary}"
    if args.plot:
        with _writing("--plot", args.plot):
            plot_sweep(points, args.plot, vary=args.vary, title=title)
        err.print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps([row for point in points for row in point.rows()]))
        return 0
    out.print(sweep_table(points, vary=args.vary, title=title))
    return 0


def _check_sweep_values(args: argparse.Namespace, values: list[str]) -> None:
    """Refuse what a sweep would otherwise trip over late (after the first capture) or quietly ignore."""
    if args.vary == "budget" and args.budget is not None:
        # Each value is the budget; a --budget as well would be dropped without a word.
        raise ValueError(f"--vary budget takes the budgets from --values; drop --budget {args.budget}")
    if args.vary == "nsa-block" and args.nsa_block is not None:
        raise ValueError(f"--vary nsa-block takes the block sizes from --values; drop --nsa-block {args.nsa_block}")
    if args.vary == "nsa-block":
        for value in values:
            try:
                _positive(value)
            except argparse.ArgumentTypeError as error:
                raise ValueError(f"--values {value!r}: an NSA block is a positive whole number of tokens ({error}); "
                                 f"write e.g. --values 16,32,64") from None
    if args.vary in ("h2d-bw", "d2h-bw"):
        for value in values:
            # before the capture, not after it
            problem = field_problem(args.vary.replace("-", "_"), parse_bandwidth(value))
            if problem:
                raise ValueError(f"--values {value!r}: {problem}")


@contextlib.contextmanager
def _writing(flag: str, path: str):
    """Name the flag and the file when a write fails after the checks (a full disk, a folder removed meanwhile):
    the work before it took minutes, and a bare "[Errno 28] No space left on device" says neither."""
    try:
        yield
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot write the file: {error.strerror or error}; write it "
                         f"elsewhere") from None


def _write_outputs(args: argparse.Namespace, timeline, *, title: str, limit_bytes: int | None, err: Console,
                   limit_label: str = "budget") -> None:
    if args.trace:
        from hyperoffload.report.trace import write_trace

        with _writing("--trace", args.trace):
            write_trace(timeline, args.trace, name=title, budget_bytes=limit_bytes)
        err.print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        from hyperoffload.report.plot import plot_timeline

        with err.status("Plotting..."), _writing("--plot", args.plot):
            plot_timeline(timeline, args.plot, title=title, budget_bytes=limit_bytes, budget_label=limit_label)
        err.print(f"plot written to {args.plot}")


def _hardware(args: argparse.Namespace, out: Console, err: Console) -> int:
    from hyperoffload.hardware import list_hardware
    from hyperoffload.report.hardware import hardware_detail, hardware_list, profile_dict

    if args.name is None:
        profiles = list_hardware()
        if args.json:
            print(json.dumps([profile_dict(h) for h in profiles]))
        else:
            out.print(hardware_list(profiles))
            out.print("cpu-emulated: this machine's CPU (calibrated on first use) with an emulated link; "
                      "`hyperoffload hardware cpu-emulated` measures and shows it.")
        return 0
    with err.status("Loading the profile (cpu-emulated calibrates this machine once)..."):
        hardware = get_hardware(args.name, cpu_cache=cpu_cache_path())
    if args.json:
        print(json.dumps(profile_dict(hardware)))
    else:
        out.print(hardware_detail(hardware))
    return 0


def _run(args: argparse.Namespace, out: Console, err: Console) -> int:
    from hyperoffload.analysis import memory_profile
    from hyperoffload.report.run_report import run_report, run_summary
    from hyperoffload.runtime import BudgetExceeded, TransferError
    from hyperoffload.runtime.measure import RunConfig, executor_dispatch_s, executor_issue_s, for_executor

    if args.world > 1:
        from hyperoffload.policies import HOST_COMPUTE

        if args.policy in HOST_COMPUTE and args.mode == "train":
            raise ValueError(f"--policy {args.policy} runs a sharded training step's optimizer on the host CPU, which "
                             f"the runtime cannot do yet: it is simulated only (plan, simulate, compare --world "
                             f"{args.world}); run another policy, such as hyperoffload")
        return _run_world(args, out, err)
    threads = _run_threads(args)
    torch.set_num_threads(threads)
    config = _planner_config(args, "has no static layout to run from")
    run_config = RunConfig(steps=args.steps, warmup=args.warmup, arena=args.static_layout)
    with err.status("Loading the cpu-emulated profile (calibrates this machine once per thread count)..."):
        cache = cpu_cache_path().with_name(f"cpu-calibration-{threads}-threads.json")
        hardware = get_hardware("cpu-emulated", cpu_cache=cache).replace(
            h2d_bw=args.link, d2h_bw=args.link, h2d_latency_s=args.copy_latency, d2h_latency_s=args.copy_latency)
    # Sized on fake tensors first: the inputs, the reference, checked and timed copies, and each run's peak.
    _check_host_room(6 * memory_profile(_capture(args, err).program).peak_bytes, "run", "run")
    captured = _capture(args, err, fake=False)
    program = captured.program
    with err.status("Measuring the executor's dispatch cost per op and per cache instruction..."):
        bare = hardware
        hardware = for_executor(bare, program, executor_dispatch_s(), executor_issue_s(), inputs=captured.inputs)
    budget = _resolved_budget(args, program, hardware, err)
    _note_policies([args.policy], program, err)
    with _phase_bars(err) as (stage, progress):
        try:
            report = run_report(captured, hardware, bare, budget.budget_bytes, policy=args.policy, config=config,
                                run_config=run_config, threads=threads, stage=stage, progress=progress)
        except (BudgetExceeded, TransferError) as error:
            err.print(f"[red]run failed:[/red] {error}", highlight=False)
            return 1
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        out.print(run_summary(report, budget_text=args.budget))
    return 0 if report.exact else 1


RANK_PROCESS_BYTES = 512 << 20
"""What one rank's process holds beside its step's tensors (Python, torch, gloo's buffers), bytes, for ``run
--world``'s host-room check: a tiny-llama rank peaks at about 450 MiB resident in all."""


def _run_world(args: argparse.Namespace, out: Console, err: Console) -> int:
    """``run --world N``: the step sharded with FSDP2 over N gloo ranks of this machine, each rank's planned step
    measured (``report.sharded_run_report``)."""
    from hyperoffload.analysis import memory_profile
    from hyperoffload.report.sharded_run_report import (ShardedRunConfig, profile_fields, sharded_run_report,
                                                        sharded_run_summary)
    from hyperoffload.runtime.measure import RunConfig
    from hyperoffload.runtime.ranks import RankFailed

    cores = os.cpu_count() or 1
    if args.world > cores:
        raise ValueError(f"run --world {args.world} starts {args.world} rank processes, more than this machine's "
                         f"{cores} cores; give --world {cores} or less (plan, compare and simulate take any --world "
                         f"without running it)")
    threads = max(1, _run_threads(args) // args.world)
    _planner_config(args, "has no static layout to run from")
    # Rank 0's step on a fake group first: refuses what cannot be sharded, and sizes each rank's run.
    peak = memory_profile(_capture(args, err).program).peak_bytes
    _check_host_room(args.world * (6 * peak + RANK_PROCESS_BYTES), f"run --world {args.world}", "run")
    torch.set_num_threads(threads)
    with err.status("Loading the cpu-emulated profile (calibrates this machine once per thread count)..."):
        cache = cpu_cache_path().with_name(f"cpu-calibration-{threads}-threads.json")
        hardware = get_hardware("cpu-emulated", cpu_cache=cache).replace(
            h2d_bw=args.link, d2h_bw=args.link, h2d_latency_s=args.copy_latency, d2h_latency_s=args.copy_latency)
    config = ShardedRunConfig(workload=args.workload, mode=args.mode, world=args.world, budget=args.budget,
                              hardware=profile_fields(hardware), batch=args.batch, seq=args.seq, policy=args.policy,
                              static_layout=args.static_layout, threads=threads,
                              run_config=RunConfig(steps=args.steps, warmup=args.warmup, arena=args.static_layout))
    err.print(f"starting {args.world} gloo ranks, {threads} compute thread(s) each...", highlight=False)
    try:
        report = sharded_run_report(config, on_line=lambda rank, text: err.print(f"rank {rank}: {text}",
                                                                                  highlight=False, soft_wrap=True))
    except RankFailed as error:
        err.print(f"[red]run failed:[/red] {error}", highlight=False, soft_wrap=True)
        return 1
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        out.print(sharded_run_summary(report, budget_text=args.budget))
    return 0 if report.exact and report.feasible else 1


def _run_threads(args: argparse.Namespace) -> int:
    """The compute threads ``run`` uses: ``--threads``, or all cores but one (which the copy engines use)."""
    cores = os.cpu_count() or 1
    if args.threads is not None and args.threads > cores:
        # More compute threads than cores only slows the step and starves the copy engines; millions would
        # never start.
        raise ValueError(f"--threads {args.threads} is more than this machine's {cores} cores; give at most {cores}")
    return args.threads or max(1, (os.cpu_count() or 2) - 1)


def _check_host_room(needed: int, flag: str, verb: str) -> None:
    """Refuse to execute a step for real (``flag`` does) when it would need ``needed`` bytes, more than half of
    this machine's memory; ``verb`` is what to do with a smaller step instead."""
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > host // 2:
        raise ValueError(f"{flag} executes the step for real and would need about {format_bytes(needed)}, more than "
                         f"half of this machine's {format_bytes(host)}; {verb} a smaller workload (tiny-llama) or "
                         f"smaller --batch/--seq/--context")


@contextlib.contextmanager
def _phase_bars(console: Console):
    """A bar per phase on ``console`` while a run goes: yields ``run_report``'s ``stage`` (a line above the bars)
    and ``progress(phase, done, total)`` callbacks."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True) as bars:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task(phase, total=total)
            bars.update(tasks[phase], completed=done)

        yield bars.console.print, progress


USER_ERRORS = (UnknownWorkload, CaptureError, HardwareError, PlanError, InfeasibleBudget, ValueError, OSError)
"""What ``hyperoffload.cli.main`` reports as one ``error:`` line with exit status 2 (the user's to fix)."""

COMMANDS = {"inspect": _inspect, "workloads": _workloads, "simulate": _simulate, "plan": _plan,
            "hardware": _hardware, "compare": _compare, "sweep": _sweep, "run": _run}


@contextlib.contextmanager
def one_line_cache_warnings(err: Console):
    """Show a calibration cache's warning (measured again, or not written) as one ``warning: ...`` line, not with
    the library's file and line; other warnings as Python shows them."""
    from hyperoffload.hardware.cpu import CalibrationCacheWarning

    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, *rest, **kwargs):
            if issubclass(category, CalibrationCacheWarning):
                err.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)
            else:
                shown(message, category, *rest, **kwargs)

        warnings.showwarning = show
        yield
