"""Train the tiny LLaMA with ``torch.compile(backend=hyperoffload.backend(...))`` next to eager.

Run: ``.venv/bin/python examples/compile_tiny_llama.py [--budget 50%] [--hardware h100-sxm] [--steps 3]``

Both copies start from the same weights and take AdamW steps on the same batches; the script prints
each step's loss and the largest difference of any gradient from eager (0 on CPU in float32), then
what the backend planned for the compiled step: its budget, the step's peak with and without the
plan, the cache operators in the forward and backward graphs, and the plan simulated on the profile.
"""

from __future__ import annotations

import argparse
import copy
from collections import Counter

import torch
import torch.nn.functional as F

import hyperoffload
from hyperoffload.plans import Kind
from hyperoffload.units import format_bytes, format_seconds
from hyperoffload.workloads import Llama, get_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="50%", help="bytes (40MiB), a percentage of the step's peak, or hideable")
    parser.add_argument("--hardware", default="h100-sxm", help="hardware profile the plan is made for")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    args = parser.parse_args()

    workload = get_workload("tiny-llama")
    vocab = workload.config.vocab_size
    torch.manual_seed(0)
    model = Llama(workload.config)
    eager = copy.deepcopy(model)
    backend = hyperoffload.backend(budget=args.budget, hardware=args.hardware)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, eager)]

    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (workload.batch, workload.seq))
        targets = torch.randint(0, vocab, (workload.batch, workload.seq))
        losses = []
        for m in (compiled, eager):
            loss = F.cross_entropy(m(tokens).flatten(0, -2), targets.flatten())
            loss.backward()
            losses.append(loss)
        diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), eager.parameters()))
        print(f"step {step}: loss {losses[0].item():.6f} (eager {losses[1].item():.6f}), "
              f"max |grad - eager grad| = {diff}")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()

    record = backend.last
    program, figures = record.program, record.figures
    moved = Counter(program.values[i.target].kind.value for i in record.plan.instructions if i.kind is Kind.OFFLOAD)
    print(f"\nplanned on {backend.hardware.name} in {record.plan_s:.2f} s ({len(program.ops)} ops, forward and "
          f"backward as one step)")
    print(f"  budget {format_bytes(record.budget_bytes)}: peak {format_bytes(record.unplanned_peak_bytes)} without "
          f"offload, {format_bytes(record.planned_peak_bytes)} with the plan")
    print(f"  cache operators in the compiled graphs: {record.cache_op_counts()}")
    print(f"  offloaded: {dict(moved)}; kept in remote memory between steps: {len(record.plan.initial_remote)} inputs")
    print(f"  simulated: compute {format_seconds(figures.compute_s)}, step {format_seconds(figures.step_s)} "
          f"(slowdown {figures.slowdown:.3f}), {format_bytes(figures.h2d_bytes)} in, "
          f"{format_bytes(figures.d2h_bytes)} out per step")


if __name__ == "__main__":
    main()
