"""From how many query tokens per sequence does staged quantized prefill beat the direct kernel
(staging.STAGE_MIN_QUERY_LEN), and what does its gather pass cost? On the GPU.

    python3 bench/probes/staging_sweep.py [SEQSxQUERY ...]

Every row checks the output against float64 attention first, then times CUDA-graph replays
(median, triton.testing.do_bench_cudagraph) of: the direct kernel on the codes, the staged run
(gather + attention), the gather alone (K/V codes and the query rows), the attention on the workspace alone, and mode "none"
on a bf16 cache of the same shape. Where staging applies it also times other gather programs,
and from 1024 query tokens other attention configs.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for its shared modules

from attention_inputs import ceilings, err, make  # noqa: E402

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402
from kvzoo.backends.triton import staging  # noqa: E402

CONTEXT = 4096
# (sequences, query tokens each): chunks on top of CONTEXT - q tokens of context.
SHAPES = ((32, 16), (32, 32), (32, 64), (16, 128), (16, 256), (8, 1024), (4, 4096))
MODES = ("int8_per_token_head", "fp8_per_token_head")
# Staged configs besides the table's, timed on the workspace alone (the fourth session's
# 64 x 4 and 32 x 4 tiles took 2x and 1.4x the table's time, 128 x 8 x 2 stages 1.1x: left out).
VARIANTS = {
    "64 keys 8 warps 3 stages": dict(block_n=64, num_warps=8, num_stages=3),
    "64 keys 8 warps 4 stages": dict(block_n=64, num_warps=8, num_stages=4),
    "query blocks in grid order": dict(longest_first=False),
}
# Gather programs besides staging's (GATHER_ROWS, GATHER_WARPS): (rows of a page, warps).
GATHER_VARIANTS = ((16, 2), (32, 2), (64, 4), (128, 4))


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def main() -> None:
    # Optional: only these shapes, e.g. `python3 bench/probes/staging_sweep.py 8x1024 4x4096`.
    wanted = sys.argv[1:] or [f"{seqs}x{q}" for seqs, q in SHAPES]
    copy_bw, _ = ceilings()
    print(f"copy ceiling {copy_bw:.0f} GB/s; context {CONTEXT}; times in us (CUDA-graph medians)")
    print(
        f"{'mode':6} {'seqs x q':>10} {'direct':>9} {'staged':>9} {'gather':>8} {'gather GB/s':>11} "
        f"{'attend':>9} {'bf16':>9} {'staged/direct':>13} {'staged/bf16':>11} {'err direct':>10} {'err staged':>10}"
    )
    for seqs, q in SHAPES:
        if f"{seqs}x{q}" not in wanted:
            continue
        bf16 = make(seqs, q, CONTEXT, "none", seed=q)
        t_bf16 = timed(lambda bf16=bf16: K.run(bf16, "cuda"))
        for mode in MODES:
            p = make(seqs, q, CONTEXT, mode, seed=q + 1)
            p = dataclasses.replace(p, num_prefills=seqs)
            direct_cfg = K.direct_prefill_config(p)
            staged_cfg = K.staged_prefill_config(p)
            last = [0, seqs - 1]
            p.out.fill_(float("nan"))
            K.run(p, "cuda", prefill=direct_cfg)
            e_direct = err(p, last)
            p.out.fill_(float("nan"))
            K.run(p, "cuda", prefill=staged_cfg)
            e_staged = err(p, last)
            t_direct = timed(lambda p=p, cfg=direct_cfg: K.run(p, "cuda", prefill=cfg))
            t_staged = timed(lambda p=p, cfg=staged_cfg: K.run(p, "cuda", prefill=cfg))
            t_gather = timed(lambda p=p: staging.staged_problem(p))
            staged = staging.staged_problem(p)
            w = staged.problem
            t_attend = timed(lambda staged=staged, cfg=staged_cfg: K._launch(K.staged_kernel_call(staged, "cuda", cfg)))
            keys = seqs * CONTEXT * p.num_kv_heads * p.head_size * 2  # K and V elements
            scale_bytes = seqs * CONTEXT * p.num_kv_heads * 4 * 3 if p.k_scale_cache is not None else 0
            # Codes in, fp16 out; K and V scales in, plus one counted out per row (an upper bound:
            # a page scale is written once per 128 rows); the query in bf16, out in fp16 with
            # one fp32 factor a row.
            query_rows = seqs * q * p.num_q_heads
            gather_bytes = keys * (1 + 2) + scale_bytes + query_rows * (p.head_size * (2 + 2) + 4)
            print(
                f"{mode[:4]:6} {f'{seqs}x{q}':>10} {t_direct:9.1f} {t_staged:9.1f} {t_gather:8.1f} "
                f"{gather_bytes / t_gather / 1e3:11.0f} {t_attend:9.1f} {t_bf16:9.1f} {t_direct / t_staged:12.2f}x "
                f"{t_staged / t_bf16:10.2f}x {e_direct:10.1e} {e_staged:10.1e}"
            )
            if q >= 1024 and mode == MODES[0]:
                for label, change in VARIANTS.items():
                    cfg = dataclasses.replace(staged_cfg, **change)
                    w.out.fill_(float("nan"))
                    K._launch(K.staged_kernel_call(staged, "cuda", cfg))
                    e = err(p, last)  # w shares p.out; ref_seq decodes p's cache
                    t = timed(lambda staged=staged, cfg=cfg: K._launch(K.staged_kernel_call(staged, "cuda", cfg)))
                    print(
                        f"       attend on the workspace, {label:28}: {t:9.1f} us (table {t_attend:.1f}), err {e:.1e}"
                    )
            if q >= staging.STAGE_MIN_QUERY_LEN:
                table = staging.GATHER_ROWS, staging.GATHER_WARPS
                for staging.GATHER_ROWS, staging.GATHER_WARPS in GATHER_VARIANTS:
                    p.out.fill_(float("nan"))
                    again = staging.staged_problem(p)
                    K._launch(K.staged_kernel_call(again, "cuda", staged_cfg))
                    e = err(p, last)
                    t = timed(lambda p=p: staging.staged_problem(p))
                    print(
                        f"       gather, {staging.GATHER_ROWS:3d} rows {staging.GATHER_WARPS} warps a program: "
                        f"{t:7.1f} us, {gather_bytes / t / 1e3:5.0f} GB/s (table {table[0]} rows {table[1]} warps: "
                        f"{t_gather:.1f}), err {e:.1e}"
                    )
                staging.GATHER_ROWS, staging.GATHER_WARPS = table


if __name__ == "__main__":
    main()
