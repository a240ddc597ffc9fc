"""``layerwise``: offload every saved activation after the forward pass is done with it, reload it when
the backward pass needs it. Models saved-tensor-hook offloading: torchtune's ``OffloadActivations`` and
``torch.autograd.graph.save_on_cpu`` (``docs/references.md``).

How faithful: the pack hook copies each saved activation to host memory and its device memory is
returned once the forward pass no longer holds it and the copy has landed; here the copy is issued
right after the activation's last forward use and released there (the simulator frees it when the
copy lands). The unpack hook copies it back when autograd first needs it in backward, with no
lookahead: here a prefetch immediately followed by a wait, right before its first backward use.
Activations under ``min_offload_bytes`` (torchtune's ``min_offload_size``, 1024 bytes) stay. Weights,
gradients and optimizer state never move.

Budget: these hooks know nothing of a budget. The plan is whatever this rule gives; if its peak is
over the budget it is returned without one, and its peak is what the policy needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Phase, Program, ValueKind
from hyperoffload.plans import Kind, Plan
from hyperoffload.policies.common import Placed, emit_plan

POLICY = "layerwise"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerwiseConfig:
    """Knobs of the saved-tensor hooks."""

    min_offload_bytes: int = 1024
    """Saved activations smaller than this (bytes) stay on the device (torchtune's default)."""


def plan_layerwise(program: Program, hardware: Hardware, budget_bytes: int,
                   config: LayerwiseConfig = LayerwiseConfig()) -> Plan:
    """Every saved activation out after its last forward use, back (blocking) at its first backward use."""
    values = program.values
    forward_last: dict[int, int] = {}
    backward_first: dict[int, int] = {}
    for p, op in enumerate(program.ops):
        for s in {values[v].storage for v in (*op.inputs, *op.outputs)}:
            owner = values[s]
            if owner.kind is not ValueKind.ACTIVATION or owner.alloc_bytes < config.min_offload_bytes:
                continue
            if op.phase is Phase.FORWARD:
                forward_last[s] = p
            elif op.phase is Phase.BACKWARD:
                backward_first.setdefault(s, p)
    placed: list[Placed] = []
    for s, last in forward_last.items():
        first = backward_first.get(s)
        if first is None or first <= last:
            continue  # not saved for backward after all
        placed += [Placed(last + 1, Kind.OFFLOAD, s), Placed(last + 1, Kind.RELEASE, s),
                   Placed(first, Kind.PREFETCH, s), Placed(first, Kind.WAIT, s)]
    return emit_plan(program, placed, policy=POLICY, budget_bytes=budget_bytes)
