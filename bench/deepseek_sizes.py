"""Sizes and capture times of the DeepSeek-style presets (fake capture: nothing is allocated).

For each step: parameters, KV cache, peak device bytes with no offload, FLOPs, capture time, and for
decode the bytes the NSA branches read from the latent cache per step (selected blocks gathered plus
the window) against the whole latent cache, i.e. what a remote KV cache would have to deliver.

    .venv/bin/python bench/deepseek_sizes.py            # v2-lite batch 32 context 32768, v3 batch 1
    .venv/bin/python bench/deepseek_sizes.py --quick    # tiny-deepseek only
"""

from __future__ import annotations

import argparse

import torch

from hyperoffload.analysis import memory_profile
from hyperoffload.ir import ValueKind
from hyperoffload.units import format_bytes
from hyperoffload.workloads import capture_workload, get_workload

# (workload, mode, sizes): the DeepSeek-style inference cases of docs/results.md.
CASES = [
    ("deepseek-v2-lite", "decode", {"batch": 32, "context": 32768}),
    ("deepseek-v2-lite", "prefill", {"batch": 32, "seq": 32768}),
    ("deepseek-v2-lite", "prefill", {"batch": 1, "seq": 4096}),
    ("deepseek-v3", "decode", {"batch": 1, "context": 32768}),
    ("deepseek-v3", "prefill", {"batch": 1, "seq": 4096}),
]
QUICK = [("tiny-deepseek", "decode", {}), ("tiny-deepseek", "prefill", {})]

# Ops through which a decode step reads latent-cache rows by index: selected blocks, window, compression.
GATHERS = ("aten.index.Tensor", "aten.index_select.default")
ALIASES = ("aten.index_copy_.default", "aten.view.default")


def measure(name: str, mode: str, sizes: dict) -> dict:
    workload = get_workload(name)
    captured = capture_workload(workload, mode, **sizes)
    program = captured.program
    values = program.values
    kinds = {kind: sum(values[v].nbytes for v in program.inputs if values[v].kind == kind)
             for kind in (ValueKind.PARAMETER, ValueKind.KV_CACHE)}
    row = {"workload": name, "mode": mode, **sizes, "params_bytes": kinds[ValueKind.PARAMETER],
           "kv_bytes": kinds[ValueKind.KV_CACHE], "peak_bytes": memory_profile(program).peak_bytes,
           "flops": sum(op.flops for op in program.ops), "capture_s": captured.capture_s,
           "kv_bytes_per_token": workload.config.kv_bytes_per_token(workload.dtype)}
    if mode == "decode":
        latent = {v for v in program.inputs if values[v].name.endswith("kv_latent")}
        row["latent_bytes"] = sum(values[v].nbytes for v in latent)
        gathered = 0
        for op in program.ops:  # follow the cache through its in-place write and block view
            if not latent & set(op.inputs):
                continue
            if op.target in GATHERS:
                gathered += sum(values[out].nbytes for out in op.outputs)
            elif op.target in ALIASES:
                latent |= set(op.outputs)
        row["gathered_bytes"] = gathered
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-deepseek only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, mode, sizes in QUICK if args.quick else CASES:
        r = measure(name, mode, sizes)
        shape = ", ".join(f"{k} {v}" for k, v in sizes.items()) or "defaults"
        line = (f"{name} {mode} ({shape}): params {format_bytes(r['params_bytes'])}, KV cache "
                f"{format_bytes(r['kv_bytes'])} ({r['kv_bytes_per_token']:,} B/token latent), peak "
                f"{format_bytes(r['peak_bytes'])}, {r['flops'] / 1e12:.2f} TFLOP, capture {r['capture_s']:.1f} s")
        if mode == "decode":
            line += (f"; NSA gathers {format_bytes(r['gathered_bytes'])} of the {format_bytes(r['latent_bytes'])} "
                     f"latent cache per step ({r['gathered_bytes'] / r['latent_bytes']:.3f})")
        print(line, flush=True)


if __name__ == "__main__":
    main()
