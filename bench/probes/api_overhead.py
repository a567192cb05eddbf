"""What do kvzoo's own checks cost per eager call, kernel excluded? The public API's argument
checks, the problem record and the registry's choice, timed with an implementation that does
nothing: what an engine pays per call without CUDA graphs, on top of the launch itself
(bench/host_cost.py times whole calls, launch included, on the GPU's host).

    python bench/probes/api_overhead.py        (CPU tensors; prints microseconds per call)

Inputs come from kvzoo.samples, drawn from the session seed (KVZOO_SEED replays it).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kvzoo  # noqa: E402
from kvzoo import samples  # noqa: E402
from kvzoo.inputs import rng_for  # noqa: E402
from kvzoo.registry import Implementation  # noqa: E402

MODE = "int8_per_token_head"
SEQS, HQ, HKV, D, BS, BLOCKS_PER_SEQ = 64, 32, 8, 128, 16, 4


def no_op(op: str) -> Implementation:
    return Implementation(f"no-op {op}", op, "any", frozenset({MODE}), run=lambda problem: None, array_kind="torch")


def calls() -> dict[str, callable]:
    rng = rng_for("api_overhead")
    longest = BS * BLOCKS_PER_SEQ
    a = samples.paged_sample(
        rng,
        MODE,
        q_lens=[1] * SEQS,
        seq_lens=rng.integers(1, longest + 1, SEQS),
        block_size=BS,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        query_dtype="bfloat16",
    )
    w = samples.write_sample(
        rng, MODE, num_tokens=SEQS, num_kv_heads=HKV, head_size=D, block_size=BS, poison=False, index_dtype="int32"
    )
    out = torch.empty_like(a.query)
    ac, wc = a.caches, w.caches
    attention, write = no_op("paged_attention"), no_op("reshape_and_cache")
    return {
        "paged_attention (decode, 64 seqs)": lambda: kvzoo.paged_attention(
            a.query,
            ac.key_cache,
            ac.value_cache,
            mode=MODE,
            block_tables=a.block_tables,
            seq_lens=a.seq_lens,
            query_start_loc=a.query_start_loc,
            k_scale_cache=ac.k_scale_cache,
            v_scale_cache=ac.v_scale_cache,
            out=out,
            max_query_len=1,
            max_seq_len=longest,
            impl=attention,
            validate=False,
        ),
        "reshape_and_cache (64 tokens)": lambda: kvzoo.reshape_and_cache(
            w.key,
            w.value,
            wc.key_cache,
            wc.value_cache,
            w.slot_mapping,
            mode=MODE,
            k_scale_cache=wc.k_scale_cache,
            v_scale_cache=wc.v_scale_cache,
            impl=write,
            validate=False,
        ),
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
        "triton kernel_call (argument lists)": lambda: kernels.kernel_call(
            p, "cuda", cfg, per_seq=True, skip_decode=False
        ),
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
