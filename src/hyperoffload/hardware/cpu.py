"""The ``cpu-emulated`` profile: this machine's CPU as the device, an emulated link as the remote tier.

Compute is measured by a short calibration (about a second): matmul FLOP/s per dtype, memory
bandwidth from a large copy, and the per-op dispatch overhead of calling an aten op from Python
(what the executors pay per op). Results are cached in a JSON file when a path is given, keyed by
the torch version and thread count, so later runs reuse them. The link's bandwidth and latency
are parameters: the CPU runtime throttles its copy threads to them.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from hyperoffload.hardware.profile import Hardware

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
    (written to ``cache_path`` when given)."""
    if cache_path is not None and cache_path.is_file():
        try:
            cached = CpuCalibration(**json.loads(cache_path.read_text()))
            if cached.key == _key():
                return cached
        except (ValueError, TypeError):
            pass  # a corrupt or old cache is replaced by a new measurement
    calibration = measure_cpu()
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(asdict(calibration), indent=2))
    return calibration


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
