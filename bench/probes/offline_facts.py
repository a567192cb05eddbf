"""What will the compiler make of each attention table config for the H200 (sm_90a), without a
GPU? Registers, spills, shared memory, MMA kind, K/V buffers of the software pipeline, and
instructions per key tile in the main loops (SASS).

    python bench/probes/offline_facts.py                 (CPU: the table configs of issue 5's shapes)
    python bench/probes/offline_facts.py write           (CPU: the write of 32768 tokens, inline page and
                                                   separate, with and without wide_rows' layout)

kernel_facts.py measures the same kernels on the GPU, with their time.

Triton compiles for a target given by hand (GPUTarget("cuda", 90, 32)); the wheel's ptxas and
cuobjdump give the rest. The problem is built from meta tensors, the launch arguments by the
kernel's own `kernel_call` (`staged_kernel_call`), so what compiles here is what `_launch` would launch: the
arguments are bound and specialised by Triton's own binder for that target (ints equal to 1
become constants, ints and pointers divisible by 16 are marked so, tuples element by element).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

# Compiled, never interpreted: @triton.jit reads this when the kernels module is imported.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402
from kvzoo.backends.triton import staging  # noqa: E402
from kvzoo.layout import inline_views  # noqa: E402
from kvzoo.modes import SCALE_FLOOR, get_kv_quant_mode  # noqa: E402
from kvzoo.problem import Attention, CacheWrite  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
H200_SMS = 132
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
HQ, HKV, D, BS = 32, 8, 128, 16


def meta_problem(
    num_seqs: int, q_len: int, seq_len: int, mode: str, quantize_query: bool = False, fp8_dots: bool = False
) -> Attention:
    m = get_kv_quant_mode(mode)
    blocks = num_seqs * seq_len // BS
    code = torch.bfloat16 if m.code_dtype is None else torch.int8 if m.code_dtype == "int8" else torch.float8_e4m3fn

    def t(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    scales = (
        (t((blocks, BS, HKV), torch.float32), t((blocks, BS, HKV), torch.float32)) if m.per_token_head else (None, None)
    )
    return Attention(
        mode=m,
        query=t((num_seqs * q_len, HQ, D), torch.bfloat16),
        key_cache=t((blocks, BS, HKV, D), code),
        value_cache=t((blocks, BS, HKV, D), code),
        block_tables=t((num_seqs, seq_len // BS), torch.int32),
        seq_lens=t((num_seqs,), torch.int32),
        query_start_loc=t((num_seqs + 1,), torch.int32),
        out=t((num_seqs * q_len, HQ, D), torch.bfloat16),
        max_query_len=q_len,
        max_seq_len=seq_len,
        softmax_scale=1 / math.sqrt(D),
        k_scale_cache=scales[0],
        v_scale_cache=scales[1],
        quantize_query=quantize_query,
        fp8_dots=fp8_dots,
    )


def meta_inline(p: Attention) -> Attention:
    """`p` on the inline page (each row's scale after its codes), in meta tensors."""
    blocks, block_size, heads, head_size = p.key_cache.shape
    buffer = torch.empty((blocks, 2, block_size, heads, head_size + 4), dtype=torch.uint8, device="meta")
    t = inline_views(buffer, head_size, p.mode)
    return dataclasses.replace(
        p,
        key_cache=t.key_cache,
        value_cache=t.value_cache,
        k_scale_cache=t.k_scale_cache,
        v_scale_cache=t.v_scale_cache,
    )


def meta_staged(p: Attention) -> staging.Staged:
    """`p` over staging.py's workspace (fp16 codes, page scales as stride-0 views, the fp16
    query and its row factors), in meta tensors."""
    shape = staging.workspace_shape(p)
    cache = torch.empty(shape, dtype=torch.float16, device="meta")
    scales = {}
    if p.mode.per_token_head:
        page_scale = torch.empty((shape[0], 1, shape[2]), dtype=torch.float32, device="meta").expand(shape[:3])
        scales = dict(k_scale_cache=page_scale, v_scale_cache=page_scale)
    # One column, each sequence's first page, as staged_problem builds it (its stride of 1 is
    # specialised by Triton, so the shape matters for what compiles).
    table = torch.empty((p.num_seqs, 1), dtype=torch.int32, device="meta")
    query = torch.empty(p.query.shape, dtype=torch.float16, device="meta")
    q_undo = torch.empty(p.query.shape[:2], dtype=torch.float32, device="meta")
    return staging.Staged(
        dataclasses.replace(p, query=query, key_cache=cache, value_cache=cache, block_tables=table, **scales),
        q_undo,
        p.block_tables,
        p.key_cache.shape[0],
        p.block_size,
        shape[0] // max(1, p.num_prefills or p.num_seqs) * staging.STAGE_PAGE,
    )


def compile_call(call: K.KernelCall):
    """The launch compiled as JITFunction.run would compile it on an H200 (meta tensors' addresses
    are 0, so every pointer is marked 16-byte aligned, as allocations are)."""
    fn = call.kernel
    backend = make_backend(H200)
    kwargs = {**call.constexprs, **call.options, "debug": False, "instrumentation_mode": ""}
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(
        *call.args, **kwargs
    )
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=H200, options=options.__dict__)


