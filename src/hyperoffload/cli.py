"""The ``hyperoffload`` command line. It maps flags onto library calls and prints results.

User errors (unknown names, impossible sizes, models that do not trace) print one
clear line on stderr and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch
from rich.console import Console

from hyperoffload.capture import CaptureError
from hyperoffload.workloads import MODES, WORKLOADS, UnknownWorkload, capture_workload, get_workload

EXIT_USER_ERROR = 2


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = _positive(text) if text.strip() not in ("0", "+0") else 0
    return value


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, metavar="NAME",
                        help=f"one of: {', '.join(WORKLOADS)}; or hf:PATH for a Hugging Face causal LM built "
                             f"from a local config.json (random weights, nothing downloaded)")
    parser.add_argument("--mode", required=True, choices=MODES, help="which step to capture")
    parser.add_argument("--batch", type=_positive, help="sequences per step (default: the workload's)")
    parser.add_argument("--seq", type=_positive, help="tokens per sequence for train and prefill")
    parser.add_argument("--context", type=_non_negative, help="tokens already in the KV cache for decode")
    parser.add_argument("--master-weights", action="store_true",
                        help="train with a float32 master copy of the weights")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperoffload",
        description="Plan, simulate and run offloading of a training or inference step to remote memory.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="capture a step and show its sizes and no-offload peak")
    _add_step_arguments(inspect)
    inspect.add_argument("--top", type=_positive, default=10, help="how many of the largest peak values to list")
    inspect.add_argument("--verify", action="store_true",
                         help="also build the step with real random weights, execute it on CPU with the reference "
                              "executor and compare measured live bytes and results with the analysis and eager")
    commands.add_parser("workloads", help="list the built-in workloads")
    return parser


HF_PREFIX = "hf:"


def _capture(args: argparse.Namespace, console: Console, *, fake: bool = True):
    """Capture the step the flags describe: a built-in workload, or a Hugging Face config (``hf:PATH``)."""
    kind = "fake" if fake else "real"
    if args.workload.startswith(HF_PREFIX):
        from hyperoffload.capture.hf import build_hf_model, capture_hf

        if args.context is not None or args.master_weights:
            raise ValueError("--context and --master-weights apply to the built-in workloads only")
        path = args.workload.removeprefix(HF_PREFIX)
        with console.status(f"Capturing the {args.mode} step of {path} on {kind} tensors..."):
            model = build_hf_model(path, fake=fake)
            torch.manual_seed(0)  # the example batch
            return capture_hf(model, args.mode, batch=args.batch or 1, seq=args.seq or 128,
                              name=args.workload)
    workload = get_workload(args.workload)
    with console.status(f"Capturing the {args.mode} step of {workload.name} on {kind} tensors..."):
        return capture_workload(workload, args.mode, batch=args.batch, seq=args.seq, context=args.context,
                                master_weights=args.master_weights, fake=fake)



def _inspect(args: argparse.Namespace, out: Console, err: Console) -> int:
    from hyperoffload.report.inspect import inspect_step, inspect_tables

    figures = inspect_step(_capture(args, err), top=args.top)
    if args.verify:
        figures["verify"] = _verify(args, figures["peak_bytes"], err)
    if args.json:
        print(json.dumps(figures))
    else:
        out.print(inspect_tables(figures))
    check = figures.get("verify")
    if check and not (check["identical_to_eager"] and check["live_bytes_agree"]):
        err.print("[red]verification failed:[/red] the executed step disagrees with the analysis or with eager")
        return 1
    return 0


def _verify(args: argparse.Namespace, peak_bytes: int, err: Console) -> dict:
    import os

    from hyperoffload.runtime import compare_with_eager
    from hyperoffload.units import format_bytes

    # The check holds the inputs three times (original, graph run, eager run) plus each run's peak.
    needed = 3 * peak_bytes
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > host // 2:
        raise ValueError(f"--verify executes the step for real and would need about {format_bytes(needed)}, more "
                         f"than half of this machine's {format_bytes(host)}; verify a smaller workload "
                         f"(tiny-llama) or smaller --batch/--seq/--context")
    captured = _capture(args, err, fake=False)
    with err.status("Executing the step with real weights and comparing..."):
        result = compare_with_eager(captured)
    return {"identical_to_eager": result.identical, "max_abs_diff": result.max_abs_diff,
            "measured_peak_bytes": result.measured_peak_bytes, "analysed_peak_bytes": result.analysed_peak_bytes,
            "live_bytes_agree": result.live_bytes_agree}


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


COMMANDS = {"inspect": _inspect, "workloads": _workloads}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out, err = Console(), Console(stderr=True)
    try:
        return COMMANDS[args.command](args, out, err)
    except (UnknownWorkload, CaptureError, ValueError) as error:
        err.print(f"[red]error:[/red] {error}", highlight=False)
        return EXIT_USER_ERROR


def main_entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
