"""Other captures of the same step that a policy may plan instead: a decode step with its KV cache in
remote memory.

A decode step of a DeepSeek-style workload is captured with its KV cache on the device (what ``none``,
``kv-naive`` and the other policies plan); ``workloads.build.capture_workload`` gives its Program a
``RemoteKvForms`` (``Program.remote_kv``): how to capture the same step with the latent cache in remote memory
and a device block pool of a given size (``deepseek_remote.capture_remote_decode_step``), and the sizes a pool is
chosen from. ``paged`` and ``hyperoffload`` plan that form when it serves the budget better. Captures are made on
first use and kept with the step's Program.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyperoffload.analysis import memory_profile
from hyperoffload.ir import Program, ValueKind

RemoteCapture = Callable[[int | None, bool], Any]
"""(pool_blocks, speculative) -> a ``capture.Captured`` of the step with its KV cache remote."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RemoteKvForms:
    """How to capture a decode step with its KV cache in remote memory, and the captures made so far.

    The figures are the device step's own (``deepseek_remote.pool_facts``): what sizing a block pool needs."""

    capture: RemoteCapture = field(repr=False)
    """``capture(pool_blocks, speculative)`` returns the ``Captured`` step with its KV cache remote, a pool of
    ``pool_blocks`` blocks per sequence and layer (None: no pool), and ``speculative`` prefetch (no pool)."""
    smallest_pool: int
    """Blocks one step selects per sequence and layer (``nsa_top_n``): the smallest pool (blocks)."""
    valid_blocks: int
    """Blocks holding tokens up to the step's own, per sequence and layer: the largest useful pool (blocks)."""
    pool_block_bytes: int
    """Device bytes one more pool block per sequence costs over all layers, its block-table entry included."""
    made: dict[tuple[int | None, bool], Any] = field(default_factory=dict, repr=False)
    """(pool_blocks, speculative) -> the ``Captured`` made by ``capture``: each form is captured once, on first
    use, and kept as long as the step is (the only part that changes)."""

    def captured(self, pool_blocks: int | None, speculative: bool = False):
        """The ``Captured`` form with ``pool_blocks`` blocks per sequence and layer (None: no pool), captured on
        first use."""
        key = (pool_blocks, speculative)
        if key not in self.made:
            self.made[key] = self.capture(pool_blocks, speculative)
        return self.made[key]

    def find(self, variant: Program):
        """The ``Captured`` that ``variant`` is the Program of, among the forms made so far, or None."""
        for captured in self.made.values():
            if captured.program is variant:
                return captured
        return None


def has_remote_kv(program: Program) -> bool:
    """Whether ``program``'s step can also be captured with its KV cache remote (``Program.remote_kv``)."""
    return program.remote_kv is not None


def _forms(program: Program) -> RemoteKvForms:
    if program.remote_kv is None:
        raise KeyError(f"{program.name} {program.mode} has no remote-KV form (Program.remote_kv is None): only a "
                       f"decode step of a DeepSeek-style workload has one")
    return program.remote_kv


def remote_kv_variant(program: Program, pool_blocks: int | None) -> Program:
    """``program``'s step with its KV cache in remote memory and a pool of ``pool_blocks`` blocks per
    sequence and layer (None: none). Raises ``KeyError`` if the step has no such form."""
    return remote_kv_captured(program, pool_blocks).program


def remote_kv_captured(program: Program, pool_blocks: int | None, speculative: bool = False):
    """Like ``remote_kv_variant``, the whole ``Captured`` (its example inputs run the variant's graph)."""
    return _forms(program).captured(pool_blocks, speculative)


def smallest_pool_variant(program: Program) -> Program:
    """``program``'s step with its KV cache remote and the smallest pool: the blocks one step selects."""
    return remote_kv_variant(program, _forms(program).smallest_pool)


def speculative_variant(program: Program) -> Program:
    """``program``'s step with its KV cache remote and no pool: each layer prefetches the blocks it selected
    at the previous step before its own selection is known, then fetches what that missed."""
    return remote_kv_captured(program, None, speculative=True).program


def find_captured(variant: Program, step: Program):
    """The ``Captured`` that ``variant`` (a remote-KV form of ``step`` made here) came from, or None (``variant``
    is ``step`` itself, or ``step`` has no remote-KV form)."""
    return None if step.remote_kv is None else step.remote_kv.find(variant)


def largest_pool_variant(program: Program, budget_bytes: int) -> Program | None:
    """The remote-KV form of ``program`` with the largest block pool whose unplanned peak fits
    ``budget_bytes``; the form without a pool if even the smallest pool (one step's selection) does not
    fit; None if that does not fit either (its peak, ``remote_kv_variant(program, None)``, is what the
    smallest remote form needs)."""
    if not has_remote_kv(program):
        return None
    forms = program.remote_kv
    top_n, valid, per_block = forms.smallest_pool, forms.valid_blocks, forms.pool_block_bytes
    smallest = remote_kv_variant(program, top_n)
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
