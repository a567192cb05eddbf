#!/usr/bin/env python3
"""Host time of the transformers integration's decode step, kvzoo's layer calls left out.

An eager decode step in transformers is bound by the host (bench/e2e_transformers.py): every
microsecond the integration spends between the model's update() and the kernels' launches is
a microsecond of the step. This probe runs the integration's decode path on CPU tensors with
the plan's two layer calls (StepPlan.write, StepPlan.attention) replaced by stubs, so what is
timed is the integration alone: the step's page table and metadata (once per step) and each
layer's update, checks, plan look-up and tensor views. Beside it, the least a layer needs: the
same views and the two stub calls, nothing else. CPU time of this thread (time.thread_time),
so other processes on the machine stretch it less than wall time; medians of each round, the
rounds interleaved.

    python bench/probes/integration_host.py                 # this checkout
    python bench/probes/integration_host.py --tree ../old   # another checkout's kvzoo, to compare
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[2]), help="the checkout whose kvzoo runs")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)

    import torch
    import transformers

    from kvzoo.integrations.transformers import KVZooCache
    from kvzoo.integrations.transformers.attention import kvzoo_paged_attention, register
    from kvzoo.plan import StepPlan

    StepPlan.write = lambda self, *a, **k: None  # type: ignore[method-assign]
    StepPlan.attention = lambda self, q, *a, **k: torch.empty_like(q)  # type: ignore[method-assign]
    torch.set_num_threads(1)
    layers, batch, prompt, hq, hkv, d = args.layers, args.batch, 64, 8, 2, 32
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hq * d,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=d,
        max_position_embeddings=8192,
    )
    register()
    config._attn_implementation = "kvzoo_paged"

    class Module(torch.nn.Module):
        is_causal = True

    module = Module()
    stub = StepPlan.__new__(StepPlan)

    def least(query, key, value):
        k, v, q = key.squeeze(2), value.squeeze(2), query.squeeze(2)
        StepPlan.write(stub, k, v, None)
        out = StepPlan.attention(stub, q, None)
        return out.view(query.shape[0], 1, query.shape[1], query.shape[3])

    def one_round(integration: bool) -> float:
        cache = KVZooCache(config, max_cache_len=prompt + args.steps + 8, impl="numpy")
        q, k, v = (
            torch.randn(batch, hq, prompt, d),
            torch.randn(batch, hkv, prompt, d),
            torch.randn(batch, hkv, prompt, d),
        )
        for layer in range(layers):
            kvzoo_paged_attention(module, q, *cache.update(k, v, layer), None, scaling=d**-0.5)
        q, k, v = torch.randn(batch, hq, 1, d), torch.randn(batch, hkv, 1, d), torch.randn(batch, hkv, 1, d)
        times = []
        for _ in range(args.steps):
            start = time.thread_time()
            for layer in range(layers):
                if integration:
                    kvzoo_paged_attention(module, q, *cache.update(k, v, layer), None, scaling=d**-0.5)
                else:
                    least(q, k, v)
            times.append(time.thread_time() - start)
        return statistics.median(times) * 1e6

    rows: dict[str, list[float]] = {"integration": [], "least": []}
    for _ in range(args.rounds):
        rows["integration"].append(one_round(True))
        rows["least"].append(one_round(False))
    print(f"kvzoo from {args.tree}; {layers} layers, batch {batch}, decode steps after a {prompt}-token prompt")
    print("| path | us a step (median of rounds) | fastest round | us a layer |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {min(values):.1f} | {med / layers:.1f} |")


if __name__ == "__main__":
    main()
