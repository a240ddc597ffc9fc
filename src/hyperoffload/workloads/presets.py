"""Named workloads: model configs with their dtype policy and default step sizes.

Sizes of the LLaMA 3 presets are Meta's published configs (``shared/REFERENCES.md``:
LLaMA 3 8B: 32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads, vocab 128256;
LLaMA 3 70B: 80 layers, hidden 8192, FFN 28672, 64 heads, 8 KV heads). Their dtype
policy is the training policy of ``shared/BENCHMARKS.md``: bf16 weights, gradients and
activations, fp32 AdamW moments, an optional fp32 master copy. ``tiny-llama`` runs in
fp32 so planned and unplanned runs can be compared bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperoffload.workloads.llama import LlamaConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A built-in model and the step sizes it is usually run at."""

    name: str
    description: str
    config: LlamaConfig
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


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="tiny-llama",
            description="4-layer LLaMA-style decoder for tests and demos; a training step takes about a second on CPU",
            config=LlamaConfig(vocab_size=512, hidden=128, ffn=352, layers=4, heads=4, kv_heads=2),
            dtype=torch.float32, batch=2, seq=64, context=64,
            source="project-defined; shape follows LLaMA 3 (GQA 2:1, SwiGLU, RMSNorm, RoPE)"),
        Workload(
            name="llama3-8b",
            description="LLaMA 3 8B",
            config=LlamaConfig(vocab_size=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8),
            dtype=torch.bfloat16, batch=1, seq=4096, context=4096,
            source="Meta Llama 3 8B config (shared/REFERENCES.md)"),
        Workload(
            name="llama3-70b",
            description="LLaMA 3 70B",
            config=LlamaConfig(vocab_size=128256, hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8),
            dtype=torch.bfloat16, batch=1, seq=4096, context=4096,
            source="Meta Llama 3 70B config (shared/REFERENCES.md)"),
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
