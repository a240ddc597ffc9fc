"""A plan for a GPU step lowers to cache operators that move data between the GPU and host memory.

Autograd and kernels need a GPU, but fake tensors of a CUDA device do not: the step is captured on fake CUDA
tensors and its lowered graph run under the same fake mode, which checks every operator's devices (a kernel
reading tensors of two devices raises)."""

import torch
import torch.fx
from torch import nn

import hyperoffload
from hyperoffload import cache_ops
from hyperoffload.capture.fake import fake_build
from hyperoffload.capture.steps import capture_prefill_step
from hyperoffload.compile.held_inputs import start_released_inputs_remote
from hyperoffload.lower import lower_plan
from hyperoffload.plans import Kind


class SkipMLP(nn.Module):
    """Matrix products with a long skip connection: the first activation is read again at the end, so a tight
    budget offloads it, and the weights start the step in remote memory."""

    def __init__(self, width: int = 256, layers: int = 5, device: str = "cuda") -> None:
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.empty(width, width, device=device), requires_grad=False)
                                   for _ in range(layers))

    def forward(self, x):
        first = h = torch.relu(x @ self.ws[0])
        for w in self.ws[1:]:
            h = torch.relu(h @ w)
        return h + first


def _devices_of(gm: torch.fx.GraphModule, inputs) -> dict[str, tuple[object, torch.device]]:
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and n.op == "call_function":
                seen[n.name] = (n.target, out.device)
            return out

    Recorder(gm).run(*inputs)
    return seen


def test_a_gpu_plan_offloads_to_host_memory_and_prefetches_back_to_the_gpu():
    with fake_build():
        captured = capture_prefill_step(SkipMLP(), (torch.empty(512, 256, device="cuda"),))
        plan = start_released_inputs_remote(hyperoffload.plan(captured.program, "h100-sxm", "60%"))
        kinds = {i.kind for i in plan.instructions}
        assert {Kind.OFFLOAD, Kind.PREFETCH, Kind.RELEASE} <= kinds and plan.initial_remote
        gm = lower_plan(plan)
        values = plan.program.values
        # The caller passes each input that starts the step remote in host memory, as the lowered graph says.
        inputs = [t.to("cpu") if values[v].storage in plan.initial_remote else t
                  for v, t in zip(plan.program.inputs, captured.inputs)]
        for node, t in zip(gm.graph.find_nodes(op="placeholder"), inputs):
            assert node.meta["val"].device == t.device
        devices = _devices_of(gm, inputs)
    by_target = {}
    for target, device in devices.values():
        by_target.setdefault(target, set()).add(device.type)
    assert by_target.pop(cache_ops.OFFLOAD) == {"cpu"}
    assert by_target.pop(cache_ops.PREFETCH) == {"cuda"}
    # Prefetched copies (an offload's buffer is waited for only if nothing prefetches it while it is in flight).
    assert "cuda" in by_target.pop(cache_ops.WAIT)
    assert set().union(*by_target.values()) == {"cuda"}  # every op of the step itself runs on the GPU
    prefetches = gm.graph.find_nodes(op="call_function", target=cache_ops.PREFETCH)
    assert prefetches and all(n.args[1] == torch.device("cuda", 0) for n in prefetches)


def test_a_cpu_plan_lowers_as_before():
    with fake_build():
        captured = capture_prefill_step(SkipMLP(device="cpu"), (torch.empty(512, 256),))
        plan = start_released_inputs_remote(hyperoffload.plan(captured.program, "h100-sxm", "60%"))
    gm = lower_plan(plan)
    prefetches = gm.graph.find_nodes(op="call_function", target=cache_ops.PREFETCH)
    assert prefetches and all(len(n.args) == 1 for n in prefetches)  # both tiers are host memory: no device
