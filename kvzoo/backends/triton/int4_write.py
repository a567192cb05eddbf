"""Triton kernels that write int4 per-token-head rows into the paged cache and read them back
(SPEC.md section 2's int4 rows): modes int4_per_token_head (rows rotated first) and
int4_per_token_head_norot, and the values of the split modes, whose keys the same launch writes
in their own format (KEY_CODE: int8 or fp8 codes and a float32 scale, encode.py's row rule).

reshape_and_cache: a program owns ROWS rows of K or of V (BLOCK_T tokens x BLOCK_H heads; the
grid's second axis says which tensor), a memory path of its own beside write_kernels.py's: the
rows are rotated in registers (int4_rotation.fwht), rounded back to the input dtype, quantized
with an asymmetric scale and zero point, packed two codes a byte and stored with one scale word
a row (the scale's top 28 bits, the zero point in the low 4). Where the cache's rows allow it the
codes go out as int32 words of eight nibbles (pack_words), else as bytes. NARROW_HW says the
launch is compiled CUDA, where inline PTX runs: the bf16 convert, the sign flip as a foldable
negation, and cvt.rzi's NaN -> 0. What bounds the write on the H200: docs/int4_write_notes.md.

dequantize: gathers the tokens of sequences through their block tables, decodes the codes in
the stored basis and (rotated mode) un-rotates them in float32, bit for bit SPEC.md 3.5's
decode and SPEC.md 3.4's float32 inverse.

Exactness: every float32 operation here is one correctly rounded add, subtract, multiply or
`tl.math.div_rn`; the conversions are exact, or RNE (bf16 narrowing on the bits, or through
CUDA's own RNE convert where compiled); launches pass enable_fp_fusion=False, so `r * inv + zp`
keeps its two roundings (SPEC.md 3.6: no FMA; bench/probes/int4_offline_facts.py --check reads the PTX). The
interpreter checks every path but the CUDA convert, which the conformance suite checks on the
GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...problem import CacheWrite, Dequantize
from .encode import (
    CANONICAL_NAN_BITS,
    bf16_as_bits,
    bits_float,
    encode_row_codes,
    encoder_code,
    float_bits,
    load_f32,
    reciprocal,
    row_absmax_bits,
    row_scale,
)
from .formats import CODE_INT8, CODE_UINT4, code_of
from .int4_rotation import (
    deinterleave,
    flip_signs,
    fwht,
    interleave,
    log2,
    over_blocks,
    padded,
    sign_bits,
    unpack_nibbles,
)
from .int4_tiles import UINT4_CODE
from .launch import BoundLaunch, launch_nothing
from .platform import build_target, interpreted

# Input dtypes (constexpr IN_KIND): what a rotated row is rounded back to (SPEC.md 3.4 step 3).
IN_F32, IN_F16, IN_BF16 = 0, 1, 2
QMAX = tl.constexpr(15.0)
ZP_MAX = tl.constexpr(15)
# The scale word's low bits that hold the zero point (SPEC.md 3.5 step 6).
ZP_MASK = tl.constexpr(0xF)
SCALE_MASK = tl.constexpr(-16)  # 0xFFFFFFF0 as an int32
_ROUND_HALF = tl.constexpr(0.5)

# Elements of rows a write thread holds: whole rows of D <= 128 (one per lane), so a warp writes
# 32 rows (_load_row_tile says why whole rows); a longer row is shared by D / 128 lanes.
WRITE_THREAD_ELEMENTS = 128
# Tokens a dequantize program gathers per KV head.
DEQUANT_TOKENS = 16


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def range_with_zero(r, ROWS: tl.constexpr, D: tl.constexpr, INTERPRETED: tl.constexpr):
    """(max, min) of each row of r [ROWS, D] and 0, NaN-propagating.

    The interpreter runs a reduce's combine function element by element in Python (27 s of a
    28 s write at 64 tokens x 16 heads x 128); there the halves of the rows are folded onto
    each other instead, log2(D) NumPy operations (1.9 s). Max and min are exact, so the order
    changes no value but the sign of a zero, which the clamp to 0 and SPEC.md 3.5's floor
    make irrelevant (tests/test_triton_int4.py runs both on such rows). Compiled, the fold is
    not used: for sm_90a it gave tl.reduce's SASS at D <= 128 but, at D = 256 rotated, 102040
    instructions and 94 KB of spills against 5568 and none (rows there span two lanes). Each
    clamp follows its reduce, as it always has: clamping after both reordered the compiled code
    (a review's sm_90a compile; with this order the SASS matched the old at D 32-128)."""
    if INTERPRETED:
        hi = r
        lo = r
        for stage in tl.static_range(log2(D)):
            hi, lo = _fold_range(hi, lo, ROWS, D >> (stage + 1))
        hi = tl.maximum(tl.reshape(hi, [ROWS]), 0.0, propagate_nan=tl.PropagateNan.ALL)
        lo = tl.minimum(tl.reshape(lo, [ROWS]), 0.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        hi = tl.maximum(tl.reduce(r, 1, _max_nan), 0.0, propagate_nan=tl.PropagateNan.ALL)
        lo = tl.minimum(tl.reduce(r, 1, _min_nan), 0.0, propagate_nan=tl.PropagateNan.ALL)
    return hi, lo


@triton.jit
def _fold_range(hi, lo, ROWS: tl.constexpr, HALF: tl.constexpr):
    """One stage of range_with_zero's fold: element pairs (2j, 2j + 1) of [ROWS, 2 HALF] -> [ROWS, HALF]."""
    a, b = tl.split(tl.reshape(hi, [ROWS, HALF, 2]))
    c, d = tl.split(tl.reshape(lo, [ROWS, HALF, 2]))
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL), tl.minimum(c, d, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def narrow_bf16(r):
    """float32 -> nearest bfloat16 (ties to even) -> float32, on the bits: exact for every
    finite value and Inf (a float32 beyond bfloat16's range rounds to Inf); a NaN gives some
    NaN or other bits, in a row that is poisoned anyway."""
    b = float_bits(r)
    return bits_float((b + 0x7FFF + ((b >> 16) & 1)) & -65536)


@triton.jit
def narrow_bf16_cvt(r):
    """narrow_bf16 through the GPU's convert: cvt.rn.bf16x2.f32 rounds two values at once (RNE,
    subnormals kept), and a shift and a mask widen them back."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t;
        cvt.rn.bf16x2.f32 t, $3, $2;
        shl.b32 $0, t, 16;
        and.b32 $1, t, 0xffff0000;
        }
        """,
        constraints="=r,=r,r,r",
        args=[r],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def narrow(r, IN_KIND: tl.constexpr, NARROW_HW: tl.constexpr):
    """SPEC.md 3.4 step 3: the rotated row rounded to the input's dtype and widened back.
    NARROW_HW (compiled CUDA): bf16 through narrow_bf16_cvt, 1.5 instructions a value against
    narrow_bf16's 4."""
    if IN_KIND == 2:
        if NARROW_HW:
            r = narrow_bf16_cvt(r)
        else:
            r = narrow_bf16(r)
    elif IN_KIND == 1:
        r = r.to(tl.float16).to(tl.float32)  # RNE, overflow to Inf: IEEE on both sides
    return r


@triton.jit
def round_code(v):
    """SPEC.md 3.5's R(v) for v > -1 (every v the encoder meets): trunc(fl(v + 0.5)) capped at
    15; a v in (-1, 0) truncates to 0 as R's first case says."""
    return tl.minimum((v + _ROUND_HALF).to(tl.int32), ZP_MAX)


@triton.jit
def quantize_rows(r, SCALE_FLOOR: tl.constexpr, NAN_TO_ZERO: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rows r [ROWS, D] (rotated, or not: _norot) -> (codes [ROWS, D] int32, scale words [ROWS]
    int32), SPEC.md 3.5 and 4.1.

    hi and lo keep a NaN (NaN-propagating max/min), and hi - lo is NaN or Inf exactly when the
    row holds a NaN or an Inf or its range overflows: the poisoned rows of SPEC.md 4.1, which store
    codes 0 under the canonical NaN word. Such a row is quantized with zp 0 and inv 0, so its
    finite elements give y = 0 and code 0, and its NaN and Inf ones y = NaN, whose code is 0 on
    a GPU (cvt.rzi gives 0) and INT_MIN under NumPy (which warns of the cast). pack_words'
    sums need codes 0..15, so where NaN may not convert to 0 (NAN_TO_ZERO false: anything but
    compiled CUDA) the codes are raised to 0; a GPU spends no instruction on it. (Clearing the
    poisoned rows' words instead costs more: the row mask in the packed words' layout made the
    compiler compute the rows' max and min twice, sm_90a SASS.)"""
    hi, lo = range_with_zero(r, r.shape[0], r.shape[1], INTERPRETED)
    span = hi - lo
    poison = (float_bits(span) & 0x7F800000) == 0x7F800000
    span = tl.where(poison, 0.0, span)
    lo = tl.where(poison, 0.0, lo)
    q = tl.math.div_rn(span, tl.full(span.shape, QMAX, tl.float32))
    scale = tl.where(q > SCALE_FLOOR, q, SCALE_FLOOR)
    zp = round_code(tl.math.div_rn(-lo, scale))
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    inv = tl.where(poison, 0.0, inv)
    # Two roundings (fusion is off for the launch): fl(fl(r * inv) + zp).
    y = r * inv[:, None] + zp.to(tl.float32)[:, None]
    codes = round_code(y)
    if not NAN_TO_ZERO:
        codes = tl.maximum(codes, 0)
    words = tl.where(poison, CANONICAL_NAN_BITS, (float_bits(scale) & SCALE_MASK) | zp)
    return codes, words


@triton.jit
def _neg_ptx(x):
    return tl.inline_asm_elementwise(
        asm="neg.f32 $0, $1;", constraints="=r,r", args=[x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def flip_signs_first(x, D: tl.constexpr, HW: tl.constexpr):
    """int4_rotation.flip_signs for the rows the butterfly starts from. HW (compiled CUDA): a
    PTX neg where the sign is -1, which ptxas folds into the first stage's adds as an operand's
    sign; the XOR of the bits stays an instruction an element, and Triton's own `-x` is
    fl(0 - x), an instruction too. Both flip the sign bit exactly (a NaN stays some NaN, in a
    row that is poisoned anyway)."""
    if HW:
        d = tl.arange(0, D)[None, :]
        return tl.where(sign_bits(d, D) != 0, _neg_ptx(x), x)
    else:
        return flip_signs(x, D)


@triton.jit
def pack_words(codes, ROWS: tl.constexpr, D: tl.constexpr):
    """Codes [ROWS, D] (0..15) -> [ROWS, D / 8] int32 words of eight nibbles, element 8w + k in
    bits 4k..4k+3 of word w: the bytes of SPEC.md 5.3 in little-endian order. Each step adds
    one half shifted onto the other (one LEA or IMAD a value, where the byte path spent a shift
    and an OR a byte and three PRMTs a word)."""
    even, odd = tl.split(tl.reshape(codes, [ROWS, D // 2, 2]))
    b = even + odd * 16
    lo, hi = tl.split(tl.reshape(b, [ROWS, D // 4, 2]))
    h = lo + hi * 256
    lo, hi = tl.split(tl.reshape(h, [ROWS, D // 8, 2]))
    return lo + hi * 65536


@triton.jit
def _load_row_tile(src_ptr, row, row_ok, s_d, IN_KIND: tl.constexpr, PAIRS: tl.constexpr, D: tl.constexpr):
    """The rows at element offsets row [ROWS], s_d apart along D, as float32 [ROWS, P], exactly
    (P = padded(D): a head that is no power of two padded with zeros).

    Loaded as [ROWS, chunks, 16 bytes]: the compiler spreads the lanes over the rows and keeps
    each thread's rows whole in its registers, so the butterfly, the max and min and the
    packing need no exchange between lanes. PAIRS: bf16 rows read as int32 words of two values
    (src_ptr an int32 view, row in its units, s_d 1), widened by one shift or mask each."""
    ROWS: tl.constexpr = row.shape[0]
    P: tl.constexpr = padded(D)
    if PAIRS:
        W: tl.constexpr = P // 2
        V: tl.constexpr = min(4, W)
        j = (tl.arange(0, W // V)[:, None] * V + tl.arange(0, V)[None, :])[None, :, :]
        ok = row_ok[:, None, None]
        if P != D:
            ok = ok & (j < D // 2)
        words = tl.load(src_ptr + row[:, None, None] + j, mask=ok, other=0)
        words = tl.reshape(words, [ROWS, W])
        x = interleave(bits_float(words << 16), bits_float(words & -65536), ROWS, P)
    else:
        V: tl.constexpr = min(16 // (4 if IN_KIND == 0 else 2), P)
        d = (tl.arange(0, P // V)[:, None] * V + tl.arange(0, V)[None, :])[None, :, :]
        ok = row_ok[:, None, None]
        if P != D:
            ok = ok & (d < D)
        x = tl.reshape(load_f32(src_ptr + row[:, None, None] + d * s_d, ok), [ROWS, P])
    return x


@triton.jit
def _write_rows(
    src_ptr,
    cache_ptr,
    words_ptr,
    slot_ptr,
    first_token,
    num_tokens,
    num_heads,
    num_slots,
    block_size,
    s_t,
    s_h,
    s_d,
    s_cb,
    s_cs,
    s_ch,
    s_cd,
    s_wb,
    s_ws,
    s_wh,
    CODE: tl.constexpr,
    QMAX_BYTES: tl.constexpr,
    NAN_CODE: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_KIND: tl.constexpr,
    NARROW_HW: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    PAIRS: tl.constexpr,
    PACK_WORDS: tl.constexpr,
):
    """One side's rows in its own format: UINT4_CODE: packed rows (rotated where ROTATE), or a
    code a byte (int8, fp8: a split mode's keys) with QMAX_BYTES and NAN_CODE, SPEC.md 3's row."""
    ROWS: tl.constexpr = BLOCK_T * BLOCK_H
    rows = tl.arange(0, ROWS)
    token = first_token + rows // BLOCK_H
    head = (rows % BLOCK_H).to(tl.int64)
    row_ok = (token < num_tokens) & (head < num_heads)
    row = token.to(tl.int64) * s_t + head * s_h
    # A head that is no power of two is a tile of P, its padding zeros: they stay zeros
    # through the rotation (int4_rotation.fwht) and leave the row's range as it is (it holds 0).
    P: tl.constexpr = padded(D)
    x = _load_row_tile(src_ptr, row, row_ok, s_d, IN_KIND, PAIRS, D)
    if CODE == UINT4_CODE:
        if ROTATE:
            x = narrow(fwht(flip_signs_first(x, P, NARROW_HW), ROWS, P, D), IN_KIND, NARROW_HW)
        codes, words = quantize_rows(x, SCALE_FLOOR, NARROW_HW, INTERPRETED)
    else:
        scale, words = row_scale(row_absmax_bits(x, 1), QMAX_BYTES, SCALE_FLOOR)
        codes = encode_row_codes(x * reciprocal(scale)[:, None], CODE, NAN_CODE, False)

    slot = tl.load(slot_ptr + token, mask=row_ok, other=-1).to(tl.int64)
    # Past-the-end slots reach here only with validation off: skipped like negative ones, so
    # nothing is ever written outside the cache.
    keep = row_ok & (slot >= 0) & (slot < num_slots)
    slot = tl.maximum(slot, 0)
    block = slot // block_size
    offset = slot % block_size
    dst_row = block * s_cb + offset * s_cs + head * s_ch
    if CODE != UINT4_CODE:
        V: tl.constexpr = min(16, P)
        j = (tl.arange(0, P // V)[:, None] * V + tl.arange(0, V)[None, :])[None, :, :].to(tl.int64)
        dst = cache_ptr + dst_row[:, None, None] + j * s_cd
        ok = keep[:, None, None]
        if P != D:
            ok = ok & (j < D)
        tl.store(dst, tl.reshape(codes, [ROWS, P // V, V]).to(cache_ptr.dtype.element_ty), mask=ok)
    elif PACK_WORDS:
        # cache_ptr an int32 view (s_cd 1): a row's D / 8 words, four to a 16-byte store.
        W: tl.constexpr = P // 8
        VW: tl.constexpr = min(4, W)
        j = (tl.arange(0, W // VW)[:, None] * VW + tl.arange(0, VW)[None, :])[None, :, :]
        packed = tl.reshape(pack_words(codes, ROWS, P), [ROWS, W // VW, VW])
        ok = keep[:, None, None]
        if P != D:
            ok = ok & (j < D // 8)
        tl.store(cache_ptr + dst_row[:, None, None] + j, packed, mask=ok)
    else:
        even, odd = deinterleave(codes, ROWS, P)
        packed = (even | (odd << 4)).to(tl.uint8)
        BYTES: tl.constexpr = P // 2
        VB: tl.constexpr = min(16, BYTES)
        j = (tl.arange(0, BYTES // VB)[:, None] * VB + tl.arange(0, VB)[None, :])[None, :, :].to(tl.int64)
        dst = cache_ptr + dst_row[:, None, None] + j * s_cd
        ok = keep[:, None, None]
        if P != D:
            ok = ok & (j < D // 2)
        tl.store(dst, tl.reshape(packed, [ROWS, BYTES // VB, VB]), mask=ok)
    # A column [ROWS, 1], not a vector: stored as a vector, the words took another layout than
    # the rows' max and min, and the compiler computed those twice to match it (sm_90a SASS).
    tl.store((words_ptr + block * s_wb + offset * s_ws + head * s_wh)[:, None], words[:, None], mask=keep[:, None])


@triton.jit
def _int4_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    k_words_ptr,
    v_words_ptr,
    slot_ptr,
    num_tokens,
    num_heads,
    num_slots,
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
    s_kwb,
    s_kws,
    s_kwh,
    s_vwb,
    s_vws,
    s_vwh,
    KEY_CODE: tl.constexpr,
    KEY_QMAX: tl.constexpr,
    KEY_NAN_CODE: tl.constexpr,
    KEY_ROTATE: tl.constexpr,
    VALUE_ROTATE: tl.constexpr,
    IN_KIND: tl.constexpr,
    NARROW_HW: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    PAIRS: tl.constexpr,
    PACK_WORDS: tl.constexpr,
):
    """Program (i, 0) writes the K rows of tokens [i * BLOCK_T, (i + 1) * BLOCK_T), (i, 1) V's:
    V's are the family's int4 rows, K's in KEY_CODE's format (UINT4_CODE, or a split mode's
    byte codes, QMAX KEY_QMAX); each side rotated where its mode rotates."""
    first_token = tl.program_id(0) * BLOCK_T
    if tl.program_id(1) == 0:
        _write_rows(
            key_ptr,
            key_cache_ptr,
            k_words_ptr,
            slot_ptr,
            first_token,
            num_tokens,
            num_heads,
            num_slots,
            block_size,
            s_kt,
            s_kh,
            s_kd,
            s_kcb,
            s_kcs,
            s_kch,
            s_kcd,
            s_kwb,
            s_kws,
            s_kwh,
            KEY_CODE,
            KEY_QMAX,
            KEY_NAN_CODE,
            KEY_ROTATE,
            IN_KIND,
            NARROW_HW,
            INTERPRETED,
            SCALE_FLOOR,
            BLOCK_T,
            BLOCK_H,
            D,
            PAIRS,
            PACK_WORDS,
        )
    else:
        _write_rows(
            value_ptr,
            value_cache_ptr,
            v_words_ptr,
            slot_ptr,
            first_token,
            num_tokens,
            num_heads,
            num_slots,
            block_size,
            s_vt,
            s_vh,
            s_vd,
            s_vcb,
            s_vcs,
            s_vch,
            s_vcd,
            s_vwb,
            s_vws,
            s_vwh,
            UINT4_CODE,
            0.0,
            0,
            VALUE_ROTATE,
            IN_KIND,
            NARROW_HW,
            INTERPRETED,
            SCALE_FLOOR,
            BLOCK_T,
            BLOCK_H,
            D,
            PAIRS,
            PACK_WORDS,
        )


@triton.jit
def decode_rows(packed, words):
    """Packed rows [ROWS, D/2] (int32 bytes) and their scale words [ROWS] -> the even and the
    odd elements' values in the stored basis, fl(float32(code - zp) * scale_t) (SPEC.md 3.5)."""
    scale = bits_float(words & SCALE_MASK)[:, None]
    zp = (words & ZP_MASK)[:, None]
    even, odd = unpack_nibbles(packed)
    return (even - zp).to(tl.float32) * scale, (odd - zp).to(tl.float32) * scale


@triton.jit
def unrotate_exact(y, ROWS: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """SPEC.md 3.4's float32 inverse on a tile of P: fl(fl(fwht(y) * s) / B) (int4_rotation.over_blocks)."""
    return over_blocks(flip_signs(fwht(y, ROWS, P, D), P), P, D)


@triton.jit
def _int4_dequantize_kernel(
    cache_ptr,
    words_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seq_lens_ptr,
    out_ptr,
    block_size,
    s_cb,
    s_cs,
    s_ch,
    s_cd,
    s_wb,
    s_ws,
    s_wh,
    s_bt_s,
    s_bt_b,
    s_ot,
    s_oh,
    s_od,
    ROTATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(2).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = pos < tl.load(seq_lens_ptr + seq)
    block = tl.load(block_tables_ptr + seq.to(tl.int64) * s_bt_s + (pos // block_size) * s_bt_b, mask=t_ok, other=0)
    block = block.to(tl.int64)
    offset = (pos % block_size).to(tl.int64)
    P: tl.constexpr = padded(D)
    j = tl.arange(0, P // 2).to(tl.int64)
    row = block * s_cb + offset * s_cs + head * s_ch
    ok = t_ok[:, None]
    if P != D:
        ok = ok & (j[None, :] < D // 2)
    packed = tl.load(cache_ptr + row[:, None] + j[None, :] * s_cd, mask=ok, other=0).to(tl.int32)
    words = tl.load(words_ptr + block * s_wb + offset * s_ws + head * s_wh, mask=t_ok, other=0)
    even, odd = decode_rows(packed, words)
    x = interleave(even, odd, BLOCK_T, P)
    if ROTATE:
        x = unrotate_exact(x, BLOCK_T, P, D)
    out_row = tl.load(cu_seq_lens_ptr + seq).to(tl.int64) + pos
    d = tl.arange(0, P)
    ok = t_ok[:, None]
    if P != D:
        ok = ok & (d[None, :] < D)
    tl.store(out_ptr + (out_row * s_ot + head * s_oh)[:, None] + d[None, :] * s_od, x, mask=ok)


# ---------------------------------------------------------------------------------------------
# Host side


def _in_kind(t: torch.Tensor) -> int:
    return {torch.float32: IN_F32, torch.float16: IN_F16, torch.bfloat16: IN_BF16}[t.dtype]


def _narrow_hw(t: torch.Tensor) -> bool:
    # CUDA's bf16 convert is IEEE RNE; the interpreter's casts through bf16 are not trusted
    # (encode.py), and ROCm's lowering is not checked here.
    return t.is_cuda and build_target() == "cuda" and not interpreted()


# No tile has fewer than four rows: Triton 3.6 compiles a tile of two 16-bit rows at head size
# 64 for sm_90 to wrong row maxima and minima (so wrong scale words and codes).
MIN_TILE_ROWS = 4


def _write_tile(num_tokens: int, num_heads: int, head_size: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, warps): a token's heads in one program, and tokens up to a warp's rows."""
    rows_per_warp = 32 * WRITE_THREAD_ELEMENTS // max(triton.next_power_of_2(head_size), WRITE_THREAD_ELEMENTS)
    block_h = triton.next_power_of_2(num_heads)
    block_t = max(1, min(rows_per_warp // block_h, triton.next_power_of_2(num_tokens)))
    # At least MIN_TILE_ROWS rows, the rest masked: see its comment.
    block_t = max(block_t, MIN_TILE_ROWS // block_h)
    return block_t, block_h, max(1, min(8, block_t * block_h // rows_per_warp))


def _as_pairs(t: torch.Tensor) -> torch.Tensor | None:
    """A bf16 tensor [T, H, D] as int32 words of two values, where its rows allow: contiguous
    along D, even strides, and 16-byte aligned, which a prepared launch's signature holds for
    every tensor it is relaunched with (a 4-byte alignment would not be); else None."""
    if t.dtype != torch.bfloat16 or t.stride(2) != 1 or t.data_ptr() % 16:
        return None
    if t.stride(0) % 2 or t.stride(1) % 2:
        return None
    return t.view(torch.int32)


def _as_words(cache: torch.Tensor) -> torch.Tensor | None:
    """A uint8 cache [blocks, block_size, H, D / 2] as int32 words, where its rows allow it
    (D / 2 a multiple of 4 bytes, contiguous along it, strides of whole words, 16-byte
    aligned as _as_pairs says); else None."""
    if cache.shape[-1] % 4 or cache.stride(3) != 1 or cache.data_ptr() % 16:
        return None
    if any(s % 4 for s in cache.stride()[:3]):
        return None
    return cache.view(torch.int32)


def _write_call(
    p: CacheWrite,
    scale_floor: float,
    tile: tuple[int, int, int] | None = None,
    pack_words: bool = True,
):
    """(grid, args, kwargs, slots) of the write kernel's launch for `p`; slots: the positions
    of args each of CacheWrite.operand_names() fills. tile: (BLOCK_T, BLOCK_H, warps) instead
    of _write_tile's, and pack_words=False the byte stores (bench/probes/int4_write_probe.py compares
    them)."""
    num_tokens, num_heads, head_size = p.key.shape
    block_t, block_h, warps = tile or _write_tile(num_tokens, num_heads, head_size)
    k_words, v_words = p.k_scale_cache.view(torch.int32), p.v_scale_cache.view(torch.int32)
    key_side = p.mode.key_side
    key_code = code_of(key_side)
    # A split mode's byte keys: int8 codes signed, fp8 ones bytes (write_kernels._as_codes).
    key_cache = p.key_cache.view(torch.int8 if key_code == CODE_INT8 else torch.uint8)
    value_cache = p.value_cache.view(torch.uint8)
    # Byte keys are stored a 16-byte vector at a time whatever PACK_WORDS says.
    key_words = _as_words(key_cache) if key_code == CODE_UINT4 else key_cache
    value_words = _as_words(value_cache)
    words = pack_words and key_words is not None and value_words is not None
    if words:
        key_cache, value_cache = key_words, value_words
    key, value = _as_pairs(p.key), _as_pairs(p.value)
    pairs = key is not None and value is not None
    if not pairs:
        key, value = bf16_as_bits(p.key), bf16_as_bits(p.value)
    args = (
        key,
        value,
        key_cache,
        value_cache,
        k_words,
        v_words,
        p.slot_mapping,
        num_tokens,
        num_heads,
        p.key_cache.shape[0] * p.key_cache.shape[1],
        p.key_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *k_words.stride(),
        *v_words.stride(),
    )
    kwargs = dict(
        KEY_CODE=encoder_code(key_code, p.key),
        KEY_QMAX=float(key_side.qmax),
        KEY_NAN_CODE=int(key_side.nan_code),
        KEY_ROTATE=key_side.rotation is not None,
        VALUE_ROTATE=p.mode.value_side.rotation is not None,
        IN_KIND=_in_kind(p.key),
        NARROW_HW=_narrow_hw(p.key),
        INTERPRETED=interpreted(),
        SCALE_FLOOR=float(scale_floor),
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        D=head_size,
        PAIRS=pairs,
        PACK_WORDS=words,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    grid = (triton.cdiv(num_tokens, block_t), 2, 1)
    # CacheWrite.operand_names(): key, value, key_cache, value_cache, slot_mapping,
    # k_scale_cache, v_scale_cache, k_scale, v_scale.
    slots = ((0,), (1,), (2,), (3,), (6,), (4,), (5,), (), ())
    return grid, args, kwargs, slots


def reshape_and_cache(p: CacheWrite, scale_floor: float) -> None:
    """Run a validated int4 CacheWrite problem (torch tensors)."""
    if p.key.shape[0] == 0:
        return
    grid, args, kwargs, _ = _write_call(p, scale_floor)
    _int4_write_kernel[grid](*args, **kwargs)


def prepare_write(p: CacheWrite, scale_floor: float):
    """write_kernels.prepare_write for an int4 problem: its launch bound once (launch.py)."""
    if p.key.shape[0] == 0:
        return launch_nothing
    grid, args, kwargs, slots = _write_call(p, scale_floor)
    return BoundLaunch(_int4_write_kernel, grid, args, kwargs, slots).relaunch


def dequantize(p: Dequantize) -> None:
    """Run a validated int4 Dequantize problem (torch tensors)."""
    num_seqs = p.seq_lens.shape[0]
    _, block_size, num_heads, _ = p.cache.shape
    if num_seqs == 0 or p.out.shape[0] == 0:
        return
    # A host read: dequantize is a debugging/test op, never on a captured path.
    max_len = int(p.seq_lens.max())
    if max_len <= 0:
        return
    head_size = p.head_size
    block_t = max(1, min(DEQUANT_TOKENS, triton.next_power_of_2(max_len)))
    cache, words = p.cache.view(torch.uint8), p.scale_cache.view(torch.int32)
    _int4_dequantize_kernel[(num_seqs, triton.cdiv(max_len, block_t), num_heads)](
        cache,
        words,
        p.block_tables,
        p.seq_lens,
        p.cu_seq_lens,
        p.out,
        block_size,
        *cache.stride(),
        *words.stride(),
        *p.block_tables.stride(),
        *p.out.stride(),
        ROTATE=p.mode.rotation is not None,
        BLOCK_T=block_t,
        D=head_size,
        num_warps=4,
        enable_fp_fusion=False,
    )
