"""Other captures of the same step that a policy may plan instead: a decode step with its KV cache in
remote memory.

A decode step of a DeepSeek-style workload is captured with its KV cache on the device (what ``none``,
``kv-naive`` and the other policies plan); ``workloads.build.capture_workload`` registers here how to
capture the same step with the latent cache in remote memory and a device block pool of a given size
(``deepseek_remote.capture_remote_decode_step``). ``paged`` and ``hyperoffload`` plan that form when it
serves the budget better. Captures are made on first use and kept while the step is alive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

from hyperoffload.analysis import memory_profile
from hyperoffload.ir import Program, ValueKind

RemoteCapture = Callable[[int | None, bool], Any]
"""(pool_blocks, speculative) -> a ``capture.Captured`` of the step with its KV cache remote."""
_REMOTE: WeakKeyDictionary[Program, tuple[RemoteCapture, dict]] = WeakKeyDictionary()


def register_remote_kv(program: Program, capture: RemoteCapture) -> None:
    """Say how to capture ``program``'s step with its KV cache remote: ``capture(pool_blocks, speculative)``
    (pool_blocks None: no pool) returns a ``Captured``."""
    _REMOTE[program] = (capture, {})


def has_remote_kv(program: Program) -> bool:
    return program in _REMOTE


def remote_kv_variant(program: Program, pool_blocks: int | None) -> Program:
    """``program``'s step with its KV cache in remote memory and a pool of ``pool_blocks`` blocks per
    sequence and layer (None: none). Raises ``KeyError`` if no such form was registered."""
    return remote_kv_captured(program, pool_blocks).program


def remote_kv_captured(program: Program, pool_blocks: int | None, speculative: bool = False):
    """Like ``remote_kv_variant``, the whole ``Captured`` (its example inputs run the variant's graph)."""
    capture, made = _REMOTE[program]
    key = (pool_blocks, speculative)
    if key not in made:
        made[key] = capture(pool_blocks, speculative)
    return made[key]


def speculative_variant(program: Program) -> Program:
    """``program``'s step with its KV cache remote and no pool: each layer prefetches the blocks it selected
    at the previous step before its own selection is known, then fetches what that missed."""
    return remote_kv_captured(program, None, speculative=True).program


def find_captured(variant: Program):
    """The ``Captured`` that ``variant`` (a remote-KV form made here) came from, or None."""
    for _, made in _REMOTE.values():
        for captured in made.values():
            if captured.program is variant:
                return captured
    return None


def largest_pool_variant(program: Program, budget_bytes: int) -> Program | None:
    """The remote-KV form of ``program`` with the largest block pool whose unplanned peak fits
    ``budget_bytes``; the form without a pool if even the smallest pool (one step's selection) does not
    fit; None if that does not fit either (its peak, ``remote_kv_variant(program, None)``, is what the
    smallest remote form needs)."""
    if not has_remote_kv(program):
        return None
    smallest = remote_kv_variant(program, program.meta["nsa_top_n"])
    meta = smallest.meta
    top_n, valid, per_block = meta["nsa_top_n"], meta["valid_blocks"], meta["pool_block_bytes"]
    peak = memory_profile(smallest).peak_bytes
    if peak > budget_bytes:
        bare = remote_kv_variant(program, None)
        return bare if memory_profile(bare).peak_bytes <= budget_bytes else None
    # The pool is a step input the size of its blocks: the peak grows by exactly that per block.
    pool = min(valid, top_n + (budget_bytes - peak) // per_block)
    variant = remote_kv_variant(program, pool)
    while memory_profile(variant).peak_bytes > budget_bytes and pool > top_n:
        pool -= 1
        variant = remote_kv_variant(program, pool)
    return variant


def kv_placement(program: Program) -> dict:
    """How a planned program holds its KV cache, for reports: ``kv`` ("remote" for a remote-KV form,
    "device" for a step with a KV cache captured on the device), and for a remote form its ``pool_blocks``
    (per sequence and layer; None: no pool), the expected share of selected blocks fetched
    (``fetch_share``) and the stated ``reselection`` statistic. Empty for a step without a KV cache."""
    meta = program.meta
    if meta.get("kv") == "remote":
        return {"kv": "remote", "pool_blocks": meta.get("pool_blocks"), "speculative": meta.get("speculative", False),
                "fetch_share": meta.get("pool_fetch_fraction"), "reselection": meta.get("reselection")}
    if any(program.values[v].kind is ValueKind.KV_CACHE for v in program.inputs):
        return {"kv": "device"}
    return {}
