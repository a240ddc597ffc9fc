"""A DeepSeek-style decoder: MLA attention with NSA over a latent KV cache, and MoE feed-forward.

Built from a config with random weights (nothing is downloaded). Each block is RMSNorm, multi-head
latent attention with Native Sparse Attention (``deepseek_attention``), RMSNorm, and a feed-forward
that is a dense SwiGLU in the first ``dense_layers`` blocks and a mixture of experts after
(``deepseek_moe``), as in DeepSeek-V2/V3. Sizes of the presets are in ``presets.py``.

The KV cache is a list with one ``(latent, compressed)`` pair per layer, fixed-size tensors the
step takes as inputs and writes in place (``index_copy_``), as the LLaMA workload's cache:

* ``latent`` (batch, slots, kv_lora_rank + qk_rope_head_dim): each token's latent ``c_kv`` and
  rotary key ``k_pe`` side by side; slots are rounded up to whole NSA selection blocks, so block
  ``j`` is the contiguous rows ``j * nsa_sel_block ...``;
* ``compressed`` (batch, blocks, kv_lora_rank + qk_rope_head_dim): NSA's compressed keys, one per
  compression block, written once when the block's last token arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyperoffload.workloads.deepseek_attention import MLAttention
from hyperoffload.workloads.deepseek_cache_shapes import cache_shapes
from hyperoffload.workloads.deepseek_moe import MoE, SwiGLU
from hyperoffload.workloads.llama import RMSNorm, rope_tables


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepSeekConfig:
    """Shape of a DeepSeek-style decoder (names follow DeepSeek-V3's ``ModelArgs`` where they exist)."""

    vocab_size: int
    """Number of token ids."""
    hidden: int
    """Model width (elements)."""
    layers: int
    """Number of decoder blocks."""
    dense_layers: int
    """The first blocks use a dense SwiGLU of width ``ffn`` instead of experts."""
    heads: int
    """Query heads."""
    q_lora_rank: int
    """Rank of the query's low-rank projection; 0 projects queries directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    """Width of the latent ``c_kv`` cached per token (elements)."""
    qk_nope_head_dim: int
    """Per-head query/key width without position (elements)."""
    qk_rope_head_dim: int
    """Rotary query/key width, one rotary key shared by all heads (elements)."""
    v_head_dim: int
    """Per-head value width (elements)."""
    ffn: int
    """Dense SwiGLU width of the first ``dense_layers`` blocks (elements)."""
    moe_ffn: int
    """SwiGLU width of one expert (elements)."""
    routed_experts: int
    """Experts chosen by the gate."""
    shared_experts: int
    """Experts every token goes through."""
    experts_per_token: int
    """Routed experts each token uses (top-k)."""
    capacity_factor: float | None = 1.25
    """Rows per expert relative to an even share; None for drop-free dispatch (see ``deepseek_moe``)."""
    norm_topk: bool = False
    """Renormalise the top-k gate weights to sum to 1 (V3 does, V2-Lite does not)."""
    routed_scale: float = 1.0
    """Factor on the routed experts' output (V3: 2.5)."""
    nsa_cmp_block: int = 32
    """NSA compression block length l (tokens)."""
    nsa_cmp_stride: int = 16
    """NSA compression stride d (tokens)."""
    nsa_sel_block: int = 64
    """NSA selection block length l' (tokens); also the cache's block granularity."""
    nsa_top_n: int = 16
    """NSA selected blocks per query, including the first block and the local blocks."""
    nsa_local_blocks: int = 2
    """Blocks ending at the query's own block that are always selected."""
    nsa_window: int = 512
    """NSA sliding-window length w (tokens)."""
    rope_theta: float = 10_000.0
    """RoPE base (DeepSeek-V2/V3 use 10,000 before YaRN scaling, which is left out here)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""

    @property
    def kv_dim(self) -> int:
        """Values cached per token per layer: latent plus rotary key (elements)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def check(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field."""
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "ffn", "moe_ffn", "routed_experts", "experts_per_token", "nsa_cmp_block",
                     "nsa_cmp_stride", "nsa_sel_block", "nsa_top_n", "nsa_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("q_lora_rank", "shared_experts", "nsa_local_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"dense_layers ({self.dense_layers}) must be between 0 and layers ({self.layers})")
        if self.experts_per_token > self.routed_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be <= routed_experts "
                             f"({self.routed_experts})")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for rotary embeddings")
        if self.nsa_cmp_block > self.nsa_sel_block:
            raise ValueError(f"nsa_cmp_block ({self.nsa_cmp_block}) must be <= nsa_sel_block ({self.nsa_sel_block}): "
                             f"the cache is allocated in selection blocks and must hold one compression block")
        if self.nsa_local_blocks + 1 > self.nsa_top_n:
            raise ValueError(f"nsa_top_n ({self.nsa_top_n}) must cover the first block and the "
                             f"{self.nsa_local_blocks} local blocks")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive or None (drop-free), got {self.capacity_factor}")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of latent cache per token over all layers (compressed keys not included)."""
        return self.layers * self.kv_dim * dtype.itemsize


class Block(nn.Module):
    def __init__(self, cfg: DeepSeekConfig, dense: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = MLAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.hidden, cfg.ffn) if dense else MoE(
            cfg.hidden, cfg.moe_ffn, cfg.routed_experts, cfg.shared_experts, cfg.experts_per_token,
            capacity_factor=cfg.capacity_factor, norm_topk=cfg.norm_topk, routed_scale=cfg.routed_scale)

    def forward(self, x, cos, sin, positions, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, cache)
        batch, seq, hidden = x.shape
        return x + self.ffn(self.ffn_norm(x).reshape(batch * seq, hidden)).view(batch, seq, hidden)


class DeepSeek(nn.Module):
    """Decoder-only DeepSeek-style model. ``forward(tokens)`` returns logits (batch, seq, vocab).

    With ``cache`` (from ``new_cache``) and ``start`` (an int64 tensor of one element: the position
    of the first token of ``tokens``), the tokens' latent keys are written into the cache in place
    and attention reads the cache: a prefill into the cache for several tokens, a decode step for
    one (which reads only the NSA-selected blocks, the window and the compressed keys).
    """

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, dense=i < cfg.dense_layers) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, tokens, cache=None, start=None):
        batch, seq = tokens.shape
        positions = torch.arange(seq, device=tokens.device)
        if start is not None:
            positions = start + positions
        elif cache is not None:
            raise ValueError("a cache needs start= (the position of the first token)")
        cos, sin = rope_tables(self.cfg.qk_rope_head_dim, positions, self.cfg.rope_theta)
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, None if cache is None else cache[i])
        return self.output(self.norm(x).reshape(batch * seq, -1)).view(batch, seq, -1)

    def new_cache(self, batch: int, context: int, dtype: torch.dtype | None = None):
        """A zeroed cache for ``context`` tokens: one ``(latent, compressed)`` pair per layer (module
        docstring), on the weights' device (fake if they are fake)."""
        slots, blocks = cache_shapes(context, self.cfg)
        weight = self.embed.weight
        dim = self.cfg.kv_dim
        return [(weight.new_zeros((batch, slots, dim), dtype=dtype), weight.new_zeros((batch, blocks, dim), dtype=dtype))
                for _ in range(self.cfg.layers)]

    def cache_names(self) -> list[str]:
        """Names of the flattened cache tensors, in ``new_cache`` order."""
        return [f"layers.{i}.{part}" for i in range(self.cfg.layers) for part in ("kv_latent", "kv_compressed")]
