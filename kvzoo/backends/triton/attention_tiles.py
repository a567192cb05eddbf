"""The pieces the attention kernels (attention_kernels.py) are made of: what one key tile does on
the paged cache (`paged_tile`) and on staged prefill's workspace (`staged_tile`), the small
helpers those compose, and the parts around the key loop both kernels share (the tile's query
rows, its key range, the state it starts from, its stores).

Every function here is @triton.jit and inlined into the kernel that calls it. A tile's operand
path is chosen once per tile by its constexprs: how the logits come from the K operand (int8
query codes against the codes as loaded, converted codes with the per-key scales folded in,
converted codes with the scales on the logits or per row, the workspace's fp16 rows), and
likewise how P meets V.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import encode as _encode
from .attention_constants import (
    CONVERT_BF16_BITS,
    CONVERT_E4M3_ASM,
    CONVERT_I8_ASM,
    CONVERT_I8_OFFSET,
    CONVERT_I8_OFFSET_CAST,
    CONVERT_TABLE,
    FP8_CACHE_CODE,
    FP8_CVT_CODE,
    FP8_NAN_CODE,
    FP8_QMAX,
    FP8_WEIGHT_FLOOR,
    FP8_WEIGHT_UNIT,
    I8_OFFSET,
    LN2,
    LOG2E,
    SCALE_TENSOR,
    SCALE_TOKEN_HEAD,
    TABLE_SCAN,
    offset_codes,
)

# ----------------------------------------------------------------------------------------
# Codes to dot operands.


@triton.jit
def _int8x4_to_fp16_offset(x, PURE: tl.constexpr):
    # 0x6400 | (c ^ 0x80) is the fp16 1024 + (c + 128) = 1152 + c, exact (fp16 spacing is 1 in
    # [1024, 2048)): one xor and two byte permutes per four codes, against four int->float
    # conversions, the slow unit on this path. Callers subtract 1152 per code, or per row
    # after the dot (1152 * sum of the other operand's row) where that factors out.
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, hi;
        xor.b32 t, $2, 0x80808080;
        mov.b32 hi, 0x64646464;
        prmt.b32 $0, t, hi, 0x5140;
        prmt.b32 $1, t, hi, 0x7362;
        }
        """,
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=PURE,
        pack=4,
    )


