"""How many slots the DeepSeek-style model's latent KV cache and its NSA compressed keys take for a number of
tokens: shared by the on-device cache (``deepseek``), the attention that reads it (``deepseek_attention``) and the
remote cache (``deepseek_remote``), none of which needs the others to size it."""

from __future__ import annotations

import math


def cache_shapes(tokens: int, cfg) -> tuple[int, int]:
    """(latent slots, compressed slots) of a cache for ``tokens`` tokens: latent slots are rounded up
    to whole selection blocks, so the cache views as (blocks, nsa_sel_block, dim) without copying."""
    slots = max(1, math.ceil(tokens / cfg.nsa_sel_block)) * cfg.nsa_sel_block
    return slots, (slots - cfg.nsa_cmp_block) // cfg.nsa_cmp_stride + 1


__all__ = ["cache_shapes"]
