"""A LLaMA-style decoder built from a config with random weights.

RMSNorm, rotary position embeddings, grouped-query attention through
``torch.nn.functional.scaled_dot_product_attention`` and a SwiGLU feed-forward,
as in LLaMA 3 (sizes in ``docs/references.md``: Meta's published configs).
Nothing is downloaded: weights are random, or absent when built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """Shape of a LLaMA-style decoder."""

    vocab_size: int
    """Number of token ids."""
    hidden: int
    """Model width (elements)."""
    ffn: int
    """SwiGLU intermediate width (elements)."""
    layers: int
    """Number of decoder blocks."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention); divides ``heads``."""
    rope_theta: float = 500_000.0
    """RoPE base (LLaMA 3 uses 500,000)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field."""
        for name in ("vocab_size", "hidden", "ffn", "layers", "heads", "kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as LLaMA does, then return to the activation dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_tables(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq, head_dim // 2) for integer ``positions``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of ``x`` (batch, heads, seq, head_dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin, cache=None, cache_pos=None):
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            # Decode: write this step's keys and values into the preallocated cache in place,
            # then attend over everything up to and including the new position.
            cache_k, cache_v = cache
            cache_k.index_copy_(2, cache_pos, k)
            cache_v.index_copy_(2, cache_pos, v)
            k, v = cache_k, cache_v
            # Attend to every cached position up to each query's own position.
            mask = torch.arange(cache_k.shape[2], device=x.device)[None, :] <= cache_pos[:, None]
        else:
            mask = None
        # enable_gqa shares each key/value head across its query group without copying it.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=self.heads != self.kv_heads)
        # Flatten to 2-D before the projection: for a 3-D input, matmul picks mm or bmm from the
        # strides, and a fake trace can see different strides for size-1 dimensions than a real run.
        return self.wo(out.transpose(1, 2).reshape(batch * seq, -1)).view(batch, seq, -1)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin, cache=None, cache_pos=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, cache_pos)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only LLaMA. ``forward(tokens)`` returns logits (batch, seq, vocab).

    For decode, pass ``cache`` (a list of (k, v) per layer, each
    (batch, kv_heads, max_context, head_dim)) and ``start`` (an int64 tensor of
    one element: the position of the first token of ``tokens``); the cache is
    updated in place.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.embed.weight

    def forward(self, tokens, cache=None, start=None):
        seq = tokens.shape[1]
        if start is None:
            positions = torch.arange(seq, device=tokens.device)
        else:
            positions = start + torch.arange(seq, device=tokens.device)
        cos, sin = rope_tables(self.cfg.head_dim, positions, self.cfg.rope_theta)
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if cache is None else cache[i], None if cache is None else positions)
        return self.output(self.norm(x))

    def new_cache(self, batch: int, context: int, dtype: torch.dtype | None = None):
        """A zeroed KV cache for ``context`` tokens: list of (k, v) per layer, each
        (batch, kv_heads, context, head_dim), on the weights' device (fake if they are fake)."""
        cfg = self.cfg
        weight = self.embed.weight
        shape = (batch, cfg.kv_heads, context, cfg.head_dim)
        return [(weight.new_zeros(shape, dtype=dtype), weight.new_zeros(shape, dtype=dtype))
                for _ in range(cfg.layers)]
