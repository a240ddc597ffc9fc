"""Every rank runs the same plan: checked across the ranks of a process group before a sharded step runs.

Ranks plan independently, from identical inputs, and deterministic planning gives them the same plan
(``plans.plan_digest``). A rank whose plan differed would issue its collectives in another order than the others
and every rank would wait on them for ever, so ``check_same_plan`` compares the digests of all ranks (one
``all_gather_object`` of a 64-character string) and refuses, on every rank alike, before the first step.
"""

from __future__ import annotations

from hyperoffload.plans import Plan, plan_digest


class PlanMismatch(RuntimeError):
    """The ranks of a group hold different plans; ``digests`` lists each rank's."""

    def __init__(self, message: str, digests: list[str]) -> None:
        super().__init__(message)
        self.digests = digests


def check_same_plan(plan: Plan, group=None) -> str:
    """``plan``'s digest, once every rank of ``group`` (``torch.distributed``'s default group when None; it must be
    initialized) has the same; else ``PlanMismatch`` on every rank, naming the ranks that differ from rank 0."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("check_same_plan needs torch.distributed initialized (dist.init_process_group) on every "
                           "rank of the step")
    digest = plan_digest(plan)
    digests: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    differ = [rank for rank, other in enumerate(digests) if other != digests[0]]
    if differ:
        ranks = ", ".join(str(r) for r in differ)
        raise PlanMismatch(
            f"rank{'s' if len(differ) > 1 else ''} {ranks} planned the step differently from rank 0 (plan digest "
            f"{digests[differ[0]][:12]} against {digests[0][:12]}); the ranks would issue their collectives in "
            f"different orders and wait on each other for ever. Give every rank the same step (model, batch shape, "
            f"world size), budget, hardware profile, policy and hyperoffload version", digests)
    return digest


__all__ = ["PlanMismatch", "check_same_plan"]
