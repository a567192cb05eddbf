"""Registers, spills and MMA instruction kinds of the compiled attention kernel per config,
with a CUDA-event median time: what decides occupancy and tensor-core use on the GPU.

    python3 bench/kernel_facts.py [SWEEP ...]     (default: every sweep in SWEEPS)
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_probe import ceilings, decode_bytes, err, make, prefill_flops  # noqa: E402

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402
from kvzoo.backends.triton import staging  # noqa: E402


def facts(kernel) -> str:
    ptx = kernel.asm.get("ptx", "")
    wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
    mma = len(re.findall(r"\bmma\.sync", ptx))
    return f"regs {kernel.n_regs:3d} spills {kernel.n_spills:3d} wgmma {wgmma:3d} mma.sync {mma:3d}"


def one(p, cfg, decode: bool, copy_bw, mm):
    """A staged config times the attention on the workspace, the gather staged once before."""
    kw = dict(per_seq=decode, skip_decode=cfg.stage_kv)
    target = p
    if cfg.stage_kv:
        target, kw["q_undo"] = staging.staged_problem(p)
    try:
        p.out.fill_(float("nan"))
        kernel = K._launch(target, "cuda", cfg, **kw)
        torch.cuda.synchronize()
    except Exception as exc:  # one config failing must not end the run
        return f"FAILED {type(exc).__name__}: {str(exc)[:100]}"
    e = err(p, [0])
    ms = triton.testing.do_bench(lambda: K._launch(target, "cuda", cfg, **kw), warmup=25, rep=150, return_mode="median")
    if decode:
        speed = f"{decode_bytes(p) / ms / 1e6:6.0f} GB/s {100 * decode_bytes(p) / ms / 1e6 / copy_bw:5.1f}%"
    else:
        tf = prefill_flops(p.num_seqs, p.max_seq_len) / ms / 1e9
        speed = f"{tf:6.1f} TF/s {100 * tf / mm:5.1f}%"
    return f"{ms * 1e3:8.1f} us {speed} err {e:.1e} | {facts(kernel)}"


C = K.AttentionConfig


def R(block_n, warps, stages, split_keys=0):
    """A decode config on the group's real rows; split_keys -1 = no split at all."""
    return C(1, block_n, warps, stages, split_keys, min_rows=1)

