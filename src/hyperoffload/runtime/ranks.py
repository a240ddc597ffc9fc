"""Run one function on every rank of a gloo process group made of this machine's processes, and gather the results.

``run_on_ranks(work, payload, setup)`` spawns ``setup.world`` fresh processes (the ``spawn`` start method: a child
inherits no process group, no threads and no CUDA state from the caller). Each one sets its torch threads, joins a
gloo process group through a ``FileStore`` in a temporary folder of its own (no port to find), calls
``work(rank, payload, say)`` and hands its result to rank 0 (``gather_object``), which passes the list to the
caller; the gather is itself a collective, so the results arrive only once every rank has finished. ``say(text)``
sends a progress line to the caller, which hears it as ``on_line(rank, text)``. A rank that has finished leaves the
group and exits without the interpreter's teardown (see ``_rank_main``).

A rank that raises sends its exception (type, message, where) to the caller and exits. The other ranks would wait
in their next collective until the group's timeout (``RankSetup.timeout_s``); the caller does not let them:
as soon as one rank fails (or exits without a result, killed or crashed) it stops the others (SIGTERM, then
SIGKILL after ``STOP_GRACE_S``) and raises ``RankFailed`` naming the rank and its exception. The timeout remains
for ranks whose caller is gone; each rank also exits by itself when its caller does.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

STOP_GRACE_S = 3.0
"""Seconds a rank that is being stopped gets to exit on SIGTERM before it is killed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSetup:
    """How the ranks are started."""

    world: int
    """Ranks (processes) in the group."""
    threads: int = 1
    """torch compute threads of each rank (``torch.set_num_threads``)."""
    timeout_s: float = 300.0
    """The gloo group's timeout (seconds): how long a collective waits for the other ranks before it fails; also
    the longest any rank may spend between two collectives (capturing or planning) while the others wait."""

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world must be a whole number of ranks >= 1, got {self.world!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be a whole number >= 1, got {self.threads!r}")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")


class RankFailed(RuntimeError):
    """A rank raised (or exited without a result); the others were stopped. ``rank``: which one; ``error_type``,
    ``detail``: its exception's type name and message; ``where``: the file, line and function it was raised in
    (empty if unknown); ``trace``: its formatted traceback (empty if it sent none)."""

    def __init__(self, rank: int, error_type: str, detail: str, where: str = "", trace: str = "") -> None:
        at = f" (raised in {where})" if where else ""
        super().__init__(f"rank {rank} failed: {error_type}: {detail}{at}; the other ranks were stopped")
        self.rank, self.error_type, self.detail, self.where, self.trace = rank, error_type, detail, where, trace


