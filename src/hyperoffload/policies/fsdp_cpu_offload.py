"""``fsdp-cpu-offload``: FSDP2 with ``CPUOffloadPolicy`` on a sharded training step.

What FSDP2 does (``torch.distributed.fsdp``, ``CPUOffloadPolicy``'s docstring): it "offloads parameters, gradients,
and optimizer states to CPU. Sharded parameters are copied host-to-device before all-gather [...] Sharded gradients
are copied device-to-host in backward, and the optimizer step runs on CPU with CPU optimizer states." The plan is the
step's host-optimizer form (``host_optimizer.host_optimizer_form``: each shard fetched right before the all-gather
copy-in that reads it, in the forward and again in the backward; each gradient sent to the host right after its
reduce-scatter; the optimizer step on the host lane) with its ops in captured order, and nothing else offloaded:
activations stay on the device.

Budget: FSDP2 has no device budget to plan for. The plan carries the budget if its peak fits it; otherwise it is
returned without one, and its peak is what the policy needs (``common.fit_budget``). It refuses a step that is not a
sharded training step (``NotShardedTraining``, naming ``--world``) and a profile with no host memory bandwidth
(``cost.HostBandwidthMissing``). Its plans are simulated only: the runtime has no host lane.
"""

from __future__ import annotations

from hyperoffload.hardware import Hardware
from hyperoffload.host_optimizer import host_form_for
from hyperoffload.ir import Program
from hyperoffload.plans import Plan, compute_instructions
from hyperoffload.policies.common import fit_budget

POLICY = "fsdp-cpu-offload"


def plan_fsdp_cpu_offload(program: Program, hardware: Hardware, budget_bytes: int) -> Plan:
    """The step's host-optimizer form in captured order (module docstring)."""
    form = host_form_for(program, hardware, POLICY).program
    return fit_budget(Plan(program=form, instructions=compute_instructions(form), policy=POLICY), budget_bytes)


__all__ = ["POLICY", "plan_fsdp_cpu_offload"]
