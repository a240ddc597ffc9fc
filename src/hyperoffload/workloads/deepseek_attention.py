"""Multi-head latent attention (MLA) with Native Sparse Attention (NSA) over the latent KV cache.

MLA (DeepSeek-V2/V3): each token's keys and values are one compressed latent ``c_kv``
(``kv_lora_rank`` elements, RMS-normalised) plus one rotary key ``k_pe`` (``qk_rope_head_dim``)
shared by every head. Attention runs in the *absorbed* form of DeepSeek-V3's reference inference
code (``attn_impl="absorb"``, used there for prefill and decode alike): each head's no-position
query is multiplied into the latent space by its slice of ``wkv_b``, scores are taken against
``[c_kv, k_pe]`` directly, the output is a latent vector that ``wkv_b``'s value slice expands per
head. So the cache holds ``kv_lora_rank + qk_rope_head_dim`` values per token per layer, and
all heads share one latent key head: for NSA the GQA group is every query head.

NSA (Yuan et al., 2025), three branches over the same query, mixed by per-head sigmoid gates:

* compressed: blocks of ``nsa_cmp_block`` tokens every ``nsa_cmp_stride`` tokens, each pooled
  by learned position weights then a linear map (NSA uses a small MLP; pooling then a linear map
  is the one-layer case, and a block's compressed key depends on its own tokens only, so decode
  writes it once, when the block completes, into a small cache of compressed keys);
* selected: the ``nsa_top_n`` blocks of ``nsa_sel_block`` tokens with the highest compressed
  attention (summed over the heads of the group, spread onto the selection blocks each
  compressed block overlaps), always including the first block and the ``nsa_local_blocks``
  blocks around the query, chosen by the explicit ``hyperoffload::nsa_select`` operator whose
  output (block indices) is all a later indexed prefetch needs;
* sliding window: the ``nsa_window`` most recent tokens.

Two formulations of the selected and window branches give the same result:

* *gather* (decode, one query per sequence): the selected blocks and the window are read from
  the cache by index, so the step reads ``n * l' + w`` tokens per layer plus the compressed keys;
* *dense* (prefill, many queries): each branch is one fused attention over every cached token
  with a mask; like an eager attention it computes scores for every (query, key) pair and
  materialises the (batch, queries, keys) masks, so prefill at long contexts is quadratic in memory
  for the masks (a blockwise NSA kernel would not be).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyperoffload.workloads.deepseek_cache_shapes import cache_shapes
from hyperoffload.workloads.deepseek_remote import RemoteLayerCache
from hyperoffload.workloads.llama import RMSNorm, apply_rope


@torch.library.custom_op("hyperoffload::nsa_select", mutates_args=())
def nsa_select(cmp_probs: torch.Tensor, positions: torch.Tensor, cmp_block: int, cmp_stride: int, sel_block: int,
               sel_blocks: int, top_n: int, local_blocks: int) -> torch.Tensor:
    """Indices (batch, queries, min(top_n, sel_blocks)) of the selection blocks each query reads.

    ``cmp_probs`` (batch, heads, queries, compressed blocks): the compressed branch's attention
    probabilities; they are summed over the heads (one GQA group: every head shares the latent
    key) and each compressed block's score is added to every selection block it overlaps.
    ``positions`` (queries,): each query's token position. Block 0 and the ``local_blocks``
    blocks ending at the query's own block are always chosen; blocks that start after the query
    are never chosen unless there are fewer than ``top_n`` valid blocks, in which case the extra
    indices point at such blocks and the caller masks them out (a block is valid for a query
    when ``index * sel_block <= position``). Indices are in descending score order.
    """
    score = cmp_probs.float().sum(1)  # (batch, queries, compressed blocks)
    cmp_start = torch.arange(score.shape[-1], device=score.device) * cmp_stride
    sel_start = torch.arange(sel_blocks, device=score.device) * sel_block
    overlap = (cmp_start[:, None] < sel_start[None] + sel_block) & (cmp_start[:, None] + cmp_block > sel_start[None])
    block_score = score @ overlap.to(score.dtype)  # (batch, queries, selection blocks)
    index = torch.arange(sel_blocks, device=score.device)
    own = (positions // sel_block)[:, None]
    forced = (index[None] == 0) | ((index[None] <= own) & (index[None] > own - local_blocks))
    valid = sel_start[None] <= positions[:, None]
    block_score = block_score.masked_fill(forced, math.inf).masked_fill(~valid, -math.inf)
    return block_score.topk(min(top_n, sel_blocks), dim=-1).indices


@nsa_select.register_fake
def _nsa_select_fake(cmp_probs, positions, cmp_block, cmp_stride, sel_block, sel_blocks, top_n, local_blocks):
    batch, _, queries, _ = cmp_probs.shape
    return cmp_probs.new_empty((batch, queries, min(top_n, sel_blocks)), dtype=torch.int64)


class Compressor(nn.Module):
    """Compress blocks of ``block`` latent tokens (every ``stride`` tokens) into one key each."""

    def __init__(self, dim: int, block: int, stride: int) -> None:
        super().__init__()
        self.block, self.stride = block, stride
        self.position_logits = nn.Parameter(torch.zeros(block))  # starts as a plain mean
        self.proj = nn.Linear(dim, dim, bias=False)

    def blocks(self, latent: torch.Tensor) -> torch.Tensor:
        """Every block of ``latent`` (batch, tokens, dim) that fits in ``tokens``, whether or not its tokens
        are written yet (the caller masks blocks that end after the query): (batch, blocks, dim)."""
        windows = latent.unfold(1, self.block, self.stride)  # (batch, blocks, dim, block)
        pooled = (windows * self.position_logits.softmax(0).to(latent.dtype)).sum(-1)
        return self._project(pooled)

    def ending_at(self, latent: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The block of ``latent`` whose last token is ``position`` (one element): (batch, 1, dim)."""
        index = (position - self.block + 1 + torch.arange(self.block, device=latent.device)).clamp(min=0)
        window = latent.index_select(1, index)  # (batch, block, dim)
        pooled = (window.transpose(1, 2) * self.position_logits.softmax(0).to(latent.dtype)).sum(-1)
        return self._project(pooled[:, None])

    def _project(self, pooled: torch.Tensor) -> torch.Tensor:
        batch, blocks, dim = pooled.shape
        return self.proj(pooled.reshape(batch * blocks, dim)).view(batch, blocks, dim)


