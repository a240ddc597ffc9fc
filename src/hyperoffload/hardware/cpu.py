"""The ``cpu-emulated`` profile: this machine's CPU as the device, an emulated link as the remote tier.

Compute is measured by a short calibration (about a second): matmul FLOP/s per dtype, memory
bandwidth from a large copy, and the per-op dispatch overhead of calling an aten op from Python
(what the executors pay per op). Results are cached in a JSON file when a path is given, keyed by
the torch version and thread count, so later runs reuse them. The link's bandwidth and latency
are parameters: the CPU runtime throttles its copy threads to them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import MappingProxyType

import torch

from hyperoffload.hardware.profile import Hardware, field_problem

DEFAULT_LINK_BW = 2e9
"""Default emulated link bandwidth each way (bytes/s): slow enough that transfers matter on a CPU."""
DEFAULT_LINK_LATENCY_S = 50e-6
"""Default fixed cost per emulated copy (seconds): a thread hand-off and wake-up."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuCalibration:
    """What the calibration measured on this machine."""

    key: str
    """Identifies the setting measured (torch version, threads, machine); a cache entry is reused only on a match."""
    matmul_flops: dict[str, float]
    """Achieved matmul FLOP/s per dtype name."""
    memory_bw: float
    """Achieved copy bandwidth, bytes read plus written per second."""
    op_overhead_s: float
    """Seconds to dispatch one small aten op from Python."""
    memory_bytes: int
    """Physical memory (bytes)."""


def _key() -> str:
    return f"torch {torch.__version__}; threads {torch.get_num_threads()}; {platform.machine()} {os.cpu_count()} cpus"


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate and pick kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu() -> CpuCalibration:
    """Measure this machine (about a second of work)."""
    n = 768
    matmul_flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        seconds = _best_time(lambda: torch.mm(a, b), 5)
        matmul_flops[str(dtype).removeprefix("torch.")] = 2 * n**3 / seconds
    src = torch.randn(8 * 2**20)  # 32 MiB
    dst = torch.empty_like(src)
    memory_bw = 2 * src.nbytes / _best_time(lambda: dst.copy_(src), 5)
    x, y = torch.ones(4), torch.ones(4)
    add = torch.ops.aten.add.Tensor
    count = 2000

    def many_adds():
        for _ in range(count):
            add(x, y)

    op_overhead_s = _best_time(many_adds, 3) / count
    memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return CpuCalibration(key=_key(), matmul_flops=matmul_flops, memory_bw=memory_bw, op_overhead_s=op_overhead_s,
                          memory_bytes=memory_bytes)


def load_or_measure(cache_path: Path | None) -> CpuCalibration:
    """The cached calibration for this setting if ``cache_path`` holds one, else a fresh measurement
    (written to ``cache_path`` when given).

    A cache from another setting is measured again without a word; one that cannot be read or whose numbers
    are not what a calibration measures (text, NaN, a negative rate, tables nested in tables) is measured again
    with a warning naming the file, so that a hand-edited or damaged file never feeds the cost model. A cache
    that cannot be written is a warning too: the measurement is used, and repeated next time.
    """
    if cache_path is not None and cache_path.is_file():
        cached, problem = _read_cache(cache_path)
        if cached is not None and cached.key == _key():
            return cached
        if problem:
            warnings.warn(f"ignoring the CPU calibration cache {cache_path}: {problem}; measuring this machine again",
                          CalibrationCacheWarning, stacklevel=2)
    calibration = measure_cpu()
    if cache_path is not None:
        _write_cache(cache_path, calibration)
    return calibration


class CalibrationCacheWarning(UserWarning):
    """A CPU calibration cache was unusable (it is measured again) or could not be written."""


def _read_cache(path: Path) -> tuple[CpuCalibration | None, str | None]:
    """(the calibration ``path`` holds, None) or (None, what is wrong with it)."""
    try:
        data = json.loads(path.read_text())
    except RecursionError:
        return None, "it nests arrays or objects too deeply"
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON
        return None, f"it is not a readable JSON file ({getattr(error, 'strerror', None) or error})"
    names = [f.name for f in fields(CpuCalibration)]
    if not isinstance(data, dict) or sorted(data) != sorted(names):
        return None, f"it is not an object with exactly the keys {names}"
    if not isinstance(data["key"], str):
        return None, "key is not text"
    # The numbers follow the rules of the profile fields they become.
    for name, field in (("memory_bw", "hbm_bw"), ("op_overhead_s", "launch_s"), ("memory_bytes", "memory_bytes")):
        problem = field_problem(field, data[name])
        if problem:
            return None, f"{name} {problem.removeprefix(field + ' ')}"
    flops = data["matmul_flops"]
    if not isinstance(flops, dict) or not flops or not all(_is_rate(v) for v in flops.values()):
        return None, "matmul_flops is not an object of dtype name -> a finite FLOP/s > 0"
    return CpuCalibration(**data), None


def _is_rate(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _write_cache(path: Path, calibration: CpuCalibration) -> None:
    """Write ``calibration`` to ``path`` whole or not at all (a reader never sees half a file; a link at ``path``
    is replaced, not followed)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(asdict(calibration), indent=2))
        os.replace(partial, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        warnings.warn(f"cannot cache the CPU calibration at {path} ({error.strerror or error}); it will be measured "
                      f"again next time", CalibrationCacheWarning, stacklevel=3)


def cpu_emulated(calibration: CpuCalibration, *, h2d_bw: float = DEFAULT_LINK_BW, d2h_bw: float = DEFAULT_LINK_BW,
                 latency_s: float = DEFAULT_LINK_LATENCY_S) -> Hardware:
    """The ``cpu-emulated`` profile from a calibration and the emulated link's parameters."""
    measured = f"measured on this machine by the calibration ({calibration.key})"
    return Hardware(
        name="cpu-emulated",
        description="This machine's CPU as the device; an emulated link (throttled copy threads) as the remote tier",
        memory_bytes=calibration.memory_bytes,
        peak_flops=MappingProxyType(dict(calibration.matmul_flops)),
        hbm_bw=calibration.memory_bw,
        h2d_bw=h2d_bw, d2h_bw=d2h_bw, h2d_latency_s=latency_s, d2h_latency_s=latency_s,
        # Each direction has its own copy thread throttled far below memory bandwidth: no contention.
        duplex_share=1.0,
        launch_s=calibration.op_overhead_s,
        compute_efficiency=1.0, memory_efficiency=1.0,
        sources=MappingProxyType({
            "memory_bytes": "physical memory of this machine",
            "peak_flops": f"matmul throughput {measured}",
            "hbm_bw": f"copy throughput {measured}",
            "launch_s": f"dispatch cost of one aten op from Python, {measured}",
            "h2d_bw": "emulated link parameter", "d2h_bw": "emulated link parameter",
            "h2d_latency_s": "emulated link parameter", "d2h_latency_s": "emulated link parameter",
            "duplex_share": "each direction has its own throttled copy thread",
            "compute_efficiency": "1.0: the calibration measures achieved, not peak, throughput",
            "memory_efficiency": "1.0: the calibration measures achieved, not peak, throughput",
        }))
