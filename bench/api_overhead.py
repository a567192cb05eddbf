"""Host time of one eager kvzoo call, kernel excluded: the public API's checks, the problem
record and the registry's choice, with an implementation that does nothing. What an engine
pays per call without CUDA graphs, on top of the kernel launch itself.

    python bench/api_overhead.py        (CPU tensors; prints microseconds per call)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvzoo  # noqa: E402
from kvzoo.registry import Implementation  # noqa: E402

MODE = "int8_per_token_head"
SEQS, HQ, HKV, D, BS, BLOCKS_PER_SEQ = 64, 32, 8, 128, 16, 4


def no_op(op: str) -> Implementation:
    return Implementation(f"no-op {op}", op, "any", frozenset({MODE}), run=lambda problem: None,
                          array_kind="torch")


def calls() -> dict[str, callable]:
    g = torch.Generator().manual_seed(1)
    blocks = SEQS * BLOCKS_PER_SEQ
    query = torch.randn(SEQS, HQ, D, generator=g).to(torch.bfloat16)
    kc = torch.randint(-127, 128, (blocks, BS, HKV, D), generator=g, dtype=torch.int8)
    vc = torch.randint(-127, 128, (blocks, BS, HKV, D), generator=g, dtype=torch.int8)
    ks, vs = torch.rand(blocks, BS, HKV, generator=g), torch.rand(blocks, BS, HKV, generator=g)
    tables = torch.randperm(blocks, generator=g).to(torch.int32).view(SEQS, BLOCKS_PER_SEQ)
    seq_lens = torch.randint(1, BS * BLOCKS_PER_SEQ + 1, (SEQS,), generator=g, dtype=torch.int32)
    qsl = torch.arange(SEQS + 1, dtype=torch.int32)
    out = torch.empty_like(query)
    key = torch.randn(SEQS, HKV, D, generator=g).to(torch.bfloat16)
    value = torch.randn(SEQS, HKV, D, generator=g).to(torch.bfloat16)
    slots = torch.randperm(blocks * BS, generator=g)[:SEQS].to(torch.int32)
    attention, write = no_op("paged_attention"), no_op("reshape_and_cache")
    return {
        "paged_attention (decode, 64 seqs)": lambda: kvzoo.paged_attention(
            query, kc, vc, mode=MODE, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
            k_scale_cache=ks, v_scale_cache=vs, out=out, max_query_len=1, max_seq_len=BS * BLOCKS_PER_SEQ,
            impl=attention, validate=False),
        "reshape_and_cache (64 tokens)": lambda: kvzoo.reshape_and_cache(
            key, value, kc, vc, slots, mode=MODE, k_scale_cache=ks, v_scale_cache=vs, impl=write,
            validate=False),
    }


def triton_launch_preparation() -> dict[str, callable]:
    """The Triton backend's own per-call Python before Triton's launcher: the table lookup and
    the argument lists (meta tensors, so no GPU and no kernel)."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import offline_facts
    except ImportError:  # no triton here
        return {}
    kernels = offline_facts.K
    kernels._num_sms = lambda device_index: offline_facts.H200_SMS
    p = offline_facts.meta_problem(SEQS, 1, BS * BLOCKS_PER_SEQ, MODE)
    cfg = kernels.decode_config(p, False)
    return {
        "triton decode_config": lambda: kernels.decode_config(p, False),
        "triton kernel_call (argument lists)": lambda: kernels.kernel_call(p, "cuda", cfg, per_seq=True, skip_decode=False),
    }


def main() -> None:
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}; validate=False, no-op implementation")
    for name, fn in {**calls(), **triton_launch_preparation()}.items():
        for _ in range(300):
            fn()
        runs = []
        for _ in range(7):
            n = 2000
            t = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t) / n * 1e6)
        print(f"{name:36s} median {statistics.median(runs):6.1f} us per call (runs {min(runs):.1f}-{max(runs):.1f})")


if __name__ == "__main__":
    main()
