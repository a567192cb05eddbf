"""Triton kernels that write the paged KV cache and read it back.

reshape_and_cache: one launch quantizes the K and V rows of every token and scatters them to
their slots; a program owns one token and a group of its KV heads, loads each head row once,
and writes codes and (per-token-head) the row's scale. Everything is addressed through strides,
so vLLM's split caches, the inline-scale page layout and key/value views into a fused QKV
tensor are the same kernel. Negative slots are skipped.

dequantize: gathers the tokens of sequences through their block tables and decodes them to
float32.

Launches pass enable_fp_fusion=False: the encode helpers are contraction-proof by construction
(see encode.py) and the flag makes the whole kernel so, for anything added later.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import platform as _platform
from . import wide_rows
from .alignment import row_align
from .encode import (
    CODE_COPY,
    CODE_INT8,
    bits_float,
    decode_codes,
    encode_codes,
    encode_row_codes,
    encoder_code,
    float_bits,
    reciprocal,
    row_absmax_bits,
    row_scale,
    widen_bf16_bits,
)
from .formats import code_of
from .launch import BoundLaunch, launch_nothing
from .wide_rows import widen_tile_layout

# Elements of one head-group tile (heads x padded head size) a program holds in registers.
_TILE_ELEMENTS = 2048
# Integer carriers: the kernels move model-dtype and fp8 data as bits.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# Input dtype classes (constexpr IN_KIND): how a loaded row becomes fp32.
_IN_F32, _IN_F16, _IN_BF16 = 0, 1, 2


@triton.jit
def _load_rows_f32(ptrs, mask, IN_KIND: tl.constexpr):
    if IN_KIND == 2:
        # Loaded as int16 bits: widening bf16 by hand is exact everywhere, and keeps bf16
        # arithmetic out of the interpreter.
        xf = widen_bf16_bits(tl.load(ptrs, mask=mask, other=0))
    else:
        xf = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return xf


@triton.jit
def _load_rows(
    src_ptr,
    token,
    stride_st,
    stride_sh,
    stride_sd,
    offs_h,
    offs_d,
    load_mask,
    CODE: tl.constexpr,
    IN_KIND: tl.constexpr,
):
    """One token's rows [heads of this program, D]: raw bits for mode none, else fp32."""
    src = src_ptr + token * stride_st + offs_h.to(tl.int64)[:, None] * stride_sh + offs_d[None, :] * stride_sd
    if CODE == 0:
        x = tl.load(src, mask=load_mask)
    else:
        x = _load_rows_f32(src, load_mask, IN_KIND)
    return x


