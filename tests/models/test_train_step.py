"""``hyperoffload.train_step``: the user's whole step with their own optimizer, planned, compiled by Inductor and run
on an emulated link. Results equal the same compiled step unplanned, and eager PyTorch within the optimizer's own
rounding; the measured device peak stays under the budget; schedulers, checkpoints and bad input behave."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from backend_checks import check_cache_op_order, graph_counts
from torch import nn
from torch._inductor.utils import run_and_get_code

import hyperoffload
from hyperoffload.capture import CaptureError
from hyperoffload.compile.optimizers import UnsupportedOptimizer
from hyperoffload.compile.train_step import TrialRuns
from hyperoffload.plans import check_plan
from hyperoffload.policies import InfeasibleBudget
from hyperoffload.runtime.emulated_link import EmulatedLink
from hyperoffload.runtime.transfers import TransferError

def cpu() -> str:
    """The profile the steps here are planned for: a preset, so that every process makes the same plans (the
    ``cpu-emulated`` profile is measured anew in each, and a plan made for other speeds may differ). The copies
    run on the CPU over the emulated link either way."""
    return "h100-sxm"


FAST_LINK = dict(h2d_bw=20e9, d2h_bw=20e9)
"""An emulated link fast enough not to slow the small steps here down (bytes/s)."""


@pytest.fixture(autouse=True)
def one_thread():
    """One compute thread: Inductor's parallel CPU reductions may add in another order with several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class MLP(nn.Module):
    def __init__(self, width: int = 64, layers: int = 4, classes: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
}


def make(optimizer: str = "adamw", seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    return model, OPTIMIZERS[optimizer](model.parameters())


def batches(count: int, rows: int = 32):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 64, generator=gen), torch.randint(0, 8, (rows,), generator=gen)) for _ in range(count)]


