"""Decode of the DeepSeek-style model with its latent KV cache in remote memory.

``new_remote_cache(model, batch, context, pool_blocks=...)`` returns a cache the model takes where
it takes ``new_cache``'s (``model(tokens, cache=..., start=...)``, ``greedy_generate(..., cache=...)``).
Per layer it holds:

* in remote memory, the whole latent cache ``remote`` (batch, slots, kv_dim), slots rounded up to
  whole selection blocks as on the device (``cache_shapes``); every new token is written to it in
  place (the only device -> remote traffic of a step: ``kv_dim`` elements per token per layer);
* on the device, NSA's compressed keys (batch, compressed blocks, kv_dim), 1/``nsa_cmp_stride`` of
  the latent cache, which the compressed branch reads whole;
* on the device, the sliding window (batch, ``nsa_window``, kv_dim), a ring buffer indexed by
  ``position % nsa_window`` holding the most recent tokens, which also supplies the tokens of the
  compression block that completes at a decode step (so ``nsa_window >= nsa_cmp_block``);
* optionally on the device, a block pool (batch, ``pool_blocks``, ``nsa_sel_block``, kv_dim) with a
  block table (batch, blocks) -> pool slot or -1, vLLM-style paging with least-recently-used
  eviction per sequence: a selected block already resident is read from the pool, not moved again.

A decode step runs the compressed branch on the device keys, ``nsa_select`` picks the blocks, and
the selected branch reads them through ``hyperoffload::prefetch_blocks`` (``block_ops``): without a
pool all ``nsa_top_n`` selected blocks are fetched every step; with one only the blocks that are
not resident. The values read are the same as an on-device cache's, in the same order, so the
logits are bit-for-bit those of the on-device decode. Copies here are synchronous CPU copies
("remote memory" is another host tensor): what this measures is the bytes a step moves, not the
time; the overlap of the fetch with the compressed and window branches is for a real transfer
engine (the fetch is issued right after ``nsa_select`` and before the window branch is needed).

A prefill (several tokens) writes its keys to remote memory and computes its attention from them
as the on-device prefill does; in a real system those keys were computed on the device and are
offloaded once. The block table and the traffic counters read the selected indices in Python, so a
step with this cache runs eagerly and does not trace (``prefetch_blocks`` itself traces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import register_pytree_node

from hyperoffload.block_ops import fetch_blocks_pooled, fetch_missing_blocks, prefetch_blocks, store_rows
from hyperoffload.capture.steps import capture_decode_step
from hyperoffload.workloads.catalog import DEFAULT_RESELECTION
from hyperoffload.workloads.deepseek_cache_shapes import cache_shapes


@dataclass(slots=True)
class RemoteKVStats:
    """Traffic of a remote KV cache since it was made, over all layers (bytes and block counts).

    Mutable on purpose: the cache's layers add to it as the model runs.
    """

    decode_steps: int = 0
    """Decode steps (one token per sequence) counted once per step, not per layer."""
    tokens_decoded: int = 0
    """Tokens decoded: decode steps x batch."""
    fetched_bytes: int = 0
    """Bytes copied remote -> device by ``prefetch_blocks`` during decode."""
    fetched_blocks: int = 0
    """Blocks copied remote -> device during decode (one sequence, one layer each)."""
    selected_blocks: int = 0
    """Blocks decode steps selected (one sequence, one layer each); fetched or read from the pool."""
    written_bytes: int = 0
    """Bytes written device -> remote (each new token's latent, every layer), prefill included."""
    compared_blocks: int = 0
    """Valid selected blocks at decode steps that had a previous decode step to compare with."""
    reselected_blocks: int = 0
    """Of ``compared_blocks``, those that the same layer also selected for the same sequence one step before."""
    compared_free_blocks: int = 0
    """Like ``compared_blocks``, without the blocks NSA always selects (the first and the local blocks)."""
    reselected_free_blocks: int = 0
    """Of ``compared_free_blocks``, those also selected one step before."""

    @property
    def fetched_bytes_per_token(self) -> float:
        """Bytes fetched from remote memory per decoded token (all layers)."""
        return self.fetched_bytes / max(self.tokens_decoded, 1)

    @property
    def pool_hit_rate(self) -> float:
        """Fraction of selected blocks that did not have to be fetched."""
        return 1 - self.fetched_blocks / max(self.selected_blocks, 1)

    @property
    def reselection_rate(self) -> float:
        """How often a (valid) block selected at one decode step is selected again at the next."""
        return self.reselected_blocks / max(self.compared_blocks, 1)

    @property
    def free_reselection_rate(self) -> float:
        """``reselection_rate`` over the blocks selection chose by score, not the always-selected ones."""
        return self.reselected_free_blocks / max(self.compared_free_blocks, 1)


class RemoteLayerCache:
    """One layer's KV cache with its latent cache in remote memory (module docstring).

    ``stats`` None counts nothing (a traced step: the counters read tensor values in Python).
    """

    def __init__(self, cfg, remote: torch.Tensor, compressed: torch.Tensor, window: torch.Tensor,
                 pool: torch.Tensor | None, slots: torch.Tensor | None, stats: RemoteKVStats | None,
                 first_layer: bool, spec_ids: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        self.remote, self.compressed, self.window = remote, compressed, window
        # The pool and its block table: per slot, the block held (-1: free) and when it was last read.
        self.pool, self.slots = pool, slots
        # Speculation: the previous step's selection (batch, nsa_top_n), prefetched before this step's is known.
        self.spec_ids = spec_ids
        self.stats = stats
        self.first_layer = first_layer  # counts each decode step once
        self.previous: list[set[int]] | None = None

    @classmethod
    def new(cls, cfg, remote: torch.Tensor, device_like: torch.Tensor, compressed_blocks: int,
            pool_blocks: int | None, stats: RemoteKVStats | None, first_layer: bool,
            speculative: bool = False) -> RemoteLayerCache:
        batch, _, dim = remote.shape
        pool = slots = spec_ids = None
        if speculative:  # block 0 until a first selection: any valid guess will do
            spec_ids = torch.zeros((batch, cfg.nsa_top_n), dtype=torch.int64, device=device_like.device)
        if pool_blocks is not None:
            pool = device_like.new_zeros((batch, pool_blocks, cfg.nsa_sel_block, dim))
            slots = torch.zeros((batch, pool_blocks, 2), dtype=torch.int64, device=device_like.device)
            slots[..., 0] = -1
        return cls(cfg, remote, device_like.new_zeros((batch, compressed_blocks, dim)),
                   device_like.new_zeros((batch, cfg.nsa_window, dim)), pool, slots, stats, first_layer, spec_ids)

    def tensors(self) -> list[torch.Tensor]:
        """The layer's tensors, remote cache first: what a traced step takes as inputs."""
        extra = [self.pool, self.slots] if self.pool is not None else [self.spec_ids] if self.spec_ids is not None else []
        return [self.remote, self.compressed, self.window, *extra]

    def part_names(self) -> list[str]:
        """Names of ``tensors()``, in order."""
        extra = ["pool", "block_table"] if self.pool is not None else ["spec_ids"] if self.spec_ids is not None else []
        return ["remote", "compressed", "window", *extra]

    def with_tensors(self, tensors, stats: RemoteKVStats | None) -> RemoteLayerCache:
        """The same layer over other tensors (in ``tensors()`` order)."""
        remote, compressed, window, *extra = tensors
        pool, slots = extra if self.pool is not None else (None, None)
        spec_ids = extra[0] if self.spec_ids is not None else None
        return RemoteLayerCache(self.cfg, remote, compressed, window, pool, slots, stats, self.first_layer, spec_ids)

    def speculate(self) -> torch.Tensor | None:
        """With speculation, the previous step's selected blocks, prefetched before this step's selection is
        known (call it before ``write``: the prefetch has no other input, so it can run a layer ahead)."""
        if self.spec_ids is None:
            return None
        return prefetch_blocks(self.remote, self.spec_ids, self.cfg.nsa_sel_block)

    def device_bytes(self) -> int:
        """Bytes this layer keeps on the device: compressed keys, window and block pool with its table."""
        return sum(t.numel() * t.element_size() for t in self.tensors()[1:])

    def write(self, latent: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the new tokens' ``latent`` (batch, seq, dim) at ``positions`` to remote memory and the
        window. A decode step's resident pool block is refreshed by the fetch; a prefill drops the
        resident copies of the blocks it writes rather than patch them row by row."""
        store_rows(self.remote, latent, positions)
        if self.stats is not None:
            self.stats.written_bytes += latent.numel() * latent.element_size()
        window = self.cfg.nsa_window
        self.window.index_copy_(1, positions[-window:] % window, latent[:, -window:])
        if self.pool is not None and latent.shape[1] > 1:
            written = torch.isin(self.slots[..., 0], torch.unique(positions // self.cfg.nsa_sel_block))
            self.slots[..., 0].masked_fill_(written, -1)

    def window_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """The window of a decode step at ``positions`` (one element), oldest first: (batch, nsa_window, dim).
        Positions before 0 read position 0, as the on-device decode does (the branch masks them)."""
        window = self.cfg.nsa_window
        recent = positions - window + 1 + torch.arange(window, device=positions.device)
        return self.window.index_select(1, recent.clamp(min=0) % window)

    def fetch(self, chosen: torch.Tensor, positions: torch.Tensor, spec: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks ``chosen`` (batch, n) as (batch, n, nsa_sel_block, dim) on the device, fetched
        from remote memory with ``prefetch_blocks``, through the pool with ``fetch_blocks_pooled``, or
        with speculation as the speculative blocks ``spec`` completed by ``fetch_missing_blocks``."""
        block = self.cfg.nsa_sel_block
        if self.stats is not None:
            self._count(chosen, positions)
        if self.spec_ids is not None:
            return fetch_missing_blocks(self.remote, spec, self.spec_ids, chosen, positions, block)
        if self.pool is None:
            return prefetch_blocks(self.remote, chosen, block)
        return fetch_blocks_pooled(self.remote, self.pool, self.slots, chosen, positions, block)

    def _count(self, chosen: torch.Tensor, positions: torch.Tensor) -> None:
        batch, n = chosen.shape
        stats = self.stats
        block_bytes = self.cfg.nsa_sel_block * self.remote.shape[-1] * self.remote.element_size()
        if self.first_layer:
            stats.decode_steps += 1
            stats.tokens_decoded += batch
        stats.selected_blocks += batch * n
        self._count_reselection(chosen, int(positions[0]))
        if self.spec_ids is not None:  # the speculation, and then what it missed
            fetched = batch * n + sum(len(set(ids) - set(spec))
                                      for ids, spec in zip(chosen.tolist(), self.spec_ids.tolist()))
        elif self.pool is None:
            fetched = batch * n
        else:
            fetched = sum(len(set(ids) - set(held)) for ids, held in zip(chosen.tolist(), self.slots[..., 0].tolist()))
        stats.fetched_blocks += fetched
        stats.fetched_bytes += fetched * block_bytes

    def _count_reselection(self, chosen: torch.Tensor, position: int) -> None:
        cfg = self.cfg
        own = position // cfg.nsa_sel_block
        forced = {0, *range(max(own - cfg.nsa_local_blocks + 1, 0), own + 1)}
        valid = [{i for i in ids if i * cfg.nsa_sel_block <= position} for ids in chosen.tolist()]
        if self.previous is not None:
            stats = self.stats
            for now, before in zip(valid, self.previous):
                stats.compared_blocks += len(now)
                stats.reselected_blocks += len(now & before)
                stats.compared_free_blocks += len(now - forced)
                stats.reselected_free_blocks += len((now - forced) & before)
        self.previous = valid


class RemoteKVCache:
    """A remote KV cache for every layer of a ``DeepSeek`` model; ``cache[i]`` is layer ``i``'s."""

    def __init__(self, layers: list[RemoteLayerCache], stats: RemoteKVStats) -> None:
        self.layers = layers
        self.stats = stats

    def __getitem__(self, i: int) -> RemoteLayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def device_bytes(self) -> int:
        """Bytes kept on the device over all layers: compressed keys, windows and block pools."""
        return sum(layer.device_bytes() for layer in self.layers)

    def remote_bytes(self) -> int:
        """Bytes of the latent cache in remote memory over all layers."""
        return sum(layer.remote.numel() * layer.remote.element_size() for layer in self.layers)


def _flatten(cache: RemoteKVCache):
    return [t for layer in cache.layers for t in layer.tensors()], cache.layers


def _unflatten(tensors, layers: list[RemoteLayerCache]) -> RemoteKVCache:
    # A rebuilt cache (a traced step's) counts nothing: the counters read tensor values in Python.
    tensors, rebuilt = list(tensors), []
    for layer in layers:
        count = len(layer.tensors())
        rebuilt.append(layer.with_tensors(tensors[:count], None))
        del tensors[:count]
    return RemoteKVCache(rebuilt, None)


# A pytree of its tensors, so a decode step taking it traces like one taking an on-device cache.
register_pytree_node(RemoteKVCache, _flatten, _unflatten)


def new_remote_cache(model, batch: int, context: int, pool_blocks: int | None = None,
                     dtype: torch.dtype | None = None, speculative: bool = False) -> RemoteKVCache:
    """A zeroed remote KV cache for ``context`` tokens of ``model`` (a ``DeepSeek``).

    The latent cache is allocated on the CPU (remote memory); compressed keys, windows and the
    pool on the weights' device. ``pool_blocks``: blocks per sequence per layer in the device
    block pool, at least ``nsa_top_n`` (every block a step reads is resident while it reads it);
    None for no pool (every selected block fetched every step). ``speculative`` (no pool): each layer
    prefetches the blocks it selected at the previous step before its selection is known, then fetches
    only the selected blocks that guess missed (``fetch_missing_blocks``).
    """
    cfg = model.cfg
    if batch <= 0 or context <= 0:
        raise ValueError(f"batch and context must be positive, got batch={batch}, context={context}")
    if cfg.nsa_window < cfg.nsa_cmp_block:
        raise ValueError(f"a remote KV cache needs nsa_window ({cfg.nsa_window}) >= nsa_cmp_block "
                         f"({cfg.nsa_cmp_block}): a decode step reads the completing compression block from the window")
    if speculative and pool_blocks is not None:
        raise ValueError("speculative prefetch replaces the block pool: pass pool_blocks=None with speculative=True "
                         "(a pool already keeps the previous step's selection resident)")
    if pool_blocks is not None and pool_blocks < cfg.nsa_top_n:
        raise ValueError(f"pool_blocks ({pool_blocks}) must be at least nsa_top_n ({cfg.nsa_top_n}): every block a "
                         f"step selects is resident while it is read; pass None for no pool")
    slots, compressed_blocks = cache_shapes(context, cfg)
    weight = model.embed.weight
    dtype = dtype or weight.dtype
    device_like = weight.new_empty((), dtype=dtype)
    stats = RemoteKVStats()
    # new_zeros of the weights: fake when the model is (a fake capture allocates nothing).
    layers = [RemoteLayerCache.new(cfg, weight.new_zeros((batch, slots, cfg.kv_dim), dtype=dtype, device="cpu"), device_like,
                                   compressed_blocks, pool_blocks, stats, first_layer=i == 0,
                                   speculative=speculative)
              for i in range(cfg.layers)]
    return RemoteKVCache(layers, stats)


def expected_fetch_fraction(pool_blocks: int | None, top_n: int, valid_blocks: int,
                            reselection: float = DEFAULT_RESELECTION) -> float:
    """Expected share of a step's selected blocks that must be fetched from remote memory.

    No pool: every selected block (1.0). A least-recently-used pool of ``pool_blocks >= top_n`` blocks per
    sequence holds the previous step's selection, so a share ``reselection`` of the blocks hit; the pool's
    other ``pool_blocks - top_n`` slots hold older blocks, and a newly selected block is assumed equally
    likely to be any of the ``valid_blocks - top_n`` blocks the previous step did not select, so it hits
    with probability ``(pool_blocks - top_n) / (valid_blocks - top_n)``. A pool holding every valid block
    fetches nothing.
    """
    if not 0 <= reselection <= 1:
        raise ValueError(f"reselection must be a share between 0 and 1, got {reselection}")
    if pool_blocks is None:
        return 1.0
    if pool_blocks < top_n:
        raise ValueError(f"pool_blocks ({pool_blocks}) must be at least nsa_top_n ({top_n})")
    if pool_blocks >= valid_blocks or valid_blocks <= top_n:
        return 0.0
    other_hit = (pool_blocks - top_n) / (valid_blocks - top_n)
    return (1 - reselection) * (1 - other_hit)


def capture_remote_decode_step(model, tokens: torch.Tensor, context: int, *, pool_blocks: int | None = None,
                               reselection: float = DEFAULT_RESELECTION, name: str | None = None,
                               meta: dict | None = None, speculative: bool = False):
    """Capture one decode step of ``model`` (a ``DeepSeek``) with its latent KV cache in remote memory.

    Like ``capture_decode_step`` (``tokens`` (batch, 1) at position ``context``), but the cache is
    ``new_remote_cache(model, batch, context + 1, pool_blocks=...)``: each layer's latent cache is a
    remote step input (``Value.remote``), written by ``store_rows`` and read by ``prefetch_blocks`` or,
    with a pool, ``fetch_blocks_pooled``, which the Program holds as lane ops; compressed keys, window,
    pool and block table are device inputs. A pooled fetch is charged ``expected_fetch_fraction`` of its
    blocks (``reselection`` is the stated statistic; ``meta`` records both). ``speculative``: no pool; each
    layer prefetches the previous step's selection and then fetches the share ``1 - reselection`` it missed.
    """
    cfg = model.cfg
    batch = tokens.shape[0]
    cache = new_remote_cache(model, batch, context + 1, pool_blocks=pool_blocks, speculative=speculative)
    valid_blocks = context // cfg.nsa_sel_block + 1
    fraction = 1 - reselection if speculative else \
        expected_fetch_fraction(pool_blocks, cfg.nsa_top_n, valid_blocks, reselection)
    parts = cache.layers[0].part_names()
    return capture_decode_step(
        model, tokens, context, name=name, cache=cache,
        cache_names=[f"{i}.{part}" for i in range(len(cache.layers)) for part in parts],
        remote=[i * len(parts) for i in range(len(cache.layers))],  # each layer's tensors start with its remote one
        fetch_fraction=fraction,
        meta={"kv": "remote", "pool_blocks": pool_blocks, "speculative": speculative, "reselection": reselection,
              "pool_fetch_fraction": fraction, **pool_facts(cfg, batch, context, cache.layers[0].remote.element_size()),
              **(meta or {})})


def pool_facts(cfg, batch: int, context: int, element_size: int) -> dict:
    """What sizing a block pool needs to know about a decode step at ``context`` (position of its token):
    ``nsa_top_n`` (blocks a step reads per sequence and layer, the smallest pool), ``nsa_sel_block``,
    ``valid_blocks`` (blocks holding tokens up to the step's own) and ``pool_block_bytes`` (device bytes
    one more pool block per sequence costs over all layers: the block and its block-table entry)."""
    block_bytes = cfg.nsa_sel_block * cfg.kv_dim * element_size
    return {"nsa_top_n": cfg.nsa_top_n, "nsa_sel_block": cfg.nsa_sel_block,
            "valid_blocks": context // cfg.nsa_sel_block + 1,
            "pool_block_bytes": cfg.layers * batch * (block_bytes + 2 * 8)}
