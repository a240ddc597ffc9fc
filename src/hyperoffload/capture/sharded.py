"""Capture one rank's step of a model sharded with FSDP2 (``fully_shard``) over a world of ranks, without the ranks.

The model is sharded on a *fake* process group (torch.distributed's ``fake`` backend: collectives return at once
and move nothing) with a one-dimensional CPU device mesh of ``world`` ranks, and rank 0's step is traced with
``make_fx`` in fake mode, so ``llama3-70b`` on 8 ranks is captured on any machine in seconds. FSDP2 runs as it
would on real ranks: each sharded module gathers its parameters before its forward (``c10d._allgather_base_``)
and frees them after; the backward gathers them again and reduces each gradient to this rank's shard
(``c10d._reduce_scatter_base_``). The Program holds those collectives as ops (``Op.collective``: kind, the
whole tensor's bytes, the group size) and this rank's shards as its parameters; the optimizer updates the
shards with the reduced gradients, its state sharded likewise (the update of ``steps.adamw_update``).

The model is sharded in place (``fully_shard`` turns its parameters into DTensors): build it for the capture,
under ``fake_build`` for a model of any size. Each module of every ``nn.ModuleList`` in it (a transformer's
blocks) is one FSDP unit, and the root module another, as FSDP2's documentation shows. A process group must not already exist in the process: the fake one is made and destroyed
around the capture.

Given ``mesh`` (a 1-D CPU ``DeviceMesh`` over a real process group, e.g. gloo, of which this process is one rank),
the same capture runs on that group instead: the trace is still made in fake mode, so nothing is communicated
while tracing, but the c10d calls in the graph hold the real group, and running the graph on real tensors (the plan
executor does) communicates with the other ranks. Every rank captures and runs its own step, in the same order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hyperoffload.capture.graph_to_program import CaptureError, program_from_graph
from hyperoffload.capture.input_views import constants_as_views
from hyperoffload.capture.sharded_passes import drop_profiler_calls, issue_gathers_ahead, lift_constants, separate_regathers
from hyperoffload.capture.steps import AdamW, Captured, _batch, _batch_names, _rebuild, adamw_update, lm_loss
from hyperoffload.capture.tags import mark_phase, tag_values
from hyperoffload.ir import Phase, ValueKind

MAX_WORLD = 2**16
"""The most ranks a step may be sharded over: beyond the largest published training runs (tens of thousands of
accelerators), and small enough that a shard of any real layer still has elements."""


def check_world(world: Any) -> int:
    """``world`` itself if it is a whole number of ranks in [1, ``MAX_WORLD``]; else a ``CaptureError`` naming
    ``--world``."""
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise CaptureError(f"world (--world) is the number of ranks the model is sharded over: a whole number from 1 "
                           f"to {MAX_WORLD}, got {world!r}")
    return world


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[Any]:
    """Inside the block, a fake process group of ``world`` ranks (this process is rank 0) and its 1-D CPU
    ``DeviceMesh``, which the block receives; the group is destroyed after."""
    import importlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers the ``fake`` backend

    check_world(world)
    if not dist.is_available():
        raise CaptureError("this PyTorch build has no torch.distributed; a sharded step cannot be captured with it")
    if dist.is_initialized():
        raise CaptureError("a process group already exists in this process; a sharded step is captured on a fake "
                           "group of its own: capture it in a process that has not called init_process_group")
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def real_world(mesh: Any, world: int) -> Iterator[Any]:
    """``mesh`` itself, once it is a 1-D mesh of ``world`` ranks over an initialized process group (this process is
    one of its ranks); the group is the caller's, left as it is after the block."""
    import torch.distributed as dist

    check_world(world)
    if not dist.is_available() or not dist.is_initialized():
        raise CaptureError("a step captured on a real group needs torch.distributed initialized "
                           "(dist.init_process_group) in every rank's process first")
    if mesh.ndim != 1 or mesh.size() != world:
        raise CaptureError(f"the mesh to capture on must be 1-D with {world} ranks (world), got shape "
                           f"{tuple(mesh.shape)}")
    yield mesh


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: every module held in an ``nn.ModuleList`` of ``model`` (a
    transformer's blocks), outermost lists first."""
    units: list[nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                if id(child) not in seen and not any(id(m) in seen for m in child.modules()):
                    units.append(child)
                    seen.update(id(m) for m in child.modules())
    return units


def check_rows(model: nn.Module, world: int) -> None:
    """Refuse a ``world`` of more ranks than the rows of ``model``'s largest parameter: FSDP2 shards each parameter
    along its first dimension, so ranks past that many would hold no row of any parameter (only padding)."""
    rows = [(p.shape[0], name) for name, p in model.named_parameters() if p.dim() > 0]
    if rows and world > max(rows)[0]:
        most, name = max(rows)
        raise CaptureError(f"--world {world} is more ranks than the model can be sharded over: FSDP2 splits each "
                           f"parameter along its first dimension, and the largest, {name}, has {most} rows, so ranks "
                           f"from {most} on would hold nothing; give --world at most {most}")


def shard_model(model: nn.Module, mesh: Any, units: Callable[[nn.Module], Sequence[nn.Module]] = default_units
                ) -> nn.Module:
    """``model`` sharded in place with ``fully_shard`` over ``mesh``: each of ``units(model)`` on its own, then the
    root."""
    from torch.distributed.fsdp import fully_shard

    check_rows(model, mesh.size())
    sharded = model
    try:
        for unit in units(sharded):
            fully_shard(unit, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
    except Exception as error:  # FSDP's own checks (a parameter it cannot shard, a module used twice)
        raise CaptureError(f"fully_shard refused {type(model).__name__}: {type(error).__name__}: {error}") from error
    return sharded


def capture_sharded_train_step(model: nn.Module, args: Any, target: torch.Tensor | None = None, *, world: int,
                               kwargs: dict | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] = lm_loss,
                               optimizer: AdamW = AdamW(), name: str | None = None,
                               meta: dict | None = None, mesh: Any = None) -> Captured:
    """Capture rank 0's training step of ``model`` sharded with FSDP2 over ``world`` ranks: forward, loss,
    backward (with FSDP's gathers and gradient reduce-scatters) and an AdamW update of this rank's shards.

    As ``steps.capture_train_step`` otherwise: ``args``/``kwargs`` are the model's example inputs (build the
    model and them under ``fake_build`` for a model of any size), ``target`` what ``loss_fn(output, target)``
    compares against. The Program's ``meta["world"]`` is ``world``. The captured step cannot be run eagerly
    (its process group is fake): ``Captured.step`` says so. With ``mesh`` (a 1-D DeviceMesh of ``world`` ranks over
    a real process group), this rank's step is captured on that group and its graph communicates when run (the
    module docstring says how)."""
    if optimizer.master_weights:
        raise CaptureError("master_weights (--master-weights) is not supported for a sharded step yet; FSDP2 keeps "
                           "float32 shards itself with MixedPrecisionPolicy")
    return _capture(model, args, kwargs, target, world=world, mode="train", loss_fn=loss_fn, optimizer=optimizer,
                    name=name, meta=meta, mesh=mesh)


def capture_sharded_prefill_step(model: nn.Module, args: Any, *, world: int, kwargs: dict | None = None,
                                 name: str | None = None, meta: dict | None = None, mesh: Any = None) -> Captured:
    """Capture rank 0's forward pass without gradients of ``model`` sharded with FSDP2 over ``world`` ranks (this
    rank's, on a real group, given ``mesh``: as ``capture_sharded_train_step``)."""
    return _capture(model, args, kwargs, None, world=world, mode="prefill", loss_fn=lm_loss, optimizer=AdamW(),
                    name=name, meta=meta, mesh=mesh)


def _capture(model: nn.Module, args: Any, kwargs: dict | None, target: torch.Tensor | None, *, world: int, mode: str,
             loss_fn: Callable, optimizer: AdamW, name: str | None, meta: dict | None, mesh: Any = None) -> Captured:
    from torch.fx.experimental.proxy_tensor import make_fx

    if check_world(world) < 2:
        raise CaptureError(f"a step sharded over {world} rank is the unsharded step: capture it with "
                           f"capture_{'train' if mode == 'train' else 'prefill'}_step, or give world >= 2")
    start = time.perf_counter()
    name = name or type(model).__name__
    batch, spec, leaves = _batch(args, kwargs)
    targets = [target] if target is not None else []
    real = mesh is not None
    with real_world(mesh, world) if real else fake_world(world) as mesh:
        sharded = shard_model(model, mesh)
        params = [(n, p) for n, p in sharded.named_parameters()]
        if mode == "train" and not any(p.requires_grad for _, p in params):
            raise CaptureError("the model has no parameters with requires_grad=True; nothing to train")
        shards = [(n, p._local_tensor if hasattr(p, "_local_tensor") else p) for n, p in params]
        state = [*shards, *sharded.named_buffers()]
        trained = [(n, p, s) for (n, p), (_, s) in zip(params, shards) if p.requires_grad] if mode == "train" else []
        exp_avgs = [torch.zeros_like(s, dtype=torch.float32) for _, _, s in trained]
        exp_avg_sqs = [torch.zeros_like(s, dtype=torch.float32) for _, _, s in trained]
        counts = [shards[0][1].new_zeros((), dtype=torch.float32)] if trained else []
        groups = [exp_avgs, exp_avg_sqs, counts, batch, targets]
        sizes = [len(g) for g in groups]

        def step(*flat: torch.Tensor):
            parts, at = [], 0
            for size in sizes:
                parts.append(list(flat[at:at + size]))
                at += size
            m, v, count, batch_t, target_t = parts
            call_args, call_kwargs = _rebuild(spec, leaves, batch_t)
            if mode != "train":
                with torch.no_grad():
                    output = sharded(*call_args, **call_kwargs)
                return output.logits if hasattr(output, "logits") else output
            output = sharded(*call_args, **call_kwargs)
            loss = loss_fn(output, target_t[0] if target_t else None)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise CaptureError("loss_fn must return a single-element tensor")
            mark_phase(Phase.BACKWARD)
            loss.backward()
            grads = [_local(p.grad) for _, p, _ in trained]
            tag_values(grads, ValueKind.GRADIENT)
            mark_phase(Phase.OPTIMIZER)
            with torch.no_grad():
                adamw_update([s for _, _, s in trained], grads, m, v, None, count[0], optimizer)
            for _, p, _ in trained:
                p.grad = None
            return loss.detach()

        flat = [t for g in groups for t in g]
        try:
            gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)
        except CaptureError:
            raise
        except Exception as error:  # tracing runs arbitrary model code under FSDP's hooks
            raise CaptureError(f"tracing the sharded {mode} step of {name} over {world} ranks failed: "
                               f"{type(error).__name__}: {error}") from error
    gm = issue_gathers_ahead(separate_regathers(drop_profiler_calls(gm)))
    if real:  # the shards' other tensors, as views of the shards (capture.input_views says why)
        gm = constants_as_views(gm, [t for _, t in state])
    gm, lifted, lifted_names = lift_constants(gm, {id(t): n for n, t in state})
    missing = [n for n, _ in shards if n not in lifted_names]
    if missing:
        raise CaptureError(f"the traced step does not read the shards of {', '.join(missing[:3])}: FSDP2 gathered "
                           f"them some other way than the capture knows")
    kinds = [ValueKind.PARAMETER] * len(lifted) + [ValueKind.OPTIMIZER_STATE] * (2 * len(trained) + len(counts)) + [
        ValueKind.INPUT] * (len(batch) + len(targets))
    names = [*lifted_names, *(f"exp_avg:{n}" for n, _, _ in trained), *(f"exp_avg_sq:{n}" for n, _, _ in trained),
             *(["adamw_step"] if counts else []), *_batch_names(len(batch)), *(["target"] if targets else [])]
    info = {"mode": mode, "world": world, **({"optimizer": "adamw", "master_weights": False} if trained else {}),
            **(meta or {})}
    program = program_from_graph(gm, kinds, name=name, mode=mode, input_names=names, meta=info)
    return Captured(program=program, inputs=(*lifted, *flat), step=_not_runnable(world, real=real),
                    capture_s=time.perf_counter() - start)


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a gradient FSDP2 reduced (a DTensor), or None for a parameter without one."""
    if grad is None:
        return None
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


def _not_runnable(world: int, *, real: bool = False) -> Callable[..., Any]:
    def step(*inputs: torch.Tensor) -> Any:
        if real:
            raise CaptureError(f"a step captured on a real group of {world} ranks runs as a plan on every rank at "
                               f"once (hyperoffload.runtime.run_plan in each rank's process), not eagerly")
        raise CaptureError(f"a sharded step captured over {world} fake ranks cannot run in this process: its "
                           f"collectives would move nothing; it is for inspecting, planning and simulating")

    return step


__all__ = ["MAX_WORLD", "capture_sharded_prefill_step", "capture_sharded_train_step", "check_world",
           "default_units", "fake_world", "real_world", "shard_model"]
