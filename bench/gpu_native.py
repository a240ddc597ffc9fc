"""``hyperoffload.train_step`` beside PyTorch's own ways of fitting a training step into less device memory, on one
GPU, in one run.

The model is a bf16 LLaMA-style decoder of about 1.1 billion parameters (16 layers of width 2048, SwiGLU width
8192, 32 query and 8 key/value heads, a 32k vocabulary; the project's ``Llama`` with random weights), trained with
``torch.optim.AdamW`` on one random batch (``--batch`` sequences of ``--seq`` tokens, next-token cross entropy).
Rows, each from the same initial weights on the same batch:

* ``eager``: no offload, eager PyTorch (``loss.backward(); optimizer.step(); optimizer.zero_grad()``): the
  reference every row's parameters are compared with, and the step whose ``max_memory_allocated`` the budgets are
  shares of;
* ``compile``: no offload, forward and loss under ``torch.compile`` (Inductor), the optimizer eager;
* ``train_step@B``: ``hyperoffload.train_step(..., budget=B, hardware="h200")`` for each of ``--budgets`` (a share
  of the eager step's peak, in bytes on a GPU, as a percentage of the step's own unplanned peak on the CPU);
* ``compile+activation_offload``: ``torch.compile`` with ``torch._functorch.config.enable_activation_offloading``
  and every saved activation tagged (a ``joint_custom_pass`` sets ``should_offload`` on each node of the joint graph;
  the partitioner offloads those of them the backward saves and can move), each copy a ``device_put`` in line;
* ``compile+activation_offload_streams``: the same with the copies on a stream of their own, the offloads' waits
  sunk to the end of the forward and the reloads prefetched (the ``activation_offload_*`` flags; CUDA only), from
  a pool of pinned buffers;
* ``save_on_cpu``: eager, forward and backward under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``fsdp2_cpu_offload``: eager, FSDP2 ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` on every decoder block
  and the root, one rank (world 1: nccl, with gloo for host tensors, on a GPU; gloo on the CPU; a ``FileStore``),
  the optimizer over the sharded parameters on the host;
* ``torchao_cpu_offload_optimizer``: eager, torchao's ``CPUOffloadOptimizer`` around AdamW (``not installed`` where
  ``import torchao`` fails).

Per row: ``step_ms`` (median of ``--steps`` steps after ``--warmup`` more, the first of them the one compared;
``torch.cuda.synchronize`` before and after each), ``build_s`` (making the row: copying the model to the device,
sharding it, ``train_step``'s planning and compiling), ``first_step_s`` (the first step, ``torch.compile``'s
compiling included), ``max_memory_allocated`` and ``max_memory_reserved`` (bytes, from an emptied cache and reset
peaks at the start of the row, building it included; null on the CPU), ``max_abs_diff`` (largest absolute
difference of any parameter after the first step against ``eager``'s after its first step; 0 for ``eager``) and
``error`` (null, or the exception's text: a row that fails is recorded and the run goes on). ``train_step`` rows also carry ``budget`` (the share) and
``budget_bytes`` (null where the budget is a percentage).

``--smoke`` runs the same code on the CPU (``tiny-llama``'s float32 shape, 3 steps after 1, the ``train_step``
budget 100%): the rows that cannot run there record why. Without CUDA (and without ``--smoke``) the script says so
and exits 0. The table goes to stdout, progress (as each row starts) to stderr; ``--json PATH`` writes one object,
again after every row (``complete`` false until the last, so a run cut short keeps what it measured)::

    {"gpu", "device", "torch", "smoke", "steps", "warmup", "model": {...}, "budgets": [{"share", "bytes", "text"}],
     "reference_max_memory_allocated", "rows": [{"name", "method", "budget", "budget_bytes", "step_ms",
     "build_s", "first_step_s", "max_memory_allocated", "max_memory_reserved", "max_abs_diff", "error"}], "complete"}

``--out DIR`` (default ``$OUT`` where set) also writes the table to ``DIR/gpu_native.txt`` and, without ``--json``,
the object to ``DIR/gpu_native.json``. Usage: ``PYTHONPATH=src python3 bench/gpu_native.py [--budgets 0.5,0.8]
[--steps 10] [--warmup 3] [--layers 16] [--hidden 2048] [--batch 2] [--seq 4096] [--json PATH] [--smoke]`` with a
Python that has a CUDA build of PyTorch (``make gpu-native``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo
import torch._functorch.config
import torch.nn.functional as F
from torch import nn

import hyperoffload
from hyperoffload.workloads import Llama, LlamaConfig, get_workload

GPU_CONFIG = LlamaConfig(vocab_size=32000, hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8)
"""About 1.1 billion parameters (LLaMA-3.2-1B widths with a 32k vocabulary, untied embeddings)."""

HARDWARE = "h200"
"""The profile ``train_step`` plans for (a preset of ``hyperoffload.hardware``)."""

LR, WEIGHT_DECAY = 1e-3, 0.1
"""AdamW's settings in every row."""

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSettings:
    """What one run measures and on what."""

    config: LlamaConfig
    dtype: torch.dtype
    device: torch.device
    batch: int
    """Sequences per step."""
    seq: int
    """Tokens per sequence."""
    steps: int
    """Timed steps per row."""
    warmup: int
    """Untimed steps per row before them (the first is compared with the reference)."""
    budgets: tuple[float, ...]
    """Budgets of the ``train_step`` rows, as shares of the unplanned step's peak."""

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


