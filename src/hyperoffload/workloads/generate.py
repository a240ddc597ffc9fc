"""Greedy generation with the built-in workloads' static KV cache, and without it for reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class Generated:
    """Tokens chosen greedily and the logits they were chosen from."""

    tokens: torch.Tensor
    """(batch, steps) int64."""
    logits: torch.Tensor
    """(batch, steps, vocab): the logits each token is the argmax of, in float32."""


def _check(prompt: torch.Tensor, steps: int) -> None:
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be (batch, tokens) with at least one token, got shape {tuple(prompt.shape)}")
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")


@torch.no_grad()
def greedy_generate(model: nn.Module, prompt: torch.Tensor, steps: int, cache=None) -> Generated:
    """Prefill ``prompt`` (batch, tokens) into a cache from ``model.new_cache``, then decode one token
    at a time with the cache, ``steps`` tokens in all (the first comes from the prefill).

    ``cache``: an empty cache for at least ``tokens + steps`` tokens to use instead of a new one, e.g.
    ``deepseek_remote.new_remote_cache``'s (the KV cache in remote memory)."""
    _check(prompt, steps)
    if cache is None and not hasattr(model, "new_cache"):
        raise ValueError(f"{type(model).__name__} has no new_cache(batch, context); use greedy_generate_uncached")
    batch, length = prompt.shape
    if cache is None:
        cache = model.new_cache(batch, length + steps)
    logits = model(prompt, cache=cache, start=torch.tensor([0]))[:, -1].float()
    tokens, chosen_from = [], []
    for step in range(steps):
        token = logits.argmax(-1)
        tokens.append(token)
        chosen_from.append(logits)
        if step + 1 < steps:
            logits = model(token[:, None], cache=cache, start=torch.tensor([length + step]))[:, -1].float()
    return Generated(torch.stack(tokens, 1), torch.stack(chosen_from, 1))


@torch.no_grad()
def greedy_generate_uncached(model: nn.Module, prompt: torch.Tensor, steps: int) -> Generated:
    """The reference: every token from a forward pass over the whole sequence so far, no cache."""
    _check(prompt, steps)
    sequence = prompt
    tokens, chosen_from = [], []
    for _ in range(steps):
        logits = model(sequence)[:, -1].float()
        token = logits.argmax(-1)
        tokens.append(token)
        chosen_from.append(logits)
        sequence = torch.cat((sequence, token[:, None]), dim=1)
    return Generated(torch.stack(tokens, 1), torch.stack(chosen_from, 1))
