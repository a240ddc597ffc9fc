"""What the torch.compile backend costs on CPU: compile time and step time against eager and aot_eager.

Trains copies of one tiny-llama (batch 2, seq 64, float32) side by side: eager, ``torch.compile``
with ``aot_eager`` (the same aot_autograd graphs without a plan), and ``torch.compile`` with
``hyperoffload.backend`` at each budget. For each it reports the first step (compile included) and
the median of the next steps (forward + backward, no optimizer; steps of all variants interleaved),
as ratios to eager measured in this run, plus the backend's planning time and what it moves per
step. The copies are synchronous CPU copies, so the step-time ratio is the price of the copies
themselves, with no overlap. A step takes tens of milliseconds: on a shared machine, use many steps.

    .venv/bin/python bench/compile_backend.py [--steps 21] [--budgets 80% 50%] [--hardware h100-sxm]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import hyperoffload
from hyperoffload.units import format_bytes
from hyperoffload.workloads import Llama, get_workload


def one_step(model, batch) -> float:
    """Seconds for one forward + backward (gradients dropped afterwards)."""
    tokens, targets = batch
    start = time.perf_counter()
    F.cross_entropy(model(tokens).flatten(0, -2), targets.flatten()).backward()
    elapsed = time.perf_counter() - start
    for p in model.parameters():
        p.grad = None
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--budgets", nargs="+", default=["80%", "50%"])
    parser.add_argument("--hardware", default="h100-sxm")
    args = parser.parse_args()

    workload = get_workload("tiny-llama")
    torch.manual_seed(0)
    base = Llama(workload.config)
    vocab = workload.config.vocab_size
    batch = (torch.randint(0, vocab, (workload.batch, workload.seq)),
             torch.randint(0, vocab, (workload.batch, workload.seq)))

    variants: dict[str, object] = {"eager": copy.deepcopy(base)}
    first: dict[str, float] = {}
    plans: dict[str, object] = {}
    for name in ["aot_eager", *args.budgets]:
        torch._dynamo.reset()
        if name == "aot_eager":
            backend = "aot_eager"
        else:
            backend = plans[name] = hyperoffload.backend(budget=name, hardware=args.hardware)
        variants[name] = torch.compile(copy.deepcopy(base), backend=backend, dynamic=False)
        first[name] = one_step(variants[name], batch)  # compiles
    # Steps interleaved round-robin, so load from other processes hits every variant alike.
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.steps):
        for name, model in variants.items():
            times[name].append(one_step(model, batch))
    median = {name: statistics.median(t) for name, t in times.items()}
    eager_s = median["eager"]
    print(f"tiny-llama train step, batch {workload.batch}, seq {workload.seq}, float32; eager step "
          f"{eager_s * 1e3:.1f} ms (median of {args.steps}, interleaved)")
    print(f"{'variant':<20} {'first/eager':>12} {'step/eager':>11} {'plan_s':>7} {'moved per step':>15}")
    for name, first_s in first.items():
        record = plans[name].last if name in plans else None
        label = name if record is None else f"hyperoffload {name}"
        plan_s = f"{record.plan_s:.2f}" if record else "-"
        moved = format_bytes(record.figures.h2d_bytes + record.figures.d2h_bytes) if record else "-"
        print(f"{label:<20} {first_s / eager_s:>12.1f} {median[name] / eager_s:>11.2f} {plan_s:>7} {moved:>15}")


if __name__ == "__main__":
    main()
