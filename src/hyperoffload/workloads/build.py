"""Build a workload's model and example batch, then capture one step of it."""

from __future__ import annotations

import dataclasses

import torch

from hyperoffload.capture import (AdamW, CaptureError, Captured, capture_decode_step, capture_prefill_step,
                                  capture_train_step, default_dtype, fake_build)
from hyperoffload.capture.sharded import capture_sharded_prefill_step, capture_sharded_train_step, check_world
from hyperoffload.capture.steps import check_step_tokens
from hyperoffload.variants import RemoteKvForms
from hyperoffload.workloads.catalog import MODES
from hyperoffload.workloads.deepseek import DeepSeekConfig
from hyperoffload.workloads.deepseek_remote import DEFAULT_RESELECTION, capture_remote_decode_step, pool_facts
from hyperoffload.workloads.presets import Workload


def capture_workload(workload: Workload, mode: str, *, batch: int | None = None, seq: int | None = None,
                     context: int | None = None, fake: bool = True, master_weights: bool = False,
                     seed: int = 0, remote_kv: bool = False, pool_blocks: int | None = None,
                     reselection: float | None = None, speculative: bool = False, world: int = 1,
                     mesh=None) -> Captured:
    """Capture ``mode`` ("train", "prefill" or "decode") of ``workload``.

    ``fake=True`` builds the model and batch as fake tensors (no memory: any size can be
    inspected and planned); ``fake=False`` builds real random weights seeded by ``seed``, so
    the step can be executed. ``seq`` is tokens per sequence for train and prefill, ``context``
    the tokens already cached for decode (which feeds one new token per sequence).

    ``remote_kv=True`` (decode of a DeepSeek-style workload) captures the step with its latent KV
    cache in remote memory (``deepseek_remote.capture_remote_decode_step``), with a device block pool
    of ``pool_blocks`` blocks per sequence and layer (None: no pool), or with ``speculative`` prefetch of
    the previous step's selection instead of a pool, and the stated ``reselection`` statistic (default
    ``deepseek_remote.DEFAULT_RESELECTION``). A decode step of such a workload captured with its cache on the
    device says how to capture those forms in its Program (``Program.remote_kv``, a ``variants.RemoteKvForms``).

    ``world`` > 1 captures rank 0's step of the model sharded with FSDP2 over that many ranks
    (``capture.sharded``), train or prefill; on a fake process group, or with ``mesh`` (a 1-D DeviceMesh of
    ``world`` ranks over a real group) this rank's step on that group, whose graph communicates when run.
    """
    _refuse_what_the_mode_does_not_take(mode, remote_kv=remote_kv, seq=seq, context=context, world=world,
                                        master_weights=master_weights)
    batch, seq, context = _sizes(workload, mode, batch=batch, seq=seq, context=context)
    meta = {"workload": workload.name, "batch": batch, "dtype": str(workload.dtype).removeprefix("torch.")}
    model, tokens, targets = _built(workload, mode, batch=batch, seq=seq, fake=fake, seed=seed)
    if world > 1 and mode == "train":
        return capture_sharded_train_step(model, (tokens,), targets, world=world, name=workload.name,
                                          meta={**meta, "seq": seq}, mesh=mesh)
    if world > 1:
        return capture_sharded_prefill_step(model, (tokens,), world=world, name=workload.name,
                                            meta={**meta, "seq": seq}, mesh=mesh)
    if mode == "train":
        return capture_train_step(model, (tokens,), targets, optimizer=AdamW(master_weights=master_weights),
                                  name=workload.name, meta={**meta, "seq": seq})
    if mode == "prefill":
        return capture_prefill_step(model, (tokens,), name=workload.name, meta={**meta, "seq": seq})
    if remote_kv:
        if not isinstance(workload.config, DeepSeekConfig):
            raise CaptureError(f"a remote KV cache needs a DeepSeek-style workload (MLA + NSA); {workload.name} "
                               f"is not one")
        return capture_remote_decode_step(
            model, tokens, context, pool_blocks=pool_blocks, name=workload.name, meta=meta, speculative=speculative,
            reselection=DEFAULT_RESELECTION if reselection is None else reselection)
    if not isinstance(workload.config, DeepSeekConfig):
        return capture_decode_step(model, tokens, context, name=workload.name, meta=meta)
    return _decode_with_remote_kv_forms(workload, model, tokens, meta, batch=batch, context=context, fake=fake,
                                        seed=seed, reselection=reselection)


