"""Marks left on the fx graph while a step is being traced.

``make_fx`` records aten calls but not what they mean. The step functions call
these helpers at the boundaries they know about (forward done, gradients
computed) so that the conversion to a Program can tell phases and gradient
values apart without guessing. Outside tracing they do nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from hyperoffload.ir import Phase, ValueKind

PHASE_KEY = "hyperoffload_next_phase"
KIND_KEY = "hyperoffload_kind"


def mark_phase(phase: Phase) -> None:
    """Ops traced from now on belong to ``phase``."""
    mode = get_proxy_mode()
    if mode is None:
        return
    last = next(iter(reversed(mode.tracer.graph.nodes)))
    last.meta[PHASE_KEY] = phase


def tag_values(tensors: Iterable[torch.Tensor | None], kind: ValueKind) -> None:
    """Record that the traced ``tensors`` are of ``kind`` (None entries are skipped)."""
    mode = get_proxy_mode()
    if mode is None:
        return
    for t in tensors:
        if t is None:
            continue
        node = get_proxy_slot(t, mode.tracer, None, lambda slot: slot.proxy.node)
        if node is not None:
            node.meta[KIND_KEY] = kind