@triton.jit
def _e4m3x4_to_fp16(x, PURE: tl.constexpr):
    # The same instruction Triton's cast emits; written out so that it can be marked impure.
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }
        """,
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=PURE,
        pack=4,
    )


@triton.jit
def codes_to_dot(x, table_ptr, DOT_DTYPE: tl.constexpr, CODE_CONVERT: tl.constexpr, PURE: tl.constexpr):
    # PURE=False keeps the conversion where the codes were loaded (rows contiguous along D):
    # a pure one is moved by Triton into the MMA operand layout, which for V (reduced over
    # keys, strided in memory) turns every code into a 1-byte shared-memory load.
    if CODE_CONVERT == CONVERT_I8_ASM:
        return _int8x4_to_fp16_offset(x, PURE) - I8_OFFSET
    elif CODE_CONVERT == CONVERT_I8_OFFSET:
        return _int8x4_to_fp16_offset(x, PURE)
    elif CODE_CONVERT == CONVERT_I8_OFFSET_CAST:
        return x.to(tl.float16) + I8_OFFSET
    elif CODE_CONVERT == CONVERT_E4M3_ASM:
        return _e4m3x4_to_fp16(x, PURE)
    elif CODE_CONVERT == CONVERT_TABLE:
        return tl.load(table_ptr + x.to(tl.uint8, bitcast=True).to(tl.int32)).to(DOT_DTYPE)
    elif CODE_CONVERT == CONVERT_BF16_BITS:
        return _encode.widen_bf16_bits(x)
    else:
        return x.to(DOT_DTYPE)


@triton.jit
def unit_ratios(scales):
    """(scales / unit, unit) for a tile's per-key scales, unit their largest: 16-bit operands
    normalised so that they cannot overflow. The unit is at least the smallest normal float32,
    so 1 / unit stays finite and a tile of subnormal scales (keys near 1e-37, the ones that
    meet query rows near 1e37 at logits of O(1)) gets ratios below 1 instead of Inf."""
    unit = tl.maximum(tl.max(scales, axis=0), _encode.SMALLEST_NORMAL)
    return scales * (1.0 / unit), unit


# ----------------------------------------------------------------------------------------
# Loads.


@triton.jit
def load_keys(ptrs, key_ok, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=key_ok, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def load_rows(ptrs, key_ok, d, MASKED: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """A key tile's rows (d: the columns 0..BLOCK_D), zeros past their HEAD_D elements (a row
    padded to BLOCK_D for the dots; int4's half rows of bytes too) and, where MASKED, for keys
    past the sequence; an unmasked full row loads as it is, so the compiler sees whole rows."""
    if MASKED:
        return tl.load(ptrs, mask=key_ok[:, None] & (d < HEAD_D)[None, :], other=0.0)
    elif HEAD_D < BLOCK_D:
        return tl.load(ptrs, mask=(d < HEAD_D)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def paged_rows(page, in_page, kv_head, stride_b, stride_t, stride_h, ROW_ALIGN: tl.constexpr):
    """Offsets of the rows of keys (page, in_page) of one KV head in a paged cache. ROW_ALIGN:
    elements every row offset is a multiple of, when Triton cannot see it (under 16)."""
    rows = page * stride_b + in_page * stride_t + kv_head * stride_h
    if ROW_ALIGN > 1 and ROW_ALIGN < 16:
        # Triton marks an integer argument divisible only by 16, so the inline page's rows
        # (head_size + 4 bytes apart) looked byte-aligned: the tile loads were one byte per
        # element and the copies unpipelined. Their true 4-byte alignment lets them go 4 at a
        # time through cp.async (docs/hardware.md).
        rows = tl.multiple_of(rows, ROW_ALIGN)
    return rows


# ----------------------------------------------------------------------------------------
# Logits of a tile: [rows, keys] in log2 units (or natural ones before a softcap).


@triton.jit
def logits_folded_scales(
    q, kc, ks, row_scale, table_ptr, DOT_DTYPE: tl.constexpr, CODE_CONVERT: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    # The per-key scales folded into the fp16 K operand (normalised by the tile's largest, so
    # they cannot overflow) instead of scaling the [rows, keys] logits: cheaper when the tile
    # has many rows (prefill).
    k = codes_to_dot(kc, table_ptr, DOT_DTYPE, CODE_CONVERT, False)
    k_ratio, k_unit = unit_ratios(ks)
    k = k * k_ratio.to(DOT_DTYPE)[:, None]
    return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (row_scale * k_unit)[:, None]


@triton.jit
def dot_codes(
    q,
    kc,
    q_offset,
    table_ptr,
    DOT_DTYPE: tl.constexpr,
    CODE_CONVERT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PURE: tl.constexpr,
):
    """q . the converted K codes, unscaled: what the offset conversions add taken back out."""
    k = codes_to_dot(kc, table_ptr, DOT_DTYPE, CODE_CONVERT, PURE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if offset_codes(CODE_CONVERT):
        s = s - q_offset[:, None]
    return s


@triton.jit
def logits_key_scales(
    q,
    kc,
    ks,
    row_scale,
    q_offset,
    table_ptr,
    DOT_DTYPE: tl.constexpr,
    CODE_CONVERT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PURE: tl.constexpr,
):
    # The dot is of the rescaled row (absmax near 2^14) with the codes, so its size is fixed;
    # the row's undo (the query's magnitude) and the key's scale meet first, as the logit's own
    # scale: s * ks alone overflows for huge keys beside tiny query rows, s * row_scale alone
    # for huge query rows. Two products either way.
    s = dot_codes(q, kc, q_offset, table_ptr, DOT_DTYPE, CODE_CONVERT, DOT_PRECISION, PURE)
    return s * (row_scale[:, None] * ks[None, :])


@triton.jit
def logits_row_scales(
    q,
    kc,
    row_scale,
    q_offset,
    table_ptr,
    DOT_DTYPE: tl.constexpr,
    CODE_CONVERT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PURE: tl.constexpr,
):
    # Mode none and static scales: one factor per row carries them all.
    return dot_codes(q, kc, q_offset, table_ptr, DOT_DTYPE, CODE_CONVERT, DOT_PRECISION, PURE) * row_scale[:, None]


# ----------------------------------------------------------------------------------------
# The online softmax.


@triton.jit
def softcap_logits(s, softcap):
    # tanh through exp (the interpreter has no libdevice); saturates cleanly to +-1.
    e2 = tl.exp(2.0 * (s / softcap))
    return (softcap * (1.0 - 2.0 / (e2 + 1.0))) * LOG2E


@triton.jit
def mask_logits(s, keys, key_ok, pos, window, HAS_WINDOW: tl.constexpr):
    """s with the keys a row may not see at -inf (past the cache, after the row's position,
    before its window), and which those are."""
    visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
    if HAS_WINDOW:
        visible = visible & (keys[None, :] > pos[:, None] - window)
    return tl.where(visible, s, float("-inf")), visible


@triton.jit
def online_softmax(s, m_i, l_i):
    """The running max and sum after logits s: (m, l, p, alpha), p the tile's weights and alpha
    the factor that moves what came before to the new max."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows with nothing visible yet keep m = -inf; subtract 0 there so no inf - inf.
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, p, alpha


# ----------------------------------------------------------------------------------------
# P . V of a tile, added to acc (rescaled by alpha).


