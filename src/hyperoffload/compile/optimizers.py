"""The ``torch.optim`` optimizers a whole training step can capture, one rule each.

``hyperoffload.train_step`` traces the user's own ``optimizer.step()`` into the step's graph, so the
update is torch's code, with the user's options (weight decay, ``amsgrad``, ``maximize``, Nesterov
momentum). What tracing cannot learn from the code is held here, once per optimizer class:

* the state ``step()`` creates on its first call (``init_state``): the graph takes the state as
  inputs, so it must exist before the first step, made as torch makes it (zeros, a float ``step``
  counter on the CPU), so that the first step computes what torch's would;
* the group options set while tracing (``trace_options``): the per-parameter loop
  (``foreach=False``, ``fused=False``), so the planner can move each parameter's state on its own
  rather than all of it at once, and, for Adam and AdamW, the ``capturable`` form, whose bias
  corrections are tensor arithmetic on the ``step`` counter rather than Python numbers read from it;
* how the learning rate enters the graph (``lr_requires_grad``): the learning rate is an input of
  the step (a 0-d float64 tensor, read from ``param_groups`` before every call, so schedulers work),
  and SGD applies a tensor learning rate as a tensor only when it requires grad (otherwise it reads
  it back as a Python number, which a traced graph cannot);
* why a configuration cannot be captured (``refusal``).

Tracing runs under ``torch.compiler``'s compile-session flag, as ``torch.compile`` runs an optimizer:
torch's optimizers then keep the ``step`` counter a tensor and skip the device checks of
``capturable``, which are for eager use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

StateInit = Callable[[Mapping[str, Any], torch.Tensor], dict[str, torch.Tensor]]
"""``init_state(group, param)`` -> the state torch's ``step()`` creates for ``param`` on its first call."""


class UnsupportedOptimizer(TypeError):
    """The optimizer (or one of its settings) cannot be captured in a whole training step; the message says
    which and what works instead."""


def _adam_state(group: Mapping[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    # As ``torch.optim.Adam._init_group``: the counter on the CPU in the default float dtype (neither fused nor
    # capturable), the moments shaped like the parameter.
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state = {"step": torch.tensor(0.0, dtype=dtype),
             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _sgd_state(group: Mapping[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    # torch makes the momentum buffer a copy of the first gradient; a zero buffer updated by the steady-state
    # rule, ``buf * momentum + grad * (1 - dampening)``, equals it exactly when ``dampening`` is 0 (``refusal``).
    if group["momentum"] == 0:
        return {}
    return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _adam_refusal(group: Mapping[str, Any]) -> str | None:
    if group.get("differentiable"):
        return "differentiable=True (a step that is itself differentiated) is not captured; use differentiable=False"
    return None


def _sgd_refusal(group: Mapping[str, Any], missing_state: bool) -> str | None:
    if group.get("differentiable"):
        return "differentiable=True (a step that is itself differentiated) is not captured; use differentiable=False"
    if missing_state and group["momentum"] != 0 and group["dampening"] != 0:
        return (f"SGD with dampening={group['dampening']} starts its momentum buffers differently on the first step; "
                f"run one eager step (loss.backward(); optimizer.step()) first, or use dampening=0")
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerRule:
    """What a whole-step capture needs to know about one optimizer class (see the module docstring)."""

    init_state: StateInit
    trace_options: Mapping[str, Any]
    lr_requires_grad: bool = False
    refusal: Callable[..., str | None] = field(default=lambda group, missing_state: None)
    """``refusal(group, missing_state)`` -> why this group cannot be captured, or None."""


_ADAM = OptimizerRule(init_state=_adam_state,
                      trace_options=MappingProxyType({"foreach": False, "fused": False, "capturable": True}),
                      refusal=lambda group, missing_state: _adam_refusal(group))

RULES: Mapping[type, OptimizerRule] = MappingProxyType({
    torch.optim.AdamW: _ADAM,
    torch.optim.Adam: _ADAM,
    torch.optim.SGD: OptimizerRule(init_state=_sgd_state,
                                   trace_options=MappingProxyType({"foreach": False, "fused": False}),
                                   lr_requires_grad=True, refusal=_sgd_refusal),
})
"""The optimizer classes a whole training step captures, by exact class (a subclass may change ``step``)."""


def rule_for(optimizer: object) -> OptimizerRule:
    """The rule of ``optimizer``'s class; ``UnsupportedOptimizer`` naming it and the supported ones otherwise."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizer(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    rule = RULES.get(type(optimizer))
    if rule is None:
        names = ", ".join(f"torch.optim.{cls.__name__}" for cls in RULES)
        raise UnsupportedOptimizer(f"{type(optimizer).__module__}.{type(optimizer).__qualname__} cannot be captured "
                                   f"in a whole training step; supported: {names}")
    return rule


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's settings that are fixed in the captured graph: all but its parameters and learning rate
    (tensors read as numbers, so a changed value is seen)."""
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in group.items()
            if k not in ("params", "lr")}


def learning_rate(group: Mapping[str, Any]) -> float:
    """The group's learning rate as a Python number (torch allows a 1-element tensor)."""
    lr = group["lr"]
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


__all__ = ["OptimizerRule", "RULES", "UnsupportedOptimizer", "hyperparameters", "learning_rate", "rule_for"]
