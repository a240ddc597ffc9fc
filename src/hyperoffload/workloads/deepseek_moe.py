"""The mixture-of-experts feed-forward of the DeepSeek-style model.

Routing is a softmax over ``routed_experts`` gate logits (DeepSeek-V2's gate; V3 uses a sigmoid
with a bias and group-limited routing, which changes which experts win but not the shapes or the
cost), the top ``experts_per_token`` are kept, optionally renormalised and scaled, and ``shared``
always-on experts are added as one dense SwiGLU of width ``shared_experts * moe_ffn``.

Dispatch has static shapes so ``make_fx`` can trace it on fake tensors: a **capacity-based
dispatch**. Each (token, expert) assignment gets a position in its expert's queue from a cumulative
count; assignments whose position is below the capacity ``C`` are copied into an
``(experts, C, hidden)`` buffer (``index_copy``), every expert runs its SwiGLU on its ``C`` rows as
batched matrix products (``bmm``), and the results are gathered back and weighted. Assignments past
the capacity are dropped (their expert contributes nothing for that token), as in GShard/Switch.

Cost against real sparse dispatch, which computes exactly ``tokens * experts_per_token`` rows:
the graph computes ``experts * C`` rows, so the FLOPs the op rules count are
``experts * C / (tokens * experts_per_token)`` times the real ones. With a capacity factor ``f``,
``C = ceil(f * tokens * experts_per_token / experts)``, which is ``f`` (1.25 for the large presets)
once there are enough tokens, but at least one row per expert: at decode with few tokens every
expert runs one row (DeepSeek-V3 at batch 1: 256 rows for 8 real ones, 32x), and every expert's
weights are read, as a real kernel reading only the chosen experts would not. With
``capacity_factor=None`` the capacity is ``tokens`` (no assignment can be dropped, so results do not
depend on which other tokens share the step): exact, at ``experts / experts_per_token`` times the
real FLOPs; the tiny preset uses it so cached decode and a full re-run agree.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def expert_capacity(tokens: int, experts: int, per_token: int, capacity_factor: float | None) -> int:
    """Rows each expert computes for ``tokens`` tokens: ``tokens`` when ``capacity_factor`` is None
    (drop-free), else ``ceil(capacity_factor * tokens * per_token / experts)``, between 1 and ``tokens``."""
    if capacity_factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * per_token / experts)))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Routed + shared experts over 2-D input (tokens, hidden); see the module docstring."""

    def __init__(self, hidden: int, moe_ffn: int, routed_experts: int, shared_experts: int, experts_per_token: int,
                 *, capacity_factor: float | None, norm_topk: bool, routed_scale: float) -> None:
        super().__init__()
        self.experts, self.per_token = routed_experts, experts_per_token
        self.capacity_factor, self.norm_topk, self.routed_scale = capacity_factor, norm_topk, routed_scale
        self.gate = nn.Linear(hidden, routed_experts, bias=False)
        # Expert weights stacked so one bmm runs every expert: (experts, in, out).
        self.w1 = nn.Parameter(torch.empty(routed_experts, hidden, moe_ffn))
        self.w3 = nn.Parameter(torch.empty(routed_experts, hidden, moe_ffn))
        self.w2 = nn.Parameter(torch.empty(routed_experts, moe_ffn, hidden))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=w.shape[1] ** -0.5)
        self.shared = SwiGLU(hidden, shared_experts * moe_ffn) if shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        experts, k = self.experts, self.per_token
        probs = self.gate(x).float().softmax(-1)
        weights, chosen = probs.topk(k, dim=-1)  # (tokens, k)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = (weights * self.routed_scale).to(x.dtype)
        capacity = expert_capacity(tokens, experts, k, self.capacity_factor)
        # Position of each assignment in its expert's queue, in token order.
        flat = chosen.reshape(-1)  # (tokens * k,)
        onehot = F.one_hot(flat, experts)
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1
        kept = position < capacity
        # Dropped assignments go to one spare row past the experts' rows, which is never read back
        # as a result (its duplicates make that row's content arbitrary, and it is multiplied by 0).
        slot = torch.where(kept, flat * capacity + position, experts * capacity)
        rows = x.repeat_interleave(k, dim=0)  # (tokens * k, hidden): assignment i belongs to token i // k
        buffer = x.new_zeros(experts * capacity + 1, hidden).index_copy(0, slot, rows)
        per_expert = buffer[:-1].view(experts, capacity, hidden)
        out = torch.bmm(F.silu(torch.bmm(per_expert, self.w1)) * torch.bmm(per_expert, self.w3), self.w2)
        out = torch.cat((out.reshape(experts * capacity, hidden), x.new_zeros(1, hidden)))
        routed = (out.index_select(0, slot) * (weights.reshape(-1) * kept)[:, None]).view(tokens, k, hidden).sum(1)
        return routed if self.shared is None else routed + self.shared(x)
