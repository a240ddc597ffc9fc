"""Train a small model of your own under half the memory its step needs, in your own loop, with your optimizer.

    python examples/train_under_budget.py [--steps 20] [--budget 50%] [--link 4GB/s]

The model is defined here (a small LLaMA-style decoder), the optimizer is plain ``torch.optim.AdamW`` with a
learning-rate schedule, and the batches are random token sequences. ``hyperoffload.train_step`` traces the whole
step once (forward, loss, backward and the AdamW update), plans what goes to remote memory and when, compiles it with
Inductor, and then each ``step(batch)`` runs it: the copies run asynchronously on an emulated link while the CPU
computes. Everything runs on the CPU; the plan is made for the ``cpu-emulated`` profile (this machine, measured when
the script starts, with the link at ``--link``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import hyperoffload
from hyperoffload.units import format_bytes, parse_bytes


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def random_batches(steps: int, batch: int, seq: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget", default="50%", help="bytes (40MiB), a share of the step's peak (50%%) or hideable")
    parser.add_argument("--link", default="4GB/s", help="the emulated link's speed each way")
    args = parser.parse_args()
    link_bw = parse_bytes(args.link.removesuffix("/s"))
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    hyperoffload.keep_freed_host_memory()  # on the CPU: reuse freed buffers rather than fault in new pages each step
    torch.manual_seed(0)
    model = TinyDecoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    batches = list(random_batches(args.steps, batch=8, seq=64, vocab=512))

    print(f"planning and compiling the step (budget {args.budget}, link {args.link}) ...", flush=True)
    start = time.perf_counter()
    # This machine as the device, with the link at the speed the copies are emulated at (on the CPU, the step's
    # copies run on a link of the profile's speed).
    hardware = dataclasses.replace(hyperoffload.get_hardware("cpu-emulated"), h2d_bw=link_bw, d2h_bw=link_bw)
    step = hyperoffload.train_step(model, optimizer, next_token_loss, batches[0], budget=args.budget,
                                   hardware=hardware, progress=lambda text: print(f"  {time.perf_counter() - start:5.1f} s  {text}",
                                                               flush=True))
    print(f"ready in {time.perf_counter() - start:.1f} s\n{step.report()}\n", flush=True)

    for i, batch in enumerate(batches, 1):
        # The device peak is measured through PyTorch's profiler, which slows a step several times over: only on
        # the first step, every tenth and the last; the other steps' times are the step's own.
        step.measure = i == 1 or i % 10 == 0 or i == len(batches)
        loss = step(batch)
        schedule.step()
        last = step.last
        peak = (f"device peak {format_bytes(last.peak_bytes)} of {format_bytes(last.budget_bytes)}"
                if last.peak_bytes is not None else "")
        print(f"step {i:3d}/{args.steps}  loss {loss.item():.4f}  lr {schedule.get_last_lr()[0]:.2e}  "
              f"{last.wall_s * 1e3:6.1f} ms  {peak}", flush=True)
    over = step.last.peak_bytes > step.last.budget_bytes
    print(f"\nload average {os.getloadavg()[0]:.2f}; the last step held {format_bytes(step.last.peak_bytes)} on the "
          f"device against a budget of {format_bytes(step.last.budget_bytes)}"
          + (" (OVER the budget)" if over else ""))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
