import sys
from pathlib import Path

import pytest
import torch

# The shared modules beside this file (helpers, programs, runtime_checks, backend_checks, cli_checks, output_checks,
# hf_configs) are imported by name from every layer's folder (unit, models, cli, gpu).
sys.path.insert(0, str(Path(__file__).parent))

from hyperoffload.plans import plan_without_offload  # noqa: E402
from hyperoffload.runtime import run_plan  # noqa: E402
from hyperoffload.workloads import capture_workload, get_workload  # noqa: E402


@pytest.fixture(scope="module")
def one_compute_thread():
    """Compute on one thread, so the copy engines have a core of their own on small machines (as the run
    command does); two OpenMP threads spinning against busy copy threads make steps crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def captured():
    """tiny-llama's training step with real weights."""
    return capture_workload(get_workload("tiny-llama"), "train", fake=False)


@pytest.fixture(scope="module")
def reference(captured):
    """The unplanned step on clones of the inputs: (outputs, inputs after the step)."""
    inputs = [t.clone() for t in captured.inputs]
    return run_plan(plan_without_offload(captured.program), inputs).outputs, inputs