@dataclass(slots=True, kw_only=True)
class Runner:
    """One row's training step, ready to call."""

    step: Callable[[Batch], object]
    """One training step on the batch (forward, backward, optimizer update)."""
    parameters: Callable[[], list[torch.Tensor]]
    """The model's parameters, whole, in ``model.parameters()`` order (any device)."""
    close: Callable[[], None] = lambda: None
    """Releases what the row holds outside the model (links, process groups)."""


@dataclass(slots=True, kw_only=True)
class Row:
    """A row of the table: how it was made and what it measured."""

    name: str
    method: str
    """What the row runs, in a few words."""
    budget: float | None = None
    """``train_step`` rows: the budget as a share of the unplanned step's peak."""
    budget_bytes: int | None = None
    """``train_step`` rows on a GPU: that share of the eager step's ``max_memory_allocated`` (bytes)."""
    step_ms: float | None = None
    """Median of the timed steps (milliseconds)."""
    build_s: float | None = None
    """Making the row ready: the model's copy on the device, sharding, ``train_step``'s planning and compiling
    (seconds)."""
    first_step_s: float | None = None
    """The first step, compiling under ``torch.compile`` included (seconds)."""
    max_memory_allocated: int | None = None
    """The caching allocator's peak of allocated bytes over the row (bytes; None on the CPU)."""
    max_memory_reserved: int | None = None
    """Its peak of reserved bytes over the row (bytes; None on the CPU)."""
    max_abs_diff: float | None = None
    """Largest absolute difference of a parameter after the first step against the eager step's."""
    error: str | None = None
    """Why the row stopped (the exception's type and text), or None."""


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --- the user's side: model, loss, batch, optimizer ----------------------------------------------------------------
def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross entropy over every position."""
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, -2), targets.flatten())


def adamw(parameters) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameters, lr=LR, weight_decay=WEIGHT_DECAY)


def random_batch(settings: BenchSettings) -> Batch:
    gen = torch.Generator().manual_seed(1)
    shape = (settings.batch, settings.seq)
    vocab = settings.config.vocab_size
    tokens, targets = (torch.randint(0, vocab, shape, generator=gen) for _ in range(2))
    return tokens.to(settings.device), targets.to(settings.device)


def template_model(settings: BenchSettings) -> nn.Module:
    """The initial weights every row starts from (seed 0), kept on the host in the run's dtype; drawn on the device,
    where a billion of them take a fraction of the time."""
    torch.manual_seed(0)
    with torch.device(settings.device):
        model = Llama(settings.config).to(settings.dtype)
    return model.to("cpu")


def fresh_model(template: nn.Module, settings: BenchSettings) -> nn.Module:
    """A copy of ``template`` of its own on the run's device."""
    return copy.deepcopy(template).to(settings.device)