# Sweeps: (kind, num_seqs, length, mode, quantize_query, configs); a config may be None (the
# table's) or a dict of changes to the table's. Decode configs get the table's split count
# re-rounded to their block_n unless they set split_keys themselves (-1).
SWEEPS = {
    # 1: register caps, smaller key tiles, warps (bench/archive/RESULTS-history.md).
    "1": [
        ("decode", 64, 16384, "none", False, [C(1, 64, 4, 2)]),
        ("decode", 64, 16384, "int8_per_token_head", False, [
            C(1, 32, 1, 2), C(1, 32, 1, 2, maxnreg=128), C(1, 32, 1, 2, maxnreg=168), C(1, 16, 1, 2),
            C(1, 16, 1, 3), C(1, 32, 1, 3), C(1, 32, 2, 2, maxnreg=128), C(1, 64, 2, 2, maxnreg=128)]),
        ("decode", 64, 16384, "int8_per_token_head", True, [
            C(1, 32, 1, 2), C(1, 32, 1, 2, maxnreg=128), C(1, 16, 1, 2), C(1, 64, 2, 2, maxnreg=128)]),
        ("decode", 64, 16384, "fp8_per_token_head", False, [
            C(1, 64, 2, 2), C(1, 32, 1, 2), C(1, 32, 1, 2, maxnreg=128), C(1, 64, 2, 2, maxnreg=128), C(1, 16, 1, 2)]),
    ] + [
        ("prefill", 4, 4096, mode, qq, [None, C(16, 128, 4, 2, 0, True), C(32, 64, 4, 2, 0, True),
                                       C(32, 128, 8, 2, 0, True, 128)])
        for mode, qq in (("none", False), ("int8_per_token_head", False), ("fp8_per_token_head", False),
                         ("int8_per_token_head", True))
    ],
    # 2: bf16 decode at 4K (splits, stages), fp8 decode tiles, prefill tiles for int8 query dots.
    "2": [
        ("decode", 64, 4096, "none", False, [
            C(1, 64, 4, 2), C(1, 64, 4, 2, 2048), C(1, 64, 4, 2, 1024), C(1, 64, 4, 3), C(1, 128, 4, 2),
            C(1, 64, 8, 2), C(1, 32, 4, 2)]),
        ("decode", 64, 16384, "fp8_per_token_head", False, [
            C(1, 64, 2, 3), C(1, 32, 2, 2), C(1, 64, 4, 2), C(1, 64, 2, 2, 4096), C(1, 32, 2, 2, 4096),
            C(1, 64, 2, 2, 2048)]),
        ("prefill", 4, 4096, "int8_per_token_head", True, [
            C(16, 128, 4, 3, 0, True), C(16, 64, 4, 2, 0, True), C(8, 128, 4, 2, 0, True), C(16, 128, 8, 2, 0, True)]),
        ("prefill", 4, 4096, "int8_per_token_head", False, [
            C(32, 64, 8, 2, 0, True), C(16, 128, 8, 2, 0, True), C(32, 64, 8, 3, 0, True)]),
        ("prefill", 4, 4096, "none", False, [C(32, 128, 8, 4, 0, True), C(32, 64, 8, 3, 0, True)]),
    ],
    # 3: quantized decode without software pipelining (fewer live registers, more programs/SM).
    "3": [
        ("decode", 64, 16384, "int8_per_token_head", False, [
            C(1, 32, 1, 2), C(1, 32, 1, 1), C(1, 64, 1, 1), C(1, 64, 2, 1), C(1, 128, 4, 1)]),
        ("decode", 64, 16384, "int8_per_token_head", True, [C(1, 32, 1, 2), C(1, 32, 1, 1), C(1, 64, 2, 1)]),
        ("decode", 64, 16384, "fp8_per_token_head", False, [C(1, 64, 2, 2), C(1, 64, 2, 1), C(1, 32, 1, 1),
                                                             C(1, 128, 4, 1)]),
    ],
    # 4: decode tiles of the group's real rows only (min_rows=1: 4 rows, not 16 padded).
    "4": [
        ("decode", 64, 16384, "int8_per_token_head", False, [
            C(1, 32, 1, 2), R(16, 1, 2), R(32, 1, 2), R(32, 2, 2), R(64, 2, 2), R(64, 4, 2), R(64, 4, 3),
            R(128, 4, 2), R(128, 8, 2), R(128, 8, 3), R(64, 4, 2, 4096), R(64, 4, 2, 8192), R(64, 4, 2, -1)]),
        ("decode", 64, 16384, "int8_per_token_head", True, [
            C(1, 32, 1, 2), R(32, 1, 2), R(32, 2, 2), R(64, 4, 2), R(64, 4, 3), R(128, 8, 2)]),
        ("decode", 64, 16384, "fp8_per_token_head", False, [
            C(1, 64, 2, 2), R(32, 1, 2), R(32, 2, 2), R(64, 2, 2), R(64, 4, 2), R(64, 4, 3), R(128, 8, 2),
            R(64, 4, 2, -1)]),
        ("decode", 64, 16384, "none", False, [C(1, 64, 4, 2), R(64, 4, 2), R(64, 4, 3), R(32, 2, 2), R(128, 8, 2)]),
        ("decode", 64, 4096, "none", False, [C(1, 64, 4, 2), R(64, 4, 2), R(64, 4, 3), R(32, 2, 2), R(128, 8, 2)]),
        ("decode", 64, 4096, "int8_per_token_head", False, [C(1, 32, 1, 2), R(64, 4, 2), R(64, 4, 3), R(128, 8, 2)]),
        ("decode", 8, 65536, "int8_per_token_head", False, [
            C(1, 32, 1, 2), R(32, 1, 2), R(64, 4, 2), R(64, 4, 3), R(128, 8, 2), R(64, 4, 2, 2048), R(64, 4, 2, 1024)]),
        ("decode", 8, 65536, "fp8_per_token_head", False, [C(1, 64, 2, 2), R(64, 4, 2), R(64, 4, 3), R(128, 8, 2),
                                                          R(64, 4, 2, 2048)]),
        ("decode", 8, 65536, "none", False, [C(1, 64, 4, 2), R(64, 4, 2), R(64, 4, 3)]),
    ],
    # 5: num_stages 5. The page lookup takes a pipeline stage of its own, so below 5 stages
    # Triton keeps one K/V buffer and waits for each tile's copy right after issuing it.
    "5": [
        ("decode", 64, 16384, "int8_per_token_head", False, [
            C(1, 32, 1, 2), R(32, 1, 5), C(1, 32, 1, 5), R(16, 1, 5), R(64, 2, 5), R(64, 4, 5), R(128, 4, 5),
            R(32, 1, 6), R(32, 1, 5, -1), R(32, 1, 5, 8192)]),
        ("decode", 64, 16384, "int8_per_token_head", True, [C(1, 32, 1, 2), R(32, 1, 5), R(64, 2, 5), R(128, 4, 5)]),
        ("decode", 64, 16384, "fp8_per_token_head", False, [
            C(1, 64, 2, 2), R(32, 1, 5), R(64, 2, 5), R(64, 4, 5), R(128, 4, 5), R(64, 2, 5, 4096)]),
        ("decode", 64, 16384, "none", False, [C(1, 64, 4, 2), R(64, 4, 5), C(1, 64, 4, 5), R(128, 8, 5)]),
        ("decode", 64, 4096, "none", False, [C(1, 64, 4, 2), R(64, 4, 5), R(128, 8, 5)]),
        ("decode", 64, 4096, "int8_per_token_head", False, [C(1, 32, 1, 2), R(32, 1, 5), R(64, 2, 5)]),
        ("decode", 8, 65536, "int8_per_token_head", False, [
            C(1, 32, 1, 2), R(32, 1, 5), R(64, 2, 5), R(64, 2, 5, 2048), R(32, 1, 5, 2048)]),
        ("decode", 8, 65536, "fp8_per_token_head", False, [C(1, 64, 2, 2), R(64, 2, 5), R(64, 2, 5, 2048)]),
        ("decode", 8, 65536, "none", False, [C(1, 64, 4, 2), R(64, 4, 5)]),
    ] + [
        ("prefill", 4, 4096, mode, qq, [None, C(32, 64, 8, 5, 0, True), C(32, 64, 8, 6, 0, True),
                                       C(32, 128, 8, 5, 0, True)])
        for mode, qq in (("none", False), ("int8_per_token_head", False), ("fp8_per_token_head", False),
                         ("int8_per_token_head", True))
    ],    # 7: the table configs with V's addresses computed apart from K's and shared with them
    # (A/B of same_kv_strides; the second line of each pair shares them).
    "7": [
        (kind, seqs, length, mode, qq, [None])
        for kind, seqs, length, mode, qq in (
            ("decode", 64, 16384, "int8_per_token_head", False), ("decode", 64, 16384, "fp8_per_token_head", False),
            ("decode", 64, 16384, "int8_per_token_head", True), ("decode", 64, 16384, "none", False),
            ("decode", 8, 65536, "int8_per_token_head", False), ("decode", 8, 65536, "fp8_per_token_head", False),
            ("decode", 64, 4096, "int8_per_token_head", False), ("decode", 64, 4096, "none", False),
            ("prefill", 4, 4096, "int8_per_token_head", False), ("prefill", 4, 4096, "none", False))
    ],    # 8: split points and stages around the new quantized decode tables.
    "8": [
        ("decode", 64, 4096, "int8_per_token_head", False, [None, R(32, 1, 5, 2048), R(32, 1, 5, -1)]),
        ("decode", 64, 4096, "fp8_per_token_head", False, [None, R(64, 2, 5, 1024), R(64, 2, 5, 2048)]),
        ("decode", 64, 16384, "int8_per_token_head", False, [None, R(32, 1, 5, 8192), R(32, 1, 6)]),
        ("decode", 64, 16384, "fp8_per_token_head", False, [None, R(64, 2, 6), R(64, 2, 5, 8192)]),
        ("decode", 8, 65536, "int8_per_token_head", False, [None, R(32, 1, 5, 1024), R(32, 1, 5, 4096)]),
        ("decode", 8, 65536, "fp8_per_token_head", False, [None, R(64, 2, 5, 1024), R(64, 2, 5, 4096)]),
    ],    # 9: fp8 decode on 1-warp 32-key tiles (767 instructions per tile against int8's 917,
    # bench/offline_facts.py), split like int8's.
    "9": [
        ("decode", 64, 16384, "int8_per_token_head", False, [None]),
        ("decode", 64, 16384, "fp8_per_token_head", False, [None, R(32, 1, 5, 4096), R(32, 1, 5, 8192), R(32, 1, 6, 4096)]),
        ("decode", 64, 4096, "fp8_per_token_head", False, [None, R(32, 1, 5, 1024), R(32, 1, 5, 2048)]),
        ("decode", 8, 65536, "fp8_per_token_head", False, [None, R(32, 1, 5, 2048), R(32, 1, 5, 4096)]),
    ],
}