def eager_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = classify(model, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [v.detach().clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return tensors


EAGER_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
"""How close to eager ``loss.backward(); optimizer.step()`` the state stays: the traced update computes the same
formulas with the bias corrections as float32 tensors where eager uses Python floats, and Adam's ``g / (sqrt(v) +
eps)`` amplifies the last bit of a gradient near ``eps`` (a thousandth of the learning rate at most, here)."""


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_planned_step_equals_the_unplanned_step_and_eager_and_stays_under_its_budget(optimizer):
    """Three steps at half the peak: parameters and optimizer state equal the same compiled step unplanned, and
    eager ``loss.backward(); optimizer.step()`` within the optimizer's rounding; the device bytes measured in each
    call stay within the budget while the step moves data both ways."""
    data = batches(3)
    model, opt = make(optimizer)
    plain_model, plain_opt = make(optimizer)
    eager_model, eager_opt = make(optimizer)
    link = EmulatedLink(**FAST_LINK)
    step = hyperoffload.train_step(model, opt, classify, data[0], budget="50%", hardware=cpu(), link=link)
    plain = hyperoffload.train_step(plain_model, plain_opt, classify, data[0], hardware=cpu(),
                                    offload=False, measure=False)
    assert step.budget_bytes < step.unplanned_peak_bytes
    for batch in data:
        loss = step(batch)
        assert torch.equal(loss, plain(batch))
        torch.testing.assert_close(loss, eager_step(eager_model, eager_opt, batch), rtol=1e-5, atol=1e-6)
        last = step.last
        assert last.peak_bytes is not None and 0 < last.peak_bytes <= last.budget_bytes == step.budget_bytes
        assert last.h2d_bytes > 0 and last.d2h_bytes > 0 and last.wall_s > 0
    assert max_diff(state_of(model, opt), state_of(plain_model, plain_opt)) == 0
    torch.testing.assert_close(state_of(model, opt), state_of(eager_model, eager_opt), **EAGER_TOLERANCE)
    remote = step.remote()
    assert remote.get("parameter") and remote.get("optimizer_state")
    report = step.report()
    assert "budget" in report and "remote parameter" in report and "last call" in report


def test_a_step_built_again_is_served_by_inductors_graph_cache():
    """The whole step reaches Inductor outside TorchDynamo; it still gets a shape environment, so Inductor's FX
    graph cache keys it instead of bypassing it, and the same step built again (here, or in a later process)
    reuses the compiled code."""
    from torch._dynamo.utils import counters

    data = batches(1)
    counters.clear()
    hyperoffload.train_step(*make(), classify, data[0], hardware=cpu(), offload=False, measure=False)
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] == 1
    hyperoffload.train_step(*make(), classify, data[0], hardware=cpu(), offload=False, measure=False)
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1


def test_the_code_inductor_runs_keeps_every_cache_operator_in_order():
    """The wrapper code Inductor generates for the whole step calls each cache operator of the lowered graph,
    every wait before the first reader of its transfer and every release after the last reader of its storage."""
    model, opt = make("adamw")
    data = batches(1)
    heard: list[str] = []
    step, codes = run_and_get_code(lambda: hyperoffload.train_step(model, opt, classify, data[0], budget="50%",
                                                                    hardware=cpu(), measure=False,
                                                                    progress=heard.append))
    assert heard[0].startswith("tracing") and any(t.startswith("planning") for t in heard)
    assert "compiling with Inductor" in heard and any(t.startswith("the trial held") for t in heard)
    assert len(codes) == 1
    counts = check_cache_op_order(codes[0])
    assert counts == graph_counts(step.graph)
    assert counts["offload"] > 0 and counts["prefetch"] > 0
    assert "# reuse" not in codes[0]
    # The plan leaves its headroom free under the budget (planned peak, bytes).
    assert check_plan(step.plan).peak_bytes <= step.budget_bytes - TrialRuns().headroom(step.budget_bytes)


def test_a_scheduler_changes_the_learning_rate_of_every_step_without_a_new_plan():
    """The learning rate is an input of the step: a scheduler's new rate applies on the next call, as in eager,
    with no tracing again."""
    data = batches(4)
    model, opt = make("sgd")
    eager_model, eager_opt = make("sgd")
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    eager_schedule = torch.optim.lr_scheduler.StepLR(eager_opt, step_size=1, gamma=0.5)
    step = hyperoffload.train_step(model, opt, classify, data[0], budget="60%", hardware=cpu(),
                                   link=EmulatedLink(**FAST_LINK), measure=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a new plan nor the scheduler's order warning
        for batch in data:
            step(batch)
            schedule.step()
            eager_step(eager_model, eager_opt, batch)
            eager_schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 16)
    torch.testing.assert_close(state_of(model, opt), state_of(eager_model, eager_opt), **EAGER_TOLERANCE)
    assert len(step._forms) == 1


def test_a_checkpoint_saved_between_steps_resumes_exactly():
    """``state_dict()`` of the model and optimizer between steps is the training state: loaded into a new model
    and optimizer (and a new step), the next steps give exactly what the original run gives."""
    data = batches(4)
    model, opt = make("adamw")
    link = EmulatedLink(**FAST_LINK)
    step = hyperoffload.train_step(model, opt, classify, data[0], budget="50%", hardware=cpu(), link=link,
                                   measure=False)
    for batch in data[:2]:
        step(batch)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)
    for batch in data[2:]:
        step(batch)
    saved.seek(0)
    checkpoint = torch.load(saved)
    resumed_model, resumed_opt = make("adamw", seed=5)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed = hyperoffload.train_step(resumed_model, resumed_opt, classify, data[0], budget="50%",
                                      hardware=cpu(), link=link, measure=False)
    for batch in data[2:]:
        resumed(batch)
    assert max_diff(state_of(model, opt), state_of(resumed_model, resumed_opt)) == 0
    # Loading the checkpoint into the running optimizer replaces its state tensors; the step reads the new ones.
    saved.seek(0)
    checkpoint = torch.load(saved)  # afresh: the resumed optimizer holds (and updated) the first load's tensors
    opt.load_state_dict(checkpoint["optimizer"])
    model.load_state_dict(checkpoint["model"])
    for batch in data[2:]:
        step(batch)
    assert max_diff(state_of(model, opt), state_of(resumed_model, resumed_opt)) == 0


def test_a_batch_of_other_shapes_or_a_changed_setting_plans_again_and_says_so():
    data = batches(2)
    model, opt = make("adamw")
    eager_model, eager_opt = make("adamw")
    step = hyperoffload.train_step(model, opt, classify, data[0], budget="50%", hardware=cpu(),
                                   link=EmulatedLink(**FAST_LINK), measure=False)
    smaller = batches(1, rows=16)[0]
    with pytest.warns(UserWarning, match=r"batch's tensors are .*planning the step again"):
        step(smaller)
    eager_step(eager_model, eager_opt, smaller)
    opt.param_groups[0]["weight_decay"] = 0.5
    eager_opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.warns(UserWarning, match="weight_decay changed"):
        step(data[1])
    eager_step(eager_model, eager_opt, data[1])
    torch.testing.assert_close(state_of(model, opt), state_of(eager_model, eager_opt), **EAGER_TOLERANCE)


