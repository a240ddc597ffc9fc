"""Where a training step's inputs live between calls: on the device, or, for state the plan keeps in remote memory
between steps, in host memory, as the model's and optimizer's own tensors.

On the CPU both tiers are host memory, so nothing moves. On a GPU, a parameter, buffer or optimizer state tensor
the plan starts in remote memory (``Plan.initial_remote``) is held in page-locked host memory between steps: the
compiled step prefetches it when it needs it and writes its update back there, and the GPU holds it only while
the step uses it. ``place_inputs`` moves such a tensor when a call finds it elsewhere (on the first call, or after
the user loaded a checkpoint onto the GPU) and rebinds the model's parameter or buffer (``.data``) or the optimizer's
state entry to the moved tensor, so that ``state_dict()``, checkpoints and the optimizer see it where it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hyperoffload.compile.whole_step import StepInputs
from hyperoffload.hardware import Hardware
from hyperoffload.hardware.preset_files import CPU_EMULATED
from hyperoffload.ir import Program
from hyperoffload.plans import Plan


def step_device(model: nn.Module, batch: Sequence[torch.Tensor], hardware: Hardware) -> torch.device:
    """The one device the model's tensors and the batch's are on (the CPU, or a CUDA GPU), checked against
    ``hardware``; a clear error for anything else."""
    tensors = (*model.parameters(), *model.buffers(), *batch)
    devices = sorted({t.device for t in tensors}, key=str)
    if not devices:
        raise ValueError("the model has no parameters or buffers and the batch no tensors: nothing to place")
    if len(devices) > 1:
        raise ValueError(f"the model and batch have tensors on {', '.join(map(str, devices))}; train_step runs a "
                         f"step on one device: move the model and the batch to one of them")
    device = devices[0]
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"train_step runs a model on the CPU (its copies on an emulated link of {hardware.name}) or on a CUDA "
            f"GPU; this model and batch are on {device}, for which the cache operators have no kernels. Move the "
            f"model and batch to the CPU to try the plan")
    if device.type == "cuda" and hardware.name == CPU_EMULATED:
        raise ValueError(f"the model is on {device} but hardware={CPU_EMULATED!r} describes this machine's CPU with "
                         f"an emulated link; give the GPU's profile (e.g. hardware='h100-sxm' or 'h200')")
    return device


def input_devices(program: Program, plan: Plan, device: torch.device) -> tuple[torch.device, ...]:
    """Where each of the step's flat inputs must be when it is called: host memory for one whose storage starts
    the step in remote memory, ``device`` for the rest."""
    values = program.values
    remote = set(plan.initial_remote)
    return tuple(torch.device("cpu") if values[v].storage in remote else device for v in program.inputs)


def place_inputs(inputs: StepInputs, optimizer: torch.optim.Optimizer,
                 flat: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """``flat`` with each tensor on its device of ``devices`` (copies where it is not; page-locked when it goes to
    host memory from a GPU step); a moved state tensor also replaces the model's or optimizer's own."""
    placed = list(flat)
    pinned = any(d.type == "cuda" for d in devices)
    for i, (tensor, device) in enumerate(zip(flat, devices)):
        if tensor.device == device:
            continue
        moved = tensor.detach().to(device, copy=True)
        if pinned and device.type == "cpu":
            moved = moved.pin_memory()
        placed[i] = moved
        if i < inputs.state_tensors:
            _rebind(inputs, optimizer, i, moved)
    return placed


def _rebind(inputs: StepInputs, optimizer: torch.optim.Optimizer, index: int,
            tensor: torch.Tensor) -> None:
    """Make ``tensor`` the model's or optimizer's own tensor at flat input ``index`` (a state tensor)."""
    params = (*inputs.trained, *inputs.frozen)
    if index < len(params):
        params[index][1].data = tensor
        return
    index -= len(params)
    if index < len(inputs.buffers):
        inputs.buffers[index][1].data = tensor  # the module's own buffer object, now holding ``tensor``
        return
    index -= len(inputs.buffers)
    param_index, key = inputs.state_keys[index]
    optimizer.state[inputs.trained[param_index][1]][key] = tensor


__all__ = ["input_devices", "place_inputs", "step_device"]
