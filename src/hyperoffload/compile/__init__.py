"""The ``torch.compile`` backend: plan a compiled step's forward and backward as one, run the cache operators inside."""

from hyperoffload.compile.backend import Backend, CompiledGraph, backend, check_budget_text
from hyperoffload.compile.joint import JointGraph, join_graphs
from hyperoffload.compile.split import SplitError, keep_backward_inputs_in_backward, split_lowered

__all__ = ["Backend", "CompiledGraph", "JointGraph", "SplitError", "backend", "check_budget_text", "join_graphs",
           "keep_backward_inputs_in_backward", "split_lowered"]
