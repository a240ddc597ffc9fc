"""Other captures of the same step that a policy may plan instead: a decode step with its KV cache in
remote memory.

A decode step of a DeepSeek-style workload is captured with its KV cache on the device (what ``none``,
``kv-naive`` and the other policies plan); ``workloads.build.capture_workload`` gives its Program a
``RemoteKvForms`` (``Program.remote_kv``): how to capture the same step with the latent cache in remote memory
and a device block pool of a given size (``deepseek_remote.capture_remote_decode_step``), and the sizes a pool is
chosen from. ``paged`` and ``hyperoffload`` plan that form when it serves the budget better (``largest_pool_form``
gives it with its pool size, a ``RemoteKvForm``). Captures are made on first use and kept with the step's Program
(``CapturedForms``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyperoffload.analysis import memory_profile
from hyperoffload.ir import Program, ValueKind

RemoteCapture = Callable[[int | None, bool], Any]
"""(pool_blocks, speculative) -> a ``capture.Captured`` of the step with its KV cache remote."""


class CapturedForms:
    """The remote-KV forms of one step captured so far, by (pool_blocks, speculative): a cache, filled on first use
    of each form and kept as long as the step's Program (whose ``RemoteKvForms`` holds it), since a capture costs a
    trace of the model."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[tuple[int | None, bool], Any] = {}

    def get(self, key: tuple[int | None, bool], capture: RemoteCapture):
        """The ``Captured`` form for ``key``, made by ``capture(*key)`` the first time it is asked for."""
        if key not in self._by_key:
            self._by_key[key] = capture(*key)
        return self._by_key[key]

    def find(self, variant: Program):
        """The ``Captured`` that ``variant`` is the Program of, among the forms made so far, or None."""
        for captured in self._by_key.values():
            if captured.program is variant:
                return captured
        return None


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
    captures: CapturedForms = field(default_factory=CapturedForms, repr=False)
    """The forms ``capture`` made so far (the only part that changes)."""

    def captured(self, pool_blocks: int | None, speculative: bool = False):
        """The ``Captured`` form with ``pool_blocks`` blocks per sequence and layer (None: no pool), captured on
        first use."""
        return self.captures.get((pool_blocks, speculative), self.capture)


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteKvForm:
    """A decode step's form with its KV cache in remote memory, and the block pool it was captured with."""

    program: Program
    pool_blocks: int | None
    """Blocks per sequence and layer of its device block pool (None: no pool)."""


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
    return None if step.remote_kv is None else step.remote_kv.captures.find(variant)


def remote_kv_form(program: Program, pool_blocks: int | None) -> RemoteKvForm:
    """``remote_kv_variant`` with its pool size."""
    return RemoteKvForm(program=remote_kv_variant(program, pool_blocks), pool_blocks=pool_blocks)


def largest_pool_form(program: Program, budget_bytes: int) -> RemoteKvForm | None:
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
        bare = remote_kv_form(program, None)
        return bare if memory_profile(bare.program).peak_bytes <= budget_bytes else None
    # The pool is a step input the size of its blocks: the peak grows by exactly that per block.
    pool = min(valid, top_n + (budget_bytes - peak) // per_block)
    form = remote_kv_form(program, pool)
    while memory_profile(form.program).peak_bytes > budget_bytes and pool > top_n:
        pool -= 1
        form = remote_kv_form(program, pool)
    return form


def largest_pool_variant(program: Program, budget_bytes: int) -> Program | None:
    """The Program of ``largest_pool_form``, or None."""
    form = largest_pool_form(program, budget_bytes)
    return None if form is None else form.program


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