def test_an_optimizer_it_cannot_capture_is_named():
    model, _ = make()
    with pytest.raises(UnsupportedOptimizer, match=r"torch\.optim\.rmsprop\.RMSprop cannot be captured.*AdamW"):
        hyperoffload.train_step(model, torch.optim.RMSprop(model.parameters()), classify, batches(1)[0])
    with pytest.raises(UnsupportedOptimizer, match="dampening"):
        hyperoffload.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1),
                                classify, batches(1)[0])
    other = nn.Linear(3, 3)
    with pytest.raises(UnsupportedOptimizer, match="not a parameter of the model"):
        hyperoffload.train_step(model, torch.optim.SGD(other.parameters(), lr=0.1), classify, batches(1)[0])


def test_a_budget_below_the_smallest_names_the_smallest():
    model, opt = make()
    with pytest.raises(InfeasibleBudget) as error:
        hyperoffload.train_step(model, opt, classify, batches(1)[0], budget="4KiB", hardware=cpu())
    assert error.value.min_budget_bytes > 4096
    with pytest.raises(ValueError, match="cannot read"):
        hyperoffload.train_step(model, opt, classify, batches(1)[0], budget="lots")


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.linear(x)
        return -self.linear(x)


def test_data_dependent_control_flow_is_refused_with_what_to_do():
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError, match=r"(?s)failed at .*test_train_step.py:\d+ in forward \(if x.sum\(\) > 0.*"
                                           r"torch.where"):
        hyperoffload.train_step(model, opt, classify, batches(1)[0])


def test_a_step_off_the_cpu_and_gpu_or_split_over_devices_is_explained():
    model, opt = make()
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="tensors on cpu, meta; train_step runs a step on one device"):
        hyperoffload.train_step(model, opt, classify, (x.to("meta"), y))
    model.to("meta")
    with pytest.raises(NotImplementedError, match="runs a model on the CPU.*or on a CUDA GPU.*are on meta"):
        hyperoffload.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), classify,
                                (x.to("meta"), y.to("meta")))
    step = hyperoffload.train_step(*make(), classify, (x, y), budget="100%", measure=False)
    with pytest.raises(ValueError, match="the batch has tensors on meta, but the step runs on cpu"):
        step((x.to("meta"), y))


def test_a_step_refused_before_it_runs_changes_nothing_and_a_failed_copy_raises():
    """A batch the step cannot take (another tree of tensors that does not trace) is refused before anything runs:
    the model and optimizer hold the state of the last completed step. A copy that fails raises from the step as a
    ``TransferError``, and once the link works again the step runs on."""
    data = batches(2)
    broken = {"on": False}

    def fault(transfer):
        if broken["on"]:
            raise OSError("link down")

    model, opt = make("adamw")
    step = hyperoffload.train_step(model, opt, classify, data[0], budget="50%", hardware=cpu(),
                                   link=EmulatedLink(**FAST_LINK, fault=fault), measure=False)
    step(data[0])
    before = state_of(model, opt)
    with pytest.warns(UserWarning, match="planning the step again"), pytest.raises(CaptureError, match="tracing"):
        step((data[1][0],))  # no targets: classify cannot unpack the batch
    assert max_diff(state_of(model, opt), before) == 0
    broken["on"] = True
    with pytest.raises(TransferError, match="link down"):
        step(data[1])
    broken["on"] = False
    step(data[1])
    step(data[1])
    assert step.last.h2d_bytes > 0


class CountedFault:
    """A link fault that, once armed, fails the copy numbered ``at`` (counting from 0 at arming) and no other."""

    def __init__(self) -> None:
        self.count, self.at = 0, None

    def arm(self, at: int) -> None:
        self.count, self.at = 0, at

    def __call__(self, transfer) -> None:
        if self.at is not None:
            self.count += 1
            if self.count - 1 == self.at:
                raise OSError("link down")


