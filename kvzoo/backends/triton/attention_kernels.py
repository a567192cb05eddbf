"""Unified paged attention in Triton: varlen prefill + decode over the (quantized) paged cache.

One kernel computes causal attention for a tile of query rows against the paged K/V of one KV
head. A tile's rows are BLOCK_Q consecutive query tokens of one sequence times the G query
heads that share the KV head (padded to a power of two), so each K/V tile is loaded once per
group and prefill runs tensor-core-sized [BLOCK_M, BLOCK_N] dots. Keys are gathered through
block_tables one key at a time, so a key tile may span several pages of any block size.

Per-token-head modes keep the dots on the codes: q . codes is scaled by the key's scale after
the dot, and the probabilities are scaled by the value's scale before P . V. Codes are exact in
fp16 (int8 and e4m3 both), so quantized modes dot in fp16 on any query dtype; the query rows
are rescaled by a power of two into fp16's range first (exact), which keeps bf16 and fp32
queries safe, and the row's undo factor meets the key's scale before the dot's result does, so
rows of any magnitude give finite logits wherever the logits are (SPEC.md section 11). Mode
"none" dots in the cache dtype (fp32 for fp32 caches).

Long contexts with few sequences use split-KV: each program covers `split_keys` keys of one
decode token and writes its partial (max, sum, acc); a second kernel merges the splits in a
fixed order. Nothing here synchronises with the host (grids come from the problem's host-side
max_query_len / max_seq_len), so a decode step can be captured in a CUDA graph, and nothing
uses atomics, so results are identical run to run.

Prefill on a quantized cache with long query runs is staged (staging.py): the codes are
converted once per key into a workspace of fp16 operands, and the query rows into fp16 once per
row, which the same kernel streams with STAGED and Q_STAGED set.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...modes import SCALE_FLOOR
from ...problem import Attention
from . import encode as _encode
from . import platform as _platform
from . import staging as _staging
from .attention_ops import TritonAttentionOptions
from .formats import CODE_COPY, CODE_E4M3FN, CODE_INT8, code_of
from .launch import BoundLaunch, relaunch_all

_DEFAULT_OPTIONS = TritonAttentionOptions()

_LOG2E = 1.4426950408889634

# How codes become dot operands (CODE_CONVERT).
_CONVERT_CAST = 0  # .to(dot dtype)
_CONVERT_I8_ASM = 1  # int8 -> fp16 with byte permutes (CUDA): the cast is an I2F per code
_CONVERT_TABLE = 2  # fp8 byte -> float32 through a 256-entry table (the interpreter has no fp8 math)
_CONVERT_E4M3_ASM = 3  # e4m3 -> fp16 (CUDA), as inline asm so it stays in the load layout
_CONVERT_BF16_BITS = 4  # bf16 caches as int16 bits, widened by hand (interpreter: encode.bf16_as_bits)
# The offset conversions come last: kernels test CODE_CONVERT >= 5 for them.
_CONVERT_I8_OFFSET = 5  # int8 -> fp16 1152 + c (CUDA); dots corrected per row (decode)
_CONVERT_I8_OFFSET_CAST = 6  # the same values through a cast and an add (interpreter)
# fp16 value of an int8 code c under the offset conversions.
I8_OFFSET = tl.constexpr(1152.0)

# Smallest K of a tensor-core dot on NVIDIA GPUs (Triton's min_dot_size): 16 for 16-bit
# operands, 32 for int8 (quantize_query's q . codes; Triton refuses to compile a smaller one).
# The head dimension is padded up to it with masked loads of zeros, which add nothing.
_MIN_DOT_K = 16
_MIN_DOT_K_INT8 = 32

# Scale kinds (SCALE_MODE).
_SCALE_NONE = 0
_SCALE_TENSOR = 1
_SCALE_TOKEN_HEAD = 2


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
def _codes_to_dot(x, table_ptr, DOT_DTYPE: tl.constexpr, CODE_CONVERT: tl.constexpr, PURE: tl.constexpr):
    # PURE=False keeps the conversion where the codes were loaded (rows contiguous along D):
    # a pure one is moved by Triton into the MMA operand layout, which for V (reduced over
    # keys, strided in memory) turns every code into a 1-byte shared-memory load.
    if CODE_CONVERT == 1:
        return _int8x4_to_fp16_offset(x, PURE) - 1152.0
    elif CODE_CONVERT == 5:
        return _int8x4_to_fp16_offset(x, PURE)
    elif CODE_CONVERT == 6:
        return x.to(tl.float16) + 1152.0
    elif CODE_CONVERT == 3:
        return _e4m3x4_to_fp16(x, PURE)
    elif CODE_CONVERT == 2:
        return tl.load(table_ptr + x.to(tl.uint8, bitcast=True).to(tl.int32)).to(DOT_DTYPE)
    elif CODE_CONVERT == 4:
        return _encode.widen_bf16_bits(x)
    else:
        return x.to(DOT_DTYPE)


@triton.jit
def _unit_ratios(scales):
    """(scales / unit, unit) for a tile's per-key scales, unit their largest: 16-bit operands
    normalised so that they cannot overflow. The unit is at least the smallest normal float32,
    so 1 / unit stays finite and a tile of subnormal scales (keys near 1e-37, the ones that
    meet query rows near 1e37 at logits of O(1)) gets ratios below 1 instead of Inf."""
    unit = tl.maximum(tl.max(scales, axis=0), _encode.SMALLEST_NORMAL)
    return scales * (1.0 / unit), unit


@triton.jit
def _find_seq(qsl_ptr, num_seqs, vblock, BLOCK_Q: tl.constexpr):
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
def _load_keys(ptrs, key_ok, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=key_ok, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_rows(ptrs, key_ok, d, MASKED: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=key_ok[:, None] & (d < HEAD_D)[None, :], other=0.0)
    elif HEAD_D < BLOCK_D:
        return tl.load(ptrs, mask=(d < HEAD_D)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_tile(
    start, q, row_scale, q_offset, pos, m_i, l_i, acc, v_unit, kv_end, bt_row, kv_head,
    k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, softcap, window,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ksb, stride_kst, stride_ksh,
    stride_vsb, stride_vst, stride_vsh,
    BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    SCALE_MODE: tl.constexpr, CODE_CONVERT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    MASKED: tl.constexpr, SCALE_IN_CODES: tl.constexpr, QK_INT8: tl.constexpr, SAME_KV_STRIDES: tl.constexpr,
    STAGED: tl.constexpr,
):
    """One key tile of the online softmax: returns the updated (m, l, acc, v_unit).

    MASKED=False is for tiles every row sees whole (no bounds, causal or window tests).
    SCALE_IN_CODES folds the per-key scales into the fp16 K/V operands (normalised by the
    tile's largest scale, so they cannot overflow) instead of scaling the [rows, keys] logits
    and probabilities: cheaper when the tile has many rows (prefill).
    QK_INT8: q holds int8 codes (quantize_query) and meets the K codes as loaded in an int8
    dot, exact in int32; the query and key scales multiply the logits after it.
    STAGED: K and V are staging.py's workspace, fp16 operands as SCALE_IN_CODES would build
    them, with one scale per page of keys (the tile's page): nothing to convert or fold.
    """
    d = tl.arange(0, BLOCK_D)
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < kv_end
    if STAGED:
        # The workspace gives each sequence consecutive pages of one contiguous buffer
        # (staging.py), so its keys sit at one stride: a tile's addresses are one scalar plus
        # offsets the compiler hoists out of the loop, where a page lookup per key would cost
        # dozens of instructions per tile. A tile never spans two pages: one K and V scale per
        # tile. This pays only together with the staged query (staging.py): the compiler
        # schedules either change alone worse.
        tl.static_assert(SAME_KV_STRIDES, "the staged K and V workspaces share one layout")
        first_page = tl.load(bt_row).to(tl.int64)
        page = first_page + start // PAGE
        tile_off = first_page * stride_kb + start.to(tl.int64) * stride_kt + kv_head * stride_kh
        in_tile = tl.arange(0, BLOCK_N)[:, None] * stride_kt + d[None, :] * stride_kd
        kc = _load_rows(k_ptr + tile_off + in_tile, key_ok, d, MASKED, HEAD_D, BLOCK_D)
    else:
        page = _load_keys(bt_row + keys // PAGE, key_ok, MASKED).to(tl.int64)
        in_page = keys % PAGE
        k_row = page * stride_kb + in_page * stride_kt + kv_head * stride_kh
        kc = _load_rows(k_ptr + k_row[:, None] + d[None, :] * stride_kd, key_ok, d, MASKED, HEAD_D, BLOCK_D)
    if SCALE_MODE == 2 and not STAGED:
        ks = _load_keys(ks_ptr + page * stride_ksb + in_page * stride_kst + kv_head * stride_ksh,
                        key_ok, MASKED)
    if STAGED:
        s = tl.dot(q, tl.trans(kc), input_precision=DOT_PRECISION)
        if SCALE_MODE == 2:
            s = s * (row_scale * tl.load(ks_ptr + page * stride_ksb + kv_head * stride_ksh))[:, None]
        else:
            s = s * row_scale[:, None]
    elif QK_INT8:
        # s is an integer and row_scale at least SCALE_FLOOR times the logit unit, so s * ks
        # first overflows only where the logit does too (for any softmax_scale above 1e-13),
        # and an exact 0 stays 0 (the product of the two scales first could be Inf there).
        s = tl.dot(q, tl.trans(kc), out_dtype=tl.int32).to(tl.float32) * ks[None, :] * row_scale[:, None]
    elif SCALE_IN_CODES and SCALE_MODE == 2:
        k = _codes_to_dot(kc, table_ptr, DOT_DTYPE, CODE_CONVERT, False)
        k_ratio, k_unit = _unit_ratios(ks)
        k = k * k_ratio.to(DOT_DTYPE)[:, None]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (row_scale * k_unit)[:, None]
    else:
        if SCALE_IN_CODES:
            k = _codes_to_dot(kc, table_ptr, DOT_DTYPE, CODE_CONVERT, False)
        else:
            k = _codes_to_dot(kc, table_ptr, DOT_DTYPE, CODE_CONVERT, True)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if CODE_CONVERT >= 5:
            s = s - q_offset[:, None]
        if SCALE_MODE == 2:
            # s is the dot of the rescaled row (absmax near 2^14) with the codes, so its size is
            # fixed; the row's undo (the query's magnitude) and the key's scale meet first, as
            # the logit's own scale: s * ks alone overflows for huge keys beside tiny query
            # rows, s * row_scale alone for huge query rows. Two products either way.
            s = s * (row_scale[:, None] * ks[None, :])
        else:
            s = s * row_scale[:, None]
    if HAS_SOFTCAP:
        # tanh through exp (the interpreter has no libdevice); saturates cleanly to +-1.
        e2 = tl.exp(2.0 * (s / softcap))
        s = (softcap * (1.0 - 2.0 / (e2 + 1.0))) * 1.4426950408889634
    if MASKED:
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows with nothing visible yet keep m = -inf; subtract 0 there so no inf - inf.
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    m_i = m_new

    if STAGED:
        vc = _load_rows(v_ptr + tile_off + in_tile, key_ok, d, MASKED, HEAD_D, BLOCK_D)
    elif SAME_KV_STRIDES:
        # V (and its scales) sit at K's offsets: one address computation serves both.
        vc = _load_rows(v_ptr + k_row[:, None] + d[None, :] * stride_kd, key_ok, d, MASKED, HEAD_D, BLOCK_D)
    else:
        v_row = page * stride_vb + in_page * stride_vt + kv_head * stride_vh
        vc = _load_rows(v_ptr + v_row[:, None] + d[None, :] * stride_vd, key_ok, d, MASKED, HEAD_D, BLOCK_D)
    v = _codes_to_dot(vc, table_ptr, DOT_DTYPE, CODE_CONVERT, False)
    if STAGED:
        if SCALE_MODE == 2:
            # acc is kept in units of the current page's V scale: moving to a new page costs
            # one factor per row, folded into alpha, instead of a product per element.
            page_unit = tl.load(vs_ptr + page * stride_vsb + kv_head * stride_vsh)
            alpha = alpha * (v_unit / page_unit)
            v_unit = page_unit
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    elif SCALE_MODE == 2:
        if SAME_KV_STRIDES:
            vs = _load_keys(vs_ptr + page * stride_ksb + in_page * stride_kst + kv_head * stride_ksh, key_ok, MASKED)
        else:
            vs = _load_keys(vs_ptr + page * stride_vsb + in_page * stride_vst + kv_head * stride_vsh,
                            key_ok, MASKED)
        if SCALE_IN_CODES:
            # (Unlike K's, V's tile scale is not floored: that cost 8 bytes of spills in fp8
            # prefill on sm_90a, and no query magnitude needs subnormal V scales.)
            v_max = tl.max(vs, axis=0)
            v_ratio = vs * tl.where(v_max > 0.0, 1.0 / v_max, 0.0)
            v = v * v_ratio.to(DOT_DTYPE)[:, None]
            pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv * v_max
        else:
            pv = p * vs[None, :]
            if MASKED:
                # Hidden keys may hold a NaN scale (a poisoned row): zero them after the product.
                pv = tl.where(visible, pv, 0.0)
            # Normalise each row by its largest weight so the fp16 operand cannot overflow. The
            # weight is floored at the smallest normal float32: a tile whose keys all sit ~90
            # below the row's largest logit (log2 units) has subnormal weights, whose reciprocal
            # would be Inf (and NaN in the output).
            w = tl.maximum(tl.max(pv, axis=1), _encode.SMALLEST_NORMAL)
            pv = (pv * (1.0 / w)[:, None]).to(DOT_DTYPE)
            pv_v = tl.dot(pv, v, input_precision=DOT_PRECISION)
            if CODE_CONVERT >= 5:
                pv_v = pv_v - I8_OFFSET * tl.sum(pv.to(tl.float32), axis=1)[:, None]
            acc = acc * alpha[:, None] + pv_v * w[:, None]
    else:
        p16 = p.to(DOT_DTYPE)
        pv_v = tl.dot(p16, v, input_precision=DOT_PRECISION)
        if CODE_CONVERT >= 5:
            pv_v = pv_v - I8_OFFSET * tl.sum(p16.to(tl.float32), axis=1)[:, None]
        acc = acc * alpha[:, None] + pv_v
    return m_i, l_i, acc, v_unit


@triton.jit
def _attend_range(
    lo, hi, q, row_scale, q_offset, pos, m_i, l_i, acc, v_unit, kv_end, bt_row, kv_head,
    k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, softcap, window,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ksb, stride_kst, stride_ksh,
    stride_vsb, stride_vst, stride_vsh,
    BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    SCALE_MODE: tl.constexpr, CODE_CONVERT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    MASKED: tl.constexpr, SCALE_IN_CODES: tl.constexpr, QK_INT8: tl.constexpr, SAME_KV_STRIDES: tl.constexpr,
    STAGED: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Key tiles starting at lo, lo + BLOCK_N, ... below hi."""
    if INTERPRETED:
        # The interpreter keeps scalars as 1-element arrays, which NumPy >= 2.4 will not turn
        # into the ints range() needs; a while loop compares them instead. Compiled code keeps
        # the for loop, which Triton software-pipelines.
        start = lo
        while start < hi:
            m_i, l_i, acc, v_unit = _attend_tile(
                start, q, row_scale, q_offset, pos, m_i, l_i, acc, v_unit, kv_end, bt_row, kv_head,
                k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, softcap, window,
                stride_kb, stride_kt, stride_kh, stride_kd,
                stride_vb, stride_vt, stride_vh, stride_vd,
                stride_ksb, stride_kst, stride_ksh,
                stride_vsb, stride_vst, stride_vsh,
                BLOCK_N, HEAD_D, BLOCK_D, PAGE, SCALE_MODE, CODE_CONVERT, DOT_DTYPE, DOT_PRECISION,
                HAS_SOFTCAP, HAS_WINDOW, MASKED, SCALE_IN_CODES, QK_INT8, SAME_KV_STRIDES, STAGED,
            )
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc, v_unit = _attend_tile(
                start, q, row_scale, q_offset, pos, m_i, l_i, acc, v_unit, kv_end, bt_row, kv_head,
                k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, softcap, window,
                stride_kb, stride_kt, stride_kh, stride_kd,
                stride_vb, stride_vt, stride_vh, stride_vd,
                stride_ksb, stride_kst, stride_ksh,
                stride_vsb, stride_vst, stride_vsh,
                BLOCK_N, HEAD_D, BLOCK_D, PAGE, SCALE_MODE, CODE_CONVERT, DOT_DTYPE, DOT_PRECISION,
                HAS_SOFTCAP, HAS_WINDOW, MASKED, SCALE_IN_CODES, QK_INT8, SAME_KV_STRIDES, STAGED,
            )
    return m_i, l_i, acc, v_unit


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr, table_ptr, q_undo_ptr,
    num_seqs, softmax_scale, softcap, window, split_keys, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ksb, stride_kst, stride_ksh,
    stride_vsb, stride_vst, stride_vsh,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    SCALE_MODE: tl.constexpr, CODE_CONVERT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, Q_RESCALE: tl.constexpr, Q_STAGED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    PER_SEQ: tl.constexpr, SPLIT: tl.constexpr, SKIP_DECODE: tl.constexpr, SCALE_IN_CODES: tl.constexpr,
    QK_INT8: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, STAGED: tl.constexpr, SCALE_FLOOR: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, INTERPRETED: tl.constexpr, HAS_LSE: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PER_SEQ:
        # Decode launch: one program per (sequence, KV head, split); only 1-token sequences.
        seq = tl.program_id(0)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        q_block = 0
        if q_len != 1:
            return
    else:
        vblock = tl.program_id(0)
        if LONGEST_FIRST:
            vblock = tl.num_programs(0) - 1 - vblock
        seq = _find_seq(qsl_ptr, num_seqs, vblock, BLOCK_Q)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        q_block = vblock - (q_start // BLOCK_Q + seq)
        if q_block * BLOCK_Q >= q_len:
            return
        if SKIP_DECODE:
            if q_len == 1:
                return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # position of the sequence's first query token

    # Row r of the tile: query token r // G_PAD of this block, query head r % G_PAD of the group.
    rows = tl.arange(0, BLOCK_M)
    row_tok = rows // G_PAD
    row_head = rows % G_PAD
    q_idx = q_block * BLOCK_Q + row_tok
    row_ok = (row_tok < BLOCK_Q) & (q_idx < q_len) & (row_head < GROUP)
    head = kv_head * GROUP + row_head
    pos = context + q_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    token = (q_start + q_idx).to(tl.int64)

    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    q_ok = row_ok[:, None] & d_ok[None, :]
    # Logit scale per row: what carries the row's magnitude (the undo of its power-of-two
    # rescaling, or its int8 scale), times a static key scale, times the logit unit last (log2
    # units for exp2 below; softcap needs natural units first). Magnitudes meet first, so a
    # huge query row and a tiny static scale cancel before anything else can overflow.
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if Q_STAGED:
        # staging.py rescaled the rows into fp16 already: q meets the dot as loaded, so wgmma
        # reads it from shared memory (why that matters: staging.py's docstring).
        q = tl.load(q_ptrs, mask=q_ok, other=0.0)
        row_scale = tl.load(q_undo_ptr + token * NUM_Q_HEADS + head, mask=row_ok, other=0.0)
    else:
        q = _encode.load_f32(q_ptrs, q_ok)
        if Q_RESCALE:
            # Exact powers of two: q's fp16 cast keeps every bf16 bit and cannot overflow, and
            # q . codes has the same size whatever the row's (SPEC.md section 11).
            factor, undo = _encode.fp16_row_factors(tl.max(tl.abs(q), axis=1))
            q = q * factor[:, None]
            row_scale = undo
        if QK_INT8:
            # The cache's own int8 row rule (SPEC.md 8.1), so the codes match the reference's.
            q_scale, _ = _encode.row_scale(_encode.row_absmax_bits(q, 1), 127.0, SCALE_FLOOR)
            q = _encode.encode_row_codes(q * _encode.reciprocal(q_scale)[:, None], 1, 0, False).to(tl.int8)
            row_scale = q_scale
        else:
            q = q.to(DOT_DTYPE)
    if SCALE_MODE == 1:
        row_scale = row_scale * tl.load(ks_ptr)
    if HAS_SOFTCAP:
        row_scale = row_scale * softmax_scale
    else:
        row_scale = row_scale * (softmax_scale * 1.4426950408889634)
    if CODE_CONVERT >= 5:
        # Offset codes (I8_OFFSET + c) add I8_OFFSET * sum(q) to every logit of a row.
        q_offset = I8_OFFSET * tl.sum(q.to(tl.float32), axis=1)
    else:
        q_offset = tl.zeros([BLOCK_M], tl.float32)  # unused (and a raw sum could overflow)

    # Keys this tile needs: up to its last row's position; from the window of its first row.
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

    if HAS_SINKS and not SPLIT:
        # The sink joins the denominator as exp(sink - m) and adds no value.
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    v_unit = 1.0  # staged V: the scale acc is counted in (acc is zero until the first page)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Tiles every row sees whole skip the masks: [full_begin, full_end) holds keys at or
    # before the first row's position (causal) and inside the last row's window.
    full_end = tl.maximum((tl.minimum(tile_first + 1, kv_end) // BLOCK_N) * BLOCK_N, kv_begin)
    full_begin = kv_begin
    if HAS_WINDOW:
        full_begin = tl.minimum(tl.cdiv(tl.maximum(tile_last - window + 1, 0), BLOCK_N) * BLOCK_N, full_end)
        full_begin = tl.maximum(full_begin, kv_begin)
    for phase in tl.static_range(3):
        # 0: masked tiles before the whole ones (a window only); 1: whole tiles, no masks;
        # 2: masked tiles at the causal edge.
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
            m_i, l_i, acc, v_unit = _attend_range(
                lo, hi, q, row_scale, q_offset, pos, m_i, l_i, acc, v_unit, kv_end, bt_row, kv_head,
                k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, softcap, window,
                stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
                stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                BLOCK_N, HEAD_D, BLOCK_D, PAGE, SCALE_MODE, CODE_CONVERT, DOT_DTYPE, DOT_PRECISION,
                HAS_SOFTCAP, HAS_WINDOW, phase != 1, SCALE_IN_CODES, QK_INT8, SAME_KV_STRIDES, STAGED,
                INTERPRETED,
            )

    if SCALE_MODE == 1:
        acc = acc * tl.load(vs_ptr)
    if STAGED:
        acc = acc * v_unit
    if SPLIT:
        # Decode: one token per sequence, partials indexed [seq, q head, split].
        part = (seq.to(tl.int64) * NUM_Q_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
        if HAS_LSE:
            # m and l are in log2 units; a row with no term (m = -inf, l = 0) gives -inf.
            # Padding rows (not stored) take log2(1): no log of their zero sum.
            m_use = tl.where(m_i > float("-inf"), m_i, 0.0)
            tl.store(lse_ptr + token * stride_lt + head * stride_lh,
                     (m_use + tl.log2(tl.where(row_ok, l_i, 1.0))) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, qsl_ptr, seq_lens_ptr, sinks_ptr, lse_ptr,
    split_keys, num_splits, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    NUM_Q_HEADS: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    # Only this sequence's own splits, in order: its bits do not depend on the batch.
    own = tl.cdiv(tl.load(seq_lens_ptr + seq), split_keys)
    base = (seq.to(tl.int64) * NUM_Q_HEADS + head) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    if HAS_SINKS:
        m = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    # while, not range(): see the interpreter note in _attention_kernel.
    i = own * 0
    while i < own:
        m = tl.maximum(m, tl.load(part_m_ptr + base + i))
        i += 1
    m_use = tl.where(m > float("-inf"), m, 0.0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([], tl.float32)
    if HAS_SINKS:
        total = tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_use)
    i = own * 0
    while i < own:
        w = tl.exp2(tl.load(part_m_ptr + base + i) - m_use)
        total = total + w * tl.load(part_l_ptr + base + i)
        acc = acc + w * tl.load(part_acc_ptr + (base + i) * BLOCK_D + d)
        i += 1
    out = acc / total
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_D)
    if HAS_LSE:
        # The splits' merged (max, sum), the sink's term included, in log2 units.
        tl.store(lse_ptr + q_start.to(tl.int64) * stride_lt + head * stride_lh,
                 (m_use + tl.log2(total)) * 0.6931471805599453)


# ----------------------------------------------------------------------------------------
# Configuration: a fixed table keyed by the problem's shape class, never tuned per call.


@dataclass(frozen=True)
class AttentionConfig:
    block_q: int  # query tokens per tile (rows = block_q * padded group)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    # Keys per split-KV program (a multiple of block_n); 0 = no split. Decode only.
    split_keys: int = 0
    # Fold per-key scales into the fp16 K/V tiles (prefill) instead of scaling logits and
    # probabilities (decode, where a tile has few rows).
    scale_in_codes: bool = False
    # Register cap per thread (ptxas .maxnreg); None leaves it to the compiler.
    maxnreg: int | None = None
    # Fewest tile rows. Triton 3.6 pads a dot of fewer than 16 rows itself on CUDA, and a tile
    # of only the group's real rows (decode: 4 of 16) carries less softmax and rescaling work.
    min_rows: int = 16
    # Prefill only: attend to staging.py's workspace of fp16 operands, converted once per
    # key, instead of converting codes in every query tile.
    stage_kv: bool = False
    # Prefill only: start the grid's query blocks in reverse order. Under a causal mask a
    # sequence's later blocks see more keys, and the GPU starts programs in grid order, so the
    # longest run first and the last wave holds short ones.
    longest_first: bool = False


# Tables keyed by (padded head size, quantized cache). Entries for head size 128 are the best
# of the variants timed on the GPU (bench/attention_probe.py, bench/kernel_facts.py); the others
# are scaled from them (smaller key tiles where a row is wider) and only checked for
# correctness.
# Decode: (block_n, num_warps, num_stages); one query token x the group's heads per tile.
# Quantized decode is bound by the latency of each tile's dependent chain (conversion, two
# dots, softmax), not by bytes: small tiles on one or two warps keep more programs resident.
# So it slows with the SM clock, which the board's power cap lowers under sustained load
# (bench/sustained.py). Their 5 stages are what gives the K/V copies two buffers: the page
# lookup takes a stage of its own, and below 5 Triton 3.6 keeps one buffer and waits for each
# copy right after issuing it. The bf16 tile, bound by DRAM, is slower with 5 and keeps 2.
_DECODE_TABLE = {
    (64, False): (64, 4, 2), (128, False): (64, 4, 2), (256, False): (32, 4, 2),
    (64, "int8"): (32, 1, 5), (128, "int8"): (32, 1, 5), (256, "int8"): (64, 4, 2),
    (64, "fp8"): (32, 1, 5), (128, "fp8"): (32, 1, 5), (256, "fp8"): (64, 4, 2),
}
# Prefill: (rows = query tokens x padded group, block_n, num_warps, num_stages), keyed by
# (padded head size, K operand): False the model dtype, True converted codes, "int8" codes as
# loaded (quantize_query: the int8 dot wants a smaller tile than the converted codes' one).
_PREFILL_TABLE = {
    (64, False): (128, 128, 8, 3), (128, False): (128, 128, 8, 3), (256, False): (64, 32, 4, 2),
    (64, True): (128, 128, 8, 2), (128, True): (128, 128, 8, 2), (256, True): (64, 32, 8, 2),
    (64, "int8"): (64, 128, 4, 3), (128, "int8"): (64, 128, 4, 3), (256, "int8"): (64, 32, 8, 2),
}
# Batch-invariant decode always splits at this many keys: a sequence's split points depend
# on its own length only.
INVARIANT_SPLIT_KEYS = 4096
# Split-KV heuristic: a decode grid under `below` programs per SM leaves SMs idle or its last
# wave ragged; split each sequence so the grid reaches about `target` per SM. The quantized
# 1-warp tiles need more programs per SM than the bf16 ones to hide their latency, so they
# split sooner and further. (below, target) per code type (False: the model dtype):
_SPLIT_PER_SM = {False: (2, 8), "fp8": (8, 16), "int8": (8, 16)}
_MIN_SPLIT_KEYS = 1024
_MAX_SPLITS = 64


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _size_class(head_size: int) -> int:
    return max(64, _pow2(head_size))


@functools.cache
def _num_sms(device_index: int | None) -> int:
    if _platform.interpreted():
        return 4
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


def _code_kind(p: Attention):
    code = code_of(p.mode)
    if code == CODE_COPY:
        return False
    return "int8" if code == CODE_INT8 else "fp8"


def _fit_wide_cache(p: Attention, block_n: int, stages: int) -> tuple[int, int]:
    # fp32 caches (mode none) take twice the shared memory of the tiles above.
    if p.key_cache.element_size() == 4:
        return min(block_n, 32), 2
    return block_n, stages


def decode_config(p: Attention, invariant: bool, platform: str = "cuda") -> AttentionConfig:
    block_n, warps, stages = _DECODE_TABLE[_size_class(p.head_size), _code_kind(p)]
    block_n, stages = _fit_wide_cache(p, block_n, stages)
    if platform != "cuda":
        # The 5-stage depth answers CUDA's pipeliner (measured on NVIDIA only); ROCm's own
        # pipeliner keeps the 2 stages every decode tile had before it.
        stages = min(stages, 2)
    # Quantized tiles of the group's real rows run fewer instructions per key tile
    # (bench/offline_facts.py counts them) in less shared memory; the bf16 tile
    # timed the same either way and keeps 16. On ROCm a dot under 16 rows falls back to FMA
    # (Triton's AMD backend): padded there.
    min_rows = 1 if platform == "cuda" and _code_kind(p) else 16
    if invariant:
        return AttentionConfig(1, block_n, warps, stages, INVARIANT_SPLIT_KEYS, min_rows=min_rows)
    programs = p.num_seqs * p.num_kv_heads
    dev = p.query.device.index if p.query.device.type == "cuda" else None
    sms = _num_sms(dev)
    split_keys = 0
    below, target = _SPLIT_PER_SM[_code_kind(p)]
    if programs < below * sms and p.max_seq_len >= 2 * _MIN_SPLIT_KEYS:
        want = target * sms
        # Rounded down: one program over the target starts a ragged wave.
        splits = min(_MAX_SPLITS, want // max(programs, 1), p.max_seq_len // _MIN_SPLIT_KEYS)
        if splits > 1:
            split_keys = -(-p.max_seq_len // splits)
            split_keys = -(-split_keys // block_n) * block_n
    return AttentionConfig(1, block_n, warps, stages, split_keys, min_rows=min_rows)


def staged_prefill_config(p: Attention) -> AttentionConfig:
    """The bf16 tile (16-bit operands straight from memory), on the staged workspace."""
    rows, block_n, warps, stages = _PREFILL_TABLE[_size_class(p.head_size), False]
    g_pad = _pow2(p.num_q_heads // p.num_kv_heads)
    # Page scales are read once per key tile: a tile must not span two pages.
    assert _staging.STAGE_PAGE % block_n == 0, (block_n, _staging.STAGE_PAGE)
    # Longest first pays on the workspace's short tiles and not on the paged cache's (measured
    # both ways with bench/staging_sweep.py), so direct tiles keep grid order.
    return AttentionConfig(max(1, rows // g_pad), block_n, warps, stages, 0, False, stage_kv=True,
                           longest_first=True)


def prefill_config(p: Attention, options: TritonAttentionOptions = _DEFAULT_OPTIONS) -> AttentionConfig:
    staged = options.prefill == "auto" and _staging.worth_staging(p, options.stage_max_bytes)
    return staged_prefill_config(p) if staged else direct_prefill_config(p)


def direct_prefill_config(p: Attention) -> AttentionConfig:
    """Tiles over the cache itself (codes converted in every query tile)."""
    k_operand = "int8" if p.quantize_query else p.mode.code_dtype is not None
    rows, block_n, warps, stages = _PREFILL_TABLE[_size_class(p.head_size), k_operand]
    block_n, stages = _fit_wide_cache(p, block_n, stages)
    g_pad = _pow2(p.num_q_heads // p.num_kv_heads)
    block_q = max(1, rows // g_pad)
    return AttentionConfig(block_q, block_n, warps, stages, 0, True)


# ----------------------------------------------------------------------------------------
# Launch.

_TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@functools.cache
def _code_table(fmt) -> torch.Tensor:
    # Value of every code byte, for the interpreter's table lookup (the format's own table).
    return torch.from_numpy(fmt.code_values().astype("float32"))


def _operands(p: Attention, platform: str, cfg: AttentionConfig):
    """(k, v, table, DOT_DTYPE, DOT_PRECISION, CODE_CONVERT, Q_RESCALE) for this problem."""
    interpreted = _platform.interpreted()
    k, v = p.key_cache, p.value_cache
    table = None
    if cfg.stage_kv:
        # fp16 operands already, the query too (staging.py): nothing to convert or rescale.
        return k, v, table, tl.float16, "tf32", _CONVERT_CAST, False
    if p.mode.code_dtype is None:
        same = k.dtype == p.query.dtype and k.dtype != torch.float32
        if interpreted and k.dtype == torch.bfloat16:
            # The interpreter carries bf16 as raw integers in dots, and its cast to fp32 breaks
            # subnormals: fp32 dots on values widened from the bits.
            return k.view(torch.int16), v.view(torch.int16), table, tl.float32, "ieee", _CONVERT_BF16_BITS, False
        if same:
            return k, v, table, _TORCH_TO_TL[k.dtype], "tf32", _CONVERT_CAST, False
        return k, v, table, tl.float32, "ieee", _CONVERT_CAST, False
    convert = _CONVERT_CAST
    code = code_of(p.mode)
    if code == CODE_INT8:
        # Offset codes for decode tiles (few rows: conversion dominates); exact codes where
        # per-key scales are folded into the tiles (the offset would not factor out).
        if platform == "cuda" and not interpreted:
            convert = _CONVERT_I8_ASM if cfg.scale_in_codes else _CONVERT_I8_OFFSET
        elif not cfg.scale_in_codes:
            convert = _CONVERT_I8_OFFSET_CAST
    elif platform == "cuda" and not interpreted and code == CODE_E4M3FN:
        convert = _CONVERT_E4M3_ASM
    elif interpreted:
        table = _code_table(p.mode.format)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
        convert = _CONVERT_TABLE
    return k, v, table, tl.float16, "tf32", convert, not p.quantize_query


def same_kv_strides(p: Attention) -> bool:
    """V's codes and scales are laid out like K's (two caches of one shape, as engines keep them)."""
    same = p.key_cache.stride() == p.value_cache.stride()
    if p.mode.per_token_head:
        same = same and p.k_scale_cache.stride() == p.v_scale_cache.stride()
    return same


@dataclass
class KernelCall:
    """One launch of _attention_kernel: what _launch runs, and what bench/offline_facts.py
    compiles for a GPU it does not have."""

    grid: tuple[int, int, int]
    args: tuple  # the runtime arguments, in the kernel's order
    constexprs: dict
    options: dict  # num_warps, num_stages, maxnreg
    # The split merge's (grid, args, constexprs), run after it; None without a split.
    merge: tuple | None
    # For each of Attention.operand_names(), the positions of args it fills (and of the merge's
    # args): what a bound launch (launch.py) swaps when a call brings its own tensors.
    slots: tuple = ()
    merge_slots: tuple = ()


def kernel_call(p: Attention, platform: str, cfg: AttentionConfig, *, per_seq: bool, skip_decode: bool,
                q_undo: torch.Tensor | None = None) -> KernelCall:
    """The launch of `p` under `cfg`. A staged config (stage_kv) takes staging.py's problem and
    its q_undo, the factors that undo the fp16 query rows' rescaling; nothing else takes q_undo."""
    if cfg.stage_kv != (q_undo is not None):
        # A staged tile on the paged cache, or the staged rows without their factors, would give
        # wrong numbers, not an error.
        raise ValueError("stage_kv: pass staging.staged_problem(p).problem with its q_undo (and q_undo only then)")
    k, v, table, dot_dtype, precision, convert, q_rescale = _operands(p, platform, cfg)
    group = p.num_q_heads // p.num_kv_heads
    g_pad = _pow2(group)
    block_m = max(cfg.min_rows, cfg.block_q * g_pad)
    block_d = max(_MIN_DOT_K_INT8 if p.quantize_query else _MIN_DOT_K, _pow2(p.head_size))
    num_seqs = p.num_seqs
    split = per_seq and cfg.split_keys > 0
    num_splits = -(-p.max_seq_len // cfg.split_keys) if split else 1
    if per_seq:
        grid0 = num_seqs
    else:
        grid0 = p.query.shape[0] // cfg.block_q + num_seqs
    scale_mode = _SCALE_TOKEN_HEAD if p.mode.per_token_head else _SCALE_TENSOR if p.mode.per_tensor else _SCALE_NONE
    dummy = p.seq_lens
    ks = p.k_scale_cache if scale_mode == _SCALE_TOKEN_HEAD else p.k_scale if scale_mode == _SCALE_TENSOR else dummy
    vs = p.v_scale_cache if scale_mode == _SCALE_TOKEN_HEAD else p.v_scale if scale_mode == _SCALE_TENSOR else dummy
    kss = p.k_scale_cache.stride() if scale_mode == _SCALE_TOKEN_HEAD else (0, 0, 0)
    vss = p.v_scale_cache.stride() if scale_mode == _SCALE_TOKEN_HEAD else (0, 0, 0)
    sinks = p.sinks if p.sinks is not None else dummy
    # Without lse its pointer is a stand-in never dereferenced (HAS_LSE=False).
    lse, lse_strides = (p.lse, p.lse.stride()) if p.lse is not None else (dummy, (0, 0))
    merge = None
    if split:
        shape = (num_seqs, p.num_q_heads, num_splits)
        part_m = torch.empty(shape, dtype=torch.float32, device=p.query.device)
        part_l = torch.empty(shape, dtype=torch.float32, device=p.query.device)
        part_acc = torch.empty(shape + (block_d,), dtype=torch.float32, device=p.query.device)
        merge = (
            (num_seqs, p.num_q_heads),
            (part_m, part_l, part_acc, p.out, p.query_start_loc, p.seq_lens, sinks, lse,
             cfg.split_keys, num_splits, *p.out.stride(), *lse_strides),
            dict(NUM_Q_HEADS=p.num_q_heads, HEAD_D=p.head_size, BLOCK_D=block_d,
                 HAS_SINKS=p.sinks is not None, HAS_LSE=p.lse is not None, num_warps=1),
        )
    else:
        part_m = part_l = part_acc = p.out
    args = (
        _encode.bf16_as_bits(p.query), k, v, ks, vs, p.out,
        part_m, part_l, part_acc, lse,
        p.block_tables, p.seq_lens, p.query_start_loc, sinks, table if table is not None else dummy,
        q_undo if q_undo is not None else dummy,
        num_seqs, float(p.softmax_scale), float(p.softcap or 1.0), int(p.sliding_window or 0),
        max(cfg.split_keys, 1), num_splits,
        *p.query.stride(), *p.out.stride(), *lse_strides, *k.stride(), *v.stride(), *kss, *vss,
        p.block_tables.stride(0),
    )
    constexprs = dict(
        NUM_Q_HEADS=p.num_q_heads, GROUP=group, G_PAD=g_pad,
        BLOCK_Q=cfg.block_q, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        HEAD_D=p.head_size, BLOCK_D=block_d, PAGE=p.block_size,
        SCALE_MODE=scale_mode, CODE_CONVERT=convert, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        Q_RESCALE=q_rescale, Q_STAGED=cfg.stage_kv, HAS_SOFTCAP=p.softcap is not None,
        HAS_WINDOW=p.sliding_window is not None, HAS_SINKS=p.sinks is not None,
        PER_SEQ=per_seq, SPLIT=split, SKIP_DECODE=skip_decode, SCALE_IN_CODES=cfg.scale_in_codes,
        QK_INT8=p.quantize_query, SAME_KV_STRIDES=same_kv_strides(p), STAGED=cfg.stage_kv,
        SCALE_FLOOR=float(SCALE_FLOOR), LONGEST_FIRST=cfg.longest_first and not per_seq,
        INTERPRETED=_platform.interpreted(),
        # The split path's rows are written by the merge: the split programs store partials only.
        HAS_LSE=p.lse is not None and not split,
    )
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.maxnreg is not None and not _platform.interpreted():
        options["maxnreg"] = cfg.maxnreg
    # Argument positions of each of Attention.operand_names() (query, key_cache, value_cache,
    # block_tables, seq_lens, query_start_loc, out, k_scale_cache, v_scale_cache, k_scale,
    # v_scale, sinks, lse): pointers among the leading `args` above. Where an operand is absent
    # its position keeps the stand-in, which the kernel never dereferences.
    token_head, per_tensor = scale_mode == _SCALE_TOKEN_HEAD, scale_mode == _SCALE_TENSOR
    sinks_at, lse_at = (13,) if p.sinks is not None else (), (9,) if p.lse is not None else ()
    # Then the split's partials (m, l, acc), which a relaunch allocates afresh as run() does.
    slots = ((0,), (1,), (2,), (10,), (11,), (12,), (5,) if split else (5, 6, 7, 8),
             (3,) if token_head else (), (4,) if token_head else (), (3,) if per_tensor else (),
             (4,) if per_tensor else (), sinks_at, lse_at, *(((6,), (7,), (8,)) if split else ((), (), ())))
    merge_slots = ()
    if split:
        merge_slots = ((), (), (), (), (5,), (4,), (3,), (), (), (), (), (6,) if p.sinks is not None else (),
                       (7,) if p.lse is not None else (), (0,), (1,), (2,))
    return KernelCall((grid0, p.num_kv_heads, num_splits), args, constexprs, options, merge, slots, merge_slots)


def _launch(p: Attention, platform: str, cfg: AttentionConfig, *, per_seq: bool, skip_decode: bool,
            q_undo: torch.Tensor | None = None):
    """Launches the attention kernel (and the split merge); returns the compiled attention kernel."""
    call = kernel_call(p, platform, cfg, per_seq=per_seq, skip_decode=skip_decode, q_undo=q_undo)
    kernel = _attention_kernel[call.grid](*call.args, **call.constexprs, **call.options)
    if call.merge is not None:
        grid, args, constexprs = call.merge
        _merge_splits_kernel[grid](*args, **constexprs)
    return kernel


def _launches(p: Attention, platform: str, decode: AttentionConfig | None, prefill: AttentionConfig | None,
              options: TritonAttentionOptions) -> tuple[list[tuple[AttentionConfig, bool, bool]], AttentionConfig | None]:
    """The direct launches of `p` as (config, per_seq, skip_decode), and the staged prefill's
    config when its prefills go through the staging workspace (after those launches), else None."""
    invariant = p.batch_invariant
    if invariant:
        # 1-token sequences: fixed decode tiles and fixed split points; the rest: fixed
        # prefill tiles. Which launch a sequence takes depends on its own q_len only.
        launches = [(decode or decode_config(p, True, platform), True, False)]
        if p.max_query_len > 1:
            launches.append((prefill or prefill_config(p, options), False, True))
        return launches, None
    if p.max_query_len <= 1:
        return [(decode or decode_config(p, False, platform), True, False)], None
    cfg = prefill or prefill_config(p, options)
    if not cfg.stage_kv:
        return [(cfg, False, False)], None
    if not _staging.stageable(p):
        raise ValueError(f"stage_kv: this problem cannot be staged (mode {p.mode.name}, "
                         f"quantize_query={p.quantize_query}, batch_invariant={p.batch_invariant})")
    if p.num_prefills is None or p.num_prefills < p.num_seqs:
        # Decode tokens read the codes directly: staging their context would only add bytes.
        return [(decode or decode_config(p, False, platform), True, False)], cfg
    return [], cfg


def run(p: Attention, platform: str = "cuda", *, decode: AttentionConfig | None = None,
        prefill: AttentionConfig | None = None, options: TritonAttentionOptions = _DEFAULT_OPTIONS) -> None:
    """Attention for problem `p`. decode / prefill override the table (tests, tuning)."""
    if p.num_seqs == 0 or p.query.shape[0] == 0:
        return
    launches, staged_cfg = _launches(p, platform, decode, prefill, options)
    for cfg, per_seq, skip_decode in launches:
        _launch(p, platform, cfg, per_seq=per_seq, skip_decode=skip_decode)
    if staged_cfg is not None:
        staged = _staging.staged_problem(p, options.workspace_fill)
        _launch(staged.problem, platform, staged_cfg, per_seq=False, skip_decode=True, q_undo=staged.q_undo)


def prepare(p: Attention, platform: str = "cuda", options: TritonAttentionOptions = _DEFAULT_OPTIONS):
    """`p`'s launches bound once (launch.py): a function of p.operands() that runs a problem
    equal to `p` but for its arrays, each of the dtype, shape, strides and 16-byte
    alignment of `p`'s. It launches nothing now. None where `p` takes the staged prefill (its
    workspace is sized and filled per call)."""
    if p.num_seqs == 0 or p.query.shape[0] == 0:
        return _launch_nothing
    launches, staged_cfg = _launches(p, platform, None, None, options)
    if staged_cfg is not None:
        return None
    bound, partials = [], ()
    for cfg, per_seq, skip_decode in launches:
        call = kernel_call(p, platform, cfg, per_seq=per_seq, skip_decode=skip_decode)
        bound.append(BoundLaunch(_attention_kernel, call.grid, call.args, {**call.constexprs, **call.options},
                                 call.slots))
        if call.merge is not None:
            grid, args, constexprs = call.merge
            bound.append(BoundLaunch(_merge_splits_kernel, (*grid, 1), args, constexprs, call.merge_slots))
            partials = tuple(tuple(t.shape) for t in args[:3])
    if not partials:
        return functools.partial(relaunch_all, tuple(bound))
    return functools.partial(_relaunch_split, tuple(bound), partials, p.query.device)


def _relaunch_split(bound: tuple, partials: tuple, device: torch.device, operands: tuple) -> None:
    # Each call its own partials, from torch's stream-ordered allocator as run() takes them: a
    # buffer kept here would be shared by calls on different streams.
    relaunch_all(bound, (*operands, *(torch.empty(shape, dtype=torch.float32, device=device) for shape in partials)))


def _launch_nothing(operands) -> None:
    return None