@triton.jit
def _store_rows(
    x,
    cache_ptr,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    scale_cache_ptr,
    stride_xb,
    stride_xs,
    stride_xh,
    static_scale_ptr,
    block,
    offset,
    h_ok,
    store_mask,
    offs_h,
    offs_d,
    CODE: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    QMAX: tl.constexpr,
    QMIN: tl.constexpr,
    NAN_CODE: tl.constexpr,
    INF_POS: tl.constexpr,
    INF_NEG: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
    TRUNC: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    """Quantize rows x (fp32; raw bits for mode none) and store codes and scales at the slot.
    ROW_ALIGN: elements every row offset is a multiple of (alignment.row_align)."""
    rows = block * stride_cb + offset * stride_cs + offs_h.to(tl.int64) * stride_ch
    if ROW_ALIGN > 1 and ROW_ALIGN < 16:
        # The inline page's rows are 4-byte aligned, which Triton cannot see in their stride:
        # without this every code is stored alone (st.global.b8).
        rows = tl.multiple_of(rows, ROW_ALIGN)
    dst = cache_ptr + rows[:, None] + offs_d.to(tl.int64)[None, :] * stride_cd
    if CODE == 0:
        tl.store(dst, x, mask=store_mask)  # mode none: a bit copy in the model dtype
    else:
        if PER_TENSOR:
            s = tl.load(static_scale_ptr)
            y = tl.math.div_rn(x, tl.broadcast_to(s, x.shape))
            code = encode_codes(y, CODE, QMIN, QMAX, NAN_CODE, INF_POS, INF_NEG, TRUNC)
        else:
            scale, scale_bits = row_scale(row_absmax_bits(x, 1), QMAX, SCALE_FLOOR)
            inv = reciprocal(scale)
            y = x * inv[:, None]
            sdst = scale_cache_ptr + block * stride_xb + offset * stride_xs + offs_h.to(tl.int64) * stride_xh
            tl.store(sdst, scale_bits, mask=h_ok)
            code = encode_row_codes(y, CODE, NAN_CODE, TRUNC)
        tl.store(dst, code.to(cache_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    k_scale_cache_ptr,
    v_scale_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    num_slots,
    num_heads,
    head_size,
    block_size,
    s_kt,
    s_kh,
    s_kd,
    s_vt,
    s_vh,
    s_vd,
    s_kcb,
    s_kcs,
    s_kch,
    s_kcd,
    s_vcb,
    s_vcs,
    s_vch,
    s_vcd,
    s_ksb,
    s_kss,
    s_ksh,
    s_vsb,
    s_vss,
    s_vsh,
    CODE: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    IN_KIND: tl.constexpr,
    QMAX: tl.constexpr,
    QMIN: tl.constexpr,
    NAN_CODE: tl.constexpr,
    INF_POS: tl.constexpr,
    INF_NEG: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
    TRUNC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    WIDE_TILE_LAYOUT: tl.constexpr,
):
    if WIDE_TILE_LAYOUT:
        # The key cache: 16-byte aligned (an allocation's start), of the 1-byte codes written.
        widen_tile_layout(key_cache_ptr, key_cache_ptr, BLOCK_H, BLOCK_D)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    in_rows = offs_h < num_heads
    if EVEN_D:
        # A mask on a runtime head_size hides the row's contiguity from the compiler and splits
        # every load and store into single elements; a full row needs no column mask.
        load_mask = in_rows[:, None] & (offs_d < BLOCK_D)[None, :]
    else:
        load_mask = in_rows[:, None] & (offs_d < head_size)[None, :]
    # The input rows exist whatever the slot says, so K and V loads do not wait for it.
    xk = _load_rows(key_ptr, token, s_kt, s_kh, s_kd, offs_h, offs_d, load_mask, CODE, IN_KIND)
    xv = _load_rows(value_ptr, token, s_vt, s_vh, s_vd, offs_h, offs_d, load_mask, CODE, IN_KIND)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # Past-the-end slots reach here only with validation off: skipped like negative ones, so
    # nothing is ever written outside the cache.
    keep = (slot >= 0) & (slot < num_slots)
    h_ok = in_rows & keep
    store_mask = load_mask & keep
    # A skipped token's stores are all masked off; keep its address arithmetic in range anyway.
    slot = tl.maximum(slot, 0)
    block = slot // block_size
    offset = slot % block_size
    _store_rows(
        xk,
        key_cache_ptr,
        s_kcb,
        s_kcs,
        s_kch,
        s_kcd,
        k_scale_cache_ptr,
        s_ksb,
        s_kss,
        s_ksh,
        k_scale_ptr,
        block,
        offset,
        h_ok,
        store_mask,
        offs_h,
        offs_d,
        CODE,
        PER_TENSOR,
        QMAX,
        QMIN,
        NAN_CODE,
        INF_POS,
        INF_NEG,
        SCALE_FLOOR,
        TRUNC,
        ROW_ALIGN,
    )
    _store_rows(
        xv,
        value_cache_ptr,
        s_vcb,
        s_vcs,
        s_vch,
        s_vcd,
        v_scale_cache_ptr,
        s_vsb,
        s_vss,
        s_vsh,
        v_scale_ptr,
        block,
        offset,
        h_ok,
        store_mask,
        offs_h,
        offs_d,
        CODE,
        PER_TENSOR,
        QMAX,
        QMIN,
        NAN_CODE,
        INF_POS,
        INF_NEG,
        SCALE_FLOOR,
        TRUNC,
        ROW_ALIGN,
    )


@triton.jit
def _dequantize_kernel(
    cache_ptr,
    scale_cache_ptr,
    scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seq_lens_ptr,
    out_ptr,
    head_size,
    block_size,
    s_cb,
    s_cs,
    s_ch,
    s_cd,
    s_xb,
    s_xs,
    s_xh,
    s_bt_s,
    s_bt_b,
    s_ot,
    s_oh,
    s_od,
    CODE: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    IN_KIND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(2).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    seq_len = tl.load(seq_lens_ptr + seq)
    t_ok = pos < seq_len
    mask = t_ok[:, None] & (offs_d < head_size)[None, :]
    block = tl.load(block_tables_ptr + seq.to(tl.int64) * s_bt_s + (pos // block_size) * s_bt_b, mask=t_ok, other=0).to(
        tl.int64
    )
    offset = (pos % block_size).to(tl.int64)
    row = block * s_cb + offset * s_cs + head * s_ch
    src = cache_ptr + row[:, None] + offs_d.to(tl.int64)[None, :] * s_cd
    out_row = tl.load(cu_seq_lens_ptr + seq).to(tl.int64) + pos
    dst = out_ptr + out_row[:, None] * s_ot + head * s_oh + offs_d[None, :] * s_od
    if CODE == 0:
        x = _load_rows_f32(src, mask, IN_KIND)
    else:
        value = decode_codes(tl.load(src, mask=mask, other=0), CODE)
        if PER_TENSOR:
            x = value * tl.load(scale_ptr)
        else:
            sbits = tl.load(scale_cache_ptr + block * s_xb + offset * s_xs + head * s_xh, mask=t_ok, other=0)
            x = value * bits_float(sbits)[:, None]
    tl.store(dst, x, mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS_DTYPE[t.element_size()])


def _in_kind(t: torch.Tensor) -> int:
    return {torch.float32: _IN_F32, torch.float16: _IN_F16, torch.bfloat16: _IN_BF16}[t.dtype]


def _as_input(t: torch.Tensor) -> torch.Tensor:
    # bf16 travels as int16 bits (see _load_rows_f32).
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _as_codes(t: torch.Tensor, code: int) -> torch.Tensor:
    # int8 codes are signed whatever the cache's byte dtype (vLLM may hand uint8); fp8 codes
    # are bytes computed by integer arithmetic, never through an fp8 cast.
    return t.view(torch.int8 if code == CODE_INT8 else torch.uint8)


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def _num_warps(elements: int) -> int:
    return max(1, min(8, elements // 256))


# From this many tokens fp8 writes run one warp per program. Their encode issues more
# instructions per code than int8's, and once the grid is many waves deep the issue rate
# decides; below it the shorter chain of two warps wins. int8 gains nothing from one warp.
# Rows whose offsets are not all 16-byte multiples (the inline page's: 4-byte aligned, stored 4
# bytes at a time) keep two warps: one gains nothing there (with wide_rows' layout, at 32768
# tokens, 0.91-0.92x the separate layout's speed against two warps' 0.91x; 0.90x against 0.93x
# for int8) and loses at 4096 tokens (0.90-0.92x against 0.96-0.97x).
# (Timings: bench/archive/RESULTS-history.md.)
FP8_ONE_WARP_TOKENS = 16384


def _write_warps(elements: int, code: int, num_tokens: int, row_align: int = 16) -> int:
    # A quantizing program spends per-warp instructions on the slot, addresses and each row's
    # scale; half the warps (16 codes a thread, one 16-byte store) issue fewer per token.
    if code not in (CODE_COPY, CODE_INT8) and num_tokens >= FP8_ONE_WARP_TOKENS and row_align >= 16:
        return 1
    return _num_warps(elements if code == CODE_COPY else elements // 2)


def _write_call(p, scale_floor: float):
    """(grid, args, kwargs, slots) of the write kernel's launch for `p`; slots: the positions
    of args each of CacheWrite.operand_names() fills."""
    mode = p.mode
    num_tokens, num_heads, head_size = p.key.shape
    block_d = triton.next_power_of_2(head_size)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _TILE_ELEMENTS // block_d))
    code = code_of(mode)
    if code == CODE_COPY:
        key, value = _as_bits(p.key), _as_bits(p.value)
        key_cache, value_cache = _as_bits(p.key_cache), _as_bits(p.value_cache)
    else:
        key, value = _as_input(p.key), _as_input(p.value)
        key_cache, value_cache = _as_codes(p.key_cache, code), _as_codes(p.value_cache, code)
    per_token_head = mode.per_token_head
    # Unused pointer arguments get a harmless tensor; their strides are 0.
    k_sc = p.k_scale_cache.view(torch.int32) if per_token_head else None
    v_sc = p.v_scale_cache.view(torch.int32) if per_token_head else None
    k_s = p.k_scale if mode.per_tensor else None
    v_s = p.v_scale if mode.per_tensor else None
    dummy = key_cache
    align = row_align(key_cache, value_cache)
    even_d = block_d == head_size
    grid = (num_tokens, triton.cdiv(num_heads, block_h), 1)
    args = (
        key,
        value,
        key_cache,
        value_cache,
        dummy if k_sc is None else k_sc,
        dummy if v_sc is None else v_sc,
        dummy if k_s is None else k_s,
        dummy if v_s is None else v_s,
        p.slot_mapping,
        p.key_cache.shape[0] * p.key_cache.shape[1],
        num_heads,
        head_size,
        p.key_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *_strides(k_sc, 3),
        *_strides(v_sc, 3),
    )
    kwargs = dict(
        CODE=encoder_code(code, p.key),
        PER_TENSOR=mode.per_tensor,
        IN_KIND=_in_kind(p.key),
        QMAX=float(mode.qmax),
        QMIN=float(mode.qmin),
        NAN_CODE=int(mode.nan_code),
        INF_POS=int(mode.inf_codes[0]),
        INF_NEG=int(mode.inf_codes[1]),
        SCALE_FLOOR=float(scale_floor),
        TRUNC=(p.rounding == "trunc"),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        EVEN_D=even_d,
        ROW_ALIGN=align,
        WIDE_TILE_LAYOUT=wide_rows.wanted(
            quantized=code != CODE_COPY,
            whole_rows=even_d,
            element_size=key_cache.element_size(),
            row_align=align,
            platform=_platform.build_target(),
        ),
        num_warps=_write_warps(block_h * block_d, code, num_tokens, align),
        enable_fp_fusion=False,
    )
    slots = (
        (0,),
        (1,),
        (2,),
        (3,),
        (8,),
        (4,) if per_token_head else (),
        (5,) if per_token_head else (),
        (6,) if mode.per_tensor else (),
        (7,) if mode.per_tensor else (),
    )
    return grid, args, kwargs, slots


def reshape_and_cache(p, scale_floor: float) -> None:
    """Run a validated CacheWrite problem (torch tensors)."""
    if p.key.shape[0] == 0:
        return
    grid, args, kwargs, _ = _write_call(p, scale_floor)
    _reshape_and_cache_kernel[grid](*args, **kwargs)


def prepare_write(p, scale_floor: float):
    """`p`'s launch bound once (launch.py): a function of p.operands() that writes a problem
    equal to `p` but for its arrays, each of the dtype, shape, strides and 16-byte
    alignment of `p`'s. It launches nothing now."""
    if p.key.shape[0] == 0:
        return launch_nothing
    grid, args, kwargs, slots = _write_call(p, scale_floor)
    return BoundLaunch(_reshape_and_cache_kernel, grid, args, kwargs, slots).relaunch


def dequantize(p) -> None:
    """Run a validated Dequantize problem (torch tensors)."""
    mode = p.mode
    num_seqs = p.seq_lens.shape[0]
    _, block_size, num_heads, head_size = p.cache.shape
    if num_seqs == 0 or p.out.shape[0] == 0:
        return
    # A host read: dequantize is a debugging/test op, never on a captured path.
    max_len = int(p.seq_lens.max())
    if max_len <= 0:
        return
    block_d = triton.next_power_of_2(head_size)
    block_t = max(1, min(64, _TILE_ELEMENTS // block_d, triton.next_power_of_2(max_len)))
    code = code_of(mode)
    cache = _as_input(p.cache) if code == CODE_COPY else _as_codes(p.cache, code)
    sc = p.scale_cache.view(torch.int32) if mode.per_token_head else None
    grid = (num_seqs, triton.cdiv(max_len, block_t), num_heads)
    _dequantize_kernel[grid](
        cache,
        cache if sc is None else sc,
        p.scale if mode.per_tensor else cache,
        p.block_tables,
        p.seq_lens,
        p.cu_seq_lens,
        p.out,
        head_size,
        block_size,
        *cache.stride(),
        *_strides(sc, 3),
        *p.block_tables.stride(),
        *p.out.stride(),
        CODE=code,
        PER_TENSOR=mode.per_tensor,
        IN_KIND=_in_kind(p.cache) if code == CODE_COPY else _IN_F32,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=_num_warps(block_t * block_d),
        enable_fp_fusion=False,
    )


__all__ = ["reshape_and_cache", "prepare_write", "dequantize", "float_bits", "code_of"]