def test_a_step_failing_late_is_rolled_back_with_rollback_and_said_to_be_partial_without():
    """A copy failing late in the step, after write-backs of the update began: without ``rollback`` the error says
    the state may be partly updated (and it is: neither the old state nor a completed step's); with ``rollback=True``
    the model and optimizer hold the last completed step's state exactly, and the step runs on afterwards."""
    data = batches(2)
    fault = CountedFault()
    results = {}
    for rollback in (False, True):
        model, opt = make("adamw")
        step = hyperoffload.train_step(model, opt, classify, data[0], budget="50%", hardware=cpu(), measure=False,
                                       link=EmulatedLink(**FAST_LINK, fault=fault), rollback=rollback)
        step(data[0])
        before = state_of(model, opt)
        fault.arm(at=10**9)
        step(data[1])  # count the copies of one step
        copies = fault.count
        model, opt = make("adamw")
        step = hyperoffload.train_step(model, opt, classify, data[0], budget="50%", hardware=cpu(), measure=False,
                                       link=EmulatedLink(**FAST_LINK, fault=fault), rollback=rollback)
        fault.arm(at=None)
        step(data[0])
        assert max_diff(state_of(model, opt), before) == 0
        fault.arm(at=copies - 1)  # the step's last copy
        with pytest.raises(TransferError, match="link down") as error:
            step(data[1])
        results[rollback] = (max_diff(state_of(model, opt), before), "".join(error.value.__notes__))
        fault.arm(at=None)
        step(data[1])
    moved, note = results[False]
    assert moved > 0 and "partly updated" in note and "rollback=True" in note
    moved, note = results[True]
    assert moved == 0 and "last completed step" in note


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test's duration, the one ``deferred_interrupts`` defers (a program with a
    handler of its own keeps it): an earlier test in the same pytest worker can leave SIGINT ignored (``SIG_IGN``,
    seen in a full ``-n 2`` run), and the step then has nothing to defer."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield previous
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_step_takes_effect_once_the_step_has_completed(default_sigint):
    """SIGINT arriving mid-step (sent from a copy engine's thread while the step's copies run) is raised as
    ``KeyboardInterrupt`` after the call, whose update is complete: the state equals an uninterrupted step's."""
    import os
    import signal

    data = batches(2)
    sent = {"armed": False}

    def interrupt(transfer) -> None:
        if sent["armed"]:
            sent["armed"] = False
            os.kill(os.getpid(), signal.SIGINT)

    model, opt = make("adamw")
    step = hyperoffload.train_step(model, opt, classify, data[0], budget="50%", hardware=cpu(), measure=False,
                                   link=EmulatedLink(**FAST_LINK, fault=interrupt))
    plain_model, plain_opt = make("adamw")
    plain = hyperoffload.train_step(plain_model, plain_opt, classify, data[0], hardware=cpu(), offload=False,
                                    measure=False)
    step(data[0])
    plain(data[0])
    sent["armed"] = True
    with pytest.raises(KeyboardInterrupt, match="the step completed first"):
        step(data[1])
    assert not sent["armed"]
    plain(data[1])
    assert max_diff(state_of(model, opt), state_of(plain_model, plain_opt)) == 0


def test_a_step_still_over_its_budget_after_the_last_trial_warns(monkeypatch):
    """Each plan is measured in a trial run, the last one too: a step that keeps holding more than the budget is
    planned ``TrialRuns.max_plans`` times and then said to be over it."""
    from hyperoffload.compile import train_step as module

    def over_budget(self, compiled, flat, *, measure):
        return None, compiled.budget_bytes + 1024

    monkeypatch.setattr(module.TrainStep, "_run", over_budget)
    model, opt = make("adamw")
    trials = TrialRuns(max_plans=3)
    with pytest.warns(UserWarning, match=f"over the budget .* after {trials.max_plans} plans"):
        step = hyperoffload.train_step(model, opt, classify, batches(1)[0], budget="50%", hardware=cpu(),
                                       measure=False, trials=trials)
    assert len(step._current.trials) == trials.max_plans
    assert step._current.slack == 1024 * sum(range(1, trials.max_plans))  # k times the k-th excess


def test_trial_runs_refuse_settings_that_cannot_work():
    with pytest.raises(ValueError, match="max_plans must be at least 1"):
        TrialRuns(max_plans=0)
    with pytest.raises(ValueError, match="headroom_share"):
        TrialRuns(headroom_share=1.5)
    assert TrialRuns().headroom(1 << 30) == 4096 and TrialRuns().headroom(1024) == 4
