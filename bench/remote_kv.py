"""Decode of `tiny-deepseek` with the latent KV cache in remote memory, for real on CPU.

For each prompt length: 64 greedy decode steps with the cache on the device (the reference), then
with the remote cache (``workloads.deepseek_remote``) without a block pool and with pools of 1x, 2x
and 4x ``nsa_top_n`` blocks per sequence per layer. Prints whether the tokens and logits are exactly
the reference's, bytes fetched from remote memory per decoded token (and as a fraction of fetching
every selected block, and of fetching the whole latent cache every step), device bytes against the
on-device cache's, the pool hit rate and how often a block selected at one step is selected again at
the next (all valid blocks, and only those chosen by score rather than always selected).

    .venv/bin/python bench/remote_kv.py
"""

from __future__ import annotations

import torch

from hyperoffload.units import format_bytes
from hyperoffload.workloads import DeepSeek, get_workload, greedy_generate
from hyperoffload.workloads.deepseek_remote import new_remote_cache

BATCH = 2
DECODE_STEPS = 64
PROMPTS = (100, 1000)


def main() -> None:
    cfg = get_workload("tiny-deepseek").config
    torch.manual_seed(0)
    model = DeepSeek(cfg).eval()
    print(f"tiny-deepseek: {cfg.layers} layers, latent {cfg.kv_dim} float32 per token per layer, selection blocks of "
          f"{cfg.nsa_sel_block}, top-{cfg.nsa_top_n} (first + {cfg.nsa_local_blocks} local), window {cfg.nsa_window}; "
          f"batch {BATCH}, {DECODE_STEPS} decode steps")
    print("prompt | pool blocks | exact | fetched/token | vs no pool | vs whole cache | device bytes (on-device cache) "
          "| pool hits | reselected (free)")
    for length in PROMPTS:
        prompt = torch.randint(0, cfg.vocab_size, (BATCH, length))
        steps = DECODE_STEPS + 1  # the first token comes from the prefill
        context = length + steps
        reference = greedy_generate(model, prompt, steps)
        on_device = sum(t.numel() * t.element_size() for pair in model.new_cache(BATCH, context) for t in pair)
        # Fetching the whole latent cache each step (at its final length, as a fixed-size remote cache would).
        whole = cfg.layers * new_remote_cache(model, 1, context)[0].remote[0].numel() * 4
        baseline = None
        for pool in (None, cfg.nsa_top_n, 2 * cfg.nsa_top_n, 4 * cfg.nsa_top_n):
            cache = new_remote_cache(model, BATCH, context, pool_blocks=pool)
            out = greedy_generate(model, prompt, steps, cache=cache)
            exact = torch.equal(out.tokens, reference.tokens) and torch.equal(out.logits, reference.logits)
            s = cache.stats
            per_token = s.fetched_bytes_per_token
            baseline = baseline or per_token
            print(f"{length} | {pool or 'none'} | {exact} | {format_bytes(per_token)} | {per_token / baseline:.3f} | "
                  f"{per_token / whole:.4f} | {format_bytes(cache.device_bytes())} ({format_bytes(on_device)}) | "
                  f"{s.pool_hit_rate:.3f} | {s.reselection_rate:.3f} ({s.free_reselection_rate:.3f})")


if __name__ == "__main__":
    main()
