"""A plan pass for Inductor: each wait moved up to where Inductor could not fuse across anyway.

A plan waits for a transfer right before the first op that reads its storage. In a compiled step a wait
is a barrier no fused kernel crosses (``KeepPlanOrder``), so waits spread over a run of elementwise ops
split the run into several kernels, each writing its results to memory for the next to read back. An
optimizer update is such a run: AdamW reads a parameter's gradient, its two moments and the parameter
itself, and the plan waits for each just before its first read, where Inductor would fuse the whole
update into one kernel.

``gathered_waits`` moves each wait up past the ops before it, up to (not past) an op Inductor runs as an
external kernel (a matrix product, attention, a convolution: no fusion crosses those anyway), another wait
(so waits keep their order), or a transfer or release of its own storage. A wait allocates and frees
nothing, so no budget moves; the compute stream waits earlier, which costs nothing when the transfer has
landed by then, and the plan's simulated step says what it costs.
"""

from __future__ import annotations

import dataclasses

from hyperoffload.plans import Instr, Kind, Plan

EXTERN_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._scaled_dot_product_",
              "aten.convolution.", "aten.convolution_backward.", "aten._grouped_mm.")
"""Ops (``Op.target`` prefixes) Inductor calls as external kernels, which no fused kernel includes."""


def gathered_waits(plan: Plan) -> Plan:
    """``plan`` with each wait moved up as far as the module docstring says; ``plan`` itself if none moves."""
    extern = [op.target.startswith(EXTERN_OPS) for op in plan.program.ops]
    instructions: list[Instr] = []
    moved = False
    for ins in plan.instructions:
        if ins.kind is not Kind.WAIT:
            instructions.append(ins)
            continue
        at = len(instructions)
        while at > 0:
            before = instructions[at - 1]
            if before.kind is Kind.COMPUTE:
                if extern[before.target]:
                    break
            elif before.kind is Kind.WAIT or before.target == ins.target:
                break
            at -= 1
        moved |= at < len(instructions)
        instructions.insert(at, ins)
    return dataclasses.replace(plan, instructions=tuple(instructions)) if moved else plan


__all__ = ["EXTERN_OPS", "gathered_waits"]
