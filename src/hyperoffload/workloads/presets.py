"""Named workloads: model configs with their dtype policy and default step sizes.

Sizes of the LLaMA 3 presets are Meta's published configs (``docs/references.md``:
LLaMA 3 8B: 32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads, vocab 128256;
LLaMA 3 70B: 80 layers, hidden 8192, FFN 28672, 64 heads, 8 KV heads). Their dtype
policy is the training policy of ``docs/figures.md``: bf16 weights, gradients and
activations, fp32 AdamW moments, an optional fp32 master copy. ``tiny-llama`` runs in
fp32 so planned and unplanned runs can be compared bit for bit. The DeepSeek-style presets
(``deepseek.py``) are for inference: bf16 weights and KV cache, each size with its source in
a comment at the preset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hyperoffload.workloads.deepseek import DeepSeek, DeepSeekConfig
from hyperoffload.workloads.llama import Llama, LlamaConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A built-in model and the step sizes it is usually run at."""

    name: str
    description: str
    config: LlamaConfig | DeepSeekConfig
    dtype: torch.dtype
    """Dtype of weights, gradients and activations (AdamW moments are always float32)."""
    batch: int
    """Default sequences per step."""
    seq: int
    """Default tokens per sequence for train and prefill."""
    context: int
    """Default tokens already in the KV cache for decode."""
    source: str
    """Where the sizes come from."""
    model: Callable[[LlamaConfig | DeepSeekConfig], nn.Module] = Llama
    """Builds the model from ``config``."""


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="tiny-llama",
            description="4-layer LLaMA-style decoder for tests and demos; its steps take milliseconds on CPU",
            config=LlamaConfig(vocab_size=512, hidden=128, ffn=352, layers=4, heads=4, kv_heads=2),
            dtype=torch.float32, batch=2, seq=64, context=64,
            source="project-defined; shape follows LLaMA 3 (GQA 2:1, SwiGLU, RMSNorm, RoPE)"),
        Workload(
            name="llama3-8b",
            description="LLaMA 3 8B",
            config=LlamaConfig(vocab_size=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8),
            dtype=torch.bfloat16, batch=1, seq=4096, context=4096,
            source="Meta Llama 3 8B config (docs/references.md)"),
        Workload(
            name="llama3-70b",
            description="LLaMA 3 70B",
            config=LlamaConfig(vocab_size=128256, hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8),
            dtype=torch.bfloat16, batch=1, seq=4096, context=4096,
            source="Meta Llama 3 70B config (docs/references.md)"),
        Workload(
            name="tiny-deepseek",
            description="3-layer DeepSeek-style decoder (MLA + NSA + MoE) for tests and demos; its prefill and decode "
                        "steps are quick to run on CPU",
            # Project-defined, with DeepSeek's proportions scaled down: NSA blocks small enough that a 64-token
            # sequence has 4 selection blocks, so selection, window and compression all matter; drop-free
            # expert dispatch so a cached decode and a full re-run agree (deepseek_moe).
            config=DeepSeekConfig(vocab_size=512, hidden=128, layers=3, dense_layers=1, heads=4, q_lora_rank=64,
                                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn=256,
                                  moe_ffn=64, routed_experts=8, shared_experts=1, experts_per_token=2,
                                  capacity_factor=None, nsa_cmp_block=8, nsa_cmp_stride=4, nsa_sel_block=16,
                                  nsa_top_n=4, nsa_window=16),
            dtype=torch.float32, batch=2, seq=64, context=64, model=DeepSeek,
            source="project-defined; shape follows DeepSeek-V3 (MLA, MoE with a shared expert) with NSA"),
        Workload(
            name="deepseek-v2-lite",
            description="DeepSeek-V2-Lite (15.7B, 2.4B active) with NSA attention",
            # DeepSeek-V2-Lite config.json (Hugging Face deepseek-ai/DeepSeek-V2-Lite; 27 layers, hidden 2048,
            # 64 routed + 2 shared experts, 6 active, kv_lora_rank 512 are in docs/references.md; heads 16,
            # no query LoRA, qk_nope 128, qk_rope 64, v 128, dense FFN 10944, expert FFN 1408, first layer dense,
            # vocab 102400, no top-k renormalisation are from the same config, not in docs/references.md). NSA sizes:
            # the NSA paper's l=32, d=16, l'=64, n=16, w=512 (docs/references.md).
            config=DeepSeekConfig(vocab_size=102400, hidden=2048, layers=27, dense_layers=1, heads=16, q_lora_rank=0,
                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  ffn=10944, moe_ffn=1408, routed_experts=64, shared_experts=2, experts_per_token=6),
            dtype=torch.bfloat16, batch=32, seq=4096, context=32768, model=DeepSeek,
            source="DeepSeek-V2-Lite config (Hugging Face) with NSA (docs/references.md)"),
        Workload(
            name="deepseek-v3",
            description="DeepSeek-V3 (671B, 37B active) with NSA attention; fake capture only",
            # DeepSeek-V3 config_671B.json (docs/references.md): 61 layers, first 3 dense, dim 7168, 128 heads,
            # vocab 129280, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, 256 routed +
            # 1 shared experts, 8 active, expert FFN 2048, dense FFN 18432; top-k renormalised and scaled by 2.5
            # (same config: norm_topk_prob, route_scale). NSA sizes as above.
            config=DeepSeekConfig(vocab_size=129280, hidden=7168, layers=61, dense_layers=3, heads=128,
                                  q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, ffn=18432, moe_ffn=2048, routed_experts=256, shared_experts=1,
                                  experts_per_token=8, norm_topk=True, routed_scale=2.5),
            dtype=torch.bfloat16, batch=1, seq=4096, context=32768, model=DeepSeek,
            source="DeepSeek-V3 config_671B.json with NSA (docs/references.md)"),
    )
}


class UnknownWorkload(KeyError):
    def __str__(self) -> str:
        return f"unknown workload {self.args[0]!r}; choose one of: {', '.join(WORKLOADS)}"


def get_workload(name: str) -> Workload:
    """The preset called ``name``; ``UnknownWorkload`` lists the valid names otherwise."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise UnknownWorkload(name) from None
