"""The HyperOffload planner: budgeted selection of idle spans and their schedule, checked by simulation.

Every storage (parameters, gradients, optimizer state, saved activations, KV cache) idles between
two of its uses; each such span is a candidate to spend in remote memory. The planner:

1. measures each op's time with the cost model and the no-offload memory profile in plan order;
2. finds the smallest budget it can meet (every op's own inputs and outputs stay on the device,
   and a storage can leave only across a span of at least one op) and refuses smaller ones;
3. selects spans greedily where the profile is furthest over budget, preferring spans whose
   offload and prefetch hide in the compute between their uses and that relieve the most
   over-budget time per byte moved (a span that cannot be hidden is taken only when nothing
   hideable covers the position);
4. schedules them on the two copy lanes: each offload right after the use before its span, each
   release where the lane model says the offload has finished, each prefetch as late as its
   deadline needs (latest deadline first), then as early as the budget allows, in deadline order;
   a storage whose remote copy is still current is released without a second offload;
5. repeats 3-4 while the schedule leaves positions over budget, for several bandwidth margins (and, where
   saved activations are much of the peak, once more taking the step's state first where spans tie:
   ``PlannerConfig.state_first``), simulates each candidate plan and returns the fastest. The plan's own
   accounting never exceeds the budget, so neither does the simulation;
6. does all that in the captured order and in the refined execution orders (each optimizer update
   run where its gradient is final, which frees gradients early; ``reorder``, ``candidate_orders``):
   one quick pass per order (the first margin, no refinement), then the full search in the order whose
   quick plan was fastest and in any within ``PlannerConfig.quick_tolerance`` of it.

Its modules: ``config`` (``PlannerConfig``, ``PositionBudget``, ``InfeasibleBudget``), ``orders`` (the candidate
execution orders), ``minimum`` (step 2), ``context`` (what a selection pass plans from), ``selection`` (steps 3-4 for
one order, margin and start), ``passes`` (what follows the selection: reused remote copies, early prefetches, the
emitted plan), ``order_search`` (step 5 in one order), ``search`` (step 6) and ``driver`` (``plan_hyperoffload``: the
step's forms and, with a static layout, the arena that must fit).
"""

from hyperoffload.policies.hyperoffload.config import POLICY, InfeasibleBudget, PlannerConfig, PositionBudget
from hyperoffload.policies.hyperoffload.driver import plan_hyperoffload, plan_in_arena
from hyperoffload.policies.hyperoffload.minimum import minimum_budget
from hyperoffload.policies.hyperoffload.orders import candidate_orders, made_share, order_name


__all__ = ["POLICY", "InfeasibleBudget", "PlannerConfig", "PositionBudget", "plan_hyperoffload", "plan_in_arena",
           "minimum_budget", "candidate_orders", "order_name", "made_share"]
