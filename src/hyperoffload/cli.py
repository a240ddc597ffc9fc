"""The ``hyperoffload`` command line: the flags, parsed without importing torch, so ``--help`` and argument errors
answer at once; the commands themselves are ``hyperoffload.commands``.

User errors (unknown names, impossible sizes, models that do not trace) print one
clear line on stderr and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hyperoffload.capture.task_names import TASK_NAMES
from hyperoffload.hardware.preset_files import PRESET_NAMES
from hyperoffload.units import parse_bandwidth, parse_bytes, parse_duration
from hyperoffload.workloads.catalog import DEFAULT_RESELECTION, MODES, WORKLOAD_NAMES

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
"""As a shell reports a command stopped by Ctrl-C (128 + SIGINT)."""


MAX_COUNT = 2**31 - 1
"""The largest whole number a count flag takes (sequences, tokens, steps, list lengths): the most a 32-bit index
holds, which many kernels use; a step with more sequences or tokens than that cannot be captured anyway."""


def _whole(text: str, least: int, rule: str) -> int:
    """``text`` as an int in [least, MAX_COUNT] for argparse; ``rule`` says what is wrong below ``least``."""
    try:
        value = int(text)
    except ValueError:  # also a number of more than 4300 digits
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{rule}, got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT} (2**31 - 1), got {value}")
    return value


def _positive(text: str) -> int:
    return _whole(text, 1, "must be positive")


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share between 0 and 1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share between 0 and 1, got {text}")
    return value


def _non_negative(text: str) -> int:
    return _whole(text, 0, "must be 0 or more")


def _units_type(parse, field: str, *, positive: bool = False):
    """``parse`` (a ``units`` parser) as an argparse type for a flag that sets the profile field ``field``.
    argparse shows a ValueError only as "invalid parse_bandwidth value: 'abc'"; an ArgumentTypeError's own text
    ("write it like 25GB/s") reaches the user. With ``positive``, zero is refused here, and any value the profile
    would refuse (a latency of 1e30s) too, where the message names the flag (a profile would name only its own
    field)."""
    def convert(text: str):
        from hyperoffload.hardware.profile import field_problem

        try:
            value = parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if positive and value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than zero, got {text!r}")
        problem = field_problem(field, value)
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r} {problem.removeprefix(field + ' ')}")
        return value

    return convert


_bandwidth = _units_type(parse_bandwidth, "h2d_bw", positive=True)
_duration = _units_type(parse_duration, "h2d_latency_s")
_size = _units_type(parse_bytes, "memory_bytes", positive=True)


class _Parser(argparse.ArgumentParser):
    """argparse, with a hint where it is most puzzling: a value that starts with '-' ("--budget -5%") is taken
    for an option, and argparse says only "expected one argument"."""

    def error(self, message: str):
        if message.startswith("argument ") and message.endswith("expected one argument"):
            option = message.removeprefix("argument ").split(":")[0].split("/")[-1]
            message += f"; to give a value that starts with '-', write {option}=VALUE"
        super().error(message)


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, metavar="NAME",
                        help=f"one of: {', '.join(WORKLOAD_NAMES)}; or hf:PATH for a Hugging Face model built from a "
                             f"local config.json (random weights, nothing downloaded)")
    parser.add_argument("--mode", required=True, choices=MODES, help="which step to capture")
    parser.add_argument("--batch", type=_positive, help="sequences per step (default: the workload's)")
    parser.add_argument("--seq", type=_positive, help="tokens per sequence for train and prefill")
    parser.add_argument("--context", type=_non_negative, help="tokens already in the KV cache for decode")
    parser.add_argument("--master-weights", action="store_true",
                        help="train with a float32 master copy of the weights")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--nsa-block", type=_positive, metavar="TOKENS",
                        help="DeepSeek-style workloads: the NSA selection block (default: the preset's)")
    parser.add_argument("--reselection", type=_share, metavar="SHARE",
                        help="DeepSeek-style decode: the stated share of a step's selected blocks that the previous "
                             "step also selected, which sets how much a remote KV cache's block pool saves "
                             f"(default {DEFAULT_RESELECTION}, measured on tiny-deepseek)")
    parser.add_argument("--hf-task", choices=TASK_NAMES,
                        help="hf:PATH: which kind of model to build and what batch to feed it (default: from the "
                             "config's architectures or model_type)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="hf:PATH: import and run the Python files that the config's auto_map names in the model "
                             "folder (off by default: such a config is refused)")


def _add_world_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=_positive, default=1, metavar="RANKS",
                        help="capture rank 0's step of the model sharded with FSDP2 over this many ranks (train or "
                             "prefill; on a fake process group, so no ranks are needed)")


def _add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", required=True, metavar="NAME|FILE.toml",
                        help=f"one of: {', '.join(PRESET_NAMES)}; or a path to your own TOML profile")
    parser.add_argument("--h2d-bw", type=_bandwidth, metavar="RATE", help="override, e.g. 25GB/s")
    parser.add_argument("--d2h-bw", type=_bandwidth, metavar="RATE", help="override, e.g. 12GB/s")
    parser.add_argument("--copy-latency", type=_duration, metavar="TIME",
                        help="override both directions' per-copy latency, e.g. 10us")
    parser.add_argument("--device-memory", type=_size, metavar="SIZE", help="override, e.g. 64GiB")
    parser.add_argument("--host-memory", type=_size, metavar="SIZE",
                        help="override one node's host memory, the remote tier's capacity shared by the node's ranks "
                             "(a plan that keeps more there is refused), e.g. 256GiB")


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace JSON of the simulated step")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of device memory and stream activity over time")


def _budget(text: str) -> str:
    """``--budget`` as written, once it reads as a budget (the bytes a percentage stands for need the step)."""
    from hyperoffload.budgets import check_budget_text

    try:
        check_budget_text(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _add_budget_argument(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--budget", required=required, metavar="SIZE|PCT%|hideable", type=_budget,
                        help="device-memory budget: bytes with units (40GiB, 60GB), a percentage of the step's "
                             "no-offload peak (50%%), or 'hideable'")


def _add_policies_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", metavar="P1,P2,...",
                        help="comma-separated policies to compare (default: all of them)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hyperoffload",
        description="Plan, simulate and run offloading of a training or inference step to remote memory.")
    # The installed distribution's version; the package's own __version__ (pyproject's) from an uninstalled tree.
    from importlib.metadata import distributions

    from hyperoffload import __version__
    parser.add_argument("--version", action="version", version="%(prog)s " + next(
        (d.version for d in distributions(name="hyperoffload")), __version__))
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="capture a step and show its sizes and no-offload peak")
    _add_step_arguments(inspect)
    inspect.add_argument("--top", type=_positive, default=10, help="how many of the largest peak values to list")
    _add_world_argument(inspect)
    inspect.add_argument("--verify", action="store_true",
                         help="also build the step with real random weights, execute it on CPU with the reference "
                              "executor and compare measured live bytes and results with the analysis and eager")
    commands.add_parser("workloads", help="list the built-in workloads")
    simulate = commands.add_parser("simulate", help="simulate the captured step (no offload) on a hardware profile")
    _add_step_arguments(simulate)
    _add_world_argument(simulate)
    _add_hardware_arguments(simulate)
    _add_output_arguments(simulate)
    plan = commands.add_parser("plan", help="plan offloading under a budget and simulate the plan")
    _add_step_arguments(plan)
    _add_world_argument(plan)
    _add_hardware_arguments(plan)
    plan.add_argument("--budget", required=True, metavar="SIZE|PCT%|hideable", type=_budget,
                      help="device-memory budget: bytes with units (40GiB, 60GB), a percentage of the step's "
                           "no-offload peak (50%%), or 'hideable'")
    plan.add_argument("--policy", default="hyperoffload", help="which planner (default: hyperoffload)")
    plan.add_argument("--graph", metavar="FILE", help="write the planned FX graph, cache operators included, as code")
    plan.add_argument("--static-layout", action="store_true",
                      help="hyperoffload only: give every device tensor a fixed offset in one arena and re-plan until "
                           "the arena fits the budget, so the budget bounds reserved memory, not only live bytes")
    _add_output_arguments(plan)
    compare = commands.add_parser("compare", help="plan with every policy at one budget and compare the simulated steps")
    _add_step_arguments(compare)
    _add_world_argument(compare)
    _add_hardware_arguments(compare)
    _add_budget_argument(compare)
    _add_policies_argument(compare)
    compare.add_argument("--plot", metavar="FILE", help="write a PNG of the step time of each policy")
    sweep = commands.add_parser("sweep", help="compare every policy at each value of a bandwidth or the budget")
    _add_step_arguments(sweep)
    _add_world_argument(sweep)
    _add_hardware_arguments(sweep)
    _add_budget_argument(sweep, required=False)
    _add_policies_argument(sweep)
    sweep.add_argument("--vary", required=True, choices=("h2d-bw", "d2h-bw", "budget", "nsa-block"),
                       help="what to vary (nsa-block: the NSA selection block in tokens, DeepSeek-style decode)")
    sweep.add_argument("--values", required=True, metavar="V1,V2,...",
                       help="comma-separated values: rates (8GB/s,16GB/s) or budgets (40GiB,60%%,hideable)")
    sweep.add_argument("--plot", metavar="FILE", help="write a PNG of step time against the varied quantity")
    for parser_, rows in ((compare, "one per policy"), (sweep, "one per value and policy")):
        for action in parser_._actions:
            if action.dest == "json":
                action.help = f"print a JSON list of objects ({rows}) instead of tables"
    run = commands.add_parser("run", help="run planned steps for real on an emulated link and compare with the "
                                          "unplanned step and the simulator")
    _add_step_arguments(run)
    run.add_argument("--budget", required=True, metavar="SIZE|PCT%|hideable", type=_budget,
                     help="device-memory budget, as for plan")
    run.add_argument("--link", type=_bandwidth, default="2GB/s", metavar="RATE",
                     help="emulated link bandwidth each way (default 2GB/s)")
    run.add_argument("--copy-latency", type=_duration, default="50us", metavar="TIME",
                     help="emulated fixed cost per copy (default 50us)")
    run.add_argument("--policy", default="hyperoffload", help="which planner (default: hyperoffload)")
    run.add_argument("--steps", type=_positive, default=5, help="timed steps after warm-up (default 5)")
    run.add_argument("--warmup", type=_non_negative, default=2, help="untimed steps first (default 2)")
    run.add_argument("--threads", type=_positive, metavar="N",
                     help="compute threads (default: all cores but one, which the copy engines use)")
    run.add_argument("--static-layout", action="store_true",
                     help="hyperoffload only: plan with a static layout and run the planned steps from its one "
                          "arena (every device tensor a view into it)")
    run.add_argument("--world", type=_positive, default=1, metavar="RANKS",
                     help="shard the model with FSDP2 over this many ranks, each a process of this machine on the "
                          "gloo backend, and run every rank's planned step (train or prefill; --threads is split "
                          "between them)")
    hardware = commands.add_parser("hardware", help="list hardware profiles, or show one with its sources")
    hardware.add_argument("name", nargs="?", metavar="NAME|FILE.toml", help="the profile to show")
    hardware.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


def _check_output_paths(args: argparse.Namespace) -> None:
    """Refuse an output file that cannot be written before capturing and planning (minutes for a large step)
    rather than after, and name the flag: a bare "[Errno 2] No such file or directory" says neither."""
    for flag in ("trace", "plot", "graph"):
        path = getattr(args, flag, None)
        if path is not None:
            _check_writable(f"--{flag}", Path(path))


def _check_writable(flag: str, path: Path) -> None:
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name, e.g. {path / 'out'}")
    if not folder.exists():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it or write the file elsewhere")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a folder; write the file elsewhere")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable; write the file elsewhere")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rich.console import Console

    from hyperoffload import commands

    # Tables piped to a file or another program keep their columns whole (rich would assume 80 columns).
    out = Console() if sys.stdout.isatty() else Console(width=160)
    err = Console(stderr=True)
    try:
        _check_output_paths(args)
        with commands.one_line_cache_warnings(err):
            return commands.COMMANDS[args.command](args, out, err)
    except KeyboardInterrupt:
        err.print("interrupted", highlight=False)
        return EXIT_INTERRUPTED
    except commands.USER_ERRORS as error:
        # soft_wrap: one line, however long, rather than rich's wrapping at 80 columns on a pipe or a log.
        err.print(f"[red]error:[/red] {error}", highlight=False, soft_wrap=True)
        return EXIT_USER_ERROR


def main_entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