def eager_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_of: Callable[[Batch], torch.Tensor],
               batch: Batch) -> None:
    loss_of(batch).backward()
    optimizer.step()
    optimizer.zero_grad()


def plain_runner(model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_of: Callable[[Batch], torch.Tensor]) -> Runner:
    return Runner(step=lambda batch: eager_step(model, optimizer, loss_of, batch),
                  parameters=lambda: list(model.parameters()))


# --- the rows --------------------------------------------------------------------------------------------------------
def eager_row(template: nn.Module, settings: BenchSettings) -> Runner:
    model = fresh_model(template, settings)
    return plain_runner(model, adamw(model.parameters()), lambda batch: lm_loss(model, batch))


def compiled_row(template: nn.Module, settings: BenchSettings) -> Runner:
    torch._dynamo.reset()
    model = fresh_model(template, settings)
    runner = plain_runner(model, adamw(model.parameters()), torch.compile(lambda batch: lm_loss(model, batch)))
    runner.close = torch._dynamo.reset
    return runner


def tag_every_activation_for_offload(graph_module: torch.fx.GraphModule, joint_inputs) -> torch.fx.GraphModule:
    """``joint_custom_pass``: marks every computed node of the joint graph ``should_offload``; the partitioner's
    activation offloading then moves each of them the backward saves (and can move: no views, model outputs or
    non-contiguous tensors) to the host after its last forward use and back before its first backward use."""
    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            node.meta["should_offload"] = True
    return graph_module


def activation_offload_flags(streams: bool) -> dict:
    """The ``torch._functorch.config`` settings that turn activation offloading on, with every activation tagged:
    each copy a ``device_put`` in the graph's own order, or (``streams``) the copies on a stream of their own, the
    offloads' waits sunk to the end of the forward and the reloads prefetched ahead of their use. AOTAutograd's
    cache is off, as it does not key on the tagging pass. ``AttributeError`` if this PyTorch lacks a flag the row
    needs; the sinking and prefetching flags are left out where they do not exist."""
    config = torch._functorch.config
    required = {"enable_activation_offloading": True, "joint_custom_pass": tag_every_activation_for_offload}
    if streams:
        required["activation_offload_separate_stream"] = True
    optional = {"enable_autograd_cache": False}
    if streams:
        optional |= {"activation_offload_sink_wait": True, "activation_reload_prefetch": True}
    missing = [name for name in required if not hasattr(config, name)]
    if missing:
        raise AttributeError(f"torch {torch.__version__} has no torch._functorch.config.{', '.join(missing)}")
    return required | {name: value for name, value in optional.items() if hasattr(config, name)}


def pinned_buffer_pool(on_gpu: bool):
    """The activation offloading's pool of pinned host buffers, reused from step to step (without it each offload
    allocates pinned memory afresh, milliseconds a tensor); nothing on the CPU or where the pool does not exist."""
    if not on_gpu:
        return nullcontext()
    try:
        from torch._functorch._activation_offloading.offload_ops import pinned_memory_pool
    except ImportError:
        return nullcontext()
    return pinned_memory_pool(True)


def activation_offload_row(streams: bool) -> Callable[[nn.Module, BenchSettings], Runner]:
    def build(template: nn.Module, settings: BenchSettings) -> Runner:
        if streams and not settings.on_gpu:
            raise RuntimeError("needs CUDA: the copies run on a CUDA stream of their own")
        return activation_offload_runner(template, settings, activation_offload_flags(streams))

    return build