def loop_bodies(sass: str) -> list[collections.Counter]:
    """Instruction counts of each loop (a backward branch and the code it jumps over)."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    where = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (addr, text) in enumerate(ins):
        target = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in where:
            body = ins[where[int(target.group(1), 16)] : i + 1]
            loops.append(collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9]+)", t).group(1) for _, t in body))
    return loops


def assemble(call: K.KernelCall) -> tuple[Any, str, str]:
    """(the compiled kernel, ptxas -v's report, the SASS) of a launch, for sm_90a."""
    ck = compile_call(call)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(ck.asm["ptx"])
        ptxas = subprocess.run(
            [BIN / "ptxas", "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin], capture_output=True, text=True, check=True
        ).stderr
        sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return ck, ptxas, sass


def facts(call: K.KernelCall) -> str:
    ck, ptxas, sass = assemble(call)
    regs = int(re.search(r"Used (\d+) registers", ptxas).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", ptxas).group(1))
    buffers = sorted({int(b) for b in re.findall(r"memdesc<(\d+)x\d+x\d+x(?:i8|bf16|f16|f8E4M3FN)", ck.asm["ttgir"])})
    mma = "wgmma" if "wgmma.mma_async" in ck.asm["ptx"] else "mma.sync"
    loops = ", ".join(str(sum(c.values())) for c in loop_bodies(sass))
    return (
        f"regs {regs:3d} spills {spills:3d} smem {ck.metadata.shared // 1024:3d} KB "
        f"K/V buffers {buffers} {mma:8s} instructions per loop [{loops}]"
    )


# How each case's option reads in its label.
OPTION_LABEL = {None: "", "quantize_query": " qq", "fp8_dots": " fp8_dots"}


def main() -> None:
    K._num_sms = lambda device_index: H200_SMS  # the table's split choice as on the H200
    modes = (
        ("none", None),
        ("int8_per_token_head", None),
        ("int8_per_token_head", "quantize_query"),
        ("fp8_per_token_head", None),
        ("fp8_per_token_head", "fp8_dots"),
    )
    cases = [("decode", 64, 16384, mode, option) for mode, option in modes]
    cases += [("prefill", 4, 4096, mode, option) for mode, option in modes]
    print(
        f"triton {triton.__version__}, target sm_90a. Spills in bytes (kernel_facts.py reports 4-byte words). "
        "Loops in code order: prefill's first is the sequence lookup; then whole tiles, masked tiles."
    )
    for kind, seqs, length, mode, option in cases:
        decode = kind == "decode"
        p = meta_problem(seqs, 1 if decode else length, length, mode, option == "quantize_query", option == "fp8_dots")
        cfg = K.decode_config(p, False) if decode else K.prefill_config(p)
        # Quantized decode also as it was before the third session's changes, one at a time:
        # 16 padded rows; and 2 stages on top (the second session's tile); V's addresses apart.
        variants = [(cfg, True, p)]
        if decode and cfg.min_rows == 1:
            padded = dataclasses.replace(cfg, min_rows=16)
            variants += [(padded, True, p), (dataclasses.replace(padded, num_stages=2), True, p), (cfg, False, p)]
        if decode and p.mode.per_token_head and option is None:
            # And on the inline page, at its own table row and at the separate layout's stages.
            inline = meta_inline(p)
            own = K.decode_config(inline, False)
            variants += [(own, True, inline), (dataclasses.replace(own, num_stages=cfg.num_stages), True, inline)]
        if cfg.stage_kv:  # and the direct kernel it replaced
            variants.append((K.direct_prefill_config(p), True, p))
        for c, shared, q in variants:
            if c.stage_kv:
                call = K.staged_kernel_call(meta_staged(q), "cuda", c)
            else:
                call = K.kernel_call(q, "cuda", c, per_seq=decode, skip_decode=False)
            if not shared:
                call.constexprs["SAME_KV_STRIDES"] = False
            label = (
                f"{kind} {seqs}x{length} {mode[:4]}{OPTION_LABEL[option]} rows {call.constexprs['BLOCK_M']} "
                f"keys {c.block_n} w{c.num_warps} s{c.num_stages} split {c.split_keys}"
                f"{'' if shared else ' V apart'}{' staged' if c.stage_kv else ''}{' inline' if q is not p else ''}"
            )
            print(f"{label:70s} {facts(call)}", flush=True)


def write_main(tokens: int = 32768) -> None:
    """The write kernel's registers and SASS instructions (it has no loop: the whole kernel),
    as _write_call launches it for each layout."""
    from kvzoo.backends.triton import wide_rows, write_kernels

    blocks = tokens // BS

    def t(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    for mode in ("int8_per_token_head", "fp8_per_token_head"):
        m = get_kv_quant_mode(mode)
        views = inline_views(t((blocks, 2, BS, HKV, D + 4), torch.uint8), D, m)
        inline = (views.key_cache, views.value_cache, views.k_scale_cache, views.v_scale_cache)
        code = torch.int8 if m.code_dtype == "int8" else torch.float8_e4m3fn
        separate = (t((blocks, BS, HKV, D), code), t((blocks, BS, HKV, D), code))
        separate += (t((blocks, BS, HKV), torch.float32), t((blocks, BS, HKV), torch.float32))
        layouts = (("inline", inline, True), ("inline", inline, False), ("separate", separate, False))
        for name, (kc, vc, ks, vs), wide in layouts:
            wide_rows.ENABLED = wide
            rows = t((tokens, HKV, D), torch.bfloat16)
            p = CacheWrite(
                mode=m,
                key=rows,
                value=rows,
                key_cache=kc,
                value_cache=vc,
                slot_mapping=t((tokens,), torch.int64),
                k_scale_cache=ks,
                v_scale_cache=vs,
            )
            _, args, kwargs, _ = write_kernels._write_call(p, float(SCALE_FLOOR))
            options = {k: kwargs.pop(k) for k in ("num_warps", "enable_fp_fusion")}
            # What compile_call reads of a launch (the write has no KernelCall).
            call = types.SimpleNamespace(
                kernel=write_kernels._reshape_and_cache_kernel, args=args, constexprs=kwargs, options=options
            )
            _, ptxas, sass = assemble(call)
            regs = int(re.search(r"Used (\d+) registers", ptxas).group(1))
            instructions = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[^;]*;", sass))
            label = f"write {tokens} {mode[:4]} {name}{' wide' if kwargs['WIDE_TILE_LAYOUT'] else ''}"
            print(f"{label:40s} warps {options['num_warps']} regs {regs:3d} instructions {instructions}", flush=True)
        wide_rows.ENABLED = True


if __name__ == "__main__":
    write_main() if sys.argv[1:] == ["write"] else main()
