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
the selected branch reads them through ``hyperoffload::prefetch_blocks`` (``cache_ops``): without a
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

from collections import OrderedDict
from dataclasses import dataclass

import torch

from hyperoffload.cache_ops import prefetch_blocks


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
    """One layer's KV cache with its latent cache in remote memory (module docstring)."""

    def __init__(self, cfg, remote: torch.Tensor, device_like: torch.Tensor, compressed_blocks: int,
                 pool_blocks: int | None, stats: RemoteKVStats, first_layer: bool) -> None:
        batch, slots, dim = remote.shape
        self.cfg = cfg
        self.remote = remote
        self.compressed = device_like.new_zeros((batch, compressed_blocks, dim))
        self.window = device_like.new_zeros((batch, cfg.nsa_window, dim))
        self.stats = stats
        self.first_layer = first_layer  # counts each decode step once
        self.pool = None if pool_blocks is None else device_like.new_zeros((batch, pool_blocks, cfg.nsa_sel_block, dim))
        # block id -> pool slot per sequence, least recently used first: the block table and LRU order in one.
        self.table: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(batch)]
        self.previous: list[set[int]] | None = None

    def device_bytes(self) -> int:
        """Bytes this layer keeps on the device: compressed keys, window and block pool."""
        parts = (self.compressed, self.window) + (() if self.pool is None else (self.pool,))
        return sum(t.numel() * t.element_size() for t in parts)

    def write(self, latent: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the new tokens' ``latent`` (batch, seq, dim) at ``positions`` to remote memory, the
        window and (write-through) any resident pool block they fall in."""
        self.remote.index_copy_(1, positions, latent)
        self.stats.written_bytes += latent.numel() * latent.element_size()
        window = self.cfg.nsa_window
        self.window.index_copy_(1, positions[-window:] % window, latent[:, -window:])
        if self.pool is None:
            return
        block = self.cfg.nsa_sel_block
        if latent.shape[1] == 1:
            index, row = divmod(int(positions[0]), block)
            for b, table in enumerate(self.table):
                if index in table:
                    self.pool[b, table[index], row] = latent[b, 0]
        else:  # a prefill: drop resident copies of the blocks it writes rather than patch them row by row
            written = set((positions // block).tolist())
            for table in self.table:
                for index in written & table.keys():
                    del table[index]

    def window_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """The window of a decode step at ``positions`` (one element), oldest first: (batch, nsa_window, dim).
        Positions before 0 read position 0, as the on-device decode does (the branch masks them)."""
        window = self.cfg.nsa_window
        recent = positions - window + 1 + torch.arange(window, device=positions.device)
        return self.window.index_select(1, recent.clamp(min=0) % window)

    def fetch(self, chosen: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The blocks ``chosen`` (batch, n) as (batch, n, nsa_sel_block, dim) on the device, fetched
        from remote memory with ``prefetch_blocks`` unless the pool holds them."""
        block = self.cfg.nsa_sel_block
        batch, n = chosen.shape
        block_bytes = block * self.remote.shape[-1] * self.remote.element_size()
        stats = self.stats
        if self.first_layer:
            stats.decode_steps += 1
            stats.tokens_decoded += batch
        stats.selected_blocks += batch * n
        self._count_reselection(chosen, int(positions[0]))
        if self.pool is None:
            stats.fetched_blocks += batch * n
            stats.fetched_bytes += batch * n * block_bytes
            return prefetch_blocks(self.remote, chosen, block)
        slots = []
        for b, (table, ids) in enumerate(zip(self.table, chosen.tolist())):
            wanted = set(ids)
            missing = list(dict.fromkeys(i for i in ids if i not in table))  # each block once, in order
            free = sorted(set(range(self.pool.shape[1])) - set(table.values()))
            for index in missing:
                if not free:  # evict the least recently used block this step does not read
                    victim = next(i for i in table if i not in wanted)
                    free.append(table.pop(victim))
                table[index] = free.pop(0)
            for index in ids:
                table.move_to_end(index)
            if missing:
                fetched = prefetch_blocks(self.remote[b], torch.tensor(missing, device=chosen.device), block)
                self.pool[b, [table[i] for i in missing]] = fetched
                stats.fetched_blocks += len(missing)
                stats.fetched_bytes += len(missing) * block_bytes
            slots.append([table[i] for i in ids])
        slot = torch.tensor(slots, device=chosen.device)
        return self.pool[torch.arange(batch, device=chosen.device)[:, None], slot]

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


def new_remote_cache(model, batch: int, context: int, pool_blocks: int | None = None,
                     dtype: torch.dtype | None = None) -> RemoteKVCache:
    """A zeroed remote KV cache for ``context`` tokens of ``model`` (a ``DeepSeek``).

    The latent cache is allocated on the CPU (remote memory); compressed keys, windows and the
    pool on the weights' device. ``pool_blocks``: blocks per sequence per layer in the device
    block pool, at least ``nsa_top_n`` (every block a step reads is resident while it reads it);
    None for no pool (every selected block fetched every step).
    """
    from hyperoffload.workloads.deepseek_attention import cache_shapes  # that module imports this one

    cfg = model.cfg
    if batch <= 0 or context <= 0:
        raise ValueError(f"batch and context must be positive, got batch={batch}, context={context}")
    if cfg.nsa_window < cfg.nsa_cmp_block:
        raise ValueError(f"a remote KV cache needs nsa_window ({cfg.nsa_window}) >= nsa_cmp_block "
                         f"({cfg.nsa_cmp_block}): a decode step reads the completing compression block from the window")
    if pool_blocks is not None and pool_blocks < cfg.nsa_top_n:
        raise ValueError(f"pool_blocks ({pool_blocks}) must be at least nsa_top_n ({cfg.nsa_top_n}): every block a "
                         f"step selects is resident while it is read; pass None for no pool")
    slots, compressed_blocks = cache_shapes(context, cfg)
    weight = model.embed.weight
    dtype = dtype or weight.dtype
    device_like = weight.new_empty((), dtype=dtype)
    stats = RemoteKVStats()
    layers = [RemoteLayerCache(cfg, torch.zeros((batch, slots, cfg.kv_dim), dtype=dtype, device="cpu"), device_like,
                               compressed_blocks, pool_blocks, stats, first_layer=i == 0)
              for i in range(cfg.layers)]
    return RemoteKVCache(layers, stats)