def activation_offload_runner(template: nn.Module, settings: BenchSettings, flags: dict) -> Runner:
    torch._dynamo.reset()
    model = fresh_model(template, settings)
    optimizer = adamw(model.parameters())
    compiled = torch.compile(lambda batch: lm_loss(model, batch))
    held = ExitStack()
    held.enter_context(pinned_buffer_pool(settings.on_gpu))

    def step(batch: Batch) -> None:
        with torch._functorch.config.patch(**flags):  # on every call: a recompilation sees the flags too
            eager_step(model, optimizer, compiled, batch)

    def close() -> None:
        held.close()
        torch._dynamo.reset()

    return Runner(step=step, parameters=lambda: list(model.parameters()), close=close)


def save_on_cpu_row(template: nn.Module, settings: BenchSettings) -> Runner:
    model = fresh_model(template, settings)
    optimizer = adamw(model.parameters())

    def step(batch: Batch) -> None:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss = lm_loss(model, batch)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return Runner(step=step, parameters=lambda: list(model.parameters()))


@contextmanager
def single_rank_group(on_gpu: bool) -> Iterator[None]:
    """A default process group of one rank (nccl for CUDA tensors and gloo for host ones on a GPU, gloo on the CPU)
    through a ``FileStore`` in a fresh temporary folder; destroyed on exit."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter sharded over one rank (a ``DTensor``): its local shard, which is all of it (no collective, so a
    host-offloaded shard needs no host backend); others as they are."""
    local = getattr(tensor, "to_local", None)
    return local() if callable(local) else tensor


def fsdp2_row(template: nn.Module, settings: BenchSettings) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    held = ExitStack()
    held.enter_context(single_rank_group(settings.on_gpu))
    try:
        mesh = init_device_mesh(settings.device.type, (1,))
        model = copy.deepcopy(template)  # on the host: fully_shard moves each block to the device and back alone
        policy = CPUOffloadPolicy(pin_memory=settings.on_gpu)
        for block in model.layers:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        optimizer = adamw(model.parameters())
    except BaseException:
        held.close()
        raise
    runner = plain_runner(model, optimizer, lambda batch: lm_loss(model, batch))
    runner.parameters = lambda: [whole(p) for p in model.parameters()]
    runner.close = held.close
    return runner


def cpu_offload_optimizer_class():
    """torchao's ``CPUOffloadOptimizer`` (``torchao.optim``, or ``torchao.prototype.low_bit_optim`` in older
    releases); ``ModuleNotFoundError`` saying ``not installed`` where ``import torchao`` fails."""
    try:
        import torchao
    except ImportError as error:
        raise ModuleNotFoundError(f"not installed (import torchao: {error})") from None
    progress(f"  torchao {getattr(torchao, '__version__', '(version unknown)')}")
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
    return CPUOffloadOptimizer