@triton.jit
def pv_folded_scales(p, v, vs, acc, alpha, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The per-key scales folded into the fp16 V operand, as logits_folded_scales does for K.
    # (Unlike K's, V's tile scale is not floored: that cost 8 bytes of spills in fp8 prefill on
    # sm_90a, and no query magnitude needs subnormal V scales.)
    v_max = tl.max(vs, axis=0)
    v_ratio = vs * tl.where(v_max > 0.0, 1.0 / v_max, 0.0)
    v = v * v_ratio.to(DOT_DTYPE)[:, None]
    pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return acc * alpha[:, None] + pv * v_max


@triton.jit
def pv_key_scales(
    p,
    v,
    vs,
    acc,
    alpha,
    visible,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CODE_CONVERT: tl.constexpr,
    MASKED: tl.constexpr,
):
    # The probabilities scaled by the value's scale before the dot (decode: few rows).
    pv, w = key_weights(p, vs, visible, DOT_DTYPE, MASKED)
    pv_v = tl.dot(pv, v, input_precision=DOT_PRECISION)
    if offset_codes(CODE_CONVERT):
        pv_v = pv_v - I8_OFFSET * tl.sum(pv.to(tl.float32), axis=1)[:, None]
    return acc * alpha[:, None] + pv_v * w[:, None]


@triton.jit
def key_weights(p, vs, visible, DOT_DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """(weights, w): p times each key's V scale as a dot operand, normalised per row by its
    largest, w."""
    pv = p * vs[None, :]
    if MASKED:
        # Hidden keys may hold a NaN scale (a poisoned row): zero them after the product.
        pv = tl.where(visible, pv, 0.0)
    # Normalise each row by its largest weight so the fp16 operand cannot overflow. The
    # weight is floored at the smallest normal float32: a tile whose keys all sit ~90
    # below the row's largest logit (log2 units) has subnormal weights, whose reciprocal
    # would be Inf (and NaN in the output).
    w = tl.maximum(tl.max(pv, axis=1), _encode.SMALLEST_NORMAL)
    return (pv * (1.0 / w)[:, None]).to(DOT_DTYPE), w


@triton.jit
def as_e4m3(codes):
    """e4m3 codes as loaded (uint8 bytes, or already e4m3) as the fp8 dot operand they are."""
    if codes.dtype == tl.float8e4nv:
        return codes
    return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def e4m3_of(y, FP8_CODE: tl.constexpr):
    """The e4m3fn operand of fp32 y within +-448 (encode.encode_row_codes' rounding): the
    hardware convert straight to the operand where FP8_CODE is CODE_E4M3FN_CVT (it keeps NaN,
    and saturates nothing here), else the integer rounding's code bytes reinterpreted."""
    if FP8_CODE == FP8_CVT_CODE:
        return y.to(tl.float8e4nv)
    return as_e4m3(_encode.encode_row_codes(y, FP8_CODE, FP8_NAN_CODE, False).to(tl.uint8))


@triton.jit
def twice_along_rows(x):
    """x [rows, D] as [rows, 2 D], each element repeated in place (x0, x0, x1, x1, ...): what
    meets fp8_query_operand's interleaved terms in one dot."""
    return tl.reshape(tl.join(x, x), [x.shape[0], 2 * x.shape[1]])


@triton.jit
def fp8_query_operand(q, FP8_CODE: tl.constexpr, SCALE_FLOOR: tl.constexpr):
    """(operand, scale) of query rows q [rows, D] (fp32) for fp8_dots (SPEC.md 8.3): the row's
    two e4m3 terms interleaved, [rows, 2 D] (hi0, lo0, hi1, lo1, ...), hi the codes of the e4m3fn
    cache format's row rule, lo the e4m3 rounding of y - hi (y = q * inv; the residual is exact
    in fp32), so hi + lo carries about 7 bits of each large element. Against twice_along_rows
    of the K codes, one dot sums both terms: Triton 3.6 compiles two dots (added, or one
    accumulating into the other) to wrong numbers on sm_90a's wgmma."""
    scale, _ = _encode.row_scale(_encode.row_absmax_bits(q, 1), FP8_QMAX, SCALE_FLOOR)
    y = q * _encode.reciprocal(scale)[:, None]
    hi = e4m3_of(y, FP8_CODE)
    # The max (a no-op on every lane but NaN's, whose hi is NaN anyway) stands between q * inv
    # and the subtraction, so they cannot contract into an FMA, which would skip y's rounding.
    kept = tl.maximum(y, -3.4028234663852886e38)
    hi_value = _encode.decode_codes(hi.to(tl.uint8, bitcast=True), FP8_CACHE_CODE)
    lo = e4m3_of(kept - hi_value, FP8_CODE)
    return tl.reshape(tl.join(hi, lo), [q.shape[0], 2 * q.shape[1]]), scale


@triton.jit
def fp8_weights(p, vs, visible, FP8_CODE: tl.constexpr, MASKED: tl.constexpr):
    """(codes, unit): the tile's weights p times each key's V scale as fp8_dots' e4m3 P operand
    (SPEC.md 8.3): per row divided by their largest, w (floored at FP8_WEIGHT_FLOOR), times
    FP8_WEIGHT_UNIT, rounded to e4m3; `unit` = w / FP8_WEIGHT_UNIT undoes it."""
    pv = p * vs[None, :]
    if MASKED:
        pv = tl.where(visible, pv, 0.0)
    w = tl.maximum(tl.max(pv, axis=1), FP8_WEIGHT_FLOOR)
    return e4m3_of(pv * ((1.0 / w) * FP8_WEIGHT_UNIT)[:, None], FP8_CODE), w * (1.0 / FP8_WEIGHT_UNIT)


@triton.jit
def pv_row_scales(p, v, acc, alpha, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, CODE_CONVERT: tl.constexpr):
    # Mode none and static scales (the static V scale multiplies acc once, at the end).
    p16 = p.to(DOT_DTYPE)
    pv_v = tl.dot(p16, v, input_precision=DOT_PRECISION)
    if offset_codes(CODE_CONVERT):
        pv_v = pv_v - I8_OFFSET * tl.sum(p16.to(tl.float32), axis=1)[:, None]
    return acc * alpha[:, None] + pv_v


# ----------------------------------------------------------------------------------------
# Key tiles. A tile function takes (start, kv_end, bt_row, m, l, acc, v_unit, MASKED, *its own
# arguments), for the keys [start, start + BLOCK_N) below kv_end of the sequence whose
# block_tables row bt_row points at, and returns the updated (m, l, acc, v_unit); MASKED=False
# is for tiles every row sees whole (no bounds, causal or window tests).


@triton.jit
def paged_tile(
    start,
    kv_end,
    bt_row,
    m_i,
    l_i,
    acc,
    v_unit,
    MASKED: tl.constexpr,
    q,
    row_scale,
    q_offset,
    pos,
    window,
    softcap,
    kv_head,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    k_strides,
    v_strides,
    ks_strides,
    vs_strides,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    CODE_CONVERT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SCALE_IN_CODES: tl.constexpr,
    QK_INT8: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    FP8_DOTS: tl.constexpr,
    FP8_CODE: tl.constexpr,
):
    """One key tile on the paged cache, its keys gathered through the sequence's block-table row
    (a tile may span several pages of any size). acc carries no unit here (v_unit stays 1).
    k_strides, v_strides: the caches' stride() (block, token, head, dim); ks_strides,
    vs_strides: their scales' (block, token, head).

    SCALE_IN_CODES folds the per-key scales into the fp16 K/V operands (prefill; decode scales
    logits and probabilities). QK_INT8: q holds int8 codes (quantize_query). FP8_DOTS: q holds
    the query's two e4m3 terms (fp8_query_operand), and every dot takes fp8 operands, the K
    and V codes as loaded (fp8_dots; P's codes encoded with FP8_CODE)."""
    d = tl.arange(0, BLOCK_D)
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < kv_end
    page = load_keys(bt_row + keys // PAGE, key_ok, MASKED).to(tl.int64)
    in_page = keys % PAGE
    k_row = paged_rows(page, in_page, kv_head, k_strides[0], k_strides[1], k_strides[2], ROW_ALIGN)
    kc = load_rows(k_ptr + k_row[:, None] + d[None, :] * k_strides[3], key_ok, d, MASKED, HEAD_D, BLOCK_D)
    if QK_INT8 or FP8_DOTS:
        tl.static_assert(SCALE_MODE == SCALE_TOKEN_HEAD, "quantize_query and fp8_dots take per-token-head scales")
    if SCALE_MODE == SCALE_TOKEN_HEAD:
        ks = load_keys(
            ks_ptr + page * ks_strides[0] + in_page * ks_strides[1] + kv_head * ks_strides[2], key_ok, MASKED
        )
        if QK_INT8:
            # q holds int8 codes (quantize_query) and meets the K codes as loaded in an int8 dot,
            # exact in int32. s is an integer and row_scale at least SCALE_FLOOR times the logit
            # unit, so s * ks first overflows only where the logit does too (for any softmax_scale
            # above 1e-13), and an exact 0 stays 0 (the product of the two scales first could be
            # Inf there). Written here, not as a helper of its own: that compiled the quantize_query
            # prefill's loop to other SASS (the same instructions, scheduled otherwise).
            s = tl.dot(q, tl.trans(kc), out_dtype=tl.int32).to(tl.float32) * ks[None, :] * row_scale[:, None]
        elif FP8_DOTS:
            # Both query terms in one dot (fp8_query_operand says why); e4m3 products are exact
            # in fp32, and the size argument is QK_INT8's.
            s = tl.dot(q, tl.trans(twice_along_rows(as_e4m3(kc)))) * ks[None, :] * row_scale[:, None]
        elif SCALE_IN_CODES:
            s = logits_folded_scales(q, kc, ks, row_scale, table_ptr, DOT_DTYPE, CODE_CONVERT, DOT_PRECISION)
        else:
            s = logits_key_scales(
                q, kc, ks, row_scale, q_offset, table_ptr, DOT_DTYPE, CODE_CONVERT, DOT_PRECISION, True
            )
    else:
        s = logits_row_scales(
            q, kc, row_scale, q_offset, table_ptr, DOT_DTYPE, CODE_CONVERT, DOT_PRECISION, not SCALE_IN_CODES
        )
    if HAS_SOFTCAP:
        s = softcap_logits(s, softcap)
    visible = key_ok
    if MASKED:
        s, visible = mask_logits(s, keys, key_ok, pos, window, HAS_WINDOW)
    m_i, l_i, p, alpha = online_softmax(s, m_i, l_i)

    if SAME_KV_STRIDES:
        # V (and its scales) sit at K's offsets: one address computation serves both.
        vc = load_rows(v_ptr + k_row[:, None] + d[None, :] * k_strides[3], key_ok, d, MASKED, HEAD_D, BLOCK_D)
    else:
        v_row = paged_rows(page, in_page, kv_head, v_strides[0], v_strides[1], v_strides[2], ROW_ALIGN)
        vc = load_rows(v_ptr + v_row[:, None] + d[None, :] * v_strides[3], key_ok, d, MASKED, HEAD_D, BLOCK_D)
    if SCALE_MODE == SCALE_TOKEN_HEAD:
        if SAME_KV_STRIDES:
            vs = load_keys(
                vs_ptr + page * ks_strides[0] + in_page * ks_strides[1] + kv_head * ks_strides[2], key_ok, MASKED
            )
        else:
            vs = load_keys(
                vs_ptr + page * vs_strides[0] + in_page * vs_strides[1] + kv_head * vs_strides[2], key_ok, MASKED
            )
    if FP8_DOTS:
        p8, unit = fp8_weights(p, vs, visible, FP8_CODE, MASKED)
        acc = acc * alpha[:, None] + tl.dot(p8, as_e4m3(vc)) * unit[:, None]
    else:
        v = codes_to_dot(vc, table_ptr, DOT_DTYPE, CODE_CONVERT, False)
        if SCALE_MODE == SCALE_TOKEN_HEAD:
            if SCALE_IN_CODES:
                acc = pv_folded_scales(p, v, vs, acc, alpha, DOT_DTYPE, DOT_PRECISION)
            else:
                acc = pv_key_scales(p, v, vs, acc, alpha, visible, DOT_DTYPE, DOT_PRECISION, CODE_CONVERT, MASKED)
        else:
            acc = pv_row_scales(p, v, acc, alpha, DOT_DTYPE, DOT_PRECISION, CODE_CONVERT)
    return m_i, l_i, acc, v_unit


@triton.jit
def staged_tile(
    start,
    kv_end,
    bt_row,
    m_i,
    l_i,
    acc,
    v_unit,
    MASKED: tl.constexpr,
    q,
    row_scale,
    pos,
    window,
    softcap,
    kv_head,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    w_strides,
    ks_strides,
    vs_strides,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One key tile on staging.py's workspace: fp16 K and V as logits_folded_scales and
    pv_folded_scales would build them, with one scale per page of keys (the tile's page),
    nothing to convert or fold. The block_tables row holds one column, the sequence's first
    workspace page; acc is kept in units of the current page's V scale, v_unit. w_strides: the
    workspace's (page, key, head, dim); ks_strides, vs_strides: its page scales' (page, head)."""
    d = tl.arange(0, BLOCK_D)
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < kv_end
    # The workspace gives each sequence consecutive pages of one contiguous buffer (staging.py),
    # so its keys sit at one stride: a tile's addresses are one scalar plus offsets the compiler
    # hoists out of the loop, where a page lookup per key would cost dozens of instructions per
    # tile. A tile never spans two pages: one K and V scale per tile. This pays only together
    # with the staged query (staging.py): the compiler schedules either change alone worse.
    first_page = tl.load(bt_row).to(tl.int64)
    page = first_page + start // PAGE
    tile_off = first_page * w_strides[0] + start.to(tl.int64) * w_strides[1] + kv_head * w_strides[2]
    in_tile = tl.arange(0, BLOCK_N)[:, None] * w_strides[1] + d[None, :] * w_strides[3]
    kc = load_rows(k_ptr + tile_off + in_tile, key_ok, d, MASKED, HEAD_D, BLOCK_D)
    s = tl.dot(q, tl.trans(kc))
    if SCALE_MODE == SCALE_TOKEN_HEAD:
        s = s * (row_scale * tl.load(ks_ptr + page * ks_strides[0] + kv_head * ks_strides[1]))[:, None]
    else:
        s = s * row_scale[:, None]
    if HAS_SOFTCAP:
        s = softcap_logits(s, softcap)
    if MASKED:
        s, _ = mask_logits(s, keys, key_ok, pos, window, HAS_WINDOW)
    m_i, l_i, p, alpha = online_softmax(s, m_i, l_i)

    vc = load_rows(v_ptr + tile_off + in_tile, key_ok, d, MASKED, HEAD_D, BLOCK_D)
    if SCALE_MODE == SCALE_TOKEN_HEAD:
        # acc is kept in units of the current page's V scale: moving to a new page costs one
        # factor per row, folded into alpha, instead of a product per element.
        page_unit = tl.load(vs_ptr + page * vs_strides[0] + kv_head * vs_strides[1])
        alpha = alpha * (v_unit / page_unit)
        v_unit = page_unit
    acc = tl.dot(p.to(tl.float16), vc, acc * alpha[:, None])
    return m_i, l_i, acc, v_unit


@triton.jit
def attend_range(
    lo,
    hi,
    kv_end,
    bt_row,
    state,
    TILE: tl.constexpr,
    tile_args,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """TILE on the key tiles starting at lo, lo + BLOCK_N, ... below hi: the loop state after
    them, state the tuple TILE takes after (start, kv_end, bt_row) and returns, whatever its
    family keeps per row (paged_tile's (m, l, acc, v_unit), int4_attention's own)."""
    if INTERPRETED:
        # The interpreter keeps scalars as 1-element arrays, which NumPy >= 2.4 will not turn
        # into the ints range() needs; a while loop compares them instead. Compiled code keeps
        # the for loop, which Triton software-pipelines.
        start = lo
        while start < hi:
            state = TILE(start, kv_end, bt_row, *state, MASKED, *tile_args)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            state = TILE(start, kv_end, bt_row, *state, MASKED, *tile_args)
    return state


@triton.jit
def attend(
    seq,
    q_block,
    q_len,
    seq_len,
    context,
    block_tables_ptr,
    stride_bt,
    window,
    split,
    split_keys,
    sinks_ptr,
    head,
    row_ok,
    TILE: tl.constexpr,
    tile_args,
    accs,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    WITH_SINK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    seq_ok,
):
    """The online softmax of a query tile over every key its rows see (within this program's
    split), TILE by TILE in attend_tiles' order (tile_args: TILE's own arguments): (m, l, accs)
    after the last, accs what TILE keeps per row besides (m, l), starting from the given ones
    (paged_tile's and staged_tile's (acc, v_unit), int4's own). An ill-formed sequence (not
    seq_ok: sequence_ok) reads no key: the caller takes l through poisoned_sum(l, seq_ok) once
    its rows are final, which leaves that sequence's l NaN, so its rows store NaN."""
    keys = key_range(
        context, q_block, q_len, seq_len, window, split, split_keys, seq_ok, BLOCK_Q, BLOCK_N, HAS_WINDOW, SPLIT
    )
    m_i, l_i = _initial_state(sinks_ptr, head, row_ok, BLOCK_M, WITH_SINK)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    state = attend_tiles(keys, window, bt_row, (m_i, l_i) + accs, TILE, tile_args, BLOCK_N, HAS_WINDOW, INTERPRETED)
    return state[0], state[1], state[2:]


@triton.jit
def zero_acc(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """paged_tile's and staged_tile's accumulators before the first key: acc, and v_unit, the V
    scale acc is counted in where a tile keeps one (staged_tile)."""
    return tl.zeros([BLOCK_M, BLOCK_D], tl.float32), 1.0


@triton.jit
def attend_tiles(
    keys,
    window,
    bt_row,
    state,
    TILE: tl.constexpr,
    tile_args,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """attend_range over a query tile's keys (key_range's four values): masked tiles before the
    whole ones (a window only), the whole tiles without masks, then the masked tiles at the
    causal edge."""
    kv_begin, kv_end, tile_first, tile_last = keys
    full_begin, full_end = _whole_tiles(kv_begin, kv_end, tile_first, tile_last, window, BLOCK_N, HAS_WINDOW)
    for phase in tl.static_range(3):
        if phase == 0:
            lo = kv_begin
            hi = full_begin
        elif phase == 1:
            lo = full_begin
            hi = full_end
        else:
            lo = full_end
            hi = kv_end
        if HAS_WINDOW or phase != 0:
            state = attend_range(lo, hi, kv_end, bt_row, state, TILE, tile_args, phase != 1, BLOCK_N, INTERPRETED)
    return state


# ----------------------------------------------------------------------------------------
# Around the key loop.


@triton.jit
def find_seq(qsl_ptr, num_seqs, vblock, BLOCK_Q: tl.constexpr):
    # Sequence s owns virtual q-blocks [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1):
    # at least ceil(q_len / BLOCK_Q) of them, with no host-side prefix sum.
    # Tensors from the start: num_seqs may arrive as a constexpr (Triton specialises 1).
    lo = tl.program_id(0) * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= vblock:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def query_block(qsl_ptr, num_seqs, BLOCK_Q: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """(seq, q_start, q_len, q_block) of this program of a prefill grid: program_id(0) counts
    virtual query blocks (find_seq), which a caller past its sequence's last block skips."""
    vblock = tl.program_id(0)
    if LONGEST_FIRST:
        vblock = tl.num_programs(0) - 1 - vblock
    found = find_seq(qsl_ptr, num_seqs, vblock, BLOCK_Q)
    # Offsets that start above 0 or decrease (SPEC.md 11.1: unchecked metadata) leave a
    # program before the first sequence or before its block 0: it gets no rows (q_len 0).
    seq = tl.maximum(found, 0)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = vblock - (q_start // BLOCK_Q + seq)
    q_len = tl.where((found >= 0) & (q_block >= 0), q_len, 0)
    return seq, q_start, q_len, tl.maximum(q_block, 0)


@triton.jit
def program_query(
    qsl_ptr,
    num_seqs,
    BLOCK_Q: tl.constexpr,
    PER_SEQ: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
):
    """(seq, q_start, q_len, q_block, live) of this program: a decode launch's (PER_SEQ: one
    program per sequence, which takes 1-token sequences only) or a prefill grid's (query_block;
    SKIP_DECODE leaves 1-token sequences to the decode launch). A program not live has no rows
    and returns at once."""
    if PER_SEQ:
        seq = tl.program_id(0)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        q_block = 0
        live = q_len == 1
    else:
        seq, q_start, q_len, q_block = query_block(qsl_ptr, num_seqs, BLOCK_Q, LONGEST_FIRST)
        live = q_block * BLOCK_Q < q_len
        if SKIP_DECODE:
            live = live & (q_len != 1)
    return seq, q_start, q_len, q_block, live


@triton.jit
def tile_rows(
    q_block,
    q_start,
    q_len,
    context,
    kv_head,
    num_tokens,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    G_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr,
):
    """The tile's rows: (row_ok, head, pos, token, d, d_ok). Row r is query token r // G_PAD of
    this block and query head r % G_PAD of the KV head's group. Only tokens in
    [0, num_tokens) are rows, whatever query_start_loc says (SPEC.md 11.1)."""
    rows = tl.arange(0, BLOCK_M)
    row_tok = rows // G_PAD
    row_head = rows % G_PAD
    q_idx = q_block * BLOCK_Q + row_tok
    token = (q_start + q_idx).to(tl.int64)
    row_ok = (row_tok < BLOCK_Q) & (q_idx < q_len) & (row_head < GROUP) & (token >= 0) & (token < num_tokens)
    head = kv_head * GROUP + row_head
    pos = context + q_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    return row_ok, head, pos, token, d, d_ok


@triton.jit
def logit_scale(row_scale, ks_ptr, softmax_scale, SCALE_MODE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Logit scale per row: what carries the row's magnitude (row_scale: the undo of its
    power-of-two rescaling, or its int8 scale), times a static key scale, times the logit unit
    last (log2 units for exp2; softcap needs natural units first). Magnitudes meet first, so a
    huge query row and a tiny static scale cancel before anything else can overflow."""
    if SCALE_MODE == SCALE_TENSOR:
        row_scale = row_scale * tl.load(ks_ptr)
    if HAS_SOFTCAP:
        row_scale = row_scale * softmax_scale
    else:
        row_scale = row_scale * (softmax_scale * LOG2E)
    return row_scale


@triton.jit
def key_range(
    context,
    q_block,
    q_len,
    seq_len,
    window,
    split,
    split_keys,
    seq_ok,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """(kv_begin, kv_end, tile_first, tile_last): the keys this tile needs, up to its last row's
    position and from the window of its first row (within this program's split), none for an
    ill-formed sequence (not seq_ok), and those two rows' positions."""
    tile_first = context + q_block * BLOCK_Q
    tile_last = context + tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    kv_end = tl.minimum(tile_last + 1, seq_len)
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(tile_first - window + 1, 0)
    if SPLIT:
        kv_begin = tl.maximum(kv_begin, split * split_keys)
        kv_end = tl.minimum(kv_end, (split + 1) * split_keys)
    # Tiles start on multiples of BLOCK_N whatever the window, so a row's tiling is fixed.
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    kv_end = tl.where(seq_ok, kv_end, kv_begin)
    return kv_begin, kv_end, tile_first, tile_last


@triton.jit
def sequence_ok(
    bt_row,
    seq_len,
    q_len,
    split,
    split_keys,
    max_blocks,
    num_blocks,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Whether a sequence's metadata keeps the rules its keys are read by (SPEC.md 11.1): its
    length at least its query's and within its block-table row, and the entries covering
    positions [0, seq_len) (this program's split of them) in [0, num_blocks). Checked before
    any key is read, once per program: a pass over the entries, not a test per key tile (the
    key loop is unchanged, and reads only entries the pass saw)."""
    ok = (q_len <= seq_len) & (seq_len <= max_blocks * PAGE)
    first_key = 0
    last_key = seq_len
    if SPLIT:
        first_key = tl.maximum(first_key, split * split_keys)
        last_key = tl.minimum(last_key, (split + 1) * split_keys)
    begin = first_key // PAGE
    end = tl.where(ok, tl.cdiv(last_key, PAGE), begin)
    bad = tl.program_id(0) * 0
    if INTERPRETED:
        # while, not range(): see attend_range's note.
        start = begin
        while start < end:
            bad += _entries_out_of_range(bt_row, start, end, num_blocks)
            start += TABLE_SCAN
    else:
        for start in range(begin, end, TABLE_SCAN):
            bad += _entries_out_of_range(bt_row, start, end, num_blocks)
    return ok & (bad == 0)


@triton.jit
def staged_sequence_ok(
    bt_row,
    seq_len,
    q_len,
    max_blocks,
    num_blocks,
    workspace_keys,
    PAGE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """sequence_ok on the cache's block-table row (bt_row, pages of PAGE keys), for a staged
    prefill whose keys come from a workspace slot of workspace_keys keys: a length past the slot
    (seq_lens over the max_seq_len the workspace was sized by) is refused like one past the
    table, so the kernel never reads another slot's keys."""
    ok = sequence_ok(bt_row, seq_len, q_len, 0, 0, max_blocks, num_blocks, PAGE, False, INTERPRETED)
    return ok & (seq_len <= workspace_keys)


@triton.jit
def _entries_out_of_range(bt_row, start, end, num_blocks):
    idx = start + tl.arange(0, TABLE_SCAN)
    live = idx < end
    ids = tl.load(bt_row + idx, mask=live, other=0)
    return tl.sum((live & ((ids < 0) | (ids >= num_blocks))).to(tl.int32), axis=0)


@triton.jit
def poisoned_sum(l_i, seq_ok):
    """The softmax denominator, NaN for an ill-formed sequence: every row stores acc / l (and
    lse m + log l; a split's merge adds it in), so its rows come out NaN (SPEC.md 11.1)."""
    return tl.where(seq_ok, l_i, float("nan"))


@triton.jit
def _whole_tiles(kv_begin, kv_end, tile_first, tile_last, window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[full_begin, full_end): the tiles every row sees whole, which skip the masks: keys at or
    before the first row's position (causal) and inside the last row's window."""
    full_end = tl.maximum((tl.minimum(tile_first + 1, kv_end) // BLOCK_N) * BLOCK_N, kv_begin)
    full_begin = kv_begin
    if HAS_WINDOW:
        full_begin = tl.minimum(tl.cdiv(tl.maximum(tile_last - window + 1, 0), BLOCK_N) * BLOCK_N, full_end)
        full_begin = tl.maximum(full_begin, kv_begin)
    return full_begin, full_end


@triton.jit
def _initial_state(sinks_ptr, head, row_ok, BLOCK_M: tl.constexpr, WITH_SINK: tl.constexpr):
    """(m, l) before the first key: the sink joins the denominator as exp(sink - m) and adds no
    value."""
    if WITH_SINK:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * LOG2E
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return m_i, l_i


@triton.jit
def store_partials(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    seq,
    head,
    split,
    num_splits,
    acc,
    m_i,
    l_i,
    row_ok,
    NUM_Q_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A split decode's partials for the merge, indexed [seq, q head, split]: each row's acc
    (all BLOCK_D columns) and its running max and sum."""
    part = (seq.to(tl.int64) * NUM_Q_HEADS + head) * num_splits + split
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    cols = tl.arange(0, BLOCK_D)
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + cols[None, :], acc, mask=row_ok[:, None])


@triton.jit
def store_rows(
    out_ptr,
    lse_ptr,
    acc,
    m_i,
    l_i,
    token,
    head,
    d,
    row_ok,
    d_ok,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    HAS_LSE: tl.constexpr,
):
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    if HAS_LSE:
        # m and l are in log2 units; a row with no term (m = -inf, l = 0) gives -inf.
        # Padding rows (not stored) take log2(1): no log of their zero sum.
        m_use = tl.where(m_i > float("-inf"), m_i, 0.0)
        tl.store(
            lse_ptr + token * stride_lt + head * stride_lh,
            (m_use + tl.log2(tl.where(row_ok, l_i, 1.0))) * LN2,
            mask=row_ok,
        )