class MLAttention(nn.Module):
    """MLA + NSA attention of one layer. ``forward(x, cos, sin, positions, cache)``:

    ``x`` (batch, seq, hidden); ``positions`` (seq,) int64; ``cache`` None (the sequence attends
    to itself), this layer's ``(latent, compressed)`` cache tensors, written in place, or its
    ``deepseek_remote.RemoteLayerCache`` (the latent cache in remote memory).
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg = cfg
        heads, nope, rope, rank = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * (nope + rope), bias=False)
        else:
            self.wq = nn.Linear(cfg.hidden, heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(cfg.hidden, rank + rope, bias=False)
        self.kv_norm = RMSNorm(rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(rank, heads * (nope + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * cfg.v_head_dim, cfg.hidden, bias=False)
        self.compress = Compressor(rank + rope, cfg.nsa_cmp_block, cfg.nsa_cmp_stride)
        self.gates = nn.Linear(cfg.hidden, 3 * heads, bias=False)
        self.scale = (nope + rope) ** -0.5
        # True forces the dense formulation even for one query, so tests can compare the two.
        self.dense_branches = False

    def forward(self, x, cos, sin, positions, cache=None):
        cfg = self.cfg
        batch, seq, _ = x.shape
        heads, nope, rope, rank = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        # Linear layers on 2-D input: a fake trace can see other strides than a real run for 3-D ones.
        x2 = x.reshape(batch * seq, -1)
        q = self.wq_b(self.q_norm(self.wq_a(x2))) if cfg.q_lora_rank else self.wq(x2)
        q = q.view(batch, seq, heads, nope + rope).transpose(1, 2)  # (batch, heads, seq, nope + rope)
        q_pe = apply_rope(q[..., nope:], cos, sin)
        kv = self.wkv_a(x2).view(batch, seq, rank + rope)
        latent = torch.cat((self.kv_norm(kv[..., :rank]), apply_rope(kv[..., rank:], cos, sin)), dim=-1)
        wkv_b = self.wkv_b.weight.view(heads, nope + cfg.v_head_dim, rank)
        # Absorb each head's key projection into its query: scores are taken in the latent space.
        q_latent = torch.einsum("bhsd,hdc->bhsc", q[..., :nope], wkv_b[:, :nope])
        query = torch.cat((q_latent, q_pe), dim=-1)  # (batch, heads, seq, rank + rope)

        remote = isinstance(cache, RemoteLayerCache)
        if cache is None:
            slots, _ = cache_shapes(seq, cfg)
            keys = F.pad(latent, (0, 0, 0, slots - seq))
            compressed = self.compress.blocks(keys)
        elif remote:
            # The latent cache is in remote memory: a decode step reads the window and compressed keys
            # kept on the device and fetches the selected blocks (deepseek_remote).
            keys, compressed = cache.remote, cache.compressed
            spec = cache.speculate() if seq == 1 else None  # before the write: it depends on nothing in this layer
            cache.write(latent, positions)
            if seq == 1:
                window_keys = cache.window_keys(positions)
                last = torch.full((1,), cfg.nsa_window - 1, dtype=positions.dtype, device=positions.device)
                self._update_compressed(window_keys, compressed, positions, at=last)
            else:
                # A prefill computed these keys itself, on the device, before writing them out.
                compressed.copy_(self.compress.blocks(keys))
        else:
            keys, compressed = cache
            keys.index_copy_(1, positions, latent)
            if seq == 1:
                self._update_compressed(keys, compressed, positions)
            else:
                compressed.copy_(self.compress.blocks(keys))

        o_cmp, cmp_probs = self._compressed_branch(query, compressed, positions)
        selected = nsa_select(cmp_probs.detach(), positions, cfg.nsa_cmp_block, cfg.nsa_cmp_stride,
                              cfg.nsa_sel_block, keys.shape[1] // cfg.nsa_sel_block, cfg.nsa_top_n,
                              cfg.nsa_local_blocks)
        if seq == 1 and remote:
            chosen = selected[:, 0]
            o_sel, o_win = self._attend_gathered(query, cache.fetch(chosen, positions, spec), chosen, window_keys,
                                                 positions)
        elif seq == 1 and not self.dense_branches:
            o_sel, o_win = self._gathered_branches(query, keys, selected, positions)
        else:
            o_sel, o_win = self._dense_branches(query, keys, selected, positions)
        gates = torch.sigmoid(self.gates(x2).float()).to(x.dtype).view(batch, seq, heads, 3).permute(0, 2, 1, 3)
        out = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win  # latent, per head
        out = torch.einsum("bhsc,hvc->bshv", out, wkv_b[:, nope:])
        return self.wo(out.reshape(batch * seq, heads * cfg.v_head_dim)).view(batch, seq, -1)

    def _update_compressed(self, keys, compressed, positions, at=None):
        """Write the compressed key of the block that ends at this position, if one does. ``keys`` holds
        that block's tokens at rows ``at - nsa_cmp_block + 1 ... at`` (``at`` defaults to ``positions``)."""
        cfg = self.cfg
        ended = positions + 1 - cfg.nsa_cmp_block  # first token of the block ending here
        aligned = (ended >= 0) & (ended % cfg.nsa_cmp_stride == 0)
        slot = (ended.clamp(min=0) // cfg.nsa_cmp_stride).clamp(max=compressed.shape[1] - 1)
        new = self.compress.ending_at(keys, positions if at is None else at)
        compressed.index_copy_(1, slot, torch.where(aligned, new, compressed.index_select(1, slot)))

    def _compressed_branch(self, query, compressed, positions):
        """Attention over the compressed keys that are complete at each query's position; returns
        the latent output and the probabilities (batch, heads, seq, blocks) selection reads."""
        cfg = self.cfg
        rank = cfg.kv_lora_rank
        scores = torch.einsum("bhsd,bnd->bhsn", query, compressed).float() * self.scale
        block_end = torch.arange(compressed.shape[1], device=query.device) * cfg.nsa_cmp_stride + cfg.nsa_cmp_block - 1
        complete = block_end[None] <= positions[:, None]  # (seq, blocks)
        # A query before the first complete block has nothing here: its probabilities are zero, not NaN.
        probs = scores.masked_fill(~complete, torch.finfo(torch.float32).min).softmax(-1) * complete
        out = torch.einsum("bhsn,bnc->bhsc", probs.to(query.dtype), compressed[..., :rank])
        return out, probs

    def _attend(self, query, keys, mask):
        """Attention of (batch, heads, seq, dim) queries over one shared key head (batch, tokens, dim),
        values the keys' latent part, under a boolean ``mask`` broadcastable to (batch, 1, seq, tokens)."""
        # Values are the whole key (latent + rope), so one fused kernel takes them; the rope part of
        # the output is dropped (12% more value FLOPs at DeepSeek's sizes than values of width rank).
        out = F.scaled_dot_product_attention(query, keys[:, None], keys[:, None], attn_mask=mask, scale=self.scale,
                                             enable_gqa=True)
        return out[..., :self.cfg.kv_lora_rank]

    def _dense_branches(self, query, keys, selected, positions):
        cfg = self.cfg
        block = cfg.nsa_sel_block
        batch, _, seq, _ = query.shape
        token = torch.arange(keys.shape[1], device=query.device)
        causal = token[None] <= positions[:, None]  # (seq, tokens)
        chosen = (selected * block <= positions[:, None]).to(torch.uint8)  # valid selections only
        blocks = torch.zeros(batch, seq, keys.shape[1] // block, dtype=torch.uint8, device=query.device)
        blocks = blocks.scatter(-1, selected, chosen).bool()
        in_selected = blocks.repeat_interleave(block, dim=-1) & causal  # (batch, seq, tokens)
        in_window = causal & (token[None] > positions[:, None] - cfg.nsa_window)
        return self._attend(query, keys, in_selected[:, None]), self._attend(query, keys, in_window[None, None])

    def _gathered_branches(self, query, keys, selected, positions):
        """One query per sequence: read only the selected blocks and the window from the cache."""
        cfg = self.cfg
        block, window = cfg.nsa_sel_block, cfg.nsa_window
        batch, dim = keys.shape[0], keys.shape[-1]
        chosen = selected[:, 0]  # (batch, n)
        blocks = keys.view(batch, -1, block, dim)[torch.arange(batch, device=keys.device)[:, None], chosen]
        recent = positions - window + 1 + torch.arange(window, device=keys.device)
        return self._attend_gathered(query, blocks, chosen, keys.index_select(1, recent.clamp(min=0)), positions)

    def _attend_gathered(self, query, blocks, chosen, window_keys, positions):
        """The selected and window branches of one query per sequence from the keys they read:
        ``blocks`` (batch, n, nsa_sel_block, dim), the blocks ``chosen`` (batch, n), and ``window_keys``
        (batch, nsa_window, dim), the tokens ``positions - nsa_window + 1 ... positions`` (those before
        0 are masked)."""
        cfg = self.cfg
        block, window = cfg.nsa_sel_block, cfg.nsa_window
        batch, dim = blocks.shape[0], blocks.shape[-1]
        token = chosen[..., None] * block + torch.arange(block, device=blocks.device)  # (batch, n, block)
        in_selected = (token <= positions).reshape(batch, 1, 1, -1)
        recent = positions - window + 1 + torch.arange(window, device=blocks.device)
        in_window = (recent >= 0)[None, None, None]
        return (self._attend(query, blocks.reshape(batch, -1, dim), in_selected),
                self._attend(query, window_keys, in_window))
