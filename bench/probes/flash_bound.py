"""What does Triton itself reach on the prefill shape, without paging or quantization?

    python3 bench/probes/flash_bound.py                        (on the GPU)

A plain causal flash-attention forward on contiguous bf16 [batch, heads, tokens, 128] tensors
(grouped query heads, keys tiled in order, the logit scale folded into exp2), timed beside
kvzoo's bf16 and int8 prefill and torch SDPA in one run.

It separates two gaps: kvzoo against this kernel is what paging, staging and the quantized
cache cost; this kernel against SDPA (cuDNN) is what Triton 3.6's code generation leaves on
this GPU. Several tile configs are timed; each is checked against SDPA first. The contiguous
tensors are drawn here (kvzoo.samples builds paged problems only); kvzoo's rows take
bench/probes/attention_probe.py's `make`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for its shared modules

from attention_inputs import HKV, HQ, D, bench, make, prefill_flops  # noqa: E402

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402

BATCH, LENGTH = 4, 4096


@triton.jit
def _tile(
    acc,
    m_i,
    l_i,
    q,
    k_ptrs,
    v_ptrs,
    start,
    rows,
    logit_scale,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    DIAGONAL: tl.constexpr,
):
    keys = start + tl.arange(0, BLOCK_N)
    k = tl.load(k_ptrs + start * HEAD_D)
    s = tl.dot(q, k)
    if DIAGONAL:
        s = tl.where(rows[:, None] >= keys[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * logit_scale)
    p = tl.exp2(s * logit_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs + start * HEAD_D)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _flash_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    logit_scale,
    LENGTH: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTED_Q: tl.constexpr,
):
    # Longest query blocks first: under the causal mask later blocks see more keys.
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    kv = (bh // NUM_Q_HEADS) * (NUM_Q_HEADS // GROUP) + (bh % NUM_Q_HEADS) // GROUP
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_D)
    n = tl.arange(0, BLOCK_N)
    q_base = bh.to(tl.int64) * LENGTH * HEAD_D
    kv_base = kv.to(tl.int64) * LENGTH * HEAD_D
    q = tl.load(q_ptr + q_base + rows[:, None] * HEAD_D + d[None, :])
    if COMPUTED_Q:
        # An exact product, so only the operand's path changes: Triton keeps a computed A
        # operand in registers and reloads it from shared memory on every key tile.
        q = (q.to(tl.float32) * 2.0).to(q_ptr.dtype.element_ty)
        logit_scale = logit_scale * 0.5
    k_ptrs = k_ptr + kv_base + n[None, :] * HEAD_D + d[:, None]  # K^T tile [HEAD_D, BLOCK_N]
    v_ptrs = v_ptr + kv_base + n[:, None] * HEAD_D + d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    for start in range(0, block * BLOCK_M, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_ptrs, v_ptrs, start, rows, logit_scale, BLOCK_N, HEAD_D, False)
    for start in range(block * BLOCK_M, (block + 1) * BLOCK_M, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_ptrs, v_ptrs, start, rows, logit_scale, BLOCK_N, HEAD_D, True)
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_base + rows[:, None] * HEAD_D + d[None, :], out.to(o_ptr.dtype.element_ty))


def flash(q, k, v, out, block_m, block_n, warps, stages, computed_q=False):
    batch, heads, length, head_d = q.shape
    grid = (length // block_m, batch * heads)
    _flash_kernel[grid](
        q,
        k,
        v,
        out,
        head_d**-0.5 * 1.4426950408889634,
        LENGTH=length,
        NUM_Q_HEADS=heads,
        GROUP=heads // k.shape[1],
        HEAD_D=head_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        COMPUTED_Q=computed_q,
        num_warps=warps,
        num_stages=stages,
    )


# (block_m, block_n, warps, stages[, computed q]): the last row is the first with q computed
# in the kernel (as kvzoo's prefill did with its fp16 rescale before staging the query).
CONFIGS = [
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (128, 64, 8, 4),
    (64, 64, 4, 3),
    (128, 128, 8, 3, True),
]


def main() -> None:
    flops = prefill_flops(BATCH, LENGTH)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(BATCH, HQ, LENGTH, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(BATCH, HKV, LENGTH, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(BATCH, HKV, LENGTH, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    want = sdpa().float()
    rows = []
    for cfg in CONFIGS:
        out = torch.full_like(q, float("nan"))
        try:
            flash(q, k, v, out, *cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not fit must not end the run
            print(f"flash {cfg}: FAILED {type(exc).__name__}: {str(exc)[:120]}")
            continue
        e = (out.float() - want).abs().max().item()
        if not e < 2e-2:
            print(f"flash {cfg}: WRONG (max abs err {e:.1e} against SDPA)")
            continue
        rows.append(
            (f"triton flash, contiguous bf16 {cfg}", bench(lambda cfg=cfg, out=out: flash(q, k, v, out, *cfg)), e)
        )
    for mode in ("none", "int8_per_token_head"):
        p = dataclasses.replace(make(BATCH, LENGTH, LENGTH, mode), num_prefills=BATCH)
        K.run(p, "cuda")
        rows.append((f"kvzoo prefill {mode}", bench(lambda p=p: K.run(p, "cuda")), float("nan")))
    rows.append(("torch sdpa (cuDNN), contiguous bf16", bench(sdpa), float("nan")))
    sdpa_ms = rows[-1][1]
    best = min((ms for name, ms, _ in rows if name.startswith("triton")), default=float("nan"))
    print(f"{BATCH} x {LENGTH} causal, {HQ} query / {HKV} KV heads, head {D}; do_bench medians")
    for name, ms, e in rows:
        print(
            f"  {name:48s} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s  sdpa/this {sdpa_ms / ms:4.2f}x"
            f"  best triton flash/this {best / ms:4.2f}x" + (f"  err {e:.1e}" if e == e else "")
        )


if __name__ == "__main__":
    main()