def main():
    wanted = sys.argv[1:] or list(SWEEPS)
    copy_bw, mm = ceilings()
    print(f"# copy {copy_bw:.0f} GB/s, matmul {mm:.0f} TFLOP/s")
    for name in wanted:
        for kind, seqs, length, mode, qq, cfgs in SWEEPS[name]:
            decode = kind == "decode"
            p = make(seqs, 1 if decode else length, length, mode, quantize_query=qq)
            table = K.decode_config(p, False) if decode else K.prefill_config(p)
            for cfg in cfgs:
                cfg = dataclasses.replace(table, **cfg) if isinstance(cfg, dict) else cfg or table
                if decode and cfg.split_keys == 0 and table.split_keys:
                    cfg = dataclasses.replace(cfg, split_keys=-(-table.split_keys // cfg.block_n) * cfg.block_n)
                elif cfg.split_keys < 0:
                    cfg = dataclasses.replace(cfg, split_keys=0)
                label = (f"{kind} {seqs}x{length} {mode[:4]}{' qq' if qq else '   '} bq{cfg.block_q} "
                         f"bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} r{cfg.maxnreg} sk{cfg.split_keys} m{cfg.min_rows}")
                if name == "7":
                    shared = K.same_kv_strides
                    K.same_kv_strides = lambda p: False
                    print(f"[{name}] {label} apart: {one(p, cfg, decode, copy_bw, mm)}", flush=True)
                    K.same_kv_strides = shared
                    label += " shared"
                print(f"[{name}] {label}: {one(p, cfg, decode, copy_bw, mm)}", flush=True)
            del p
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