def torchao_row(template: nn.Module, settings: BenchSettings) -> Runner:
    optimizer_class = cpu_offload_optimizer_class()
    model = fresh_model(template, settings)
    optimizer = optimizer_class(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    return plain_runner(model, optimizer, lambda batch: lm_loss(model, batch))


def budget_text(share: float, reference_peak: int | None) -> int | str:
    """The budget ``train_step`` is given: ``share`` of the eager step's measured peak in bytes, or (no measured
    peak: the CPU) the same share of the step's own unplanned peak as a percentage."""
    if reference_peak is not None:
        return int(share * reference_peak)
    return f"{share * 100:g}%"


def train_step_row(budget: int | str) -> Callable[[nn.Module, BenchSettings], Runner]:
    def build(template: nn.Module, settings: BenchSettings) -> Runner:
        model = fresh_model(template, settings)
        step = hyperoffload.train_step(model, adamw(model.parameters()), lm_loss, random_batch(settings),
                                       budget=budget, hardware=HARDWARE, measure=False)
        return Runner(step=step, parameters=lambda: list(model.parameters()), close=step.link.close)

    return build


# --- measuring -------------------------------------------------------------------------------------------------------
def synchronize(settings: BenchSettings) -> None:
    if settings.on_gpu:
        torch.cuda.synchronize()


def fresh_memory_stats(settings: BenchSettings) -> None:
    """Drop what earlier rows left (garbage, cached blocks) and start the peaks again."""
    gc.collect()
    if settings.on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory_peaks(settings: BenchSettings) -> tuple[int | None, int | None]:
    """``max_memory_allocated`` and ``max_memory_reserved`` since the last reset (bytes); None on the CPU."""
    if not settings.on_gpu:
        return None, None
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def timed(call: Callable[[], object], settings: BenchSettings) -> float:
    """Seconds ``call`` takes, the device synchronized before and after."""
    synchronize(settings)
    start = time.perf_counter()
    call()
    synchronize(settings)
    return time.perf_counter() - start


def host_copy(parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in parameters]


def max_abs_diff(parameters: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest absolute difference of any element, in float64, one tensor at a time."""
    if len(parameters) != len(reference):
        raise ValueError(f"{len(parameters)} parameters against {len(reference)} of the reference")
    worst = 0.0
    for p, r in zip(parameters, reference, strict=True):
        p = p.detach()
        worst = max(worst, (p.double() - r.to(p.device).double()).abs().max().item())
    return worst


def measure_row(row: Row, build: Callable[[nn.Module, BenchSettings], Runner], template: nn.Module, batch: Batch,
                settings: BenchSettings) -> list[torch.Tensor] | None:
    """Fills ``row``'s times and memory peaks (or its ``error``); returns its parameters after the first step, on the
    host (None if it did not get that far). The memory peaks cover building the row and its steps, not comparing."""
    fresh_memory_stats(settings)
    runner = None
    first = None
    try:
        start = time.perf_counter()
        runner = build(template, settings)
        synchronize(settings)
        row.build_s = time.perf_counter() - start
        row.first_step_s = timed(lambda: runner.step(batch), settings)
        first = host_copy(runner.parameters())
        for _ in range(settings.warmup - 1):
            timed(lambda: runner.step(batch), settings)
        walls = [timed(lambda: runner.step(batch), settings) for _ in range(settings.steps)]
        row.step_ms = statistics.median(walls) * 1e3
    except Exception as error:  # noqa: BLE001 - recorded in the row; the run goes on
        row.error = f"{type(error).__name__}: {error}".strip()
        progress(f"  {row.name}: {row.error.splitlines()[0][:300]}")
    finally:
        row.max_memory_allocated, row.max_memory_reserved = memory_peaks(settings)
        if runner is not None:
            try:
                runner.close()
            except Exception as error:  # noqa: BLE001 - the row's figures stand; say what went wrong
                progress(f"  {row.name}: closing failed ({type(error).__name__}: {error})")
        runner = None  # the row's model, optimizer and compiled graphs go with it
        fresh_memory_stats(settings)
    return first


def other_rows(settings: BenchSettings, reference_peak: int | None) -> list[tuple[Row, Callable]]:
    """Every row after the eager reference, in table order, with how each is built."""
    rows: list[tuple[Row, Callable]] = [(Row(name="compile", method="no offload, torch.compile"), compiled_row)]
    for share in settings.budgets:
        budget = budget_text(share, reference_peak)
        rows.append((Row(name=f"train_step@{share:g}", method=f"hyperoffload.train_step, {HARDWARE}", budget=share,
                         budget_bytes=budget if isinstance(budget, int) else None), train_step_row(budget)))
    rows += [
        (Row(name="compile+activation_offload", method="torch.compile, functorch activation offloading, all tagged"),
         activation_offload_row(streams=False)),
        (Row(name="compile+activation_offload_streams",
             method="the same, copies on a side stream, waits sunk, reloads prefetched"),
         activation_offload_row(streams=True)),
        (Row(name="save_on_cpu", method="eager, autograd.graph.save_on_cpu(pin_memory=True)"), save_on_cpu_row),
        (Row(name="fsdp2_cpu_offload", method="eager, FSDP2 fully_shard + CPUOffloadPolicy, world 1"), fsdp2_row),
        (Row(name="torchao_cpu_offload_optimizer", method="eager, torchao CPUOffloadOptimizer(AdamW)"), torchao_row),
    ]
    return rows


def run_rows(settings: BenchSettings,
             done: Callable[[list[Row], int | None], None] = lambda rows, peak: None) -> tuple[list[Row], int | None]:
    """Every row, the eager reference first; returns them and the reference's ``max_memory_allocated`` (None on the
    CPU, or if the reference failed: then the budgets are percentages and no row has a ``max_abs_diff``).
    ``done(rows, peak)`` hears the rows so far after each one."""
    template = template_model(settings)
    batch = random_batch(settings)
    eager = Row(name="eager", method="no offload, eager")
    progress(f"row 1: {eager.name} ({eager.method})")
    reference = measure_row(eager, eager_row, template, batch, settings)
    if reference is not None:
        eager.max_abs_diff = 0.0
    reference_peak = eager.max_memory_allocated if eager.error is None else None
    rows = [eager]
    done(rows, reference_peak)
    for k, (row, build) in enumerate(other_rows(settings, reference_peak), 2):
        progress(f"row {k}: {row.name} ({row.method})")
        first = measure_row(row, build, template, batch, settings)
        if first is not None and reference is not None:
            try:
                row.max_abs_diff = max_abs_diff(first, reference)
            except Exception as error:  # noqa: BLE001 - recorded in the row
                row.error = row.error or f"comparing the parameters: {type(error).__name__}: {error}"
        rows.append(row)
        done(rows, reference_peak)
    return rows, reference_peak


# --- output ----------------------------------------------------------------------------------------------------------
def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def table(result: dict) -> str:
    model = result["model"]
    lines = [f"{result['gpu'] or 'CPU (smoke)'}, torch {result['torch']}: {model['parameters'] / 1e9:.3f} B "
             f"parameters ({model['layers']} layers, width {model['hidden']}, {model['dtype']}), batch "
             f"{model['batch']} x {model['seq']} tokens, AdamW; median of {result['steps']} steps after "
             f"{result['warmup']}",
             "budgets: " + ", ".join(b["text"] for b in result["budgets"]),
             f"{'row':<36} {'step ms':>9} {'build s':>8} {'alloc GiB':>9} {'resv GiB':>9} {'max_abs_diff':>12}  error"]
    for r in result["rows"]:
        ms = "-" if r["step_ms"] is None else f"{r['step_ms']:.1f}"
        build = "-" if r["build_s"] is None else f"{r['build_s']:.1f}"
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}"
        error = "" if r["error"] is None else r["error"].splitlines()[0][:100]
        lines.append(f"{r['name']:<36} {ms:>9} {build:>8} {gib(r['max_memory_allocated']):>9} "
                     f"{gib(r['max_memory_reserved']):>9} {diff:>12}  {error}")
    return "\n".join(lines)


def budget_entries(settings: BenchSettings, reference_peak: int | None) -> list[dict]:
    entries = []
    for share in settings.budgets:
        budget = budget_text(share, reference_peak)
        text = f"{share:g} of the eager peak = {budget / 2**30:.2f} GiB" if isinstance(budget, int) else \
            f"{budget} of the step's unplanned peak"
        entries.append({"share": share, "bytes": budget if isinstance(budget, int) else None, "text": text})
    return entries


def result_object(settings: BenchSettings, rows: list[Row], reference_peak: int | None, smoke: bool,
                  complete: bool = True) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(settings.device) if settings.on_gpu else None,
        "device": str(settings.device), "torch": torch.__version__, "smoke": smoke,
        "steps": settings.steps, "warmup": settings.warmup,
        "model": {**dataclasses.asdict(settings.config), "parameters": parameter_count(settings.config),
                  "dtype": str(settings.dtype).removeprefix("torch."), "batch": settings.batch, "seq": settings.seq},
        "budgets": budget_entries(settings, reference_peak),
        "reference_max_memory_allocated": reference_peak,
        "rows": [dataclasses.asdict(r) for r in rows],
        "complete": complete,
    }


def parameter_count(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(config).parameters())


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- the command line --------------------------------------------------------------------------------------------
def parse_shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets are shares like 0.5,0.8, got {text!r}") from None
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise argparse.ArgumentTypeError(f"each budget is a share in (0, 1], got {text!r}")
    return shares


def model_config(base: LlamaConfig, layers: int | None, hidden: int | None) -> LlamaConfig:
    """``base`` with ``layers`` and ``hidden`` replaced where given (the feed-forward width scaled with ``hidden``,
    to a multiple of 32); ``ValueError`` if the shape is inconsistent."""
    config = base
    if layers is not None:
        config = dataclasses.replace(config, layers=layers)
    if hidden is not None:
        ffn = max(32, round(base.ffn * hidden / base.hidden / 32) * 32)
        config = dataclasses.replace(config, hidden=hidden, ffn=ffn)
    config.check()
    return config


def settings_from(args: argparse.Namespace) -> BenchSettings:
    if args.smoke:
        tiny = get_workload("tiny-llama")
        base, dtype, device = tiny.config, torch.float32, torch.device("cpu")
        batch, seq = args.batch or tiny.batch, args.seq or tiny.seq
    else:
        base, dtype, device = GPU_CONFIG, torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
        batch, seq = args.batch or 2, args.seq or 4096
    steps = args.steps if args.steps is not None else (3 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    budgets = args.budgets if args.budgets is not None else ((1.0,) if args.smoke else (0.5, 0.8))
    return BenchSettings(config=model_config(base, args.layers, args.hidden), dtype=dtype, device=device,
                         batch=batch, seq=seq, steps=steps, warmup=warmup, budgets=budgets)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10, 3 with --smoke)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before them (default 3, 1 with --smoke)")
    parser.add_argument("--budgets", type=parse_shares, default=None,
                        help="train_step budgets as shares of the unplanned peak (default 0.5,0.8; 1 with --smoke, "
                             "where planning at 50%% takes over a minute)")
    parser.add_argument("--layers", type=int, default=None, help="decoder blocks (default 16; 4 with --smoke)")
    parser.add_argument("--hidden", type=int, default=None, help="model width (default 2048; 128 with --smoke)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 2; 2 with --smoke)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; 64 with --smoke)")
    parser.add_argument("--json", type=Path, default=None, help="write the result object to this file")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                        help="folder for gpu_native.txt (and gpu_native.json without --json); default $OUT")
    parser.add_argument("--smoke", action="store_true", help="a tiny float32 model on the CPU: the script's logic only")
    args = parser.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 1):
        parser.error("--steps and --warmup must be at least 1 (the first warm-up step is the one compared)")
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_native: no CUDA device here (torch.cuda.is_available() is False); nothing measured. --smoke runs "
              "the same code on the CPU.")
        return 0
    try:
        settings = settings_from(args)
    except ValueError as error:
        parser.error(str(error))
    if args.smoke:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # a core left to the emulated link's copies

    progress(f"{'CPU smoke run' if args.smoke else torch.cuda.get_device_name(settings.device)}: "
             f"{parameter_count(settings.config):,} parameters, {len(settings.budgets)} budget(s), "
             f"{settings.warmup} + {settings.steps} steps per row")
    json_path = args.json if args.json is not None else (args.out / "gpu_native.json" if args.out else None)

    def save(rows: list[Row], peak: int | None, complete: bool = False) -> None:
        if json_path is not None:  # after every row: a run cut short keeps what it measured
            write(json_path, json.dumps(result_object(settings, rows, peak, args.smoke, complete), indent=2) + "\n")

    rows, reference_peak = run_rows(settings, save)
    save(rows, reference_peak, complete=True)
    text = table(result_object(settings, rows, reference_peak, args.smoke))
    print(text, flush=True)
    if args.out is not None:
        write(args.out / "gpu_native.txt", text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
