"""Device bytes a whole training step holds under ``hyperoffload.backend``, against the budget of its compiled graph.

The backend plans what ``torch.compile`` hands it: the model's forward and backward. What runs outside the
compiled graph (an eager loss, autograd's buffers, the parameters' ``.grad``) is not planned, so the whole step
can hold more than the budget; ``train_step`` plans and measures the whole step instead. For each budget this
trains a 2-layer ``tiny-llama`` (random weights, float32, CPU) for one step to compile, then measures the next
forward and backward with PyTorch's profiler (``runtime.device_peak``: every CPU allocation outside the
``offload`` operator counts as device memory), plus the inputs the plan starts on the device (its
``initial_bytes``: on the CPU, an input the plan keeps in remote memory between steps is the caller's own tensor).

Prints one line per compiler and budget, or with ``--json`` one object
``{"load_avg", "rows": [{"compiler", "budget", "budget_bytes", "planned_peak_bytes", "unplanned_peak_bytes",
"measured_peak_bytes"}]}`` (bytes). Usage: ``.venv/bin/python bench/backend_peak.py [--budgets 100% 50%]
[--compilers eager inductor] [--json]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

import hyperoffload
from hyperoffload.compile.backend import COMPILERS
from hyperoffload.plans import check_plan
from hyperoffload.runtime.device_peak import device_peak
from hyperoffload.runtime.emulated_link import EmulatedLink
from hyperoffload.units import format_bytes
from hyperoffload.workloads import Llama, get_workload


def measure(compiler: str, budget: str) -> dict:
    config = replace(get_workload("tiny-llama").config, layers=2)
    torch.manual_seed(0)
    model = Llama(config)
    batches = [(torch.randint(0, config.vocab_size, (2, 64)), torch.randint(0, config.vocab_size, (2, 64)))
               for _ in range(2)]
    link = EmulatedLink(h2d_bw=20e9, d2h_bw=20e9)
    backend = hyperoffload.backend(budget=budget, hardware="h100-sxm", compiler=compiler, link=link)
    compiled = torch.compile(copy.deepcopy(model), backend=backend, dynamic=False)

    def step(batch) -> None:
        tokens, targets = batch
        F.cross_entropy(compiled(tokens).flatten(0, -2), targets.flatten()).backward()

    step(batches[0])  # compiles
    for p in compiled._orig_mod.parameters():
        p.grad = None
    with link.device_frees() as frees:
        _, peak = device_peak(lambda: step(batches[1]), extra_frees=frees)
    link.close()
    record = backend.last
    # The inputs (parameters, batch) are not allocated during the step: count those the plan starts on the device.
    resident = check_plan(record.plan).initial_bytes
    return {"compiler": compiler, "budget": budget, "budget_bytes": record.budget_bytes,
            "planned_peak_bytes": record.planned_peak_bytes, "unplanned_peak_bytes": record.unplanned_peak_bytes,
            "measured_peak_bytes": resident + peak.peak_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=["100%", "50%"])
    parser.add_argument("--compilers", nargs="+", choices=COMPILERS,
                        default=list(COMPILERS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for compiler in args.compilers:
        for budget in args.budgets:
            print(f"{compiler} at {budget}: compiling and measuring", file=sys.stderr, flush=True)
            rows.append(measure(compiler, budget))
    if args.json:
        print(json.dumps({"load_avg": os.getloadavg(), "rows": rows}, indent=1))
        return 0
    for r in rows:
        print(f"{r['compiler']:>8} {r['budget']:>5}: budget {format_bytes(r['budget_bytes'])}, planned "
              f"{format_bytes(r['planned_peak_bytes'])} (unplanned {format_bytes(r['unplanned_peak_bytes'])}), "
              f"measured over the whole step {format_bytes(r['measured_peak_bytes'])} "
              f"({r['measured_peak_bytes'] / r['budget_bytes']:.2f}x the budget)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