def _refuse_what_the_mode_does_not_take(mode: str, *, remote_kv: bool, seq: int | None, context: int | None,
                                        world: int, master_weights: bool) -> None:
    """A ``CaptureError`` for an option the mode does not use: a size or setting the step would not use is
    refused, not ignored (seq= on a decode step would otherwise leave the context at the preset's and say
    nothing)."""
    if mode not in MODES:
        raise CaptureError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if remote_kv and mode != "decode":
        raise CaptureError(f"a remote KV cache is captured for decode only, not {mode}")
    if mode == "decode" and seq is not None:
        raise CaptureError(f"seq (--seq) sizes train and prefill steps; a decode step feeds one token per sequence "
                           f"after context (--context) cached tokens: give context={seq} instead")
    if mode != "decode" and context is not None:
        raise CaptureError(f"context (--context) sizes decode steps; a {mode} step takes seq (--seq) tokens per "
                           f"sequence: give seq={context} instead")
    check_world(world)
    if world > 1 and (mode == "decode" or master_weights):
        what = "a decode step" if mode == "decode" else "master weights (--master-weights)"
        raise CaptureError(f"{what} cannot be captured sharded over ranks (--world {world}) yet; FSDP2 shards train "
                           f"and prefill steps: give --mode train or prefill without --master-weights, or --world 1")
    if master_weights and mode != "train":
        raise CaptureError(f"master_weights (--master-weights) adds an fp32 copy of the weights to a training step's "
                           f"optimizer; a {mode} step has no optimizer: drop it")


def _sizes(workload: Workload, mode: str, *, batch: int | None, seq: int | None,
           context: int | None) -> tuple[int, int, int]:
    """``(batch, seq, context)``: the given sizes, the preset's where None, each checked."""
    batch = workload.batch if batch is None else batch
    seq = workload.seq if seq is None else seq
    context = workload.context if context is None else context
    # Named as both the Python argument and the CLI flag say them (``batch`` / ``--batch``).
    for label, size, least in (("batch", batch, 1), ("seq", seq, 1), ("context", context, 0)):
        if isinstance(size, bool) or not isinstance(size, int) or size < least:
            unit = "sequences" if label == "batch" else "tokens"
            raise CaptureError(f"{label} (--{label}) must be a whole number of {unit}, at least {least}; got {size!r}")
    check_step_tokens(batch, context + 1 if mode == "decode" else seq, "context" if mode == "decode" else "seq")
    return batch, seq, context


def _built(workload: Workload, mode: str, *, batch: int, seq: int, fake: bool, seed: int):
    """The workload's model, its input tokens (one per sequence for decode) and targets: fake tensors, or real
    random ones seeded by ``seed``."""
    vocab = workload.config.vocab_size
    if not fake:
        torch.manual_seed(seed)
    with fake_build(workload.dtype) if fake else default_dtype(workload.dtype):
        model = workload.model(workload.config)
        tokens = torch.randint(0, vocab, (batch, 1 if mode == "decode" else seq))
        targets = torch.randint(0, vocab, (batch, seq))
    return model, tokens, targets


def _decode_with_remote_kv_forms(workload: Workload, model, tokens, meta: dict, *, batch: int, context: int,
                                 fake: bool, seed: int, reselection: float | None) -> Captured:
    """A DeepSeek-style decode step with its cache on the device, whose Program says how to capture its forms with
    the cache in remote memory (``Program.remote_kv``)."""
    facts = pool_facts(workload.config, batch, context, workload.dtype.itemsize)
    captured = capture_decode_step(model, tokens, context, name=workload.name, meta={**meta, **facts})

    def remote(pool: int | None, speculative: bool = False):
        return capture_workload(workload, "decode", batch=batch, context=context, fake=fake, seed=seed,
                                remote_kv=True, pool_blocks=pool, reselection=reselection, speculative=speculative)

    forms = RemoteKvForms(capture=remote, smallest_pool=facts["nsa_top_n"], valid_blocks=facts["valid_blocks"],
                          pool_block_bytes=facts["pool_block_bytes"])
    return dataclasses.replace(captured, program=dataclasses.replace(captured.program, remote_kv=forms))


def with_nsa_block(workload: Workload, block: int | None) -> Workload:
    """``workload`` with its NSA selection block set to ``block`` tokens (None: unchanged)."""
    if block is None:
        return workload
    if not isinstance(workload.config, DeepSeekConfig):
        raise CaptureError(f"NSA block sizes (--nsa-block, --vary nsa-block) apply to DeepSeek-style workloads (NSA); "
                           f"{workload.name} has no NSA")
    if block < workload.config.nsa_cmp_block:
        # The config's own check names its fields; the user gave a flag.
        raise CaptureError(f"an NSA selection block of {block} tokens (--nsa-block, --vary nsa-block) must hold at "
                           f"least one compression block, {workload.config.nsa_cmp_block} tokens in {workload.name}; "
                           f"give {workload.config.nsa_cmp_block} or more")
    try:
        config = dataclasses.replace(workload.config, nsa_sel_block=block)
    except ValueError as error:
        raise CaptureError(f"--nsa-block {block}: {error}") from None
    return dataclasses.replace(workload, config=config)
