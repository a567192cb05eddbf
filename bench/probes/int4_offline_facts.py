"""What does the compiler make of the int4 kernels for the H200 (sm_90a), without a GPU?
Registers, spills, shared memory and instructions per loop of the write kernel (32768 tokens)
and of the attention's decode (64 x 16384, 8 x 65536) and prefill (4 x 4096) launches, as
bench/probes/offline_facts.py reports them for the other modes; --check asserts what only a GPU
runs (the inline PTX assembles, the write has no multiply-add, the conversions are there).

    python bench/probes/int4_offline_facts.py [--check]            (CPU: a minute or so)

Every launch is the one the kernels' own host code builds (int4_write._write_call,
int4_attention.kernel_call) on meta tensors, compiled as CUDA would compile it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

# Compiled, never interpreted: @triton.jit reads this when the kernels module is imported.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline_facts  # noqa: E402

from kvzoo.backends.triton import attention_kernels, int4_attention, int4_staging, int4_write  # noqa: E402
from kvzoo.modes import MODES, SCALE_FLOOR  # noqa: E402
from kvzoo.problem import Attention, CacheWrite  # noqa: E402

HQ, HKV, D, BS = offline_facts.HQ, offline_facts.HKV, offline_facts.D, offline_facts.BS
MODE = "int4_per_token_head"


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def write_call(tokens: int = 32768, dtype=torch.bfloat16) -> attention_kernels.KernelCall:
    """The write kernel's launch for `tokens` rows of K and V, as a KernelCall (the record
    offline_facts compiles)."""
    blocks = 2 * tokens // BS
    p = CacheWrite(
        mode=MODES[MODE],
        key=_meta((tokens, HKV, D), dtype),
        value=_meta((tokens, HKV, D), dtype),
        key_cache=_meta((blocks, BS, HKV, D // 2), torch.uint8),
        value_cache=_meta((blocks, BS, HKV, D // 2), torch.uint8),
        slot_mapping=_meta((tokens,), torch.int64),
        k_scale_cache=_meta((blocks, BS, HKV), torch.float32),
        v_scale_cache=_meta((blocks, BS, HKV), torch.float32),
    )
    grid, args, kwargs, _ = int4_write._write_call(p, float(SCALE_FLOOR))
    options = {k: kwargs.pop(k) for k in ("num_warps", "enable_fp_fusion")}
    return attention_kernels.KernelCall(int4_write._int4_write_kernel, grid, args, kwargs, options, None)


def attention_problem(num_seqs: int, q_len: int, seq_len: int) -> Attention:
    blocks = num_seqs * seq_len // BS
    return Attention(
        mode=MODES[MODE],
        query=_meta((num_seqs * q_len, HQ, D), torch.bfloat16),
        key_cache=_meta((blocks, BS, HKV, D // 2), torch.uint8),
        value_cache=_meta((blocks, BS, HKV, D // 2), torch.uint8),
        block_tables=_meta((num_seqs, seq_len // BS), torch.int32),
        seq_lens=_meta((num_seqs,), torch.int32),
        query_start_loc=_meta((num_seqs + 1,), torch.int32),
        out=_meta((num_seqs * q_len, HQ, D), torch.bfloat16),
        max_query_len=q_len,
        max_seq_len=seq_len,
        softmax_scale=1 / math.sqrt(D),
        k_scale_cache=_meta((blocks, BS, HKV), torch.float32),
        v_scale_cache=_meta((blocks, BS, HKV), torch.float32),
    )


def decode_call(num_seqs: int, seq_len: int, **tile) -> attention_kernels.KernelCall:
    p = attention_problem(num_seqs, 1, seq_len)
    cfg = dataclasses.replace(int4_attention.decode_config(p, False), **tile)
    return int4_attention.kernel_call(p, "cuda", cfg, per_seq=True, skip_decode=False)


def prefill_call(num_seqs: int = 4, length: int = 4096) -> attention_kernels.KernelCall:
    p = attention_problem(num_seqs, length, length)
    return int4_attention.kernel_call(p, "cuda", int4_attention.prefill_config(p), per_seq=False, skip_decode=False)


def staged_call(num_seqs: int = 4, length: int = 4096) -> attention_kernels.KernelCall:
    """The staged prefill's attention launch (int4_staging.staged_call) on a meta workspace."""
    p = attention_problem(num_seqs, length, length)
    return int4_staging.staged_call(offline_facts.meta_staged(p), "cuda", attention_kernels.staged_prefill_config(p))


def check() -> None:
    """What the interpreter cannot run: the CUDA-only paths compile, assemble and keep their
    roundings."""
    write = write_call()
    assert write.constexprs["NARROW_HW"] and write.constexprs["PAIRS"], write.constexprs
    ptx = offline_facts.compile_call(write).asm["ptx"]
    assert "cvt.rn.bf16x2.f32" in ptx, "the write's bf16 narrowing is not the hardware convert"
    # fl(fl(r * inv) + zp) (SPEC.md 3.6): no multiply-add anywhere in the write.
    assert "fma.rn.f32" not in ptx and "mul.rn.f32" in ptx, "the write contracted a multiply-add"
    offline_facts.facts(write)  # runs ptxas, which refuses bad inline PTX
    decode = decode_call(64, 16384)
    assert decode.constexprs["CONVERT"] == int4_attention.CONVERT_ASM
    ptx = offline_facts.compile_call(decode).asm["ptx"]
    assert "lop3.b32" in ptx and "0x54005400" in ptx, "the nibble conversion's PTX is not in the decode kernel"
    offline_facts.facts(decode)
    print("int4 GPU paths: compiled for sm_90a, assembled, roundings kept")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="assert what only a GPU runs, then stop")
    args = ap.parse_args()
    # As on the H200: its split choice, and the write's hardware bf16 narrowing (which the
    # host picks for CUDA tensors, not for these meta ones).
    attention_kernels._num_sms = lambda device_index: offline_facts.H200_SMS  # the shared decode rule reads it
    int4_write._narrow_hw = lambda t: True
    if args.check:
        check()
        return
    rows = [("write 32768 bf16", write_call()), ("write 32768 fp16", write_call(dtype=torch.float16))]
    for seqs, ctx in ((64, 16384), (8, 65536)):
        rows.append((f"decode {seqs}x{ctx} table tile", decode_call(seqs, ctx)))
        rows.append((f"decode {seqs}x{ctx} 64 keys, 2 warps", decode_call(seqs, ctx, block_n=64, num_warps=2)))
    rows.append(("prefill 4x4096 direct", prefill_call()))
    for rows_, keys, warps in ((128, 64, 8), (64, 32, 4)):
        p = attention_problem(4, 4096, 4096)
        cfg = attention_kernels.AttentionConfig(rows_ // 4, keys, warps, 2, 0)
        call = int4_attention.kernel_call(p, "cuda", cfg, per_seq=False, skip_decode=False)
        rows.append((f"prefill 4x4096 direct {rows_} rows {keys} keys w{warps}", call))
    rows.append(("prefill 4x4096 staged", staged_call()))
    print("triton", __import__("triton").__version__, "target sm_90a; spills in bytes; loops in code order")
    for label, call in rows:
        shape = {k: call.constexprs[k] for k in ("BLOCK_M", "BLOCK_N") if k in call.constexprs}
        print(f"{label:40s} {shape} w{call.options['num_warps']} {offline_facts.facts(call)}", flush=True)


if __name__ == "__main__":
    main()
