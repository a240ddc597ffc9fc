"""``paged``: the KV cache in fixed blocks behind a block table, a device block pool as large as the
budget allows, and blocks swapped in from remote memory when a step misses them.

Models vLLM's PagedAttention with KV offloading (``docs/references.md``): the cache is addressed in
fixed blocks through a block table, blocks that do not fit the device live in CPU memory, and a miss
is swapped in, least-recently-used blocks making room. Applied to NSA decode (a step reads only its
selected blocks), the plan is the decode step captured with its latent cache in remote memory
(``deepseek_remote``) and the largest device block pool whose peak fits the budget
(``variants.largest_pool_variant``); the step fetches the selected blocks the pool does not hold
(``fetch_blocks_pooled``) at the moment attention reads them and waits for them: a swap-in on demand.

How faithful: vLLM swaps at sequence granularity on preemption and pages block by block in its
newer KV connectors; both fetch when the scheduler or the kernel needs the data, not ahead, and that
is what is modelled. Blocks are the NSA selection blocks (``nsa_sel_block`` tokens), not vLLM's 16
tokens. How many of a step's blocks the pool already holds is the stated statistic of
``deepseek_remote.expected_fetch_fraction``. Nothing else moves: on a step without a remote-KV form
(training, prefill, models without NSA) the plan is the captured step. If even the remote cache without
a pool does not fit the budget, the plan is returned without a budget and its peak is what the policy
needs.
"""

from __future__ import annotations

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Plan, plan_without_offload
from hyperoffload.policies.common import fit_budget
from hyperoffload.policies.reorder import fetch_on_demand
from hyperoffload.variants import has_remote_kv, largest_pool_variant, remote_kv_variant

POLICY = "paged"


def plan_paged(program: Program, hardware: Hardware, budget_bytes: int) -> Plan:
    """The step with its KV cache paged to remote memory behind the largest block pool that fits the
    budget, missed blocks fetched when attention reads them."""
    if not has_remote_kv(program):
        plan = plan_without_offload(program)
    else:
        variant = largest_pool_variant(program, budget_bytes) or remote_kv_variant(program, None)
        plan = plan_without_offload(variant, order=fetch_on_demand(variant))
    return fit_budget(Plan(program=plan.program, instructions=plan.instructions, policy=POLICY), budget_bytes)