def run_on_ranks(work: Callable[[int, Any, Callable[[str], None]], Any], payload: Any, setup: RankSetup, *,
                 on_line: Callable[[int, str], None] = lambda rank, text: None) -> list[Any]:
    """``work(rank, payload, say)``'s result on each of ``setup.world`` ranks, in rank order (the module docstring
    says how they run). ``work`` must be a module-level function and ``payload`` and the results picklable. Raises
    ``RankFailed`` as soon as any rank fails, with every rank stopped."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    readers: dict[Connection, int] = {}
    with tempfile.TemporaryDirectory(prefix="hyperoffload-ranks-") as folder:
        store = os.path.join(folder, "store")
        try:
            for rank in range(setup.world):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(target=_rank_main, name=f"hyperoffload-rank-{rank}", daemon=True,
                                          args=(rank, work, payload, setup, store, writer, os.getpid()))
                process.start()
                writer.close()  # the child holds the only writer: its end of the pipe closes when it exits
                processes.append(process)
                readers[reader] = rank
            return _collect(processes, readers, on_line)
        finally:
            _stop(processes)
            for reader in readers:
                reader.close()


def _collect(processes: list[Any], readers: dict[Connection, int], on_line: Callable[[int, str], None]) -> list[Any]:
    """Read the ranks' messages until rank 0 has sent the results and every rank has exited cleanly; raise
    ``RankFailed`` for the first rank that reports an error or exits without one."""
    results: list[Any] | None = None
    open_readers = dict(readers)
    while True:
        if results is not None and all(p.exitcode == 0 for p in processes):
            return results
        running = {p.sentinel: rank for rank, p in enumerate(processes) if p.exitcode is None}
        ready = wait([*open_readers, *running], timeout=1.0)
        for reader in [r for r in ready if r in open_readers]:
            results = _read(reader, open_readers, on_line, results)
        for rank, process in enumerate(processes):
            if process.exitcode not in (None, 0):
                # Its last words may still be in its pipe: read them before saying it died without any.
                reader = next((r for r, k in open_readers.items() if k == rank), None)
                while reader is not None and reader in open_readers:
                    results = _read(reader, open_readers, on_line, results)
                raise RankFailed(rank, "exited", _exit_status(process.exitcode))
        if results is None and not open_readers and all(p.exitcode == 0 for p in processes):
            raise RankFailed(0, "exited", "every rank exited but rank 0 sent no results")


def _read(reader: Connection, open_readers: dict[Connection, int], on_line: Callable[[int, str], None],
          results: list[Any] | None) -> list[Any] | None:
    """Handle one message from ``reader`` (or its end); return the results, if this was rank 0 sending them."""
    rank = open_readers[reader]
    try:
        kind, body = reader.recv()
    except (EOFError, OSError):
        del open_readers[reader]
        return results
    if kind == "line":
        on_line(rank, body)
    elif kind == "error":
        raise RankFailed(rank, *body)
    elif kind == "results":
        return body
    return results


def _exit_status(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the process was killed by {name} before it finished"
    return f"the process exited with status {code} before it finished"


def _stop(processes: list[Any]) -> None:
    """Stop every rank still running: SIGTERM, then SIGKILL after ``STOP_GRACE_S`` (a rank blocked in a collective
    runs no Python signal handler)."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in alive:
        if process.is_alive():
            process.kill()
            process.join()


def _rank_main(rank: int, work: Callable, payload: Any, setup: RankSetup, store: str, writer: Connection,
               parent: int) -> None:
    """One rank's process: join the group, run ``work``, send rank 0 the results; on any error, send it and exit
    with status 1 at once (the caller stops the others)."""
    _exit_with(parent)
    _thread_lock_for_tqdm()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(setup.threads)
        dist.init_process_group("gloo", store=dist.FileStore(store, setup.world), rank=rank,
                                world_size=setup.world, timeout=datetime.timedelta(seconds=setup.timeout_s))
        result = work(rank, payload, lambda text: writer.send(("line", str(text))))
        gathered = [None] * setup.world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        writer.send(("results", gathered) if rank == 0 else ("done", None))
        dist.destroy_process_group()
        writer.close()
    except BaseException as error:  # noqa: BLE001 - reported to the caller, which stops every rank
        try:
            writer.send(("error", _described(error)))
            writer.close()
        finally:
            os._exit(1)  # now: an orderly exit could wait on the group's threads, which wait on the other ranks
    # Done: exit at once, as on an error. The interpreter's teardown would run the C++ destructors of threads that
    # torch and gloo started, and one still joinable there aborts the process ("terminate called without an active
    # exception"), which the caller would take for a rank that failed after sending its results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _described(error: BaseException) -> tuple[str, str, str, str]:
    """``error`` as text that crosses processes: its type, message (with any notes), where it was raised, and its
    traceback."""
    detail = str(error) or repr(error)
    notes = getattr(error, "__notes__", None) or ()
    if notes:
        detail += "".join(f"; {note}" for note in notes)
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return type(error).__name__, detail, where, "".join(traceback.format_exception(error))


def _thread_lock_for_tqdm() -> None:
    """Give tqdm (torch.fx's Interpreter makes a disabled bar with it) a thread lock: by default it makes a
    multiprocessing lock on first use, a named semaphore that a rank stopped by a signal would leave behind."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _exit_with(parent: int) -> None:
    """Exit this process (status 1) as soon as the process ``parent`` is gone, so that no rank outlives a caller
    that was killed."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="hyperoffload-parent-watch", daemon=True).start()


__all__ = ["RankFailed", "RankSetup", "run_on_ranks"]
