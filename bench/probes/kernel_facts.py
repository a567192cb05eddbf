"""On the GPU, what did the compiler make of each attention config, and how fast is it? Registers,
spills and MMA instruction kinds of the compiled kernel with a CUDA-event median time: what
decides occupancy and tensor-core use (bench/probes/offline_facts.py gives the same facts without a
GPU, without the time).

    python3 bench/probes/kernel_facts.py [SWEEP ...]     (default: every sweep in SWEEPS)
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for its shared modules

from attention_inputs import ceilings, decode_bytes, err, make, prefill_flops  # noqa: E402

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402
from kvzoo.backends.triton import staging  # noqa: E402


def facts(kernel) -> str:
    ptx = kernel.asm.get("ptx", "")
    wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
    mma = len(re.findall(r"\bmma\.sync", ptx))
    return f"regs {kernel.n_regs:3d} spills {kernel.n_spills:3d} wgmma {wgmma:3d} mma.sync {mma:3d}"


def one(p, cfg, decode: bool, copy_bw, mm):
    """A staged config times the attention on the workspace, the gather staged once before."""
    if cfg.stage_kv:
        staged = staging.staged_problem(p)

        def call():
            return K.staged_kernel_call(staged, "cuda", cfg)
    else:

        def call():
            return K.kernel_call(p, "cuda", cfg, per_seq=decode, skip_decode=False)

    try:
        p.out.fill_(float("nan"))
        kernel = K._launch(call())
        torch.cuda.synchronize()
    except Exception as exc:  # one config failing must not end the run
        return f"FAILED {type(exc).__name__}: {str(exc)[:100]}"
    e = err(p, [0])
    ms = triton.testing.do_bench(lambda: K._launch(call()), warmup=25, rep=150, return_mode="median")
    if decode:
        speed = f"{decode_bytes(p) / ms / 1e6:6.0f} GB/s {100 * decode_bytes(p) / ms / 1e6 / copy_bw:5.1f}%"
    else:
        tf = prefill_flops(p.num_seqs, p.max_seq_len) / ms / 1e9
        speed = f"{tf:6.1f} TF/s {100 * tf / mm:5.1f}%"
    return f"{ms * 1e3:8.1f} us {speed} err {e:.1e} | {facts(kernel)}"


# Sweeps: (kind, num_seqs, length, mode, quantize_query, configs); a config is None (the table's),
# a dict of changes to the table's, or a K.AttentionConfig. Decode configs get the table's split
# count re-rounded to their block_n unless they set split_keys themselves (-1: no split). Add a
# sweep to compare configs; the earlier ones, with what they found, are in
# bench/archive/RESULTS-history.md under the commits that ran them.
SHAPES = (("decode", 64, 4096), ("decode", 64, 16384), ("decode", 8, 65536), ("prefill", 4, 4096))
VARIANTS = (
    ("none", False),
    ("int8_per_token_head", False),
    ("int8_per_token_head", True),
    ("fp8_per_token_head", False),
)
SWEEPS = {
    "table": [(kind, seqs, length, mode, qq, [None]) for kind, seqs, length in SHAPES for mode, qq in VARIANTS],
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
                label = (
                    f"{kind} {seqs}x{length} {mode[:4]}{' qq' if qq else '   '} bq{cfg.block_q} "
                    f"bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} r{cfg.maxnreg} sk{cfg.split_keys} m{cfg.min_rows}"
                )
                print(f"[{name}] {label}: {one(p, cfg, decode, copy_bw, mm)}", flush=True)
            del p
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
