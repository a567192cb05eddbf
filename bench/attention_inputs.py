"""The attention benchmarks' shared pieces: their inputs (Issue 5's shapes, drawn by
kvzoo.samples from the session seed), a float64 reference, timers and the GPU's ceilings. Used
by sustained.py and the probes under probes/.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvzoo import samples  # noqa: E402
from kvzoo.inputs import rng_for  # noqa: E402
from kvzoo.problem import Attention  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DEV = "cuda"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def graph_ms(fn, reps: int = 20) -> float:
    """Per launch, from a CUDA graph of `reps` launches: the kernel's own time, with no host
    launch gap (do_bench's events time a kernel of a few microseconds with its launch)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / reps


def ceilings() -> tuple[float, float]:
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    x.random_()
    ms = bench(lambda: y.copy_(x))
    copy_bw = 2 * x.numel() / ms / 1e6  # GB/s
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return copy_bw, 2 * 8192**3 / ms / 1e9


def make(num_seqs, q_len, seq_len, mode, seed=0, quantize_query=False, fp8_dots=False):
    """num_seqs sequences of seq_len keys whose last q_len tokens are queried, drawn on the GPU by
    kvzoo.samples (scattered pages, no spare ones); `seed` tells draws of one shape apart."""
    s = samples.paged_sample(
        rng_for("attention_probe", num_seqs, q_len, seq_len, mode, seed),
        mode,
        q_lens=[q_len] * num_seqs,
        seq_lens=[seq_len] * num_seqs,
        block_size=BS,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        query_dtype="bfloat16",
        device=DEV,
        spare_blocks=0,
        spare_columns=0,
        fill="torch",
    )
    return s.attention_record(
        quantize_query=quantize_query,
        fp8_dots=fp8_dots,
    )


def ref_seq(p: Attention, s: int) -> torch.Tensor:
    """float64 attention of sequence s (causal), on the GPU."""
    q0, q1 = int(p.query_start_loc[s]), int(p.query_start_loc[s + 1])
    n = int(p.seq_lens[s])
    pos = torch.arange(n, device=DEV)
    blk = p.block_tables[s, pos // BS].long()
    off = pos % BS

    def dec(cache, sc):
        x = cache[blk, off].to(torch.float64)
        return x * sc[blk, off].to(torch.float64)[..., None] if sc is not None else x

    k = dec(p.key_cache, p.k_scale_cache).repeat_interleave(HQ // HKV, dim=1)  # [n, HQ, D]
    v = dec(p.value_cache, p.v_scale_cache).repeat_interleave(HQ // HKV, dim=1)
    q = p.query[q0:q1].to(torch.float64)
    logits = torch.einsum("qhd,khd->hqk", q, k) * p.softmax_scale
    qpos = n - (q1 - q0) + torch.arange(q1 - q0, device=DEV)
    logits = logits.masked_fill(pos[None, None, :] > qpos[None, :, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)


def err(p: Attention, seqs) -> float:
    worst = 0.0
    for s in seqs:
        q0, q1 = int(p.query_start_loc[s]), int(p.query_start_loc[s + 1])
        r = ref_seq(p, s)
        o = p.out[q0:q1].to(torch.float64)
        worst = max(worst, float(torch.linalg.norm(o - r) / torch.linalg.norm(r)))
    return worst


def decode_bytes(p: Attention) -> int:
    tokens = int(p.seq_lens.sum())
    code = p.key_cache.element_size()
    b = 2 * tokens * HKV * D * code
    if p.mode.per_token_head:
        b += 2 * tokens * HKV * 4
    return b + 2 * p.query.numel() * p.query.element_size()


def prefill_flops(num_seqs, seq_len):
    return num_seqs * HQ * 4 * D * seq_len * (seq_len + 1) / 2
